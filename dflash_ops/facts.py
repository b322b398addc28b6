"""Container facts: the command that gathers them (one round trip) and the pure code that reads them.

The in-container side is `container_facts.py`, sent verbatim as `python -c` to `container.python`;
what it prints is one JSON object, read here. deploy, doctor and clean-cache share it.
"""

from __future__ import annotations

import base64
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from . import commands, jobs
from .errors import RemoteCommandFailed
from .inventory import Container

CONTAINER_FACTS = (Path(__file__).with_name("container_facts.py")).read_text(encoding="utf-8")
ALL_FACTS = ("code", "venv", "model", "gpus", "space", "caches", "runs")


# The script travels compressed as one argument, so a host line stays one line (dry-run prints one
# per line) and short; the loader is a constant and the values are separate arguments.
LOADER = "import base64,sys,zlib;exec(zlib.decompress(base64.b64decode(sys.argv.pop(1))))"


def packed(script: str) -> str:
    return base64.b64encode(zlib.compress(script.encode("utf-8"), 9)).decode("ascii")


def script_line(container: Container, script: str, verb: str | None, payload: dict) -> str:
    """Host line: the container's system python runs a constant script; the values travel as JSON."""
    argv = [container.python, "-c", LOADER, packed(script), *([verb] if verb else []),
            json.dumps(payload, sort_keys=True)]
    return commands.pct_exec(container.ctid, argv, env=container.run_env(), pct=container.host.pct)


def facts_payload(container: Container, want: Iterable[str]) -> dict:
    p = container.paths
    return {"code": p.code, "venv": p.venv, "model": p.model, "runs": p.runs, "caches": p.caches.all(),
            # "A run is alive" is jobs.py's fact: its processes hold the runs lock; .current names it.
            "lock": jobs.lock_path(container), "current": f"{p.runs}/{jobs.CURRENT}", "want": sorted(want)}


def facts_line(container: Container, want: Iterable[str] = ALL_FACTS) -> str:
    return script_line(container, CONTAINER_FACTS, "facts", facts_payload(container, want))


def parse_json_line(stdout: str, what: str) -> dict:
    """The last non-empty line of a script's stdout as a JSON object ({} when nothing was printed)."""
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        return {}
    try:
        value = json.loads(lines[-1])
    except ValueError:
        raise RemoteCommandFailed(f"{what}: unreadable answer from the container: {lines[-1][:200]!r}") from None
    if not isinstance(value, dict):
        raise RemoteCommandFailed(f"{what}: unexpected answer from the container: {lines[-1][:200]!r}")
    return value


@dataclass(frozen=True)
class TorchInfo:
    ok: bool
    version: str | None = None
    cuda: str | None = None
    gpus: int = 0
    error: str = ""


def torch_info(venv_fact: dict | None) -> TorchInfo:
    """What the venv's torch says about itself, or why it could not say it."""
    if not venv_fact or not venv_fact.get("python"):
        return TorchInfo(False, error="no python in the venv")
    check = venv_fact.get("torch") or {}
    if check.get("rc") != 0:
        tail = (check.get("err") or "").strip().splitlines()[-1:] or ["no output"]
        return TorchInfo(False, error=f"torch does not import: {tail[0]}")
    try:
        data = json.loads(check.get("out", "").splitlines()[-1])
    except (ValueError, IndexError):
        return TorchInfo(False, error=f"unreadable torch check output: {check.get('out', '')[:120]!r}")
    return TorchInfo(True, data.get("torch"), data.get("cuda"), int(data.get("count") or 0))


def gpus_needed(container: Container) -> int:
    """Devices torch must see: one past the highest GPU index the roles name (0 for a CPU-only inventory)."""
    gpus = container.roles.gpus
    return max(gpus) + 1 if gpus else 0


def gpu_verdict(container: Container, visible: int) -> tuple[bool, str]:
    need = gpus_needed(container)
    roles = f"target {container.roles.devices('target') or '-'}, drafter {container.roles.devices('drafter') or '-'}"
    if need == 0:
        if visible:
            return True, f"{visible} GPU(s) visible, the roles use CPU only ({roles})"
        return True, f"0 GPUs visible, as the CPU-only roles expect ({roles})"
    if visible < need:
        return False, (f"{visible} GPU(s) visible, the roles need {need} ({roles}): check the container's GPU "
                       f"passthrough (lxc.cgroup2.devices.allow / lxc.mount.entry for /dev/nvidia*)")
    return True, f"{visible} GPU(s) visible, the roles need {need} ({roles})"


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "?"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
