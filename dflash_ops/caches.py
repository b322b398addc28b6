"""`invoke clean-cache`: remove the compile caches the inventory names, in one round trip.

The cleaner runs in the container (remote/runs.py `clean-caches`) and holds the runs lock while it
deletes, so no run can start half-way; while a run holds that lock it refuses unless forced.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import terminal
from .errors import RunStateError
from .inventory import Container
from .remote import readings, ship
from .target import Target

CLEAN_TIMEOUT_S = 600.0  # removing a compile cache of many files


@dataclass(frozen=True)
class Freed:
    name: str
    path: str
    bytes: int
    files: int
    existed: bool


def clean_payload(ct: Container, force: bool = False) -> dict:
    return {"runs": ct.paths.runs, "caches": ct.paths.caches.all(), "force": bool(force)}


def _count(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62 else 0


def parse_clean(ct: Container, answer: dict) -> list[Freed]:
    """The cleaner's answer -> what was freed, for the caches the inventory names (pure)."""
    freed = answer.get("freed") if isinstance(answer, dict) else None
    if not isinstance(freed, dict):
        raise ship.BadAnswer(f"{ct.label}: clean-cache: the answer's field 'freed' is not an object")
    out = []
    for name, path in sorted(ct.paths.caches.all().items()):
        usage = freed.get(name) if isinstance(freed.get(name), dict) else {}
        if usage.get("left") is not False:
            raise RunStateError(f"{ct.label}: {path} could not be removed completely")
        out.append(Freed(name, path, _count(usage.get("bytes")), _count(usage.get("files")),
                         usage.get("exists") is True))
    return out


@dataclass(frozen=True)
class Cleaned:
    """What clean-cache freed in one container."""

    freed: list[Freed]

    def describe(self) -> str:
        lines = [f"{f.name:<17} {readings.human_bytes(f.bytes):>10}  {f.files:>6} files  {f.path}"
                 + ("" if f.existed else "  (was empty)") for f in self.freed]
        return "\n".join([*lines, self.row()])

    def row(self) -> str:
        total = sum(f.bytes for f in self.freed)
        files = sum(f.files for f in self.freed)
        return f"freed {readings.human_bytes(total)} ({total} bytes) in {files} files"


def clean_cache(t: Target, force: bool = False) -> Cleaned:
    ct = t.container
    try:
        answer = ship.call(t, "runs", "clean-caches", clean_payload(ct, force), timeout=CLEAN_TIMEOUT_S,
                           what="clean-cache")
    except ship.Refusal as refusal:
        if refusal.kind == "busy":
            run = refusal.extra.get("run") if isinstance(refusal.extra.get("run"), str) else "?"
            raise RunStateError(f"run {terminal.visible(run)[:80]!r} is alive on {ct.label}: its compile "
                                "caches are in use; stop it first (`invoke stop`) or pass --force") from None
        ship.raise_common(refusal)
    if t.dry_run:
        return Cleaned([])
    return Cleaned(parse_clean(ct, answer))
