"""What the facts helper's answers say, read locally: the venv's torch, the GPUs the roles need, sizes.

Pure functions over values that came from the container (remote/facts.py): every field is taken only
with the type it should have.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..inventory import Container


@dataclass(frozen=True)
class TorchInfo:
    ok: bool
    version: str | None = None
    cuda: str | None = None
    gpus: int = 0
    error: str = ""
    recorded: bool = False  # the venv's recorded check, not a fresh import of torch


def torch_info(venv_fact: dict | None) -> TorchInfo:
    """What the venv's torch says about itself, or why it could not say it (any answer: one line)."""
    from ..terminal import visible

    if not isinstance(venv_fact, dict) or not venv_fact.get("python"):
        return TorchInfo(False, error="no python in the venv")
    check = venv_fact.get("torch") if isinstance(venv_fact.get("torch"), dict) else {}
    out = check.get("out") if isinstance(check.get("out"), str) else ""
    if check.get("rc") != 0:
        err = check.get("err") if isinstance(check.get("err"), str) else ""
        tail = err.strip().splitlines()[-1:] or ["no output"]
        return TorchInfo(False, error=f"torch does not import: {visible(tail[0])[:300]}")
    try:
        data = json.loads(out.splitlines()[-1])
    except (ValueError, IndexError, RecursionError):
        data = None
    if not isinstance(data, dict):
        return TorchInfo(False, error=f"unreadable torch check output: {visible(out[:120])!r}")
    count = data.get("count")
    version, cuda = data.get("torch"), data.get("cuda")
    return TorchInfo(True, version if isinstance(version, str) else None,
                     cuda if isinstance(cuda, str) else None,
                     count if isinstance(count, int) and not isinstance(count, bool) and 0 <= count < 1 << 16
                     else 0,
                     recorded=check.get("recorded") is True)


def gpus_needed(container: Container) -> int:
    """Devices torch must see: one past the highest GPU index the roles name (0 for a CPU-only inventory)."""
    gpus = container.roles.gpus
    return max(gpus) + 1 if gpus else 0


def gpu_verdict(container: Container, visible: int) -> tuple[bool, str]:
    need = gpus_needed(container)
    roles = (f"target {container.roles.devices('target') or '-'}, drafter "
             f"{container.roles.devices('drafter') or '-'}")
    if need == 0:
        if visible:
            return True, f"{visible} GPU(s) visible, the roles use CPU only ({roles})"
        return True, f"0 GPUs visible, as the CPU-only roles expect ({roles})"
    if visible < need:
        return False, (f"{visible} GPU(s) visible, the roles need {need} ({roles}): check the "
                       "container's GPU passthrough (lxc.cgroup2.devices.allow / lxc.mount.entry for "
                       "/dev/nvidia*)")
    return True, f"{visible} GPU(s) visible, the roles need {need} ({roles})"


def human_bytes(n: int | float | None) -> str:
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not abs(n) < 1 << 80:
        return "?"  # None, or a value from the container that is not a size
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
