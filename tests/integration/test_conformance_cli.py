"""`invoke conformance`: the pct contract checked as a product command (one row per check and a
verdict), and bad input as one line with exit 2, never pytest's tracebacks."""

import os
import subprocess
from pathlib import Path

import pytest

from dflash_ops import conformance
from dflash_ops.errors import ExitStatus

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


INVOKE = str(REPO / ".venv/bin/invoke")


def invoke(sandbox, *args):
    return subprocess.run([INVOKE, "conformance", "--inventory", str(sandbox.inventory), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})


def test_every_check_passes_on_the_embedded_host_one_row_each(sandbox):
    r = invoke(sandbox, "--ct", "200", "--stopped-ct", "201")
    assert r.returncode == ExitStatus.OK, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("│ ok")]
    assert len(rows) == len(conformance.CHECKS)
    assert f"conformance: all {len(conformance.CHECKS)} checks passed on pve1, pve1/200" in r.stdout
    assert "FAIL" not in r.stdout and r.stderr == ""


def test_without_a_stopped_container_those_checks_are_skipped_not_failed(sandbox):
    r = invoke(sandbox, "--ct", "200")
    skipped = sum(c.needs_stopped for c in conformance.CHECKS)
    assert r.returncode == ExitStatus.OK, r.stdout + r.stderr
    assert f"({skipped} skipped: give --stopped-ct ID for them)" in r.stdout


@pytest.mark.parametrize("args, said", [
    (["--ct", "999"], "error: "),                       # not in the inventory
    (["--ct", "201"], "error: --ct 201: not a running container on pve1"),
    (["--ct", "200", "--stopped-ct", "200"], "error: --stopped-ct 200: not a stopped container on pve1"),
    (["--ct", "abc"], "error: --ct 'abc': a container id is a number"),
])
def test_a_wrong_container_is_one_line_and_exit_2(sandbox, args, said):
    r = invoke(sandbox, *args)
    assert r.returncode == ExitStatus.USAGE, r.stdout + r.stderr
    assert r.stderr.startswith(said) and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_a_missing_inventory_is_one_line_and_exit_2(tmp_path):
    r = subprocess.run([INVOKE, "conformance", "--inventory", str(tmp_path / "no.yaml"), "--ct", "200"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == ExitStatus.USAGE, r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
