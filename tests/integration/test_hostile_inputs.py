"""Hostile values through the real CLI, over real SSH into the sandbox container: refused with one line,
or passed literally; a marker file that any successful injection would create never appears, in the
container or on the host.

Where a value can come from: --run, --set, --config, -n (typed), and the inventory's paths and env.
Unit-level coverage elsewhere: the command builder through real bash with hypothesis
(tests/unit/test_commands.py), the launch line of hostile --set values run by bash
(tests/unit/test_cli_options.py), secrets in dry runs (tests/unit/test_secrets.py); hostile values
through `HostSession.exec` (tests/integration/test_transport.py).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml
from training_runs import CT, REPO, deploy

from dflash_ops.errors import ExitStatus

pytestmark = pytest.mark.integration

MARK = f"/tmp/pwned-{uuid.uuid4().hex[:8]}"
INJECTIONS = [f"$(touch {MARK})", f"`touch {MARK}`", f"x; touch {MARK}", f"' ; touch {MARK} ; '",
              f'" && touch {MARK} #', f"a\ntouch {MARK}", f"| touch {MARK}", f"$(touch {MARK})'\"`", "*",
              "$HOME", "-rf", "ünïcødé €", "\\", "L" * 20000]


@pytest.fixture(scope="module")
def deployed(sandbox, template):
    d = deploy(sandbox, template)
    yield d
    d.stop_any()


@pytest.fixture(autouse=True)
def nothing_executed(deployed):
    yield
    assert not Path(MARK).exists(), "an injected command ran on the host"
    assert deployed.container("test", "-e", MARK, check=False).returncode == 1, (
        "an injected command ran in the container")
    deployed.stop_any()


def one_line_error(r, code: int) -> str:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def invoke_bytes(deployed, *args: bytes | str):
    """The CLI with raw bytes in argv (what a shell passes for non-UTF-8 input)."""
    argv = [a if isinstance(a, bytes) else a.encode() for a in deployed.invoke_argv(*args)]
    return subprocess.run(argv, cwd=REPO, capture_output=True, timeout=120)


def variant_inventory(deployed, tmp_path, **changes) -> str:
    inv = yaml.safe_load(Path(deployed.inventory).read_text())
    ct = inv["containers"][int(CT)]
    ct["paths"].update(changes.pop("paths", {}))
    ct.update(changes)
    out = tmp_path / "hostile.yaml"
    out.write_text(yaml.safe_dump(inv, allow_unicode=True))
    return str(out)


def proc_of(deployed, pid: int, what: str) -> list[str]:
    """/proc/<pid>/<cmdline|environ> of a container process, NUL-separated entries."""
    raw = deployed.container("cat", f"/proc/{pid}/{what}").stdout
    return raw.split("\0")[:-1]


def started_pid(stdout: str) -> int:
    return int(stdout.split(": pid ", 1)[1].split(",", 1)[0])


# --- typed by a user ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name",
                         ["../etc", "a/b", f"x;touch {MARK}", f"$(touch {MARK})", "a b", "-rf", ".hidden",
                                  "a\nb", "r" * 65, "ünï"],
                         # one id on every xdist worker
                         ids=lambda name: name.replace(MARK, "/tmp/pwned-MARK"))
def test_hostile_run_names_are_refused_in_one_line_and_create_nothing(deployed, name):
    for task in (["train"], ["logs"], ["status"], ["stop"]):
        r = deployed.invoke(*task, "--run", name, check=False)
        assert "a run name is 1-64 characters" in one_line_error(r, ExitStatus.USAGE)
    assert (deployed.container("ls", "-A", "/root/runs", check=False).stdout.split()
            in ([], [".lock"], [".current", ".lock"]))


def test_non_utf8_values_are_refused_in_one_line(deployed):
    for args in ([b"--run", b"run\xff"], [b"--set", b"data.assistant_header=\xff\xfe"],
                 [b"--config", b"c\xff.yaml"]):
        r = invoke_bytes(deployed, "train", *args)
        assert r.returncode == ExitStatus.USAGE, r
        lines = r.stderr.decode(errors="replace").strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), lines


def test_dry_run_prints_hostile_set_and_config_values_quoted(deployed):
    sets = [a for v in INJECTIONS[:-1] for a in ("--set", f"data.assistant_header={v}")]
    config = f"configs/it's $(touch {MARK}).yaml"
    r = deployed.invoke("train", "--run", "dry", "--config", config, *sets, "--dry-run")
    argv = shlex.split(r.stdout)  # one command (a newline in a value spans lines inside its quotes)
    assert argv[:5] == ["env", "LC_ALL=C.UTF-8", str(deployed.sandbox.pct), "exec", CT]
    assert argv[-2] == "launch"  # the launch verb reads the training argv from its JSON payload
    train = json.loads(argv[-1])["argv"]
    assert [a.removeprefix("--set=data.assistant_header=") for a in train
            if a.startswith("--set=data.assistant")] \
        == INJECTIONS[:-1]
    assert f"--config=/root/dflash/{config}" in train


def test_hostile_set_values_reach_the_training_process_literally(deployed):
    # train.run_dir is a free-form string that --run-dir overrides: the run goes on with any of them.
    as_yaml = [v for v in INJECTIONS if isinstance(_yaml_or_none(v), str)]
    not_yaml = [v for v in INJECTIONS if v not in as_yaml]
    assert len(as_yaml) >= 9 and not_yaml  # both kinds are tried
    out = deployed.train("literal", "--max-steps", "400",
                         *[a for v in as_yaml for a in ("--set", f"train.run_dir={v}")])
    argv = proc_of(deployed, started_pid(out), "cmdline")  # the training process's own argv
    assert [a.removeprefix("--set=train.run_dir=") for a in argv
            if a.startswith("--set=train.run_dir=")] == as_yaml
    launch = json.loads(deployed.run_file("literal", "launch.json"))
    assert launch["sets"][-len(as_yaml):] == [f"train.run_dir={v}" for v in as_yaml]
    deployed.stop_any()
    # Passed literally too, and refused by the script in its own words (at the first of them).
    r = deployed.invoke("warmup", *[a for v in not_yaml for a in ("--set", f"train.run_dir={v}")],
                        check=False,
                        timeout=300)
    assert r.returncode == ExitStatus.REMOTE_FAILED, r.stderr
    assert "--set train.run_dir: value is not valid YAML" in r.stderr, r.stderr


def _yaml_or_none(text):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return None


def test_hostile_config_paths_are_missing_files_not_commands(deployed):
    for config in [f"configs/x.yaml; touch {MARK}", f"$(touch {MARK})", f"/tmp/`touch {MARK}`.yaml"]:
        r = deployed.invoke("train", "--run", "cfg", "--config", config, check=False)
        line = one_line_error(r, ExitStatus.PREFLIGHT)
        assert "not found in the container; check --config" in line and config in line
        warm = deployed.invoke("warmup", "--config", config, check=False)
        line = one_line_error(warm, ExitStatus.PREFLIGHT)
        assert "not found in the container; check --config" in line and config in line
    for config in ["-rf", "a\nb"]:
        refused = deployed.invoke("train", "--config", config, check=False)
        assert "--config" in one_line_error(refused, ExitStatus.USAGE)


HOSTILE_NUMBERS = (["logs", "-n", f"5; touch {MARK}"], ["status", "--stall-after", f"$(touch {MARK})"],
                   ["train", "--max-steps", "1 && reboot"], ["stop", "--grace", "`reboot`"])


def test_hostile_numbers_are_refused_and_execute_nothing(deployed):
    for args in HOSTILE_NUMBERS:
        assert deployed.invoke(*args, check=False).returncode != ExitStatus.OK, args


def test_hostile_numbers_are_one_line_errors(deployed):
    for args in HOSTILE_NUMBERS:
        one_line_error(deployed.invoke(*args, check=False), ExitStatus.USAGE)


def test_a_value_too_long_for_any_shell_is_refused_in_one_line(deployed):
    r = deployed.invoke("train", "--run", "long", "--set", "data.assistant_header=" + "L" * 100_000,
                        check=False)
    assert "more than the 131071 a remote shell accepts" in one_line_error(r, ExitStatus.USAGE)
    assert deployed.container("test", "-e", "/root/runs/long", check=False).returncode == 1


# --- held by an inventory ------------------------------------------------------------------------------

def test_hostile_inventory_paths_and_env_values_arrive_literally(deployed, tmp_path):
    runs = f"/root/runs it's $(touch {MARK}) `x`;"
    env = {"QUOTES": "it's \"quoted\"", "SUBST": f"$(touch {MARK})", "TICKS": f"`touch {MARK}`",
           "SEMI": f"a; touch {MARK}", "NEWLINE": "line1\nline2", "LONG": "E" * 20000, "UNICODE": "ünï €"}
    inventory = variant_inventory(deployed, tmp_path, paths={"runs": runs},
                                  env={**deployed_env(deployed), **env})
    r = deployed.invoke("train", "--run", "inv", "--max-steps", "400", *QUICK_SETS, inventory=inventory)
    pid = started_pid(r.stdout)
    environ = dict(e.split("=", 1) for e in proc_of(deployed, pid, "environ"))
    assert {k: environ.get(k) for k in env} == env
    assert f"--run-dir={runs}/inv" in proc_of(deployed, pid, "cmdline")
    st = json.loads(deployed.invoke("status", "--json", inventory=inventory).stdout)
    assert (st["run"], st["state"]) == ("inv", "running")
    logs = deployed.invoke("logs", "-n", "5", inventory=inventory).stdout
    assert logs.startswith("==> dflash-ops: run inv")
    stopped = deployed.invoke("stop", "--grace", "0", inventory=inventory)
    assert "run inv on pve1/200 stopped" in stopped.stdout
    assert deployed.container("test", "-f", f"{runs}/inv/train.log").returncode == 0


def test_secret_values_reach_the_process_and_show_nowhere_else(deployed, tmp_path):
    secrets = {"HF_TOKEN": "hf_it's a \"s3cr3t\" $(id)", "WANDB_API_KEY": "wandb-s3cr3t;`id`",
               "CUSTOM": "listed-s3cr3t\nsecond line"}
    inventory = variant_inventory(deployed, tmp_path, env={**deployed_env(deployed), **secrets},
                                  secret_env=["CUSTOM"])
    dry = deployed.invoke("train", "--run", "sec", "--dry-run", inventory=inventory)
    r = deployed.invoke("train", "--run", "sec", "--max-steps", "400", *QUICK_SETS, inventory=inventory)
    environ = dict(e.split("=", 1) for e in proc_of(deployed, started_pid(r.stdout), "environ"))
    assert {k: environ[k] for k in secrets} == secrets  # the real values reached the process
    recorded = deployed.run_file("sec", "env")
    assert all(f"{k}=***" in recorded.splitlines() for k in secrets)
    shown = [dry.stdout, dry.stderr, r.stdout, r.stderr, recorded, deployed.run_file("sec", "launch.json"),
             deployed.invoke("status", "--run", "sec", inventory=inventory).stdout,
             deployed.invoke("logs", "--run", "sec", inventory=inventory).stdout,
             # refused: busy
             deployed.invoke("train", "--run", "sec2", inventory=inventory, check=False).stderr]
    for value in secrets.values():
        for part in value.split("\n"):
            assert not any(part in text for text in shown), part


QUICK_SETS = ["--set", "data.heldout=null", "--set", "train.batch_size=2", "--set", "data.num_anchors=4"]


def deployed_env(deployed) -> dict:
    return yaml.safe_load(Path(deployed.inventory).read_text())["containers"][int(CT)]["env"]
