"""`invoke runs` / `invoke prune`: the container helper on real run directories and a real flock."""

import fcntl
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from waiting import wait_for

from dflash_ops import history
from dflash_ops.errors import UsageError
from dflash_ops.remote import history as ch

DAY = 86400


def make_run(runs, name, started, steps=(), latest=None, keep_last=2, exit_code="0", size=4096,
             leftover=False):
    d = runs / name
    (d / "checkpoints").mkdir(parents=True)
    (d / "started").write_text(f"{started}\n")
    (d / "ended").write_text(f"{started + 60}\n")
    (d / "pid").write_text("42\n")
    if exit_code is not None:
        (d / "exit_code").write_text(f"{exit_code}\n")
    (d / "config.yaml").write_text("data:\n  train: x.jsonl\ntrain:\n  batch_size: 2\n  keep_last: "
                                   f"{keep_last}\n")
    (d / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": max(steps or [0]), "loss": 1.5,
                                                 "acceptance_length": 2.25}) + "\n"
                                     + '{"kind": "eval", "step": 1}\n')
    for step in steps:
        (d / "checkpoints" / f"step-{step}").mkdir()
        (d / "checkpoints" / f"step-{step}" / "model.safetensors").write_bytes(b"w" * size)
    if steps:
        (d / "checkpoints" / "latest").write_text(f"step-{latest or max(steps)}\n")
    if leftover:
        (d / "checkpoints" / ".tmp-step-9-77").mkdir()
    for f in ("started", "ended", "metrics.jsonl", "config.yaml"):
        os.utime(d / f, (started + 60, started + 60))
    return d


@pytest.fixture
def runs(tmp_path):
    now = int(time.time())
    root = tmp_path / "runs"
    make_run(root, "old1", now - 30 * DAY, steps=(1, 2))
    make_run(root, "old2", now - 20 * DAY, steps=(1, 2, 3), exit_code="signal 9")
    # latest is not the newest
    make_run(root, "mid", now - 2 * DAY, steps=(2, 4, 6, 8), latest=2, leftover=True)
    make_run(root, "new", now - 3600, steps=(5, 10, 15), keep_last=1)
    make_run(root, "alive", now - 60, steps=(1, 2, 3, 4), exit_code=None)
    (root / ".current").write_text("alive\n")
    (root / ".lock").write_text("")
    (root / "not a run").mkdir()
    return root


def args(root, **extra):
    return {"runs": str(root), "lock": str(root / ".lock"), "current": str(root / ".current"), **extra}


@pytest.fixture
def alive_run(runs):
    """The run's wrapper, `sh <runs>/alive/run.sh`, holds the runs lock exclusively (the launch hands it
    the locked fd), as a real run's does."""
    (runs / "alive" / "run.sh").write_text("while :; do sleep 1; done\n")
    fd = os.open(runs / ".lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    wrapper = subprocess.Popen(["sh", str(runs / "alive" / "run.sh"), str(runs / "alive")], pass_fds=[fd],
                               start_new_session=True)
    os.close(fd)
    # Popen returns as the exec happens: /proc shows the new argv a moment later.
    wait_for("the wrapper's argv", lambda: b"run.sh" in Path(f"/proc/{wrapper.pid}/cmdline").read_bytes(),
             timeout=30, every=0.01)
    yield "alive"
    os.killpg(wrapper.pid, signal.SIGKILL)
    wrapper.wait()


def test_a_lock_held_by_no_run_prune_can_name_removes_nothing(runs):
    fd = os.open(runs / ".lock", os.O_RDWR)  # held, as by a launch still starting: no wrapper yet
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        answer = ch.prune(args(runs, keep=1, older_than=None, act=True))
    finally:
        os.close(fd)
    assert answer["alive"] == "?" and answer["plan"] and answer["removed"] == []
    assert sorted(p.name for p in runs.iterdir()) == [".current", ".lock", "alive", "mid", "new", "not a run",
                                                      "old1", "old2"]


def test_list_reads_every_run_newest_first(runs, alive_run):
    answer = ch.list_runs(args(runs))
    assert answer["alive"] == "alive"
    assert [(r["name"], r["state"]) for r in answer["runs"]] == [
        ("alive", "running"), ("new", "finished"), ("mid", "finished"), ("old2", "crashed"),
        ("old1", "finished")]
    mid = answer["runs"][2]
    assert (mid["step"], mid["loss"], mid["acceptance_length"], mid["latest_checkpoint"],
            mid["keep_last"]) == \
        (8, 1.5, 2.25, "step-2", 2)
    assert [c["name"] for c in mid["checkpoints"]] == ["step-2", "step-4", "step-6", "step-8"]
    assert mid["duration_s"] == 60 and mid["bytes"] >= 4 * 4096
    assert mid["spec"] is None  # no launch.json


def test_list_shows_each_runs_spec(runs):
    spec = {"config": "/root/dflash/configs/tiny-cpu.yaml", "sets": ["data.train=/root/d.jsonl"],
            "max_steps": 3000, "code_version": "tree abc"}
    (runs / "new" / "launch.json").write_text(json.dumps(spec, indent=1) + "\n")
    (runs / "old1" / "launch.json").write_text("{cut")
    records = {r["name"]: r for r in ch.list_runs(args(runs))["runs"]}
    assert records["new"]["spec"] == spec and records["old1"]["spec"] is None


def test_prune_plan_keeps_the_newest_the_alive_run_and_each_latest_checkpoint(runs, alive_run):
    answer = ch.prune(args(runs, keep=2, older_than=7 * DAY, act=False))
    assert answer["removed"] == [] and answer["lock"] is None
    assert [(p["what"], p["path"]) for p in answer["plan"]] == [
        ("checkpoint", "new/checkpoints/step-5"), ("checkpoint", "new/checkpoints/step-10"),  # keep_last 1
        ("checkpoint", "mid/checkpoints/step-4"),  # keep_last 2 keeps 6, 8; latest names step-2
        ("leftover", "mid/checkpoints/.tmp-step-9-77"),
        ("run", "old2"), ("run", "old1")]  # mid (2 days) is younger than --older-than 7d
    everything = ch.prune(args(runs, keep=1, older_than=None, act=False))["plan"]
    assert ("run", "mid") in [(p["what"], p["path"]) for p in everything]
    assert not any(p["run"] == "alive" for p in everything)


def test_prune_acts_while_the_run_is_alive_and_never_touches_it(runs, alive_run):
    before = sorted(p.relative_to(runs) for p in (runs / "alive").rglob("*"))
    answer = ch.prune(args(runs, keep=2, older_than=None, act=True))  # the alive run counts as the newest
    # the run holds the lock: no launch can start
    assert answer["alive"] == "alive" and answer["lock"] is None
    assert sorted(answer["removed"]) == sorted(p["path"] for p in answer["plan"])
    assert sorted(p.name for p in runs.iterdir()) == [".current", ".lock", "alive", "new", "not a run"]
    assert sorted(p.relative_to(runs) for p in (runs / "alive").rglob("*")) == before
    assert sorted(os.listdir(runs / "new" / "checkpoints")) == ["latest", "step-15"]


def test_prune_holds_the_runs_lock_while_it_deletes(runs):
    answer = ch.prune(args(runs, keep=4, older_than=None, act=True))
    assert answer["alive"] is None and answer["lock"] == "exclusive"
    assert answer["removed"][-1] == "old1" and not (runs / "old1").exists()
    assert sorted(os.listdir(runs / "mid" / "checkpoints")) == ["latest", "step-2", "step-6", "step-8"]
    # a second prune finds nothing more: the kept runs are within their keep_last
    assert ch.prune(args(runs, keep=4, older_than=None, act=True))["plan"] == []


def test_flags_are_refused_in_one_line():
    assert history.parse_age("7d") == 7 * DAY and history.parse_age("12h") == 43200
    assert history.parse_age("2w") == 14 * DAY and history.parse_age(None) is None
    for bad in ("banana", "7", "-1d", "7 days", ""):
        with pytest.raises(UsageError, match="--older-than .*expected an age such as 7d"):
            history.parse_age(bad)
    for bad in (0, -1):
        with pytest.raises(UsageError, match=f"--keep {bad}: keep at least 1 run"):
            history.check_keep(bad)
