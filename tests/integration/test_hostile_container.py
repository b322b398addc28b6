"""What a hostile container does to the operator's tools, provoked from inside container 200 (201) on the
embedded host and driven through the real CLI: every read is bounded in time and size, every answer is
data, and one container cannot blind the others.

- A FIFO in a run directory (`mkfifo runs/<run>/started`) once hung status, status --check,
  status --prometheus, watch, runs, logs and stop for ever: nothing opened it without blocking.
- The container's root owns its python3, so every helper's answer is the container's choice: a
  crafted answer gave tracebacks and wrong verdicts; a 1 GiB answer cost minutes and gigabytes here
  before it was refused; one that never comes hung the task, and a `--group` export with it.

No deploy: the tasks here need only the container's system tools.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash_ops.errors import ExitStatus
from dflash_ops.oncall import monitoring

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RUNS = "/root/runs"
TRACEBACK = "Traceback (most recent call last)"
UNTRUSTED, UNKNOWN = ExitStatus.UNTRUSTED, monitoring.UNKNOWN  # the plugin's UNKNOWN: status --check
# A crafted answer, the same whatever it is asked: fields of the wrong type for every task that reads one,
# at the top level (older readers) and as the answer (the one protocol).
CRAFTED = {"runs": [{"name": 5, "state": 7, "bytes": "x", "alive": 1, "checkpoints": 3}], "exists": True,
           "alive": True, "now": "x", "name": "r", "files": {"started": "abc"}, "log": 7, "metrics": [5],
           "gpus": ["0, 1"], "code": 5, "venv": 7, "model": [], "space": 3, "caches": "x",
           "plan": {"gpus": 3000000, "configured": {"target_devices": [], "placement": "x"},
                    "target_tok_s": 1, "drafter_tok_s": 1, "weights_gib": 1, "activations_gib": 1,
                    "device_gib": 1},
           "lines": 7, "state": 9, "freed": 3, "dir": 5, "files_": 1}
CRAFTED = {**CRAFTED, "ok": dict(CRAFTED)}


@pytest.fixture(scope="module")
def two(sandbox_factory):
    """Containers 200 and 201 on one host, both running, and the real CLI against them."""
    sb = sandbox_factory(containers=(200, 201))
    return Cli(sb)


class Cli:
    def __init__(self, sb):
        self.sb = sb
        self.inventory = str(sb.inventory)

    def __call__(self, *args, inventory=None, ct="200", timeout=120, measure=False):
        """`invoke ARGS` (here: /usr/bin/time -v with `measure`, for its peak memory)."""
        argv = [sys.executable, "-m", "invoke", *args, "--inventory", inventory or self.inventory,
                *(["--ct", ct] if ct else [])]
        argv = ["/usr/bin/time", "-v", *argv] if measure else argv
        return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout)

    def sh(self, script, *args, ct="200", data=None):
        r = subprocess.run([str(self.sb.pct), "exec", ct, "--", "sh", "-c", script, "sh", *args],
                           input=data, capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.decode()

    def interpreter(self, tmp_path, body: str, ct: int = 200) -> str:
        """An inventory whose container `ct` runs helpers with /root/evil-python: `body` (sh)."""
        self.sh('printf "%s\\n" "#!/bin/sh" "$1" > /root/evil-python && chmod +x /root/evil-python', body,
                ct=str(ct))
        inv = yaml.safe_load(Path(self.inventory).read_text())
        inv["containers"][ct]["python"] = "/root/evil-python"
        path = tmp_path / f"evil-{ct}.yaml"
        path.write_text(yaml.safe_dump(inv))
        return str(path)


def one_line_error(r, code=None):
    assert TRACEBACK not in r.stderr + r.stdout, r.stderr
    if code is not None:
        assert r.returncode == code, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: pve1/200: "), r.stderr
    return lines[0]


# --- a FIFO in a run directory ------------------------------------------------------------------------

@pytest.fixture
def fifo_run(two):
    """A run whose files are FIFOs, `.current` naming it: any plain open() of them blocks for ever."""
    two.sh(f'rm -rf {RUNS} && mkdir -p {RUNS}/r && echo r > {RUNS}/.current && touch {RUNS}/.lock && '
           f'cd {RUNS}/r && mkfifo started pid exit_code train.log metrics.jsonl eval.json data.json '
           'stopped ended && mkdir checkpoints && mkfifo checkpoints/latest')
    yield "r"
    two.sh(f"rm -rf {RUNS}")


def test_fifos_in_a_run_directory_block_no_task(two, fifo_run, tmp_path):
    st = json.loads(two("status", "--run", "r", "--json").stdout)
    assert (st["state"], st["detail"]) == ("crashed", "the training process never started")
    check = two("status", "--check")
    assert check.returncode == monitoring.CRITICAL, check
    assert check.stdout.startswith("CRITICAL - pve1/200: run r crashed"), check
    prom = tmp_path / "dflash.prom"
    assert two("status", "--prometheus", str(prom)).returncode == ExitStatus.OK
    assert 'dflash_up{host="pve1",ct="200"} 1' in prom.read_text()
    runs = two("runs")
    assert runs.returncode == ExitStatus.OK and " r " in runs.stdout and "crashed" in runs.stdout, runs
    assert two("logs", "--run", "r", "-n", "5").returncode == ExitStatus.OK
    stop = two("stop", "--run", "r")
    assert stop.returncode == ExitStatus.OK and "run r on pve1/200 is not running" in stop.stdout, stop
    watch = two("watch", "--run", "r", "--every", "1")
    assert watch.returncode == ExitStatus.RUN_STATE and "run r on pve1/200 crashed" in watch.stderr, watch
    assert two("prune", "--keep", "1").returncode == ExitStatus.OK


# --- the container's interpreter answers -----------------------------------------------------------------

def test_a_crafted_answer_is_one_line_naming_the_container_and_never_a_traceback(two, tmp_path):
    evil = two.interpreter(tmp_path, f"printf '%s\\n' {json.dumps(json.dumps(CRAFTED))}")
    for task in (["status"], ["status", "--json"], ["runs"], ["prune", "--keep", "1"], ["logs", "-n", "3"],
                 ["stop"], ["clean-cache"], ["doctor"]):
        r = two(*task, inventory=evil)
        assert r.returncode != ExitStatus.OK, (task, r.stdout)
        line = one_line_error(r)
        assert re.search(r"field|answer", line), (task, line)
    metrics = two("metrics", inventory=evil)  # what is not a metric is skipped and counted
    assert TRACEBACK not in metrics.stderr, metrics
    assert metrics.returncode in (ExitStatus.OK, ExitStatus.RUN_STATE), metrics
    check = two("status", "--check", inventory=evil)
    assert check.returncode == UNKNOWN and check.stdout.startswith("UNKNOWN"), check
    assert "pve1/200: status: the answer's field 'state'" in check.stdout, check


def test_a_flood_is_cut_at_the_cap_with_bounded_memory(two, tmp_path):
    evil = two.interpreter(tmp_path, "head -c 1073741824 /dev/zero | tr '\\0' x")  # a 1 GiB answer
    r = two("status", inventory=evil, measure=True)
    assert "passed 8388608 bytes" in one_line_error(r, UNTRUSTED)
    peak_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    assert peak_kib < 300 * 1024, peak_kib  # the CLI's own ~50 MiB plus at most the cap, not the 1 GiB
    check = two("status", "--check", inventory=evil)
    assert check.returncode == UNKNOWN and "passed 8388608 bytes" in check.stdout, check


def test_one_hanging_container_leaves_the_others_checked_and_exported(two, tmp_path):
    """201's interpreter never answers: its status is an error within its own deadline (status.STATUS_
    TIMEOUT_S), UNKNOWN in --check, `dflash_up 0` in the export; 200's series are written all the same."""
    two.sh(f"rm -rf {RUNS}", ct="201")
    evil = two.interpreter(tmp_path, "exec sleep 3600", ct=201)
    prom = tmp_path / "group.prom"
    r = two("status", "--group", "all", "--prometheus", str(prom), inventory=evil, ct=None)
    assert r.returncode == ExitStatus.OK, r
    text = prom.read_text()
    assert 'dflash_up{host="pve1",ct="200"} 1' in text
    assert 'dflash_up{host="pve1",ct="201"} 0' in text
    assert "pve1/201: " in r.stderr and "timed out" in r.stderr and TRACEBACK not in r.stderr
    check = two("status", "--group", "all", "--check", inventory=evil, ct=None)
    assert check.returncode == UNKNOWN, check
    assert "no run yet" in check.stdout and "timed out" in check.stdout, check
