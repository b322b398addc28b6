"""`invoke fetch`: bring a run's checkpoint back from the container, verified by sha256.

The container is not trusted (docs/design.md, "Trust boundary"): it chooses no name and no path.
Round trips:
1. in the container (remote/fetch.py): resolve the checkpoint to a real `step-N/` directory
   under the run's `checkpoints/` and hash the files fetch asks for, by fixed name, refusing
   symlinks and anything that is not a regular file;
2. on the host: a private directory from `mktemp -d`;
3. on the host: one `pct pull` per file into that directory, then the size and sha256 of what
   landed there. A real `pct pull` exits 0 when it fails, truncates its destination first and
   writes short without a word, so only this check says whether a pull worked, and pct's own
   stderr says why it did not;
4. `cat` on the host over its own SSH channel (memory bounded by the SSH window), into a temporary
   directory inside `--to` (files opened O_EXCL|O_NOFOLLOW relative to the checked directory), hashed
   while streaming;
   only when size and sha256 match the container's is each file renamed into `--to`;
5. on the host: remove the private directory.
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

from . import commands, runs, terminal, transport
from .errors import DflashOpsError, ExitStatus, RemoteCommandFailed, RunStateError, UntrustedData, UsageError
from .remote import ship

MODEL_FILES = ("config.json", "model.safetensors")
STATE_FILE = "training_state.pt"
KNOWN_FILES = (*MODEL_FILES, STATE_FILE, "SHA256SUMS")
HOST_TMP = re.compile(r"/tmp/dflash-fetch\.[A-Za-z0-9]{6,}")
SHA256 = re.compile(r"[0-9a-f]{64}")
TEMP_PREFIX = ".dflash-fetch-"
# Transfer timeout when none is given: a floor, plus the size at a slow link's pace.
TIMEOUT_FLOOR_S, SLOW_BYTES_PER_S = 300.0, 5 * 2**20
STALL_S = 60.0
LIST_TIMEOUT_S = 3600.0  # hashing the checkpoint in the container: a big one at a slow disk's pace

# $1 the host's private dir, then the names: `name size sha256` per file, `-` for what is missing.
HOST_CHECK = r'''cd -- "$1" || exit 1
shift
for f; do
  s=$(stat -c %s -- "$f" 2>/dev/null) || s=-
  h=$(sha256sum 2>/dev/null < "$f") || h=-
  printf '%s %s %s\n' "$f" "$s" "${h%% *}"
done'''

# The host's private dir for one fetch, made by `mktemp -d`, with `.owner`: the pid and start time of
# the sshd process that serves this fetch's connection. A fetch killed outright (SIGKILL, a lost
# client) cannot remove its dir and the copy of the checkpoint in it, so each fetch first removes the
# dirs (root's own, in /tmp) whose sshd is gone: a fetch still running keeps its connection, so its
# dir stays. A dir without `.owner` (a fetch between mktemp and the write) stays unless a day old.
# field PID N: the Nth field of /proc/PID/stat after the comm (2: the ppid, 20: the start time).
HOST_TEMP = r'''field() {
  n=$2; s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1; set -- ${s##*) }; eval "echo \"\${$n}\""
}
is_sshd() { case $(cat "/proc/$1/comm" 2>/dev/null) in sshd*) return 0;; esac; return 1; }
for d in /tmp/dflash-fetch.*; do
  [ -d "$d" ] && [ ! -L "$d" ] && [ -O "$d" ] || continue
  if [ -f "$d/.owner" ]; then
    read -r pid start < "$d/.owner" || continue
    case $pid in ''|*[!0-9]*) continue;; esac
    [ "$(field "$pid" 20)" = "$start" ] && continue
  elif [ -z "$(find "$d" -maxdepth 0 -mmin +1440)" ]; then
    continue
  fi
  rm -rf -- "$d"
done
d=$(mktemp -d /tmp/dflash-fetch.XXXXXX) || exit 1
p=$$
while [ "$p" -gt 1 ] && ! is_sshd "$p"; do p=$(field "$p" 2) || break; done
if [ "$p" -gt 1 ]; then printf '%s %s\n' "$p" "$(field "$p" 20)" > "$d/.owner"; fi
printf '%s\n' "$d"'''


class ChecksumMismatch(DflashOpsError, exit_status=ExitStatus.CHECKSUM_MISMATCH):
    pass


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
        size = f.get("size")
        if (f.get("name") != name or type(size) is not int or size < 0
                or not isinstance(f.get("sha256"), str) or not SHA256.fullmatch(f["sha256"])):
            raise UntrustedData(f"the container's entry for {name} is malformed: "
                                f"{terminal.visible(str(f))[:200]}")
        out.append(RemoteFile(name, f["sha256"], size))
    return directory, out


def raise_refusal(refusal: ship.Refusal) -> None:
    """The listing's refusal -> the error a user reads: no run or checkpoint is run state."""
    if refusal.kind in ("no-run", "no-checkpoint", "missing"):
        raise RunStateError(str(refusal)) from None
    ship.raise_common(refusal)


def parse_host_check(text: str, files: list[RemoteFile]) -> dict[str, tuple[int | None, str]]:
    """HOST_CHECK's output -> {name: (size or None, sha256 or "-")} for the names we pulled. Pure."""
    found = {}
    wanted = {f.name for f in files}
    for line in text.splitlines():
        parts = line.split(" ")
        if len(parts) == 3 and parts[0] in wanted:
            found[parts[0]] = (int(parts[1]) if parts[1].isdigit() else None, parts[2])
    return found


def pull_results(stderr: str) -> dict[str, tuple[str, int | None]]:
    """pct's stderr and exit code for each pull, split by the markers `pull_line` prints around it."""
    out: dict[str, tuple[list[str], int | None]] = {}
    current = None
    for line in stderr.splitlines():
        if line.startswith("dflash-fetch: pull "):
            current = line.split(" ", 2)[2]
            out[current] = ([], None)
        elif current is not None and re.fullmatch(r"dflash-fetch: exit [0-9]+", line):
            out[current] = (out[current][0], int(line.rsplit(" ", 1)[1]))
            current = None
        elif current is not None and line.strip():
            out[current][0].append(line.strip())
    return {name: (" | ".join(lines), code) for name, (lines, code) in out.items()}


def pull_errors(stderr: str) -> dict[str, str]:
    """pct's stderr for each pull that said something."""
    return {name: said for name, (said, _) in pull_results(stderr).items() if said}


def pull_line(ct, directory: str, host_tmp: str, files: list[RemoteFile]) -> str:
    """One host line: every pull (marked on stderr before and, with its exit code, after), then what
    landed on the host."""
    parts = []
    for f in files:
        parts.append(commands.shell_line(["printf", "dflash-fetch: pull %s\\n", f.name]) + " >&2")
        parts.append(commands.pct_transfer("pull", ct.ctid, f"{directory}/{f.name}", f"{host_tmp}/{f.name}",
                                           pct=ct.host.pct_command))
        parts.append("printf 'dflash-fetch: exit %s\\n' \"$?\" >&2")
    parts.append(commands.shell_line(["sh", "-c", HOST_CHECK, "sh", host_tmp, *[f.name for f in files]]))
    return "; ".join(parts)


def check_refused(session, ct, stderr: str) -> None:
    """A pull pct refused (the container does not run): ContainerStopped or ContainerMissing, as
    `pct status` says (pct's words are the same for both)."""
    if any(transport.transfer_refused(said, code) for said, code in pull_results(stderr).values()):
        refused = session.container_state(ct, during=False)
        if refused is not None:
            raise refused


def check_pulls(ct, directory: str, files: list[RemoteFile], landed: dict, errors: dict, to: str) -> None:
    """Each pulled file must be on the host whole: else name pct's own reason, not a checksum."""
    for f in files:
        size, sha = landed.get(f.name, (None, "-"))
        if size == f.size and sha == f.sha256:
            continue
        where = f"{ct.label}: pct pull of {directory}/{f.name}"
        said = terminal.visible(errors.get(f.name, ""))[-300:]
        if said:
            raise RemoteCommandFailed(f"{where} failed: {said}; nothing written to {to}")
        if size is None or size < f.size:
            raise RemoteCommandFailed(f"{where} wrote {size or 0} of {f.size} bytes on host "
                                      f"{ct.host.name} and said nothing (a full disk on the host's "
                                      f"/tmp?); nothing written to {to}")
        raise ChecksumMismatch(f"{where}: the host's copy differs from the file hashed in the container (did "
                               f"it change meanwhile?); nothing written to {to}, fetch again")


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


def receive(chunks, tmp_fd: int, f: RemoteFile, to: str, deadline: float) -> None:
    """Stream one file into the temp dir, hashing as it comes; refuse more or other bytes than promised."""
    fd = os.open(f.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=tmp_fd)
    digest, size = hashlib.sha256(), 0
    with os.fdopen(fd, "wb", buffering=0) as out:
        for chunk in chunks:
            size += len(chunk)
            if size > f.size:
                break
            digest.update(chunk)
            out.write(chunk)
            if time.monotonic() > deadline:
                raise RemoteCommandFailed(f"{f.name}: the transfer took longer than its timeout; "
                                          f"nothing written to {to}: give a longer --timeout")
        os.fsync(out.fileno())
    if size != f.size or digest.hexdigest() != f.sha256:
        raise ChecksumMismatch(f"{f.name}: {size} bytes, sha256 {digest.hexdigest()[:16]}... here; "
                               f"{f.size} bytes, {f.sha256[:16]}... in the container; nothing written to "
                               f"{to}, fetch again")


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
    timeout = float(timeout) or TIMEOUT_FLOOR_S + out.total_bytes / SLOW_BYTES_PER_S
    echo(f"{ct.label}: {terminal.visible(directory)}: {len(files)} files, {out.total_bytes / 2**20:.1f} MiB")

    previous = (signal.signal(signal.SIGTERM, _terminate)
                if threading.current_thread() is threading.main_thread() else None)
    host_tmp = session.run(commands.shell_line(["sh", "-c", HOST_TEMP, "sh"])).stdout.strip()
    if not HOST_TMP.fullmatch(host_tmp):
        raise UntrustedData(f"{ct.host.name}: mktemp answered {terminal.visible(host_tmp)[:100]!r}")
    dir_fd = tmp_fd = None
    created, tmp_name = False, f"{TEMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
    try:
        pulled = session.run_in(ct, pull_line(ct, directory, host_tmp, files), check=False, timeout=timeout)
        check_refused(session, ct, pulled.stderr)
        check_pulls(ct, directory, files, parse_host_check(pulled.stdout, files), pull_errors(pulled.stderr),
                    to)
        dir_fd, created = open_destination(to, force)
        os.mkdir(tmp_name, 0o700, dir_fd=dir_fd)
        tmp_fd = os.open(tmp_name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
        deadline = time.monotonic() + timeout
        for f in files:
            receive(session.iter_file(f"{host_tmp}/{f.name}", stall_timeout=STALL_S), tmp_fd, f, to,
                    deadline)
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
        session.run(commands.shell_line(["rm", "-rf", "--", host_tmp]), check=False)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return out
