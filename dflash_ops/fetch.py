"""`invoke fetch`: bring a run's checkpoint back from the container, verified by sha256.

The container is not trusted (docs/design.md, "Trust boundary"): it chooses no name and no path,
and its numbers bound nothing here. Round trips: 1 + N for N files.
1. in the container (remote/fetch.py `list`, one answer in the helper protocol): resolve the
   checkpoint to a real `step-N/` directory under the run's `checkpoints/`, and hash the files fetch
   asks for, by fixed name, refusing symlinks and anything that is not a regular file; each file's
   size and the bytes it really occupies (`disk`: st_blocks x 512).
2. before a byte moves: each file's size must be within its cap, twice the bytes it occupies on the
   container's disk plus 1 MiB (a sparse file would be written out here whole: a 3 GiB file of
   holes occupies 2 MiB there; a compressing file system stays well inside 2x), and the whole must
   fit the free space of `--to`'s file system with FREE_RESERVE to spare.
3. per file: `pct exec CT -- cat -- FILE` on an SSH channel of its own (memory bounded by the SSH
   window), into a temporary directory inside `--to` (files opened O_EXCL|O_NOFOLLOW relative to
   the checked directory), hashed as it arrives; more bytes than the listing said end it; no byte
   for STALL_S seconds ends it; its deadline grows with the bytes actually moved (TIMEOUT_FLOOR_S +
   moved / SLOW_BYTES_PER_S; `--timeout` fixes it instead). Only when size and sha256 match the
   listing's is each file renamed into `--to`. Nothing is written on the host.
By default only what `DFlashDraftModel.from_pretrained` reads comes back (config.json,
model.safetensors); `--with-state` adds training_state.pt (optimizer state: about twice the weights).
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import stat
import threading
import time
from dataclasses import dataclass, field

from . import commands, runs, terminal
from .errors import DflashOpsError, ExitStatus, RemoteCommandFailed, RunStateError, UntrustedData, UsageError
from .remote import ship
from .remote.readings import human_bytes

MODEL_FILES = ("config.json", "model.safetensors")
STATE_FILE = "training_state.pt"
KNOWN_FILES = (*MODEL_FILES, STATE_FILE, "SHA256SUMS")
SHA256 = re.compile(r"[0-9a-f]{64}")
TEMP_PREFIX = ".dflash-fetch-"
# The transfer's deadline when none is given: a floor, plus the bytes moved so far at a slow link's pace.
TIMEOUT_FLOOR_S, SLOW_BYTES_PER_S = 300.0, 5 * 2**20
STALL_S = 60.0
LIST_TIMEOUT_S = 3600.0  # hashing the checkpoint in the container: a big one at a slow disk's pace
SPARSE_SLACK = 1 << 20   # a file may claim twice the bytes it occupies, plus this
FREE_RESERVE = 64 << 20  # left free on --to's file system after the fetch


class ChecksumMismatch(DflashOpsError, exit_status=ExitStatus.CHECKSUM_MISMATCH):
    pass


@dataclass
class RemoteFile:
    name: str
    sha256: str
    size: int
    disk: int = 0  # the bytes it occupies on the container's disk (st_blocks x 512)

    @property
    def cap(self) -> int:
        return 2 * self.disk + SPARSE_SLACK


@dataclass
class Fetched:
    run: str
    checkpoint: str                       # the directory in the container
    to: str
    files: list = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def describe(self) -> str:
        return (f"{self.to}: {len(self.files)} files from {terminal.visible(self.checkpoint)}, "
                f"{self.total_bytes / 2**20:.1f} MiB, sha256 verified")

    def row(self) -> str:
        return self.describe()


def validate_checkpoint(name: str) -> str:
    if name != "latest" and not re.fullmatch(r"step-[0-9]{1,12}", name):
        raise UsageError(f"--checkpoint {terminal.visible(name)[:60]!r}: give latest or step-N")
    return name


def parse_listing(answer, names: list[str], runs: str, run: str) -> tuple[str, list[RemoteFile]]:
    """remote/fetch.py's "ok" value -> (checkpoint dir, files), or a one-line error. Pure.

    Only the names asked for, in that order; the directory must be `<runs>/<run>/checkpoints/step-N`.
    """
    answer = answer if isinstance(answer, dict) else {}
    directory, files = answer.get("dir"), answer.get("files")
    root = f"{runs.rstrip('/')}/{run}/checkpoints/"
    if (not isinstance(directory, str) or not directory.startswith(root)
            or not re.fullmatch(r"step-[0-9]{1,12}", directory[len(root):])):
        raise UntrustedData(f"the container named checkpoint {terminal.visible(str(directory))[:200]!r}, "
                            f"not a step-N under {root}: refusing it")
    if not isinstance(files, list) or len(files) != len(names):
        raise UntrustedData(f"the container listed {terminal.visible(str(files))[:200]}, not the "
                            f"files {names}")
    out = []
    for name, f in zip(names, files, strict=True):
        f = f if isinstance(f, dict) else {}
        size, disk = f.get("size"), f.get("disk")
        if (f.get("name") != name or type(size) is not int or size < 0 or type(disk) is not int or disk < 0
                or not isinstance(f.get("sha256"), str) or not SHA256.fullmatch(f["sha256"])):
            raise UntrustedData(f"the container's entry for {name} is malformed: "
                                f"{terminal.visible(str(f))[:200]}")
        out.append(RemoteFile(name, f["sha256"], size, disk))
    return directory, out


def check_caps(label: str, files: list[RemoteFile]) -> None:
    """Each file within its cap: twice the bytes it occupies on the container's disk, plus 1 MiB."""
    for f in files:
        if f.size > f.cap:
            raise UntrustedData(f"{label}: {f.name} claims {f.size} bytes but occupies {f.disk} on the "
                                f"container's disk (a sparse file: its holes would be written here whole); "
                                f"refusing it beyond its cap of {f.cap} bytes, nothing written")


def check_space(to: str, files: list[RemoteFile]) -> None:
    """The checkpoint must fit --to's file system, with FREE_RESERVE to spare."""
    probe = to
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    free, need = st.f_bavail * st.f_frsize, sum(f.size for f in files) + FREE_RESERVE
    if free < need:
        raise UsageError(f"{probe} has {human_bytes(free)} free; the checkpoint needs {human_bytes(need)} "
                         f"(with {human_bytes(FREE_RESERVE)} to spare): free space there or give another "
                         "--to")


def raise_refusal(refusal: ship.Refusal) -> None:
    """The listing's refusal -> the error a user reads: no run or checkpoint is run state."""
    if refusal.kind in ("no-run", "no-checkpoint", "missing"):
        raise RunStateError(str(refusal)) from None
    ship.raise_common(refusal)


# --- the local side --------------------------------------------------------------------------------
def open_destination(to: str, force: bool) -> tuple[int, bool]:
    """(an fd of the checked directory `to`, whether it was created here)."""
    try:
        st = os.lstat(to)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(to), exist_ok=True)
        os.mkdir(to, 0o755)
        created = True
    else:
        created = False
        if not stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{to} exists and is not a directory (a file or a symlink); give another --to")
    fd = os.open(to, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    remove_stale_temps(fd)
    if not created and os.listdir(fd) and not force:
        os.close(fd)
        raise UsageError(f"{to} exists and is not empty; give --force to replace the checkpoint's "
                         "files in it")
    return fd, created


def remove_stale_temps(dir_fd: int) -> None:
    """Temp dirs of fetches that were killed (SIGKILL cannot clean up), recognised by our
    prefix and a dead pid."""
    for name in os.listdir(dir_fd):
        m = re.fullmatch(re.escape(TEMP_PREFIX) + r"([0-9]+)-[0-9a-f]{8}", name)
        if m and not pid_alive(int(m.group(1))):
            remove_temp(dir_fd, name)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_temp(dir_fd: int, name: str) -> None:
    try:
        tmp_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return
    try:
        for entry in os.listdir(tmp_fd):
            os.unlink(entry, dir_fd=tmp_fd)
    finally:
        os.close(tmp_fd)
    os.rmdir(name, dir_fd=dir_fd)


def receive(chunks, tmp_fd: int, f: RemoteFile, to: str, timeout: float = 0.0) -> None:
    """Stream one file into the temp dir, hashing as it comes; refuse more or other bytes than listed.
    The deadline is `timeout` if given, else it grows with the bytes moved (TIMEOUT_FLOOR_S +
    moved / SLOW_BYTES_PER_S): a claimed size buys no time."""
    fd = os.open(f.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=tmp_fd)
    digest, size, start = hashlib.sha256(), 0, time.monotonic()
    with os.fdopen(fd, "wb", buffering=0) as out:
        for chunk in chunks:
            size += len(chunk)
            if size > f.size:
                break
            digest.update(chunk)
            out.write(chunk)
            allowed = timeout or TIMEOUT_FLOOR_S + size / SLOW_BYTES_PER_S
            if time.monotonic() - start > allowed:
                raise RemoteCommandFailed(f"{f.name}: the transfer took longer than its timeout "
                                          f"({allowed:.0f} s for {size} bytes); nothing written to {to}: "
                                          "give a longer --timeout")
        os.fsync(out.fileno())
    if size != f.size or digest.hexdigest() != f.sha256:
        raise ChecksumMismatch(f"{f.name}: {size} bytes, sha256 {digest.hexdigest()[:16]}... here; "
                               f"{f.size} bytes, {f.sha256[:16]}... in the container; nothing written to "
                               f"{to}, fetch again")


def cat_line(ct, path: str) -> str:
    """The host line that streams one file of the container: `pct exec CT -- cat -- PATH`."""
    return commands.pct_exec(ct.ctid, ["cat", "--", path], env={"PATH": commands.SYSTEM_PATH},
                             pct=ct.host.pct_command)


def stream(session, ct, path: str):
    """The file's bytes as they come; pct's refusal of a container that stopped meanwhile is its error."""
    try:
        yield from session.iter_command(cat_line(ct, path), stall_timeout=STALL_S)
    except RemoteCommandFailed:
        refused = session.container_state(ct, during=False)
        if refused is not None:
            raise refused from None
        raise


def install(dir_fd: int, tmp_fd: int, files: list[RemoteFile], force: bool) -> None:
    sums = "".join(f"{f.sha256}  {f.name}\n" for f in files).encode()
    fd = os.open("SHA256SUMS", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=tmp_fd)
    with os.fdopen(fd, "wb") as out:
        out.write(sums)
    if force:  # a stale training_state.pt must not sit beside other weights
        for name in set(KNOWN_FILES) - {f.name for f in files} - {"SHA256SUMS"}:
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
    for name in [f.name for f in files] + ["SHA256SUMS"]:
        os.replace(name, name, src_dir_fd=tmp_fd, dst_dir_fd=dir_fd)


def _terminate(signum, frame):
    raise KeyboardInterrupt  # so that `finally` removes the temp files (SIGTERM would not run it)


def fetch(t, run: str, to: str, checkpoint: str = "latest", force: bool = False,
          with_state: bool = False, echo=print, timeout: float = 0.0) -> Fetched | None:
    ct, session = t.container, t.session
    run = runs.validate_run_name(run)
    checkpoint = validate_checkpoint(checkpoint)
    to = os.path.abspath(os.path.expanduser(to))
    names = [*MODEL_FILES, *([STATE_FILE] if with_state else [])]
    if os.path.islink(to) or (os.path.lexists(to) and not os.path.isdir(to)):
        raise UsageError(f"{to} exists and is not a directory (a file or a symlink); give another --to")
    if os.path.lexists(to) and not force and os.listdir(to):
        raise UsageError(f"{to} exists and is not empty; give --force to replace the checkpoint's "
                         "files in it")

    payload = {"runs": ct.paths.runs, "run": run, "checkpoint": checkpoint, "names": names}
    try:
        listed = ship.call(t, "fetch", "list", payload, timeout=LIST_TIMEOUT_S, what="fetch")
    except ship.Refusal as refusal:
        raise_refusal(refusal)
    if t.dry_run:
        return None
    directory, files = parse_listing(listed, names, ct.paths.runs, run)
    out = Fetched(run, directory, to, files)
    echo(f"{ct.label}: {terminal.visible(directory)}: {len(files)} files, {out.total_bytes / 2**20:.1f} MiB")

    check_caps(ct.label, files)
    check_space(to, files)
    previous = (signal.signal(signal.SIGTERM, _terminate)
                if threading.current_thread() is threading.main_thread() else None)
    dir_fd = tmp_fd = None
    created, tmp_name = False, f"{TEMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
    try:
        dir_fd, created = open_destination(to, force)
        os.mkdir(tmp_name, 0o700, dir_fd=dir_fd)
        tmp_fd = os.open(tmp_name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
        for f in files:
            receive(stream(session, ct, f"{directory}/{f.name}"), tmp_fd, f, to, float(timeout))
            echo(f"  {f.name}  {f.size / 2**20:.1f} MiB  sha256 {f.sha256[:16]}... verified")
        install(dir_fd, tmp_fd, files, force)
        created = False
    finally:
        if tmp_fd is not None:
            os.close(tmp_fd)
        if dir_fd is not None:
            remove_temp(dir_fd, tmp_name)
            os.close(dir_fd)
            if created:
                os.rmdir(to)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return out
