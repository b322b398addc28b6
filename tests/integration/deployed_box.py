"""A sandbox of our own for test_deploy / test_caches: container 200 fresh (never deployed by another
test file, no run holding its lock), 201 stopped. Built once per session and deployed once by the
first test that needs it: the venv with torch is the slow part. test_doctor gets another one, seeded
from the run's template (ct_template.seed) and deployed: the same state without a second pip."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ct_template import seed
from parallel import worker

from dflash_ops import deploy
from dflash_ops import sandbox as sandbox_mod
from dflash_ops.errors import ExitStatus
from dflash_ops.inventory import load_inventory
from dflash_ops.target import Target
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

    def count_venv_starts(self) -> None:
        """From now on each start of the venv's interpreter appends its pid to /root/venv-starts (a .pth
        line runs at every start, Debian's site.py may run it twice): a torch check is one start, a
        deploy that imports no torch makes none."""
        self.sh("rm -f /root/venv-starts; for d in /root/venv/lib/python3*/site-packages; do "
                "echo \"import os; open('/root/venv-starts', 'a').write('%d ' % os.getpid())\" > "
                "$d/zz-count-starts.pth; done")

    def venv_starts(self) -> int:
        return len(set(self.sh("cat /root/venv-starts 2>/dev/null; true").stdout.split()))

    def stop_counting_venv_starts(self) -> None:
        self.sh("rm -f /root/venv-starts /root/venv/lib/python3*/site-packages/zz-count-starts.pth")

    def snapshot(self) -> str:
        """Every file of the code releases with size and mtime, and where the code link points."""
        return self.sh('readlink /root/dflash; cd /root/dflash.releases && '
                       'find . -path "*/__pycache__" -prune -o -type f -printf "%p %s %T@\\n" | sort').stdout


LAYOUT = {"containers": (200,), "stopped": (201,)}


def box(sandbox_factory, tmp_path_factory) -> Box:
    """$DFLASH_TEST_DEPLOY_STATE keeps the box between sessions (quicker reruns; then not fresh)."""
    if "box" not in _BOX:
        kept = os.environ.get("DFLASH_TEST_DEPLOY_STATE")
        if kept:
            kept = os.path.join(kept, worker())
            sb = sandbox_mod.up(kept, inventory_path=os.path.join(kept, "sandbox.yaml"), **LAYOUT)
        else:
            sb = sandbox_factory(**LAYOUT)
        _BOX["box"] = Box(sb, deploy.snapshot_checkout(tmp_path_factory.mktemp("checkout")))
    return _BOX["box"]


def deployed_box(sandbox_factory, tmp_path_factory) -> Box:
    """The box after one real `invoke deploy` (fresh container: code, venv, tiny target)."""
    b = box(sandbox_factory, tmp_path_factory)
    if b.deployed is None:
        b.deployed = b.invoke("deploy", timeout=900)
        assert b.deployed.returncode == ExitStatus.OK, b.deployed.stdout + b.deployed.stderr
    return b


def seeded_box(sandbox_factory, tmp_path_factory, template) -> Box:
    """A box of its own whose container 200 has the template's venv and model, then one `invoke deploy`."""
    b = Box(sandbox_factory(**LAYOUT), deploy.snapshot_checkout(tmp_path_factory.mktemp("checkout")))
    seed(template, b.sandbox)
    b.deployed = b.invoke("deploy", timeout=900)
    assert b.deployed.returncode == ExitStatus.OK, b.deployed.stdout + b.deployed.stderr
    return b
