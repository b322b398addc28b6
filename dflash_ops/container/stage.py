"""`invoke stage`: put the target back into paths.model (/dev/shm, emptied by every container restart)
from its persistent copy in the container (paths.model_store), verified against a recorded checksum.

One round trip: the `stage` verb of deploy's helper (remote/release.py, within --timeout or payload's default)
copies the store into a private dir beside paths.model, hashing each file as it is copied, checks
every file against the manifest recorded beside the store (`<model_store>.sha256`, sha256sum's
format, written by `invoke stage --record`, the `record` verb, once the store is known good), then
renames it onto paths.model (the previous copy goes only once the new one is whole). A copy already
staged from the same manifest (its stamp in paths.model) is left as it is. A refusal (no store, no
record, no room, a mismatch, the deadline, the session ended) leaves paths.model as it was and no
copy behind.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .. import payload
from ..errors import DflashOpsError, ExitStatus, TimedOut, UsageError
from ..inventory import Container
from ..remote import ship
from ..target import Target


class StageFailed(DflashOpsError, exit_status=ExitStatus.REMOTE_FAILED):
    """The target could not be staged: no store, no manifest, no room, or the copy failed."""


class StageMismatch(DflashOpsError, exit_status=ExitStatus.CHECKSUM_MISMATCH):
    """A staged file does not match the checksum recorded for the store."""


def manifest_path(ct: Container) -> str:
    return f"{store(ct).rstrip('/')}.sha256"


def store(ct: Container) -> str:
    if not ct.paths.model_store:
        raise UsageError(f"{ct.label}: no paths.model_store in the inventory: set it to the target's "
                         f"persistent copy in the container (docs/runbooks/stage-target.md)")
    return ct.paths.model_store


@dataclass
class Staged:
    container: Container
    what: str          # staged, already, recorded
    bytes: int
    seconds: float

    def describe(self) -> str:
        ct, size = self.container, f"{self.bytes / 2**30:.2f} GiB ({self.bytes} bytes)"
        if self.what == "recorded":
            return (f"recorded the sha256 of every file of {ct.paths.model_store} in {manifest_path(ct)}: "
                    f"{size}, {self.seconds:.1f} s")
        if self.what == "already":
            return f"{ct.paths.model} is already staged from {ct.paths.model_store} ({size}); nothing copied"
        rate = self.bytes / 2**20 / self.seconds if self.seconds > 0 else 0.0
        return (f"staged {ct.paths.model_store} -> {ct.paths.model} on {ct.label}: {size} in "
                f"{self.seconds:.1f} s ({rate:.0f} MiB/s), every file matches {manifest_path(ct)}")

    def facts(self) -> dict:
        ct = self.container
        return {"container": ct.label, "what": self.what, "store": ct.paths.model_store,
                "model": ct.paths.model, "bytes": self.bytes, "seconds": round(self.seconds, 3)}

    def row(self) -> str:
        return self.describe()


FAILURES = {
    "no-store": "the persistent copy {store} does not exist in the container: copy the target there once",
    "no-manifest": "no recorded checksum {manifest}: once {store} is known good, run `invoke stage --record`",
    "no-room": "not enough room for the target beside {model}",
    "copy-failed": "the copy failed",
}


def stage(t: Target, record: bool = False, timeout: float | None = None) -> Staged | None:
    """Stage (or --record) within `timeout` s (payload.TIMEOUTS' by default)."""
    ct = t.container
    timeout = payload.timeout_of("stage", timeout)
    args = {"store": store(ct), "manifest": manifest_path(ct)}
    if not record:
        args["model"] = ct.paths.model
    started = time.monotonic()
    what = "recording the store's checksums" if record else "staging"
    try:
        with payload.deadline(ct, what, timeout):
            value = ship.call(t, "release", "record" if record else "stage", args, timeout=timeout,
                              what="stage")
    except ship.Refusal as refusal:
        if refusal.kind == "mismatch":
            raise StageMismatch(f"{ct.label}: the copy of {ct.paths.model_store} does not match "
                                f"{manifest_path(ct)} ({refusal.message}); nothing was replaced: the store "
                                "changed or is damaged, check it and re-record with `invoke stage --record`"
                                ) from None
        if refusal.kind == "timeout":
            raise TimedOut(f"{ct.label}: {what} ran past its deadline of {timeout:g} s and was ended in "
                           "the container (nothing was replaced); give a longer --timeout") from None
        if refusal.kind in FAILURES or refusal.kind == "interrupted":
            why = FAILURES.get(refusal.kind, refusal.message).format(
                store=ct.paths.model_store, manifest=manifest_path(ct), model=ct.paths.model)
            said = f" ({refusal.message})" if refusal.kind in FAILURES else ""
            raise StageFailed(f"{ct.label}: stage: {why}{said}") from None
        ship.raise_common(refusal)
    seconds = time.monotonic() - started
    if t.dry_run:
        return None
    where = f"{ct.label}: stage"
    what, size = ship.field(value, "what", str, where), ship.field(value, "bytes", int, where)
    if what not in ("staged", "already", "recorded") or size < 0:
        raise ship.BadAnswer(f"{where}: the answer's field 'what' or 'bytes' is not one of the verb's")
    return Staged(ct, what, size, seconds)
