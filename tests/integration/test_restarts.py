"""A run's segments against the embedded host, with the real payload: `train --max-restarts N`
relaunches a SIGKILLed trainer from its checkpoint and the run finishes, `runs --history` shows each
segment, a stopped run is never restarted, and `metrics` shows a resumed run's steps once."""

import contextlib
import json
import subprocess

import pytest
from training_runs import LONG, REPO, deployed  # noqa: F401 (deployed: the module's container)

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def no_run_left(deployed):
    yield
    deployed.stop_any()


def history(deployed, run) -> list[tuple]:
    answer = json.loads(deployed.invoke("runs", "--history", run, "--json").stdout)
    return [(s["kind"], s["exit"], s["stopped"]) for s in answer["segments"]], answer


def follow_to_the_end(deployed, run) -> str:
    """`logs --follow` returns when the run is no longer alive (automatic restarts included)."""
    return deployed.invoke("logs", "--follow", "--run", run, "-n", "0", timeout=600).stdout


def frozen(deployed, run) -> str:
    """The run's training process, stopped (SIGSTOP): it cannot end or step while the test looks."""
    pid = deployed.run_file(run, "pid").strip()
    deployed.container("kill", "-STOP", pid)
    return pid


VENV_PYTHON = "/root/venv/bin/python"


@contextlib.contextmanager
def trainer_held_at_its_start(deployed):
    """Within the block, a training process stops itself (SIGSTOP) before its python starts: the
    venv's python is a shim that does so for train_dflash.py. The test acts on the process before
    it can take a step, however fast it would have been (a segment that reached its last step
    before the test froze it once resumed from there, not from the checkpoint the test meant)."""
    shim = ["#!/bin/sh", 'case "$1" in */train_dflash.py) kill -STOP $$ ;; esac',
            f'exec {VENV_PYTHON}.held "$@"']
    lines = " ".join(f"'{line}'" for line in shim)
    deployed.container("sh", "-c", f"mv {VENV_PYTHON} {VENV_PYTHON}.held && "
                       f"printf '%s\\n' {lines} > {VENV_PYTHON} && chmod 755 {VENV_PYTHON}")
    try:
        yield
    finally:
        deployed.container("mv", "-f", f"{VENV_PYTHON}.held", VENV_PYTHON)


def stopped_at_start(deployed, pid: str) -> bool:
    stat = deployed.container("cat", f"/proc/{pid}/stat", check=False).stdout
    return stat.rpartition(")")[2].split()[:1] == ["T"]


def test_a_run_with_max_restarts_survives_a_sigkill_from_its_checkpoint_and_finishes(deployed):
    deployed.train("requeue", "--max-steps", "2")  # a checkpoint of step 2 for the restart to resume
    follow_to_the_end(deployed, "requeue")
    with trainer_held_at_its_start(deployed):  # no step of this segment before the crash
        more = deployed.invoke("train", "--run", "requeue", "--max-steps", "8", "--max-restarts", "2",
                               "--no-wait")
        assert "  changed: --max-restarts: 0 -> 2" in more.stdout
        pid = deployed.run_file("requeue", "pid").strip()
        deployed.wait_for("the trainer stopped at its start", lambda: stopped_at_start(deployed, pid),
                          timeout=60, every=0.2)
    # the shim is gone: the automatic restart runs the real python
    assert deployed.container("test", "-e", "/root/runs/requeue/exit_code", check=False).returncode != 0
    watch = subprocess.Popen(deployed.invoke_argv("watch", "--run", "requeue", "--every", "1"), cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = watch.stdout.readline()  # its first poll: this segment, before the crash
        assert " watching: run requeue on pve1/200 running" in first, first
        deployed.container("kill", "-KILL", pid)
        follow_to_the_end(deployed, "requeue")
        watched = first + watch.communicate(timeout=240)[0]
    finally:
        watch.kill()
    assert watch.returncode == 0, watched
    assert (" restarted: run requeue on pve1/200 restarted automatically (restart 1, segment 3) after the "
            "training process ended: killed by signal 9 (SIGKILL); resuming from step 2") in watched, watched
    assert watched.splitlines()[-1].split()[1] == "finished:", watched

    st = deployed.status("requeue")
    assert (st["state"], st["step"], st["spec"]["max_restarts"]) == ("finished", 8, 2)
    rows, answer = history(deployed, "requeue")
    assert rows == [("launch", "0", False), ("resume", "signal 9", False), ("restart", "0", False)], rows
    restart = answer["segments"][2]
    assert (restart["restart"], restart["after"], restart["from_step"], restart["last_step"]) == (
        1, "signal 9", 2, 8)
    log = deployed.run_file("requeue", "train.log")
    assert "dflash-ops: the training process was killed by signal 9 (SIGKILL): restart 1 of 2 in 5 s" in log
    restarted = log.encode()[restart["log_offset"]:].decode()
    assert restarted.startswith("dflash-ops: restart ")
    assert "resumed from /root/runs/requeue/checkpoints/step-2 at step 2" in restarted

    shown = deployed.invoke("runs", "--history", "requeue").stdout.splitlines()
    assert shown[0] == "run requeue on pve1/200: finished (exit 0)"
    assert shown[1].split() == ["segment", "kind", "start", "UTC", "end", "UTC", "elapsed", "exit", "steps"]
    cells = [line.split() for line in shown[2:5]]
    assert [(c[0], c[1]) for c in cells] == [("1", "launch"), ("2", "resume"), ("3", "restart")]
    assert cells[0][-2:] == ["0", "1-2"]
    assert cells[2][1:3] == ["restart", "1"] and cells[2][-2:] == ["0", "3-8"]
    assert shown[3].endswith(" signal KILL  from 2 (none logged)")
    assert shown[5].startswith("total elapsed: ") and shown[5].endswith(" in 3 segment(s)")


def test_a_run_stopped_during_its_restart_backoff_is_not_restarted(deployed):
    deployed.train("halt", "--max-restarts", "2", *LONG)
    deployed.container("kill", "-KILL", frozen(deployed, "halt"))
    deployed.wait_for("the restart's backoff", lambda: "restart 1 of 2 in 5 s" in deployed.run_file(
        "halt", "train.log"), timeout=60, every=0.5)
    deployed.invoke("stop", "--run", "halt")  # in the backoff, or just after it on a slow machine
    st = deployed.status("halt")
    assert st["state"] == "stopped", st
    assert not [p for p in deployed.processes() if "train_dflash" in p or "run.sh" in p]
    rows, _ = history(deployed, "halt")
    assert rows[0] == ("launch", "signal 9", False) and len(rows) <= 2, rows
    assert rows[-1][2] is True or rows == [("launch", "signal 9", False)], rows  # ended by the stop
    assert deployed.run_file("halt", "stopped").startswith("term ")


def test_a_resumed_runs_metrics_show_each_step_once_from_its_latest_segment(deployed):
    deployed.train("again", "--set", "train.save_every=3", *LONG)
    while True:  # a moment past the last checkpoint, the trainer frozen there
        pid = frozen(deployed, "again")
        lines = deployed.run_file("again", "metrics.jsonl").splitlines()
        steps = [r["step"] for r in map(json.loads, filter(lambda x: x.endswith("}"), lines))
                 if r["kind"] == "train"]
        latest = deployed.container("cat", "/root/runs/again/checkpoints/latest", check=False).stdout.strip()
        if latest.startswith("step-") and steps[-1] > int(latest[5:]):
            break
        deployed.container("kill", "-CONT", pid)
        seen = len(lines)
        deployed.wait_for("a new metric", lambda seen=seen: len(
            deployed.run_file("again", "metrics.jsonl").splitlines()) > seen, timeout=120, every=0.5)
    reached, checkpoint = steps[-1], int(latest[5:])
    deployed.invoke("stop", "--run", "again", "--grace", "0")  # SIGKILL: no checkpoint of `reached`
    deployed.invoke("train", "--run", "again", "--max-steps", str(reached + 2))
    follow_to_the_end(deployed, "again")

    raw = [json.loads(line) for line in deployed.run_file("again", "metrics.jsonl").splitlines()]
    logged = [r["step"] for r in raw if r["kind"] == "train"]
    assert logged.count(reached) == 2  # the abandoned segment's step and the resumed one's
    table = deployed.invoke("metrics", "--run", "again", "-n", "0").stdout
    shown = [line.split()[0] for line in table.splitlines() if line.strip()[:1].isdigit()]
    assert shown == [str(s) for s in range(1, reached + 3)], table
    rows, answer = history(deployed, "again")
    assert rows == [("launch", "signal 9", True), ("resume", "0", False)], rows
    assert answer["segments"][1]["from_step"] == checkpoint
