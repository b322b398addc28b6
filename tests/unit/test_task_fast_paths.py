"""What a no-change deploy and a status cost besides their one round trip: the modules the CLI imports
for them here, and what deploy's probe imports in the container. Run through real interpreters
(a fresh `python` here, and the probe's exact argv); bench/bench_tasks.py has the times."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ops.inventory import parse_inventory
from dflash_ops.remote import facts as container_facts
from dflash_ops.remote import ship

REPO = Path(__file__).resolve().parents[2]
CT = parse_inventory({"hosts": {"pve1": {"address": "pve1.example"}},
                      "containers": {200: {"host": "pve1"}}}).container(200)


def imported(argv: list[str]) -> tuple[set[str], str]:
    """The modules `argv` (a python command) imported, from -X importtime, and its stdout."""
    r = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], capture_output=True, text=True, check=True)
    names = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines()
             if line.startswith("import time:")}
    return names, r.stdout


@pytest.mark.parametrize("modules", ["dflash_ops.deploy", "dflash_ops.status"])
def test_the_cli_imports_no_rich_before_it_prints_a_table(modules):
    """tasks.py and a one-container deploy or status --json: rich is imported only to draw a table."""
    names, _ = imported([sys.executable, "-c", f"import tasks, {modules}"])
    assert "tasks" in names and modules in names
    assert not {n for n in names if n == "rich" or n.startswith("rich.")}


def probe_argv(line: str, payload: dict) -> list[str]:
    """The container argv of a facts line (from the container's python on), run by this python."""
    argv = shlex.split(line)
    argv = argv[argv.index(CT.python):]
    return [sys.executable, *argv[1:-1], json.dumps(payload)]


def test_deploys_probe_is_the_facts_script_alone_without_site_subprocess_or_openssl(tmp_path):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "x.py").write_text("x")
    payload = {"code": str(tmp_path / "code"), "venv": str(tmp_path / "venv"), "model": str(tmp_path / "m"),
               "want": ["code", "model", "venv"], "torch_check": "recorded"}
    line = ship.facts_line(CT, ("code", "venv", "model"), "recorded")
    argv = probe_argv(line, payload)
    assert argv[1] == "-S"
    names, out = imported(argv)
    answer = ship.answer(out, "t")
    assert answer["code"] == container_facts.code_fact(str(tmp_path / "code"))
    assert (answer["code"]["files"]
            == {"x.py": "2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881"})
    assert answer["venv"] == {"python": False, "requirements": None, "torch": None}
    assert not names & {"site", "subprocess", "shutil", "hashlib", "_hashlib", "fcntl"}
    # doctor's facts (runs, caches) are the same helper: the prelude holds the run primitives
    assert ship.packed("facts") in ship.facts_line(CT, ship.ALL_FACTS)


def test_doctors_facts_answer_runs_and_caches_through_the_same_argv_shape(tmp_path):
    (tmp_path / "runs").mkdir()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "blob").write_bytes(b"0" * 5000)
    payload = {"runs": str(tmp_path / "runs"), "caches": {"inductor": str(cache)}, "want": ["caches", "runs"]}
    names, out = imported(probe_argv(ship.facts_line(CT, ("caches", "runs")), payload))
    answer = ship.answer(out, "t")
    assert answer["alive"] is None
    assert (answer["caches"]["inductor"]["path"] == str(cache)
            and answer["caches"]["inductor"]["bytes"] >= 5000)


def test_the_cli_leaves_its_objects_to_the_process_end_instead_of_a_last_garbage_collection():
    """At exit the objects of every import are frozen (gc.freeze) before Python's last collections; the
    handlers registered before the CLI's (this one, target's close_sessions) still run afterwards."""
    code = ("import atexit, gc, sys; atexit.register(lambda: sys.stdout.write(f'frozen "
            "{gc.get_freeze_count()}')); import tasks")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert r.stdout.startswith("frozen ") and int(r.stdout.split()[1]) > 10000
