"""`invoke fetch`: bring a run's checkpoint back from the container, verified by sha256.

Round trips: (1) in the container, resolve the checkpoint (`latest` pointer or step-N) and hash its
files there; (2) on the host, a private temp dir and one `pct pull` per file; (3) SFTP each file
from the host; (4) remove the host's temp dir. Files land in `<to>.partial-<pid>/`, are hashed
again here, and the directory is renamed to `<to>` only when every sha256 matches the one
computed in the container; a SHA256SUMS file records them. By default only what
`DFlashDraftModel.from_pretrained` reads comes back (config.json, model.safetensors);
`--with-state` adds training_state.pt (optimizer state: about twice the weights).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import shutil
from dataclasses import dataclass, field

from . import commands, jobs
from .errors import DflashOpsError, RemoteCommandFailed, RunStateError, UsageError

MODEL_FILES = ("config.json", "model.safetensors")
STATE_FILE = "training_state.pt"
EXIT_NO_RUN, EXIT_NO_CHECKPOINT = 3, 4

# $1 runs dir, $2 run, $3 checkpoint (latest | step-N), then the file names wanted.
# Prints `dir <path>` then `<sha256> <size> <name>` per file; a wanted file that is missing: exit 5.
LIST_SCRIPT = r'''
runs=$1 run=$2 want=$3
shift 3
root=$runs/$run/checkpoints
[ -d "$runs/$run" ] || { echo "dflash: no run named $run under $runs" >&2; exit 3; }
if [ "$want" = latest ]; then
  want=$(cat "$root/latest" 2>/dev/null) || want=$(ls "$root" 2>/dev/null | grep '^step-[0-9]*$' | sort -t- -k2 -n | tail -n 1)
fi
dir=$root/$want
[ -n "$want" ] && [ -f "$dir/config.json" ] || { echo "dflash: no checkpoint ${want:-yet} in $root" >&2; exit 4; }
echo "dir $dir"
for name in "$@"; do
  [ -f "$dir/$name" ] || { echo "dflash: $dir/$name is missing" >&2; exit 5; }
  printf '%s %s %s\n' "$(sha256sum < "$dir/$name" | cut -d' ' -f1)" "$(stat -c %s "$dir/$name")" "$name"
done
'''


class ChecksumMismatch(DflashOpsError):
    exit_code = 9


@dataclass
class RemoteFile:
    name: str
    sha256: str
    size: int


@dataclass
class Fetched:
    run: str
    checkpoint: str                       # the directory in the container
    to: str
    files: list = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def parse_listing(text: str) -> tuple[str, list[RemoteFile]]:
    """LIST_SCRIPT's output -> (checkpoint dir, files). Pure."""
    directory, files = None, []
    for line in text.splitlines():
        if line.startswith("dir "):
            directory = line[4:].strip()
        elif line.strip():
            sha, size, name = line.split(" ", 2)
            files.append(RemoteFile(name, sha, int(size)))
    if directory is None:
        raise ValueError("checkpoint listing has no `dir` line")
    return directory, files


def validate_checkpoint(name: str) -> str:
    if name != "latest" and not (name.startswith("step-") and name[5:].isdigit()):
        raise UsageError(f"--checkpoint {name!r}: give latest or step-N")
    return name


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(t, run: str, to: str, checkpoint: str = "latest", force: bool = False,
          with_state: bool = False, echo=print) -> Fetched | None:
    ct, session = t.container, t.session
    run = jobs.validate_run_name(run)
    checkpoint = validate_checkpoint(checkpoint)
    to = os.path.abspath(os.path.expanduser(to))
    if os.path.exists(to) and not force and (not os.path.isdir(to) or os.listdir(to)):
        raise UsageError(f"{to} exists and is not empty; give --force to replace it")
    names = [*MODEL_FILES, *([STATE_FILE] if with_state else [])]

    listing = session.exec(ct, commands.sh_script(LIST_SCRIPT, ct.paths.runs, run, checkpoint, *names),
                           check=False)
    if t.dry_run:
        return None
    if listing.exited in (EXIT_NO_RUN, EXIT_NO_CHECKPOINT):
        raise RunStateError(f"{ct.label}: {listing.stderr.strip()}")
    if listing.exited != 0:
        raise RemoteCommandFailed(f"{ct.label}: listing the checkpoint failed (exit {listing.exited}): "
                                  f"{listing.stderr.strip()[-300:]}", exited=listing.exited)
    directory, files = parse_listing(listing.stdout)
    out = Fetched(run, directory, to, files)
    echo(f"{ct.label}: {directory}: {len(files)} files, {out.total_bytes / 2**20:.1f} MiB")

    host_tmp = session.run("mktemp -d /tmp/dflash-fetch.XXXXXX").stdout.strip()
    partial = f"{to}.partial-{os.getpid()}"
    try:
        session.run_in(ct, commands.and_then(*(
            commands.pct_transfer("pull", ct.ctid, posixpath.join(directory, f.name),
                                  posixpath.join(host_tmp, f.name), pct=ct.host.pct) for f in files)))
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        for f in files:
            local = os.path.join(partial, f.name)
            with open(local, "wb") as fh:
                fh.write(session.get_bytes(posixpath.join(host_tmp, f.name)))
            got = sha256_file(local)
            if got != f.sha256:
                raise ChecksumMismatch(f"{f.name}: sha256 {got[:16]}... here, {f.sha256[:16]}... in the "
                                       f"container; nothing written to {to}, fetch again")
            echo(f"  {f.name}  {f.size / 2**20:.1f} MiB  sha256 {f.sha256[:16]}... verified")
        with open(os.path.join(partial, "SHA256SUMS"), "w") as fh:
            fh.writelines(f"{f.sha256}  {f.name}\n" for f in files)
        if os.path.exists(to):
            shutil.rmtree(to) if os.path.isdir(to) else os.remove(to)
        os.rename(partial, to)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
        session.run(commands.shell_line(["rm", "-rf", "--", host_tmp]), check=False)
    return out
