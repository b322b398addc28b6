"""Shared by test_fanout_tasks and test_multinode: the real invoke CLI against an embedded sandbox,
the fan-out table parsed into rows, and a look into a container from its host."""

import os
import re
import subprocess
import sys
from pathlib import Path

from waiting import wait_for

from dflash_ops.errors import ExitStatus

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^[\s│┃]*(pve\d/\d+)[\s│┃]+(yes|NO)[\s│┃]+(.*?)[\s│┃]*$")  # a rich table row


class Cli:
    def __init__(self, sandbox):
        self.sandbox = sandbox

    def __call__(self, *args, code=ExitStatus.OK, timeout=600, inventory=None) -> subprocess.CompletedProcess:
        env = {**os.environ, "COLUMNS": "400"}  # rich: one table row per line
        inventory = inventory or str(self.sandbox.inventory)
        r = subprocess.run([sys.executable, "-m", "invoke", *args, "--inventory", inventory],
                           cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
        assert r.returncode == code, f"invoke {' '.join(args)}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r

    def container(self, host, ctid, *argv):
        return subprocess.run([str(self.sandbox.host(host).pct), "exec", str(ctid), "--", *argv],
                              capture_output=True, text=True, timeout=60)

    def wait_for(self, what, predicate, timeout=300.0):
        """waiting.wait_for, every 2 s: the predicates here run the CLI."""
        return wait_for(what, predicate, timeout, every=2.0)


def rows(output: str) -> dict:
    """The fan-out table: {container: (ok, detail)}."""
    found = {}
    for line in output.splitlines():
        m = ROW.match(line)
        if m:
            found[m[1]] = (m[2] == "yes", m[3])
    return found
