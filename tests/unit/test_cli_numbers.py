"""Number flags: a bad value is a one-line usage error (exit 2), never a traceback; good ones work."""

import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ops.errors import ExitStatus

REPO = Path(__file__).resolve().parents[2]


def invoke(*args):
    return subprocess.run([sys.executable, "-m", "invoke", *args, "--dry-run",
                           "--inventory", str(REPO / "inventory" / "production.yaml")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args,flag", [
    (["logs", "-n", "abc"], "-n"),
    (["train", "--max-steps", "1 && reboot"], "--max-steps"),
    (["stop", "--grace", "`reboot`"], "--grace"),
    (["status", "--stall-after", "$(id)"], "--stall-after"),
])
def test_bad_numbers_are_one_line_usage_errors(args, flag):
    r = invoke(*args)
    assert r.returncode == ExitStatus.USAGE
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0
    assert r.stderr.startswith(f"error: {flag} ") and "expected" in r.stderr
    assert r.stdout == ""  # refused before anything was printed or sent


def test_good_numbers_still_reach_the_task():
    r = invoke("stop", "--grace", "0.5")
    assert r.returncode == ExitStatus.OK, r.stderr
    r = invoke("logs", "-n", "7")
    assert r.returncode == ExitStatus.OK and "7" in r.stdout


def test_a_reader_that_leaves_early_gets_no_traceback():
    # `invoke ... | head -1`: the pipe closes under the task's output.
    cmd = (f"{sys.executable} -m invoke deploy warmup train --dry-run "
           f"--inventory {REPO / 'inventory' / 'production.yaml'} | head -c 29")
    r = subprocess.run(["bash", "-c", cmd + "; echo; echo rc=${PIPESTATUS[0]}"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr
    assert r.stdout.startswith("env LC_ALL=C.UTF-8 pct exec 2")
