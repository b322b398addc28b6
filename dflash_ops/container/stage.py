"""`invoke stage`: put the target back into paths.model (/dev/shm, emptied by every container restart)
from its persistent copy in the container (paths.model_store), verified against a recorded checksum.

One round trip: a constant shell script in the container (coreutils only; values travel as "$1"..)
copies the store into a private dir beside paths.model, checks every file against the manifest
recorded beside the store (`<model_store>.sha256`, written by `invoke stage --record` once the store
is known good), then renames it onto paths.model (the previous copy goes only once the new one is
whole). A copy already staged from the same manifest (its stamp in paths.model) is left as it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .. import commands, payload
from ..errors import DflashOpsError, ExitStatus, UsageError
from ..inventory import Container
from ..remote.ship import ANSWER_CAP
from ..target import Target

STAMP = ".dflash-staged"  # in paths.model: the sha256 of the manifest it was staged from
ANSWER = "dflash-stage:"  # the script's last line: `dflash-stage: <what> <bytes>`

# $1 store, $2 model, $3 manifest. Exit 20: no store, 21: no manifest, 22: no room, 23: a file does
# not match the manifest (sha256sum's lines on stderr), 24: the copy failed.
RECORD_SCRIPT = r"""
set -u
[ -d "$1" ] || { echo "no directory $1" >&2; exit 20; }
cd "$1" || exit 20
find . -type f -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum > "$3.dflash-part" \
  && [ -s "$3.dflash-part" ] && mv -f "$3.dflash-part" "$3" || { rm -f "$3.dflash-part"; exit 24; }
echo "dflash-stage: recorded $(du -sb . | cut -f1)"
"""
STAGE_SCRIPT = r"""
set -u
[ -d "$1" ] || { echo "no directory $1" >&2; exit 20; }
[ -f "$3" ] || { echo "no manifest $3" >&2; exit 21; }
want=$(sha256sum < "$3" | cut -d' ' -f1)
if [ -f "$2/.dflash-staged" ] && [ "$(cat "$2/.dflash-staged")" = "$want" ]; then
  echo "dflash-stage: already $(du -sb "$2" | cut -f1)"; exit 0
fi
need=$(du -sb "$1" | cut -f1)
parent=$(dirname "$2")
mkdir -p "$parent" || exit 24
free=$(df -B1 --output=avail "$parent" | tail -n 1 | tr -d ' ')
[ -d "$2" ] && free=$((free + $(du -sb "$2" | cut -f1)))
[ "$need" -lt "$free" ] || { echo "need $need bytes, $free free in $parent" >&2; exit 22; }
tmp=$(mktemp -d "$2.dflash-stage.XXXXXX") || exit 24
trap 'rm -rf "$tmp"' EXIT
cp -a "$1/." "$tmp/" || exit 24
(cd "$tmp" && sha256sum --quiet --strict -c "$3") >&2 || exit 23
printf '%s' "$want" > "$tmp/.dflash-staged" || exit 24
chmod 755 "$tmp"
if [ -e "$2" ]; then rm -rf "$2.dflash-old" && mv "$2" "$2.dflash-old" || exit 24; fi
mv "$tmp" "$2" || exit 24
trap - EXIT
rm -rf "$2.dflash-old"
echo "dflash-stage: staged $need"
"""


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

    def row(self) -> str:
        return self.describe()


FAILURES = {
    20: "the persistent copy {store} does not exist in the container: copy the target there once",
    21: "no recorded checksum {manifest}: once {store} is known good, run `invoke stage --record`",
    22: "not enough room for the target beside {model}",
    24: "the copy failed",
}


def stage(t: Target, record: bool = False, timeout: float | None = None) -> Staged | None:
    """Stage (or --record) within `timeout` s (payload.TIMEOUTS' by default)."""
    ct = t.container
    timeout = payload.timeout_of("stage", timeout)
    script = RECORD_SCRIPT if record else STAGE_SCRIPT
    started = time.monotonic()
    with payload.deadline(ct, "recording the store's checksums" if record else "staging", timeout):
        result = t.session.exec(ct, commands.sh_script(script, store(ct), ct.paths.model, manifest_path(ct)),
                                env={"PATH": commands.SYSTEM_PATH}, check=False, timeout=timeout,
                                limit=ANSWER_CAP)
    seconds = time.monotonic() - started
    if t.dry_run:
        return None
    tail = " ".join(result.stderr.strip().splitlines()[-3:])[-300:]
    if result.exited == 23:
        raise StageMismatch(f"{ct.label}: the copy of {ct.paths.model_store} does not match "
                            f"{manifest_path(ct)} ({tail}); nothing was replaced: the store changed or is "
                            "damaged, check it and re-record with `invoke stage --record`")
    if result.exited != 0:
        why = FAILURES.get(result.exited, f"exit {result.exited}").format(
            store=ct.paths.model_store, manifest=manifest_path(ct), model=ct.paths.model)
        raise StageFailed(f"{ct.label}: stage: {why}" + (f" ({tail})" if tail else ""))
    last = result.stdout.strip().splitlines()[-1:] or [""]
    parts = last[0][:200].split()
    if len(parts) != 3 or parts[0] != ANSWER or not parts[2].isdigit():
        raise StageFailed(f"{ct.label}: stage: unexpected answer {last[0][:120]!r}")
    return Staged(ct, parts[1], int(parts[2]), seconds)
