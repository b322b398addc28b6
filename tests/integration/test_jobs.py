"""invoke train / stop against the embedded host, with the real payload deployed by invoke deploy."""

import json
import signal

import pytest
from training_runs import LONG, deployed  # noqa: F401 (deployed: the module's container)

from dflash_ops.errors import ExitStatus

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def no_run_left(deployed):
    yield
    deployed.stop_any()


def test_run_launched_followed_to_its_end_and_reported_finished(deployed):
    out = deployed.train("fin", "--max-steps", "2", "--set", "train.lr=0.002")
    assert "log: /root/runs/fin/train.log" in out and "invoke logs --follow --run fin" in out
    followed = deployed.invoke("logs", "--follow", "--run", "fin", timeout=300)
    assert "step 2/2" in followed.stdout
    assert followed.stdout.rstrip().endswith("==> dflash-ops: run fin is not running (exit code: 0)")

    st = deployed.status("fin")
    assert (st["state"], st["exit_code"], st["step"]) == ("finished", "0", 2)
    assert st["loss"] > 0 and st["acceptance_length"] >= 1 and st["tokens_per_s"] > 0
    assert not [p for p in deployed.processes() if "train_dflash" in p or "run.sh" in p]
    noop = deployed.invoke("stop", "--run", "fin")
    assert "run fin on pve1/200 is not running (exit code: 0)" in noop.stdout
    assert deployed.status("fin")["state"] == "finished"  # a stop of an ended run records nothing
    check_run_directory(deployed, "fin")


def test_second_launch_is_refused_while_a_run_is_alive(deployed):
    # A run that cannot end on its own while we look (a 2-step run may finish before the second launch).
    deployed.train("holder", *LONG)
    refused = deployed.invoke("train", "--run", "second", check=False)
    assert refused.returncode == ExitStatus.RUN_STATE
    assert "run 'holder' is alive on pve1/200" in refused.stderr
    assert deployed.container("test", "-e", "/root/runs/second", check=False).returncode != 0


def check_run_directory(deployed, run):
    """The run directory holds the log, metrics, pid, exit code, and what the run ran with."""
    files = set(deployed.container("ls", f"/root/runs/{run}").stdout.split())
    assert {"train.log", "metrics.jsonl", "checkpoints", "pid", "pgid", "exit_code", "started", "ended",
            "launch.json", "env", "code_version", "code_manifest.json", "config.given.yaml", "config.yaml",
            "run.sh"} <= files
    launch = json.loads(deployed.run_file(run, "launch.json"))
    assert "--set=train.lr=0.002" in launch["argv"] and "--max-steps=2" in launch["argv"]
    assert f"--run-dir=/root/runs/{run}" in launch["argv"]
    assert launch["sets"][-1] == "train.lr=0.002"
    assert "lr: 0.002" in deployed.run_file(run, "config.yaml")  # the training script got the override
    env = deployed.run_file(run, "env")
    assert "PATH=/root/venv/bin:" in env and "TORCHINDUCTOR_CACHE_DIR=/root/.cache/dflash/inductor" in env
    manifest = json.loads(deployed.run_file(run, "code_manifest.json"))
    assert deployed.run_file(run, "code_version").strip() == f"tree {manifest['tree']}"
    assert deployed.run_file(run, "config.given.yaml") == deployed.container(
        "cat", "/root/dflash/configs/tiny-cpu.yaml").stdout
    assert deployed.run_file(run, "exit_code").strip() == "0"


def test_hostile_or_unknown_run_names(deployed):
    deployed.container("mkdir", "-p", "/root/runs")
    before = deployed.container("ls", "-a", "/root/runs").stdout
    for name in ("../x", "a;b", "$(touch /root/runs/pwned)", "a\nb", "x" * 65):
        r = deployed.invoke("train", "--run", name, check=False)
        assert r.returncode == ExitStatus.USAGE and "a run name is 1-64 characters" in r.stderr
    assert deployed.container("ls", "-a", "/root/runs").stdout == before
    missing = deployed.invoke("stop", "--run", "nope", check=False)
    assert missing.returncode == ExitStatus.RUN_STATE
    assert missing.stderr.startswith("error: no run 'nope' on pve1/200; "), missing.stderr


def test_two_launches_at_the_same_moment_start_exactly_one(deployed):
    racers = [deployed.popen("train", "--run", name, *LONG) for name in ("race-a", "race-b")]
    results = [(p.wait(timeout=120), p.stdout.read()) for p in racers]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 6], results
    winner = "race-a" if results[0][0] == 0 else "race-b"
    loser_output = results[1][1] if winner == "race-a" else results[0][1]
    assert f"run '{winner}' is alive" in loser_output
    warm = deployed.invoke("warmup", check=False)  # it would share the GPUs and the compile cache
    assert warm.returncode == ExitStatus.RUN_STATE and f"run {winner} is alive on pve1/200" in warm.stderr
    training = [p for p in deployed.processes()
                if p.startswith("/root/venv/bin/python /root/dflash/train_dflash.py")]
    assert len(training) == 1 and f"--run-dir=/root/runs/{winner}" in training[0]

    stopped = deployed.invoke("stop", "--grace", "0")  # the latest run: the winner
    assert f"run {winner} on pve1/200 stopped" in stopped.stdout and "no process left" in stopped.stdout
    assert deployed.processes() == []
    st = deployed.status(winner)
    assert st["state"] == "stopped"
    assert deployed.run_file(winner, "stopped").split()[0] in ("term", "kill")


def test_stop_checkpoints_then_the_same_name_resumes(deployed):
    deployed.train("resume", *LONG)
    deployed.wait_for_file("resume", "metrics.jsonl")
    stopped = deployed.invoke("stop", "--run", "resume", "--grace", "120")
    assert "(SIGTERM, exit code: 0)" in stopped.stdout and "no process left" in stopped.stdout
    assert deployed.processes() == []
    st = deployed.status("resume")
    assert (st["state"], st["detail"]) == ("stopped", "stopped with SIGTERM, exit 0")
    stopped_at = st["step"]
    assert f"step-{stopped_at}" in deployed.container("ls", "/root/runs/resume/checkpoints").stdout

    deployed.train("resume", "--max-steps", str(stopped_at + 1))  # the schedule stays 300 steps
    log = deployed.invoke("logs", "--follow", "--run", "resume", "-n", "1000", timeout=300).stdout
    assert f"resumed from /root/runs/resume/checkpoints/step-{stopped_at} at step {stopped_at}" in log
    # The relaunch read its data back from the container's tokenized cache (data.cache_dir).
    assert "tokenized conversations from the cache (/root/.cache/dflash/data/" in log
    final = deployed.status("resume")
    assert (final["state"], final["step"]) == ("finished", stopped_at + 1)


def test_warmup_streams_progress_per_drafter_and_fails_loudly(deployed):
    r = deployed.invoke("warmup", "--set", "train.batch_size=2", "--set", "data.num_anchors=4", timeout=300)
    for worker in range(3):
        assert f"[warmup] drafter {worker} (cpu): train " in r.stdout
    assert "(6/6 shapes)" in r.stdout
    assert "inductor cache=/root/.cache/dflash/inductor" in r.stdout  # the cache training reads
    assert "warm-up done: 6 shape(s) on cpu,cpu,cpu" in r.stdout
    assert not [p for p in deployed.processes() if "warmup_compile" in p]

    p = deployed.popen("warmup")
    while "INFO" not in (line := p.stdout.readline()):
        assert line, "the warm-up ended before logging anything"
    p.send_signal(signal.SIGINT)  # Ctrl-C
    out = p.communicate(timeout=120)[0]
    assert p.returncode == ExitStatus.INTERRUPTED and out.rstrip().endswith("interrupted"), out
    assert not [p for p in deployed.processes() if "warmup_compile" in p]

    bad = deployed.invoke("warmup", "--set", "model.attention=flex", check=False, timeout=300)
    assert bad.returncode == ExitStatus.REMOTE_FAILED
    assert "warmup_compile: error: model.attention=flex on a cpu drafter" in bad.stdout  # streamed as it ran
    # then one line that says why (every error message is one line; its newlines would show as ^J)
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith(
        "error: warm-up failed on pve1/200 (exit 1): warmup_compile: error: model.attention=flex on a "
        "cpu drafter"
    ), bad.stderr
