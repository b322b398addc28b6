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
    cmd = (f"{sys.executable} -m invoke warmup train --dry-run "
           f"--inventory {REPO / 'inventory' / 'production.yaml'} | head -c 29")
    r = subprocess.run(["bash", "-c", cmd + "; echo; echo rc=${PIPESTATUS[0]}"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr
    assert r.stdout.startswith("env LC_ALL=C.UTF-8 pct exec 2")


@pytest.mark.parametrize("args", [["regenerate", "--timeout", "0"], ["eval", "--run", "r", "--timeout", "-5"],
                                  ["exec", "--timeout", "inf", "--", "true"], ["plan", "--timeout", "nan"],
                                  ["warmup", "--timeout", "abc"], ["stage", "--timeout", "1e400"]])
def test_a_deadline_is_a_number_of_seconds_above_zero(args):
    r = invoke(*args) if args[0] != "exec" else subprocess.run(
        [sys.executable, "-m", "invoke", *args[:3], "--dry-run", "--inventory",
         str(REPO / "inventory" / "production.yaml"), *args[3:]], cwd=REPO, capture_output=True, text=True,
        timeout=60)
    assert r.returncode == ExitStatus.USAGE, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("error: --timeout ") and r.stdout == "", r.stderr


def test_a_good_deadline_is_accepted_and_the_default_is_documented():
    r = invoke("regenerate", "--timeout", "90")
    assert r.returncode == ExitStatus.OK, r.stderr
    help_text = subprocess.run([sys.executable, "-m", "invoke", "--help", "regenerate"], cwd=REPO,
                               capture_output=True, text=True, timeout=60).stdout
    assert "default 43200" in " ".join(help_text.split()), help_text
