"""Shared by test_jobs/test_logs/test_status: the sandbox's container 200 deployed with the real
payload (`invoke deploy`), the real invoke CLI, and a look into the container from the host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ct_template import seed
from signals import sigint_default
from waiting import wait_for

from dflash_ops.errors import ExitStatus

REPO = Path(__file__).resolve().parents[2]
CT = "200"
# A short real run: small batches, no held-out evaluation, a metric and a checkpoint every step.
QUICK = ["--set", "data.heldout=null", "--set", "train.log_every=1", "--set", "train.save_every=1",
         "--set", "train.batch_size=2", "--set", "data.num_anchors=4"]
# A run that goes on until it is stopped (the schedule length caps --max-steps).
LONG = ["--set", "train.max_steps=1000000", "--max-steps", "1000000"]


class Deployed:
    def __init__(self, sandbox):
        self.sandbox = sandbox
        self.inventory = str(sandbox.inventory)

    def invoke_argv(self, *args, inventory=None) -> list[str]:
        return [sys.executable, "-m", "invoke", *args, "--inventory", inventory or self.inventory, "--ct", CT]

    def invoke(self, *args, check=True, timeout=120, inventory=None) -> subprocess.CompletedProcess:
        r = subprocess.run(self.invoke_argv(*args, inventory=inventory), cwd=REPO, capture_output=True,
                           text=True,
                           timeout=timeout)
        if check:
            assert r.returncode == ExitStatus.OK, (f"invoke {' '.join(args)}: exit {r.returncode}\n"
                                                   f"{r.stdout}\n{r.stderr}")
        return r

    def popen(self, *args) -> subprocess.Popen:
        # The tests send Ctrl-C (SIGINT) to this process
        return subprocess.Popen(self.invoke_argv(*args), cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, preexec_fn=sigint_default)

    def container(self, *argv, check=True) -> subprocess.CompletedProcess:
        """Run argv in the container with the host's pct (observation and fault injection only)."""
        r = subprocess.run([str(self.sandbox.pct), "exec", CT, "--", *argv], capture_output=True, text=True,
                           timeout=60)
        if check:
            assert r.returncode == 0, r.stderr
        return r

    def sh(self, script: str, *args: str, data: bytes | None = None) -> str:
        """`sh -c SCRIPT sh ARGS` in the container, stdin `data`: what a process in there could do."""
        r = subprocess.run([str(self.sandbox.pct), "exec", CT, "--", "sh", "-c", script, "sh", *args],
                           input=data, capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.decode()

    def processes(self) -> list[str]:
        """Command lines of every live process in the container except its init (LXC's init.lxc,
        whose command line reads `init`), the sleep it runs, and this ps. A zombie (`<defunct>`) has
        ended already: it is left out, whenever init gets round to reaping it."""
        out = self.container("ps", "-ww", "-eo", "stat=,args=").stdout.splitlines()
        rows = [line.split(None, 1) for line in out if line.strip()]
        ours = ("/usr/bin/sleep infinity", "ps -ww -eo")
        return [args for stat, args in (r + [""] if len(r) == 1 else r for r in rows)
                if not stat.startswith("Z") and args != "init" and not args.startswith(ours)]

    def run_file(self, run: str, name: str) -> str:
        return self.container("cat", f"/root/runs/{run}/{name}").stdout

    def status(self, run: str, *extra) -> dict:
        return json.loads(self.invoke("status", "--run", run, "--json", *extra).stdout)

    wait_for = staticmethod(wait_for)  # waiting.wait_for

    def wait_for_file(self, run: str, name: str, timeout=240.0) -> str:
        """Poll the run directory from the host (cheap: no invoke process competing for the 2 cores)."""
        path = f"/root/runs/{run}/{name}"
        self.wait_for(f"{path}", lambda: self.container("test", "-s", path, check=False).returncode == 0,
                      timeout=timeout, every=1.0)
        return self.run_file(run, name)

    def train(self, run: str, *extra) -> str:
        r = self.invoke("train", "--run", run, *QUICK, *extra)
        assert f"run {run} started on pve1/{CT}" in r.stdout, r.stdout
        return r.stdout

    def stop_any(self) -> None:
        """Leave the container without a live run for the next test."""
        if not os.path.exists(self.inventory):
            return
        if self.container("test", "-e", "/root/runs/.lock", check=False).returncode == 0:
            self.invoke("stop", "--grace", "0", check=False)  # without --run: the run holding the lock


def deploy(sandbox, template) -> Deployed:
    """`invoke deploy` into container 200, seeded from the template (ct_template.seed), so the first
    call ships the code and each later module's call is one round trip; no runs."""
    seed(template, sandbox)
    d = Deployed(sandbox)
    d.invoke("deploy", timeout=600)
    d.stop_any()
    d.container("rm", "-rf", "/root/runs")  # runs of an earlier module or session (a kept sandbox state)
    return d


@pytest.fixture(scope="module")
def box(sandbox):
    """Container 200 as it is, not deployed: for tasks that need only the container's system tools."""
    return Deployed(sandbox)


@pytest.fixture(scope="module")
def deployed(sandbox, template):
    """Container 200 deployed, without runs; any run a test module left alive is stopped at its end."""
    d = deploy(sandbox, template)
    yield d
    d.stop_any()
