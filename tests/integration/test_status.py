"""invoke status against the embedded host: one round trip, stalled, crashed with the signal, the table."""

import json
import re
import shlex

import pytest
from training_runs import LONG, deployed  # noqa: F401 (deployed: the module's container)

from dflash_ops import status, target
from dflash_ops.errors import ExitStatus

pytestmark = pytest.mark.integration


def test_no_run_yet_and_unknown_run(deployed):
    latest = deployed.invoke("status", "--json").stdout
    assert '"state": "none"' in latest
    missing = deployed.invoke("status", "--run", "nope", "--json", check=False)
    assert (missing.returncode, missing.stdout, missing.stderr) == (
        ExitStatus.RUN_STATE, "",
        "error: no run 'nope' on pve1/200; no runs yet: start one with `invoke train`\n")


def test_stalled_then_running_then_killed_by_sigkill_is_crashed_with_the_signal(deployed):
    deployed.train("victim", *LONG)
    pid = deployed.status("victim")["pid"]
    assert "/root/venv/bin/python /root/dflash/train_dflash.py" in deployed.container(
        "ps", "-o", "args=", "-p", str(pid)).stdout

    deployed.container("kill", "-STOP", str(pid))  # alive, but silent: no log line, no metric
    stalled = deployed.wait_for("status to call the silent run stalled",
                                lambda: (s := deployed.status("victim", "--stall-after", "2"))["state"]
                                == "stalled" and s,
                                every=2.0)
    assert stalled["idle_s"] > 2 and stalled["pid"] == pid
    assert "no new log line or metric" in stalled["detail"]
    assert [f["runbook"] for f in stalled["findings"]] == ["docs/runbooks/stalled-run.md"]
    deployed.container("kill", "-CONT", str(pid))
    assert deployed.status("victim")["state"] == "running"  # the default threshold is 600 s

    deployed.container("kill", "-KILL", str(pid))
    deployed.wait_for_file("victim", "exit_code")
    crashed = deployed.status("victim")
    assert (crashed["state"], crashed["exit_code"]) == ("crashed", "signal 9")
    assert crashed["detail"] == "killed by signal 9 (SIGKILL)"
    assert deployed.processes() == []  # the wrapper is gone too, and with it the run lock

    table = deployed.invoke("status", "--run", "victim").stdout
    assert "pve1/200: run victim" in table
    assert "crashed (killed by signal 9 (SIGKILL))" in table
    assert "GPUs" not in table  # the sandbox container has no nvidia-smi

    again = deployed.invoke("train", "--run", "after-crash", "--max-steps", "1")  # the lock was released
    assert "run after-crash started" in again.stdout
    deployed.invoke("stop", "--grace", "0")


def test_status_is_one_round_trip_on_one_connection(deployed):
    t = target.resolve_one(deployed.inventory, "200")
    before = (t.session.connections, t.session.round_trips)
    st = status.gather(t, "victim")
    assert st.state == "crashed"
    assert (t.session.connections - before[0], t.session.round_trips - before[1]) in ((1, 1), (0, 1))
    t.session.close()


def test_dry_run_prints_the_one_line_and_connects_to_nothing(deployed, tmp_path):
    broken = tmp_path / "inv.yaml"  # the same inventory, but the host's port has nothing listening
    broken.write_text(open(deployed.inventory).read().replace(f"port: {deployed.sandbox.port}", "port: 9"))
    r = deployed.invoke("status", "--run", "victim", "--dry-run", inventory=str(broken))
    lines = [line for line in r.stdout.splitlines() if line.startswith("env LC_ALL=")]
    assert len(lines) == 1, r.stdout
    argv = shlex.split(lines[0])
    assert argv[:6] == ["env", "LC_ALL=C.UTF-8", str(deployed.sandbox.pct), "exec", "200", "--"]
    inner = argv[argv.index("dflash-session") + 1:]  # under the session wrapper: the container's command
    assert inner[:3] == ["env", "-i", "--"] or inner[:2] == ["env", "-i"], inner
    assert inner[-2] == "status" and inner[-1].startswith("{")  # remote/runs.py's status verb


def test_a_run_on_answers_not_from_its_target_is_flagged_in_status_and_refused_on_request(deployed):
    """The shipped answers with the random tiny target: training's teacher-forced acceptance flatters,
    and `status` says so; with data.require_target_answers the launch is refused by the preflight
    with one line (train_dflash.py itself exits 2: tests/remote/test_data_runs.py)."""
    deployed.train("not-its-answers", "--max-steps", "1")
    deployed.invoke("logs", "--follow", "--run", "not-its-answers", "-n", "0", timeout=600)  # to its end
    assert deployed.status("not-its-answers")["state"] == "finished"
    warning = ("acceptance in training metrics is teacher-forced on data not produced by this target "
               "(train.jsonl: no provenance record, not from `invoke regenerate`)")
    assert deployed.status("not-its-answers")["data_warnings"] == [warning]
    table = deployed.invoke("status", "--run", "not-its-answers").stdout
    assert "teacher-forced acceptance" in table and "data warning" in table
    assert "acceptance in training metrics is teacher-forced" in table

    refused = deployed.invoke("train", "--run", "refused", "--max-steps", "1",
                              "--set", "data.require_target_answers=true", check=False)
    assert refused.returncode == ExitStatus.PREFLIGHT and "Traceback" not in refused.stderr, refused.stderr
    [line] = refused.stderr.strip().splitlines()
    assert "teacher-forced on data not produced by this target" in line and "invoke regenerate" in line
    assert deployed.invoke("status", "--run", "refused", check=False).returncode == ExitStatus.RUN_STATE


def check(deployed, run):
    return deployed.invoke("status", "--run", run, "--check", "--min-free", "0", "--min-free-shm", "0",
                           check=False)


def test_a_resumed_run_shows_its_own_step_of_total_loss_and_checkpoint_and_its_old_failure_pages_nothing(
        deployed):
    """Issue 32: after a disk-full crash and a resume, `status --check` stayed CRITICAL for a line of the
    first launch; status mixed the steps and losses of the two."""
    deployed.train("recovered", "--max-steps", "2")
    deployed.invoke("logs", "--follow", "--run", "recovered", "-n", "0", timeout=600)  # to its end
    # What a first launch that died on a full disk leaves in its log (the payload's own words for it).
    deployed.sh('printf "%s\\n" "OSError: [Errno 28] No space left on device" >> "$1"',
                "/root/runs/recovered/train.log")
    failed = check(deployed, "recovered")
    assert failed.returncode == 2 and "disk full in the log: read docs/runbooks/disk-full.md" in failed.stdout

    deployed.invoke("train", "--run", "recovered", "--max-steps", "4")  # the resume: a new segment
    deployed.invoke("logs", "--follow", "--run", "recovered", "-n", "0", timeout=600)
    ok = check(deployed, "recovered")
    assert ok.returncode == 0, ok.stdout
    assert ok.stdout.startswith("OK - pve1/200: run recovered finished (exit 0), step 4, loss "), ok.stdout

    st = deployed.status("recovered")
    metrics = [json.loads(line) for line in deployed.run_file("recovered", "metrics.jsonl").splitlines()]
    last = [m for m in metrics if m.get("kind") == "train"][-1]
    assert (st["step"], st["total_steps"], st["percent"], st["loss"]) == (4, 4, 100.0, last["loss"])
    assert (st["checkpoint_step"], st["findings"], st["last_error"]) == (4, [], None)
    assert st["duration_s"] is not None and st["uptime_s"] is None
    table = deployed.invoke("status", "--run", "recovered").stdout
    assert "4 of 4 (100.0%)" in table and f"{last['loss']:.4g} (step 4)" in table, table
    assert re.search(r"checkpoint +│ step-4, written \d+m\d\ds ago", table), table
    assert "duration" in table and "uptime" not in table and "disk full" not in table


TASKS_TAKING_RUN = {  # every task with --run, as a user types it with a mistyped name
    "status": ["status", "--run", "r11"],
    "status --json": ["status", "--run", "r11", "--json"],
    "logs": ["logs", "--run", "r11"],
    "logs --follow": ["logs", "--run", "r11", "--follow"],
    "metrics": ["metrics", "--run", "r11"],
    "fetch": ["fetch", "--run", "r11", "--to", "{tmp}/out"],
    "eval": ["eval", "--run", "r11"],
    "watch": ["watch", "--run", "r11", "--every", "1"],
    "stop": ["stop", "--run", "r11"],
    "runs --pin": ["runs", "--pin", "r11"],
}


@pytest.mark.parametrize("task", list(TASKS_TAKING_RUN))
def test_an_unknown_run_gets_the_one_answer_from_every_task(deployed, tmp_path, task):
    """Issue 32: six tasks, six answers (a table of dashes and exit 0, a path, 7 s of eval, a watch for
    ever); now one line naming the runs there are, and exit 6."""
    deployed.sh("mkdir -p /root/runs/r1 /root/runs/r2")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in TASKS_TAKING_RUN[task]]
    r = deployed.invoke(*argv, check=False, timeout=60)
    assert r.returncode == ExitStatus.RUN_STATE, (r.returncode, r.stdout, r.stderr)
    [line] = r.stderr.splitlines()
    assert line.startswith("error: no run 'r11' on pve1/200; runs: ") and line.endswith(
        " (did you mean r1?)"), line
    assert "r1, r2" in line and r.stdout == ""


def test_watch_waits_for_a_missing_run_only_with_wait(deployed):
    watch = deployed.popen("watch", "--run", "r12", "--every", "1", "--wait")
    try:
        line = watch.stdout.readline()
        assert "run r12 on pve1/200 does not exist yet; waiting for it to start" in line, line
        assert watch.poll() is None  # still waiting
    finally:
        watch.kill()
        watch.wait()
