"""`invoke train` tells the truth, against the embedded host: the preflight refuses in one line before
anything exists, the launch waits for the first step, a run dying in that window is `crashed`, and
Ctrl-C ends the wait only."""

import signal
import subprocess

import pytest
import yaml
from training_runs import CT, LONG, QUICK, deployed  # noqa: F401 (deployed: the module's container)

from dflash_ops.errors import ExitStatus

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def no_run_left(deployed):
    yield
    deployed.stop_any()


def run_exists(deployed, run):
    return deployed.container("test", "-e", f"/root/runs/{run}", check=False).returncode == 0


def test_a_healthy_launch_returns_after_its_first_step_with_the_line_shown(deployed):
    # log_every far beyond step 1: the wait returns on step 1 because training always logs it
    r = deployed.invoke("train", "--run", "healthy", *QUICK, "--set", "train.log_every=1000", *LONG)
    lines = r.stdout.splitlines()
    step = next(i for i, line in enumerate(lines) if " INFO step 1/" in line)
    started = next(i for i, line in enumerate(lines)
                   if line.startswith(f"run healthy started on pve1/{CT}: pid "))
    assert step < started, r.stdout
    assert deployed.status("healthy")["state"] == "running"


def test_ctrl_c_during_the_wait_ends_the_wait_and_the_run_goes_on(deployed):
    p = deployed.popen("train", "--run", "patient", *QUICK, *LONG)
    while "dflash-ops: launch " not in (line := p.stdout.readline()):
        assert line, "train ended before showing the launch's log"
    p.send_signal(signal.SIGINT)  # Ctrl-C: the first step is seconds away (torch is still importing)
    out = p.communicate(timeout=120)[0]
    assert p.returncode == ExitStatus.OK, out
    assert f"stopped waiting; run patient goes on on pve1/{CT}" in out
    assert deployed.status("patient")["state"] == "running"
    assert [p for p in deployed.processes() if "train_dflash" in p]


def test_a_run_that_dies_in_the_window_is_crashed_with_its_last_error_line(deployed):
    # Only the payload judges this one (it needs torch's flex attention on the drafter's device).
    r = deployed.invoke("train", "--run", "doomed", *QUICK, "--set", "model.attention=flex", check=False)
    assert r.returncode == ExitStatus.REMOTE_FAILED, r
    assert r.stderr.count("\n") == 1, r.stderr  # one line
    assert r.stderr.startswith(f"error: run doomed on pve1/{CT} crashed (exit 2): train_dflash: error: "
                               "model.attention=flex on a cpu drafter"), r.stderr
    assert "started on" not in r.stdout
    st = deployed.status("doomed")
    assert (st["state"], st["exit_code"]) == ("crashed", "2")
    assert st["last_error"].startswith("train_dflash: error: model.attention=flex on a cpu drafter")
    table = deployed.invoke("status", "--run", "doomed").stdout  # 80 columns: the line wraps in its cell
    assert "last error" in table and "train_dflash: error:" in table


def test_a_finished_run_is_refused_without_more_steps_and_resumes_with_them(deployed):
    deployed.train("done", *QUICK, "--max-steps", "2")
    deployed.invoke("logs", "--follow", "--run", "done", "-n", "0", timeout=300)  # returns when the run ends
    assert deployed.status("done")["state"] == "finished"
    again = deployed.invoke("train", "--run", "done", *QUICK, "--max-steps", "2", check=False)
    assert again.returncode == ExitStatus.RUN_STATE, again
    assert again.stderr.strip() == (f"error: pve1/{CT}: run done finished at step 2/2: give --max-steps N to "
                                    f"continue, or a new --run name")
    assert deployed.run_file("done", "exit_code").strip() == "0"  # nothing was launched over it
    deployed.train("done", *QUICK, "--max-steps", "3")
    deployed.invoke("logs", "--follow", "--run", "done", "-n", "0", timeout=300)
    final = deployed.status("done")
    assert (final["state"], final["step"]) == ("finished", 3)


def test_warmup_then_train_never_launches_after_a_failed_warm_up(deployed):
    r = deployed.invoke("warmup", "--set", "model.attention=flex", "train", "--run", "after-warmup", *QUICK,
                        check=False, timeout=300)
    assert r.returncode == ExitStatus.REMOTE_FAILED and "warm-up failed" in r.stderr, r
    assert not run_exists(deployed, "after-warmup")


def test_dev_shm_emptied_by_a_restart_is_refused_in_one_line_before_anything_exists(deployed):
    for verb in ("stop", "start"):  # as on a real LXC container, a restart empties /dev/shm
        subprocess.run([str(deployed.sandbox.pct), verb, CT], check=True, timeout=60)
    try:
        r = deployed.invoke("train", "--run", "no-target", *QUICK, check=False)
        assert r.returncode == ExitStatus.PREFLIGHT, r
        line = r.stderr.strip()
        assert "\n" not in line
        assert line.startswith(f"error: pve1/{CT}: preflight target: target checkpoint directory not found: "
                               "/dev/shm/"), line
        assert "run `invoke stage`" in line and "`invoke deploy`" in line and "nothing was launched" in line
        assert not run_exists(deployed, "no-target")
        assert not [p for p in deployed.processes() if "train_dflash" in p]
    finally:
        deployed.invoke("deploy", timeout=600)  # recreates the tiny target


def test_a_run_resumed_by_its_name_alone_keeps_its_launchs_settings(deployed):
    data = "/root/copy-of-train.jsonl"  # another file than the code's data/train.jsonl
    deployed.container("cp", "/root/dflash/data/train.jsonl", data)
    deployed.train("kept", "--set", f"data.train={data}", "--set", "train.max_steps=40")
    deployed.invoke("stop", "--run", "kept")
    resumed = deployed.invoke("train", "--run", "kept")  # the name alone
    shown = resumed.stdout.splitlines()
    assert shown[0].startswith("run kept: resuming with its saved spec: --config /root/dflash/"), shown
    assert f"--set data.train={data} --set train.max_steps=40" in shown[0]
    assert shown[1] == "  (nothing changed)"
    assert "resumed from /root/runs/kept/checkpoints/step-" in deployed.run_file("kept", "train.log")
    config = yaml.safe_load(deployed.run_file("kept", "config.yaml"))
    assert (config["data"]["train"], config["train"]["max_steps"]) == (data, 40)
    spec = deployed.status("kept")["spec"]
    assert f"data.train={data}" in spec["sets"] and "train.max_steps=40" in spec["sets"]
    assert spec["code_version"].startswith("tree ")
    deployed.invoke("stop", "--run", "kept")

    # other data for a run with checkpoints: a different run, refused until confirmed
    other = deployed.invoke("train", "--run", "kept", "--set", "data.train=data/train.jsonl", check=False)
    assert other.returncode == ExitStatus.PREFLIGHT, other
    assert other.stderr.startswith(f"error: pve1/{CT}: preflight changed: run kept has checkpoints "
                                   f"trained on other data or another target (data.train {data} -> "
                                   "data/train.jsonl)"), other.stderr
    confirmed = deployed.invoke("train", "--run", "kept", "--set", "data.train=data/train.jsonl",
                                "--confirm-change")
    assert f"  changed: --set data.train: {data} -> data/train.jsonl" in confirmed.stdout
    assert yaml.safe_load(deployed.run_file("kept", "config.yaml"))["data"]["train"] == "data/train.jsonl"


def test_max_steps_alone_continues_a_run_that_finished_its_schedule(deployed):
    deployed.train("sched", "--set", "train.max_steps=2")
    deployed.invoke("logs", "--follow", "--run", "sched", "-n", "0", timeout=300)  # returns when the run ends
    st = deployed.status("sched")
    assert (st["state"], st["step"]) == ("finished", 2)
    more = deployed.invoke("train", "--run", "sched", "--max-steps", "3")  # no --set: the spec has them
    assert "  changed: --max-steps: (train.max_steps) -> 3" in more.stdout
    deployed.invoke("logs", "--follow", "--run", "sched", "-n", "0", timeout=300)
    st = deployed.status("sched")
    assert (st["state"], st["step"], st["spec"]["max_steps"]) == ("finished", 3, 3)
    assert yaml.safe_load(deployed.run_file("sched", "config.yaml"))["train"]["max_steps"] == 3
