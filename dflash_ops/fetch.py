"""`invoke fetch`: bring a run's checkpoint back from the container, verified by sha256.

The container is not trusted (docs/design.md, "Trust boundary"): it chooses no name and no path,
and its numbers bound nothing here. Round trips: 1 + N for N files.
1. in the container (remote/fetch.py `list`, one answer in the helper protocol): resolve the
   checkpoint to a real `step-N/` directory under the run's `checkpoints/`, and hash the files fetch
   asks for, by fixed name, refusing symlinks and anything that is not a regular file; each file's
   size and the bytes it really occupies (`disk`: st_blocks x 512).
2. before a byte moves: each file's size must be within its cap, twice the bytes it occupies on the
   container's disk plus 1 MiB (a sparse file would be written out here whole: a 3 GiB file of
   holes occupies 2 MiB there; a compressing file system stays well inside 2x); the whole must be
   within the operator's `--max-size` when given, and fit the free space of `--to`'s file system
   with FREE_RESERVE to spare. config.json (the first file) is at most CONFIG_CAP.
   Without `--max-size`, the cap is the checkpoint's expected size plus margin: once config.json has
   arrived, `expected_size` counts the drafter's parameters from its shape (layers, hidden and
   intermediate sizes, heads, tapped target layers) at its dtype's width (and, with --with-state,
   the optimizer's two fp32 moments and a copy); the cap is MARGIN x that + SLACK, at most
   DEFAULT_CEILING. A config.json that describes no drafter leaves no default: give --max-size.
   Over the cap: nothing is moved past config.json, and nothing stays here (exit 11).
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
import json
import os
import re
import signal
import stat
import threading
import time
from dataclasses import dataclass, field

from . import commands, runs, terminal
from .errors import DflashOpsError, ExitStatus, RemoteCommandFailed, RunStateError, UntrustedData, UsageError
from .oncall.monitoring import parse_size
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
CONFIG_CAP = 1 << 20     # config.json: a drafter's is a few kB
# The default cap (no --max-size): MARGIN x the expected size + SLACK, never above DEFAULT_CEILING.
MARGIN, SLACK, DEFAULT_CEILING = 1.5, 64 << 20, 64 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SHAPE_MAX = 1 << 20      # the largest hidden/intermediate size, head count or head dim believed


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

    def facts(self) -> dict:
        """--json: where the checkpoint went and each file's size and sha256 (verified)."""
        return {"run": self.run, "checkpoint": self.checkpoint, "to": self.to, "bytes": self.total_bytes,
                "files": [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in self.files]}

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


def expected_size(config, with_state: bool) -> int | None:
    """The bytes a checkpoint of this drafter config should take (pure): its parameters at the
    config's dtype width (4 when unknown), plus, with the state, the optimizer's two fp32 moments and
    an fp32 copy. None when `config` does not describe a drafter (a field missing or out of range)."""
    if not isinstance(config, dict):
        return None
    dims = {}
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        value = config.get(key)
        if type(value) is not int or not 0 < value <= SHAPE_MAX:
            return None
        dims[key] = value
    hidden, heads = dims["hidden_size"], dims["num_attention_heads"]
    kv, head_dim = config.get("num_key_value_heads", heads), config.get("head_dim", hidden // heads)
    dflash = config.get("dflash_config")
    taps = dflash.get("target_layer_ids") if isinstance(dflash, dict) else None
    if (type(kv) is not int or type(head_dim) is not int or not 0 < kv <= SHAPE_MAX
            or not 0 < head_dim <= SHAPE_MAX or not isinstance(taps, list) or not 0 < len(taps) <= 1024):
        return None
    layer = (hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2  # q, o; k, v
             + 3 * hidden * dims["intermediate_size"] + 2 * hidden + 2 * head_dim)  # mlp, norms
    params = dims["num_hidden_layers"] * layer + len(taps) * hidden * hidden + 2 * hidden  # fc, norms
    width = DTYPE_BYTES.get(config.get("dtype") or config.get("torch_dtype"), 4)
    return params * width + (params * 4 * 3 if with_state else 0)


def default_cap(config_text: bytes, with_state: bool) -> tuple[int | None, int | None]:
    """(the cap, the expected size) from config.json's bytes; (None, None) when it names no drafter."""
    try:
        config = json.loads(config_text)
    except (ValueError, RecursionError):
        return None, None
    expected = expected_size(config, with_state)
    if expected is None:
        return None, None
    return min(int(MARGIN * expected) + SLACK, DEFAULT_CEILING), expected


def check_total(label: str, files: list[RemoteFile], cap: int, why: str) -> None:
    """The checkpoint's claimed total within `cap` (`why`: where the cap comes from)."""
    total = sum(f.size for f in files)
    if total > cap:
        raise UntrustedData(f"{label}: the checkpoint is {human_bytes(total)} ({total} bytes), more than "
                            f"fetch's cap of {human_bytes(cap)} ({why}); nothing was written here: give "
                            "--max-size SIZE (e.g. 20G) if that size is right")


def raise_refusal(refusal: ship.Refusal) -> None:
    """The listing's refusal -> the error a user reads: no run or checkpoint is run state."""
    if refusal.kind in ("no-run", "no-checkpoint", "missing"):
        raise RunStateError(str(refusal)) from None
    ship.raise_common(refusal)


# --- the local side --------------------------------------------------------------------------------
def check_can_make(to: str) -> None:
    """A missing --to is made, with its missing parents, in its nearest existing ancestor: that must be
    a writable directory (`/dev/null/x` is one line before any round trip, not a traceback after)."""
    made_in = os.path.dirname(to)
    while not os.path.lexists(made_in):
        made_in = os.path.dirname(made_in)
    if not os.path.isdir(made_in) or not os.access(made_in, os.W_OK):
        raise UsageError(f"--to {to}: {made_in} is not a writable directory, so {to} cannot be made; "
                         "give another --to")

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


def read_received(tmp_fd: int, name: str) -> bytes:
    """A file received into the temp dir (config.json: its size already checked, CONFIG_CAP)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=tmp_fd)
    with os.fdopen(fd, "rb") as f:
        return f.read(CONFIG_CAP + 1)


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
          with_state: bool = False, echo=print, timeout: float = 0.0,
          max_size: str | int | None = None) -> Fetched | None:
    ct, session = t.container, t.session
    run = runs.validate_run_name(run)
    cap = None if max_size in (None, "") else parse_size(max_size, "--max-size")
    if cap is not None and cap <= 0:
        raise UsageError(f"--max-size {max_size}: give the largest checkpoint to accept, e.g. 20G")
    checkpoint = validate_checkpoint(checkpoint)
    to = os.path.abspath(os.path.expanduser(to))
    names = [*MODEL_FILES, *([STATE_FILE] if with_state else [])]
    if os.path.islink(to) or (os.path.lexists(to) and not os.path.isdir(to)):
        raise UsageError(f"{to} exists and is not a directory (a file or a symlink); give another --to")
    if os.path.lexists(to) and not force and os.listdir(to):
        raise UsageError(f"{to} exists and is not empty; give --force to replace the checkpoint's "
                         "files in it")
    check_can_make(to)

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
    if files[0].name != "config.json" or files[0].size > CONFIG_CAP:
        raise UntrustedData(f"{ct.label}: config.json claims {files[0].size} bytes, more than a drafter's "
                            f"config takes ({CONFIG_CAP}): refusing it, nothing written")
    if cap is not None:
        check_total(ct.label, files, cap, "--max-size")
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
            if f.name == "config.json" and cap is None:
                cap, expected = default_cap(read_received(tmp_fd, f.name), with_state)
                if cap is None:
                    raise UsageError(f"{ct.label}: {terminal.visible(directory)}/config.json describes no "
                                     "drafter (hidden_size, intermediate_size, num_hidden_layers, "
                                     "num_attention_heads, dflash_config.target_layer_ids), so the "
                                     "checkpoint's expected size is unknown: give --max-size SIZE; nothing "
                                     "was written here")
                check_total(ct.label, files, cap, f"the default: {human_bytes(expected)} expected from "
                            f"its config.json, x{MARGIN:g} + {human_bytes(SLACK)}")
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
