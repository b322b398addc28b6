"""Nothing a task starts in the container outlives its SSH session, unless it is meant to (a run).

Without a tty, real pct leaves the command running when the SSH session goes away (pct-real.md), and
so does the stand-in. Each test starts a task, kills the local `invoke` process (the SSH client)
while the task's command runs in the container, then lists the container's processes and finds
nothing of it. The command is made long and silent, a venv whose python only sleeps, so that it
cannot end by writing to the closed session instead (a talkative one would, at its next line).
"""

import subprocess
import uuid
from pathlib import Path

import pytest
import yaml
from training_runs import CT, REPO, deployed  # noqa: F401 (deployed: the module's container)

pytestmark = pytest.mark.integration

VENV, RUNS, RUN = "/root/venv-sleepy", "/root/runs-sleepy", "held"


@pytest.fixture(scope="module")
def sleepy(deployed, tmp_path_factory):
    """An inventory whose venv python sleeps for a number no other process uses (`sleep <mark>`)."""
    mark = str(10**7 + uuid.uuid4().int % 10**7)
    # A run with a checkpoints dir: eval checks that they exist before it starts its script.
    deployed.sh('mkdir -p "$1/bin" "$3/anyrun/checkpoints" && '
                'printf "#!/bin/sh\\nexec sleep %s\\n" "$2" > "$1/bin/python" && '
                'chmod +x "$1/bin/python"', VENV, mark, RUNS)
    inv = yaml.safe_load(Path(deployed.inventory).read_text())
    inv["containers"][int(CT)]["paths"].update(venv=VENV, runs=RUNS)
    path = tmp_path_factory.mktemp("sleepy") / "sleepy.yaml"
    path.write_text(yaml.safe_dump(inv))
    yield str(path), mark
    deployed.sh('rm -rf "$1" "$2"', VENV, RUNS)


def ours(deployed, *needles):
    """Container processes of the task: its command, or the tool's session wrapper around one."""
    needles = (*needles, "dflash-session", "dflash-watch")
    return [p for p in deployed.processes() if any(n in p for n in needles)]


def kill_the_client_mid_command(deployed, inventory, args, *needles):
    client = subprocess.Popen(deployed.invoke_argv(*args, inventory=inventory), cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deployed.wait_for(f"`invoke {' '.join(args)}` to run {needles} in the container",
                          lambda: any(n in p for p in deployed.processes() for n in needles), timeout=300)
    finally:
        client.kill()  # SIGKILL: the SSH connection closes with no word to the host
        client.wait()
    deployed.wait_for("nothing of the task left in the container", lambda: not ours(deployed, *needles),
                      timeout=60)


@pytest.mark.parametrize("task", [
    ["deploy"],  # the venv check: "$venv/bin/python" -c ""
    ["warmup"],
    ["eval", "--run", "anyrun"],
    ["regenerate", "--limit", "1"],
])
def test_a_killed_client_leaves_nothing_of_the_task_in_the_container(deployed, sleepy, task):
    inventory, mark = sleepy
    kill_the_client_mid_command(deployed, inventory, task, f"sleep {mark}")


def test_a_killed_client_leaves_no_follower_and_the_run_goes_on(deployed, sleepy):
    inventory, mark = sleepy
    # A run as the follower sees one: its wrapper (`sh <run>/run.sh`) holds the runs lock (flock's
    # child inherits it). It was started detached (setsid -f) as `invoke train` starts runs, and must
    # outlive the session.
    holder = f"sleep {int(mark) + 1}"
    deployed.sh('mkdir -p "$1/$2" && echo "$2" > "$1/.current" && echo "step 1" > "$1/$2/train.log" && '
                'echo "$3" > "$1/$2/run.sh" && '
                'setsid -f flock "$1/.lock" sh "$1/$2/run.sh" </dev/null >/dev/null 2>&1', RUNS, RUN, holder)
    try:
        deployed.wait_for("the run to hold its lock", lambda: any(holder in p for p in deployed.processes()))
        kill_the_client_mid_command(deployed, inventory, ["logs", "--follow"], "tail -c +", " follow {")
        assert any(p.startswith(holder) for p in deployed.processes())  # the run is still there
    finally:
        deployed.sh('pkill -x -f "$1"; true', holder)
