"""The invoke CLI as users type it, with --dry-run: invocation-wide --ct, refused inputs, and the exact
launch line, which a real shell runs here (with a `pct` stand-in that runs the container side on this
machine) to show that hostile --set values arrive literally and execute nothing."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dflash_ops import launch, runs
from dflash_ops.errors import ExitStatus, UsageError

REPO = Path(__file__).resolve().parents[2]
INVOKE = [sys.executable, "-m", "invoke"]
HOSTILE = ["$(touch {m}/dollar)", "`touch {m}/backtick`", "x; touch {m}/semicolon", "' ; touch {m}/quote '",
           '"$(touch {m}/dquote)"', "a\ntouch {m}/newline", "| touch {m}/pipe", "*", "$HOME", "-x",
           "ünïcødé", "\\", "L" * 5000]

PCT = "env LC_ALL=C.UTF-8 pct"  # how every host line starts pct (commands.pct_argv)


def write_inventory(path: Path, root: Path, pct: str = "pct", default=201) -> Path:
    """Two containers on one loopback host whose port nothing listens on: a connection would fail."""
    def container(ct):
        base = root / str(ct)
        return {"host": "pve1", "roles": {"target": ["cpu"], "drafter": ["cpu", "cpu"]},
                "paths": {"venv": str(base / "venv"), "code": str(base / "code"), "runs": str(base / "runs"),
                          "model": str(base / "model")},
                "train_config": "configs/tiny-cpu.yaml"}
    inv = {"default_container": default,
           "hosts": {"pve1": {"address": "127.0.0.1", "port": 9, "known_hosts": str(root / "known_hosts"),
                              "pct": pct}},
           "containers": {200: container(200), 201: container(201)}}
    path.write_text(yaml.safe_dump(inv))
    return path


def invoke(*args, inventory: Path, check=True):
    r = subprocess.run([*INVOKE, *args, "--inventory", str(inventory)], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    if check:
        assert r.returncode == ExitStatus.OK, r.stderr
    return r


@pytest.fixture
def inventory(tmp_path):
    return write_inventory(tmp_path / "inv.yaml", tmp_path)


def test_one_ct_for_every_task_of_the_invocation(inventory):
    r = invoke("warmup", "train", "--run", "r1", "--ct", "200", "--dry-run", inventory=inventory)
    lines = [line for line in r.stdout.splitlines() if line.startswith(PCT)]
    # warmup's check of its config (the facts helper's needs verb), the warm-up, the launch
    assert len([line for line in lines if " needs '" not in line]) == 2, r.stdout
    assert len(lines) == 3 and " needs '" in lines[0], r.stdout
    assert all(line.startswith(f"{PCT} exec 200 -- ") for line in lines)
    assert "warmup_compile.py" in r.stdout and "train_dflash.py" in r.stdout
    assert "/201/" not in r.stdout  # the default container (201) was not used by either task


def test_warmup_runs_with_exactly_the_training_environment_config_and_devices(inventory):
    same = ["--set", "train.lr=1e-4", "--set", "a.b=x y", "--config", "configs/other.yaml"]
    r = invoke("warmup", *same, "train", "--run", "r1", *same, "--ct", "200", "--dry-run",
               inventory=inventory)
    warm_line, train_line = [line for line in r.stdout.split(f"\n{PCT} exec")
                             if line.strip() and " needs '" not in line][:2]
    warm, train = (shlex.split(f"{PCT} exec" + warm_line.removeprefix(f"{PCT} exec")),
                   shlex.split(f"{PCT} exec" + train_line))

    def env_of(argv):  # env -i ... up to the runs helper's interpreter
        return argv[argv.index("-i"):argv.index("-c", argv.index("-i")) - 1]

    def payload_of(argv):  # the python's argv: in the verb's JSON argument
        return [a for a in json.loads(argv[-1])["argv"] if not a.startswith(("--run-dir=", "--max-steps="))]

    assert env_of(warm) == env_of(train)
    assert "TORCHINDUCTOR_CACHE_DIR=/root/.cache/dflash/inductor" in env_of(warm)
    w, t = payload_of(warm), payload_of(train)
    assert w[1].endswith("/warmup_compile.py") and t[1].endswith("/train_dflash.py")
    assert w[2:] == t[2:]
    assert f"--config={inventory.parent}/200/code/configs/other.yaml" in w
    assert w[-4:] == ["--set=train.lr=1e-4", "--set=a.b=x y", "--target-devices=cpu",
                      "--drafter-devices=cpu,cpu"]


def test_ct_given_to_the_first_task_applies_to_the_later_ones(inventory):
    r = invoke("status", "--ct", "200", "stop", "--run", "r1", "logs", "--follow", "--dry-run",
               inventory=inventory)
    assert r.stdout.count(f"{PCT} exec 200 -- ") == 3 and "pct exec 201" not in r.stdout


def test_secrets_are_masked_in_the_dry_run_and_the_recorded_environment(tmp_path):
    inventory = write_inventory(tmp_path / "inv.yaml", tmp_path)
    data = yaml.safe_load(inventory.read_text())
    data["containers"][200]["env"] = {"HF_TOKEN": "hf_s3cr3t_value", "WANDB_MODE": "offline"}
    data["containers"][200]["secret_env"] = ["HF_TOKEN"]
    inventory.write_text(yaml.safe_dump(data))
    r = invoke("train", "--run", "r1", "--ct", "200", "--dry-run", inventory=inventory)
    assert "hf_s3cr3t_value" not in r.stdout + r.stderr
    assert "HF_TOKEN=***" in r.stdout and "WANDB_MODE=offline" in r.stdout
    from dflash_ops.inventory import load_inventory

    ct = load_inventory(str(inventory)).container(200)
    argv, _ = launch.launch_argv(ct, "r1")
    payload = json.loads(argv[-1])  # python -c LOADER SCRIPT launch PAYLOAD
    launch_json, env_text = payload["launch"], payload["env"]
    assert json.loads(launch_json)["run"] == "r1"
    assert "hf_s3cr3t_value" not in launch_json + env_text
    assert "HF_TOKEN=***" in env_text.splitlines() and "WANDB_MODE=offline" in env_text.splitlines()
    from dflash_ops import commands

    assert "HF_TOKEN=hf_s3cr3t_value" in commands.pct_exec(200, argv, ct.run_env())  # the process gets it


def test_two_different_ct_values_are_an_error(inventory):
    r = invoke("warmup", "--ct", "200", "train", "--ct", "201", "--dry-run", inventory=inventory, check=False)
    assert r.returncode == ExitStatus.USAGE
    assert "conflicting values" in r.stderr and "--ct 200" in r.stderr and "--ct 201" in r.stderr
    assert "pct exec" not in r.stdout  # refused before anything is printed or run


@pytest.mark.parametrize("name",
                         ["../x", "a;b", "$(id)", "a\nb", "x" * 65, ".hidden", "-rf", "a b", "", "a/b"])
def test_hostile_run_names_are_refused(name):
    with pytest.raises(UsageError, match="a run name is 1-64 characters"):
        runs.validate_run_name(name)


def test_hostile_run_name_through_the_cli(inventory):
    r = invoke("train", "--run", "$(touch /tmp/x)", "--dry-run", inventory=inventory, check=False)
    assert r.returncode == ExitStatus.USAGE and "a run name is" in r.stderr and r.stdout == ""


def test_good_run_names_and_the_default():
    for name in ("tiny", "run-1.2_b", "A" * 64, "20260101-120000"):
        assert runs.validate_run_name(name) == name
    assert len(runs.default_run_name()) == len("20260101-120000")


@pytest.mark.parametrize("value", ["noequals", "a;b=1", "=1", "a..b=1", "$(id)=1"])
def test_malformed_set_is_refused(value, inventory):
    r = invoke("train", "--run", "r1", "--set", value, "--dry-run", inventory=inventory, check=False)
    assert r.returncode == ExitStatus.USAGE and "expected key=value" in r.stderr


def test_every_task_documents_itself_and_each_flag():
    for task, flags in {"warmup": ["--config", "--set"],
                        "train": ["--run", "--config", "--set", "--max-steps"],
                        "logs": ["--run", "-n", "--follow"], "status": ["--run", "--json", "--stall-after"],
                        "stop": ["--run", "--grace"]}.items():
        r = subprocess.run([*INVOKE, "--help", task], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == ExitStatus.OK
        options = r.stdout.split("Options:")[1]
        for flag in flags + ["--dry-run", "--ct", "--inventory"]:
            line = next(ln for ln in options.splitlines() if re.search(rf"(^|\s){flag}(=|,|\s|$)", ln))
            assert len(re.split(r"\s{2,}", line.strip())) >= 2, f"{task} {flag} has no help text"


def test_hostile_set_values_arrive_literally_and_execute_nothing(tmp_path):
    """The dry-run line of `invoke train` is run by a real shell; `pct` runs the container side here."""
    markers = tmp_path / "markers"
    markers.mkdir()
    pct = tmp_path / "pct"
    pct.write_text('#!/bin/sh\n[ "$1" = exec ] || exit 99\nshift 3\nexec "$@"\n')  # drop `exec <id> --`
    pct.chmod(0o755)
    inventory = write_inventory(tmp_path / "inv.yaml", tmp_path, pct=str(pct), default=200)
    code, venv = tmp_path / "200" / "code", tmp_path / "200" / "venv"
    (code / "configs").mkdir(parents=True)
    (code / "configs" / "tiny-cpu.yaml").write_text("train: {}\n")
    (code / "train_dflash.py").write_text("")
    (venv / "bin").mkdir(parents=True)
    argv_file = tmp_path / "argv.json"
    # The training process stand-in records its argv and stays alive past the launch's check.
    (venv / "bin" / "python").write_text(
        f"#!{sys.executable}\nimport json, sys, time\n"
        f"if sys.argv[1].endswith('/preflight.py'): print(json.dumps({{'ok': True}})); sys.exit(0)\n"
        f"json.dump(sys.argv[1:], open({str(argv_file)!r}, 'w'))\ntime.sleep(4)\n")
    (code / "preflight.py").write_text("")
    (venv / "bin" / "python").chmod(0o755)
    values = [v.format(m=markers) for v in HOSTILE]
    sets = [arg for v in values for arg in ("--set", f"data.assistant_header={v}")]
    r = invoke("train", "--run", "hostile", *sets, "--max-steps", "3", "--dry-run", inventory=inventory)
    line = r.stdout
    assert line.startswith(f"{PCT[:-3]}{pct} exec 200 -- sh -c ")
    assert f" dflash-session env -i -C {code} -- " in line
    # The container side ends with its session's stdin (commands.SESSION_SCRIPT): keep it open.
    session_stdin, keep_open = os.pipe()
    run = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60,
                         stdin=session_stdin)
    os.close(session_stdin)
    os.close(keep_open)
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads(run.stdout)["ok"]["outcome"] == "started", run.stdout  # the launch verb's JSON answer
    argv = json.loads(argv_file.read_text())
    got = [a.removeprefix("--set=data.assistant_header=") for a in argv
           if a.startswith("--set=data.assistant")]
    assert got == values
    assert argv[-1] == "--max-steps=3" and f"--run-dir={tmp_path}/200/runs/hostile" in argv
    assert list(markers.iterdir()) == []
    run_dir = tmp_path / "200" / "runs" / "hostile"
    assert (json.loads((run_dir / "launch.json").read_text())["sets"]
            == [f"data.assistant_header={v}" for v in values])
    pgid = int((run_dir / "pgid").read_text())
    os.killpg(pgid, signal.SIGTERM)
    for _ in range(100):  # the wrapper records how its process ended
        if (run_dir / "exit_code").exists():
            break
        time.sleep(0.1)
    assert (run_dir / "exit_code").read_text().strip() in ("signal 15", "0")


def _task_flags() -> dict:
    """{task name: {long flag: its short letters}} as Invoke builds them from tasks.py."""
    from invoke import Collection

    import tasks

    ns = Collection.from_module(tasks)
    return {name: {a.names[0]: [n for n in a.names[1:] if len(n) == 1] for a in ns[name].get_arguments()}
            for name in ns.task_names}


def test_no_task_option_takes_h_and_a_flag_has_one_letter_in_every_task():
    letters: dict = {}
    for task, flags in _task_flags().items():
        for flag, short in flags.items():
            assert short != ["h"], f"{task} --{flag} takes -h, which must show the task's help"
            letters.setdefault(flag, {})[task] = tuple(short)
    mixed = {flag: per for flag, per in letters.items() if len(set(per.values())) > 1}
    assert mixed == {}
    assert ({letters[f]["fetch"] for f in ("ct", "inventory", "dry-run", "run")}
            == {("c",), ("i",), ("d",), ("r",)})


@pytest.mark.parametrize("task", ["deploy", "status", "trust-host", "fetch", "eval", "watch", "sandbox.up"])
def test_dash_h_after_a_task_shows_its_help_and_does_nothing_else(task):
    """`invoke deploy -h` once deployed (-h was --check); `fetch -h` took -h as the run name. The
    default inventory's hosts are `.example` names: a task that ran would fail to connect."""
    r = subprocess.run([*INVOKE, task, "-h"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == ExitStatus.OK, r.stderr
    assert r.stdout.startswith(f"Usage: inv[oke] [--core-opts] {task} [--options]"), r.stdout
    assert r.stderr == ""


def test_a_missing_required_flag_is_one_line_and_exit_2(inventory):
    for args, message in ((["fetch"], "error: --run, --to required"),
                          (["fetch", "--run", "r1"], "error: --to required"),
                          (["eval"], "error: --run required"), (["trust-host"], "error: --host required")):
        r = invoke(*args, inventory=inventory, check=False)
        assert (r.returncode, r.stderr.strip(), r.stdout) == (ExitStatus.USAGE, message, ""), args
