"""One sandbox of our own for test_deploy / test_doctor / test_caches: container 200 fresh (never
deployed by another test file, no run holding its lock), 201 stopped. Built once per session and
deployed once by the first test that needs it: the venv with torch is the slow part."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from dflash_ops import deploy
from dflash_ops import sandbox as sandbox_mod
from dflash_ops.cli import Target
from dflash_ops.inventory import load_inventory
from dflash_ops.transport import HostSession

REPO = Path(__file__).resolve().parents[2]
CT = "200"
_BOX = {}


class Box:
    def __init__(self, sandbox, checkout: Path):
        self.sandbox = sandbox
        self.inventory = str(sandbox.inventory)
        self.checkout = checkout  # where `invoke` runs: its remote_scripts/ is what deploy ships
        self.deployed = None  # the first `invoke deploy`'s result, once run

    def invoke(self, *args, timeout=300, inventory=None, ct=CT, env=None) -> subprocess.CompletedProcess:
        argv = [str(REPO / ".venv/bin/invoke"), *args, "--inventory", inventory or self.inventory]
        if ct:
            argv += ["--ct", ct]
        return subprocess.run(argv, cwd=self.checkout, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "COLUMNS": "200", **(env or {})})

    def container(self, *argv, check=True, ct=CT) -> subprocess.CompletedProcess:
        """argv in the container through the host's pct (observation and fault injection only)."""
        r = subprocess.run([str(self.sandbox.pct), "exec", ct, "--", *argv], capture_output=True, text=True,
                           timeout=120)
        if check:
            assert r.returncode == 0, r.stderr
        return r

    def sh(self, script: str, *args, check=True) -> subprocess.CompletedProcess:
        return self.container("sh", "-c", script, "sh", *args, check=check)

    def target(self, ct=CT) -> Target:
        """A library-level target with a session of its own (not the CLI's process-wide cache)."""
        inv = load_inventory(self.inventory)
        container = inv.container(ct)
        return Target(inv, container, HostSession(container.host), False)

    def snapshot(self) -> str:
        """Every file of the code releases with size and mtime, and where the code link points."""
        return self.sh('readlink /root/dflash; cd /root/dflash.releases && '
                       'find . -path "*/__pycache__" -prune -o -type f -printf "%p %s %T@\\n" | sort').stdout


def box(sandbox_factory, tmp_path_factory) -> Box:
    """$DFLASH_TEST_DEPLOY_STATE keeps the box between sessions (quicker reruns; then not fresh)."""
    if "box" not in _BOX:
        layout = {"containers": (200,), "stopped": (201,)}
        kept = os.environ.get("DFLASH_TEST_DEPLOY_STATE")
        if kept:
            sb = sandbox_mod.up(kept, inventory_path=os.path.join(kept, "sandbox.yaml"), **layout)
        else:
            sb = sandbox_factory(**layout)
        _BOX["box"] = Box(sb, deploy.snapshot_checkout(tmp_path_factory.mktemp("checkout")))
    return _BOX["box"]


def deployed_box(sandbox_factory, tmp_path_factory) -> Box:
    """The box after one real `invoke deploy` (fresh container: code, venv, tiny target)."""
    b = box(sandbox_factory, tmp_path_factory)
    if b.deployed is None:
        b.deployed = b.invoke("deploy", timeout=900)
        assert b.deployed.returncode == 0, b.deployed.stdout + b.deployed.stderr
    return b
