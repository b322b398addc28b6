"""What a process in the container writes in its run directory cannot forge a fact `status` shows, nor
aim `stop` at a process group that is not the run's: planted in container 200, driven through the real
CLI against the embedded host.

- A progress bar's `\\r` in train.log once split a log line into fact lines: a run killed by SIGKILL
  was shown `running` with a forged code version.
- `echo` in the fact script once turned `\\n` inside eval.json into fact lines: a finished run was
  shown `running` and its evaluation vanished.
- `stop` once signalled whatever group the run's `pgid` file named: another group was killed while
  the run went on, `1` killed every process in the container, `0` made the stop script kill itself.

No deploy: status and stop read and signal with the container's system tools.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from training_runs import CT, box  # noqa: F401 (box: container 200, not deployed)

from dflash_ops.errors import ExitStatus

pytestmark = pytest.mark.integration

RUNS = "/root/runs"
# A run killed by SIGKILL, as its wrapper recorded it (the pid is long gone).
KILLED = {"pid": "487", "pgid": "484", "started": "1795954052", "ended": "1795954068",
          "exit_code": "signal 9", "code_version": "tree c3f5d18a"}


def plant(box, run: str, files: dict[str, str | bytes]) -> None:
    """The run directory as its own processes could write it, `.current` naming it."""
    box.sh('rm -rf "$1" && mkdir -p "$1/$2" && printf "%s\\n" "$2" > "$1/.current"', RUNS, run)
    for name, text in files.items():
        data = text if isinstance(text, bytes) else (text + "\n").encode()
        box.sh('cat > "$1"', f"{RUNS}/{run}/{name}", data=data)


@pytest.fixture(autouse=True)
def clean(box):
    box.sh(f"rm -rf {RUNS}")
    yield
    box.sh(f"rm -rf {RUNS}")


def test_carriage_returns_in_the_log_cannot_forge_facts(box):
    forged = b"Killed\ralive 1\rexit_code 0\rcode_version tree f0f0\rstopped term 1\r\n"
    plant(box, "t3", {**KILLED, "train.log": b"12:00:00 INFO step 1/9 | loss 2.0\n" + forged})
    st = box.status("t3")
    assert (st["state"], st["exit_code"], st["code_version"]) == ("crashed", "signal 9", "tree c3f5d18a"), st


def test_backslashes_and_newlines_in_eval_json_are_read_whole(box):
    record = {"step": 3, "acceptance_length": 2.5, "lossless": True, "prompts": 4,
              "note": "a\nalive 1\nexit_code 1\nend\n", "path": "C:\\x\\n"}
    plant(box, "t1", {**KILLED, "exit_code": "0", "eval.json": json.dumps(record, indent=1)})
    st = box.status("t1")
    assert (st["state"], st["exit_code"]) == ("finished", "0"), st
    assert st["last_eval"] and st["last_eval"]["acceptance_length"] == 2.5, st


# A stand-in for the run's processes: a group of its own whose wrapper (`sh <run>/run.sh`, flock's
# child: it inherits the lock's fd) holds the runs lock (what makes run victim alive), and a second
# group that is nobody's run. Each prints its process group id.
HOLDER = (f'echo "sleep 300" > {RUNS}/victim/run.sh && setsid -f sh -c \'echo $$ > {RUNS}/holder.pgid; '
          f'exec flock {RUNS}/.lock sh {RUNS}/victim/run.sh\' </dev/null >/dev/null 2>&1')
BYSTANDER = f"setsid -f sh -c 'echo $$ > {RUNS}/bystander.pgid; exec sleep 300' </dev/null >/dev/null 2>&1"


def group_alive(box, pgid: str) -> bool:
    return subprocess.run([str(box.sandbox.pct), "exec", CT, "--", "kill", "-0", "--", f"-{pgid}"],
                          capture_output=True, timeout=60).returncode == 0


@pytest.mark.parametrize("named", ["0", "1", "another group"])
def test_stop_signals_no_group_it_cannot_prove_is_the_runs(box, named):
    plant(box, "victim", {"pid": "2", "started": "1795954052"})
    box.sh(HOLDER)
    box.sh(BYSTANDER)
    ready = f"test -s {RUNS}/holder.pgid && test -s {RUNS}/bystander.pgid && ! flock -n {RUNS}/.lock true"
    box.wait_for("the runs lock held and both groups up", lambda: subprocess.run(
        [str(box.sandbox.pct), "exec", CT, "--", "sh", "-c", ready], capture_output=True,
        timeout=60).returncode == 0,
        timeout=60)
    holder, bystander = box.sh(f"cat {RUNS}/holder.pgid {RUNS}/bystander.pgid").split()
    box.sh('printf "%s\\n" "$1" > "$2"', bystander if named == "another group" else named,
           f"{RUNS}/victim/pgid")
    try:
        r = box.invoke("stop", "--run", "victim", "--grace", "0", check=False)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == ExitStatus.RUN_STATE and len(lines) == 1, (r.returncode, r.stdout, r.stderr)
        assert lines[0].startswith(f"error: run victim on pve1/{CT}: not signalled: "), lines
        assert group_alive(box, holder) and group_alive(box, bystander), r.stderr
        assert box.sh(f"ls {RUNS}/victim").split() == ["pgid", "pid", "run.sh", "started"]  # no `stopped`
    finally:
        # One group per kill: dash's kill takes no `--` ("Illegal number: -") and stops at its first
        # failing operand, which once left both groups running into the next test file's container.
        box.sh(f'kill -KILL "-$(cat {RUNS}/holder.pgid)"; kill -KILL "-$(cat {RUNS}/bystander.pgid)"; true')
        box.wait_for("the stand-in groups gone",
                     lambda: not group_alive(box, holder) and not group_alive(box, bystander), timeout=60)
