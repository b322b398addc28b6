"""pytest-xdist workers side by side: which worker this is, and what all workers of a run share."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


def worker() -> str:
    """This process's xdist worker id (gw0, gw1, ...), or "main" without xdist."""
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def run_dir(tmp_path_factory) -> Path:
    """A temporary directory shared by every worker of this run (each worker's own is inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if worker() != "main" else base


@contextlib.contextmanager
def file_lock(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
