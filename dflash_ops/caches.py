"""`invoke clean-cache`: remove the compile caches the inventory names, in one round trip.

The cleaner runs in the container (container_runs.py `clean-caches`) and holds the runs lock while it
deletes, so no run can start half-way; while a run holds that lock it refuses unless forced.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import facts
from .errors import RunStateError
from .inventory import Container
from .target import Target


@dataclass(frozen=True)
class Freed:
    name: str
    path: str
    bytes: int
    files: int
    existed: bool


def clean_line(ct: Container, force: bool = False) -> str:
    payload = {"runs": ct.paths.runs, "caches": ct.paths.caches.all(), "force": bool(force)}
    return facts.runs_line(ct, "clean-caches", payload)


def parse_clean(ct: Container, answer: dict) -> list[Freed]:
    """The cleaner's answer -> what was freed; a refusal becomes RunStateError (pure)."""
    if answer.get("refused"):
        raise RunStateError(f"run {answer['refused']!r} is alive on {ct.label}: its compile caches "
                            "are in use; stop it first (`invoke stop`) or pass --force")
    out = []
    for name, usage in sorted((answer.get("freed") or {}).items()):
        if usage.get("left"):
            raise RunStateError(f"{ct.label}: {usage.get('path')} could not be removed completely")
        out.append(Freed(name, usage.get("path", ""), int(usage.get("bytes") or 0),
                         int(usage.get("files") or 0),
                         bool(usage.get("exists"))))
    return out


@dataclass(frozen=True)
class Cleaned:
    """What clean-cache freed in one container."""

    freed: list[Freed]

    def describe(self) -> str:
        lines = [f"{f.name:<17} {facts.human_bytes(f.bytes):>10}  {f.files:>6} files  {f.path}"
                 + ("" if f.existed else "  (was empty)") for f in self.freed]
        return "\n".join([*lines, self.row()])

    def row(self) -> str:
        total = sum(f.bytes for f in self.freed)
        return f"freed {facts.human_bytes(total)} ({total} bytes) in {sum(f.files for f in self.freed)} files"


def clean_cache(t: Target, force: bool = False) -> Cleaned:
    ct = t.container
    result = t.session.run_in(ct, clean_line(ct, force))
    if t.dry_run:
        return Cleaned([])
    return Cleaned(parse_clean(ct, facts.parse_json_line(result.stdout, "clean-cache")))
