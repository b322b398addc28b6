"""The prelude of every shipped helper: the one answer format, the bounded readers, the run primitives.

Sent ahead of each helper (runs.py, facts.py, fetch.py, history.py, release.py) as the text of one
`python -S -c` in the container (ship.py joins them), so it is standard library only and runs on
Python >= 3.8. Locally the helpers import it as a module (tests, and the names the local side shares
with the container: `run_state`, `describe_exit`).

The protocol, one for every helper: `<verb> <one JSON object>` in; out, on stdout, any number of
streamed items (`{"line": ...}` of a log being followed, `{"run": ...}`, a hashing mark; never with
an "ok" or "error" key) and then exactly one answer line, as Ansible modules answer through
exit_json/fail_json:

    {"ok": <the verb's result>}
    {"error": "<kind>", "message": "<one line>", ...extra}

`Refused(kind, message, **extra)` is how a verb refuses; a payload that is not what the verb expects
is `bad-input`, a bug `internal`: never a traceback, never an exit code to decode.

Everything read here is the container's data, read by root in the container: every file is opened
O_NONBLOCK|O_NOFOLLOW and refused unless it is a regular file (a FIFO in a run directory would block
an open or a read for ever), read up to a cap, split on `\n` only, decoded with replacement; walks
stop at the call's deadline (`time_left`).

The run primitives: a run is alive while its wrapper holds `<runs>/.lock` exclusively (flock, taken
by the launch and inherited by the wrapper and the training process): `lock_holder_run` reads which
run from the lock's holders, and `run_alive`, `alive_run` and `default_run` (status, stop, logs,
prune, runs) all ask it. `<runs>/.current` names the run last launched: only the default for a
task's --run when no run is alive, never proof of life (anyone in the container may write it). A
warm-up holds the lock shared; clean-caches and prune exclusively while deleting.
`run_state` is the one state machine of a run (status, runs, prune, logs --follow and watch read it).
"""

import json
import os
import stat
import sys
import time

LOCK, CURRENT = ".lock", ".current"
MANIFEST = ".dflash-manifest.json"                # a release's files and their sha256 (deploy writes it)
LOG_FILE = "train.log"    # in a run directory: the training log (+ stderr + the wrapper's last line)
PLAN_FILE = "plan.json"   # in paths.runs: the last `invoke plan` measurement, which doctor compares with
REQUIREMENTS_STAMP = ".dflash-requirements.sha256"  # in the venv: what it was built from (written last)
RUN_FILES = ("pid", "pgid", "started", "ended", "exit_code", "stopped", "code_version")
STATES = ("running", "stalled", "finished", "crashed", "stopped", "missing", "none")  # prometheus' order
FILE_CAP = 300            # bytes kept of each small run file (pid, exit_code, ...)
LINE_CAP = 2000           # characters kept of a log line
TAIL_WINDOW = 1 << 20     # bytes read from a file's end for its last lines
DEFAULT_DEADLINE_S = 60.0  # a verb's walks stop after this (the payload's "deadline_s" overrides it)
# The call's deadline, set by serve() when a verb starts; none outside a call (the helpers' functions
# imported and called directly, as the unit tests do, would otherwise meet a deadline counted from
# the import).
_DEADLINE = [float("inf")]


class Refused(Exception):
    """A verb's answer is a refusal: {"error": kind, "message": one line, ...extra}."""

    def __init__(self, kind, message, **extra):
        Exception.__init__(self, message)
        self.answer = dict(extra, error=kind, message=message)


# --- the answer -------------------------------------------------------------------------------------

def _write_line(obj):
    try:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):  # the reader is gone: stop working for nobody
        os._exit(1)


def emit(line=None, **fields):
    """Stream one item before the answer: {"line": text} (a log line), or other fields ({"run": name});
    never "ok" or "error", which only the answer has."""
    _write_line({"line": line} if line is not None else fields)


def serve(verbs, argv=None):
    """`<verb> <json>` -> the verb's streamed lines, then one answer line: {"ok"} or {"error", "message"}."""
    argv = sys.argv if argv is None else argv
    try:
        if len(argv) != 3 or argv[1] not in verbs:
            raise Refused("usage", f"expected one of {', '.join(sorted(verbs))} and one JSON object")
        try:
            payload = json.loads(argv[2])
        except (ValueError, RecursionError):
            raise Refused("usage", "the payload is not JSON") from None
        if not isinstance(payload, dict):
            raise Refused("usage", "the payload is not a JSON object")
        deadline = payload.get("deadline_s", DEFAULT_DEADLINE_S)
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not 0 < deadline < 1e6:
            raise Refused("bad-input", "deadline_s is not a number of seconds")
        _DEADLINE[0] = time.monotonic() + deadline
        answer = {"ok": verbs[argv[1]](payload)}
    except Refused as refused:
        answer = refused.answer
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        answer = {"error": "bad-input", "message": f"{type(exc).__name__}: {str(exc)[:300]}"}
    except Exception as exc:  # a bug or an odd container: still one line the local side can show
        answer = {"error": "internal", "message": f"{type(exc).__name__}: {str(exc)[:300]}"}
    _write_line(answer)
    return 0


def time_left():
    return _DEADLINE[0] - time.monotonic()


def check_deadline(what):
    if time_left() <= 0:
        raise Refused("timeout", f"{what} took longer than the call's deadline")


# --- the bounded readers ---------------------------------------------------------------------------

def open_regular(path, follow=False):
    """A read-only fd of `path` if it is a regular file (never blocks: a FIFO or a device is refused);
    OSError otherwise (FileNotFoundError when absent). `follow`: a symlink may lead to it."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(22, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd  # O_NONBLOCK stays: it changes nothing for a regular file


def read_bytes(path, cap, follow=False):
    """At most the first `cap` bytes of a regular file; None if absent or not a regular file."""
    try:
        fd = open_regular(path, follow)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(cap)


def read_text(path, cap=FILE_CAP):
    """The first `cap` bytes of a regular file as text (None if absent or not regular)."""
    data = read_bytes(path, cap)
    return None if data is None else data.decode("utf-8", "replace")


def read_json(path, cap=1 << 20):
    """A small regular JSON file's object, or None (absent, larger than `cap`, torn, too deep)."""
    data = read_bytes(path, cap + 1)
    if data is None or len(data) > cap:
        return None
    try:
        value = json.loads(data.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return None
    return value


def read_end(path, window):
    """(at most the last `window` bytes of a regular file, the offset they start at); (None, 0) if not."""
    try:
        fd = open_regular(path)
    except OSError:
        return None, 0
    with os.fdopen(fd, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        start = max(0, size - window)
        f.seek(start)
        return f.read(size - start), start


def end_lines(data, start):
    """The complete lines of a file's end read from `start` (the first one is cut unless start is 0)."""
    lines = data.split(b"\n")
    return lines[1:] if start > 0 else lines


def tail_lines(path, count, window=TAIL_WINDOW, cap=LINE_CAP, since=0):
    """The last `count` lines of a file, reading at most `window` bytes from its end; with `since`
    (the offset of a line's start), none before it."""
    data, start = read_end(path, window) if count > 0 else (None, 0)
    if not data:
        return []
    if since > start:
        data, start = data[since - start:], 0  # `since` starts a line: its first line is whole
    lines = end_lines(data, start)
    if lines and lines[-1] == b"":
        lines.pop()
    return [decoded(line, cap) for line in lines[-count:]]


def decoded(line, cap=LINE_CAP):
    """A line read from the container as text: decoded with replacement, cut to `cap` characters."""
    return line[:cap * 4].decode("utf-8", "replace")[:cap]


class LineCutter:
    """Bytes in, complete lines out (decoded, cut to `cap` characters); a line longer than that keeps
    its first `cap` characters and the rest is dropped as it arrives: linear time, bounded memory."""

    def __init__(self, cap):
        self.cap, self.parts, self.size, self.cut = cap, [], 0, False

    def feed(self, data):
        out = []
        pieces = data.split(b"\n")
        for i, piece in enumerate(pieces):
            if not self.cut:
                room = self.cap * 4 - self.size
                self.parts.append(piece[:room])
                self.size += min(len(piece), room)
                self.cut = len(piece) > room
            if i < len(pieces) - 1:  # a newline ends this line
                out.append(self._line())
        return out

    def _line(self):
        line = b"".join(self.parts).decode("utf-8", "replace")[:self.cap]
        self.parts, self.size, self.cut = [], 0, False
        return line

    def rest(self):
        return [self._line()] if self.parts and self.size else []


def mtime(path):
    try:
        return int(os.lstat(path).st_mtime)
    except OSError:
        return None


def free_bytes(path):
    try:
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize
    except OSError:
        return None


def free_near(path):
    """Bytes free on the filesystem that holds path, or would hold it (its nearest existing parent)."""
    probe = path
    while probe not in ("", "/") and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return free_bytes(probe or "/")


def free_text(path):
    free = free_near(path)
    return "unknown free" if free is None else f"{human(free)} free"


def human(n):
    """df -h's way: 0, 512K, 1.5M, 20G."""
    for unit in ("", "K", "M", "G", "T"):
        if n < 1024 or unit == "T":
            return f"{int(n)}{unit}" if unit == "" or n >= 10 else f"{n:.1f}{unit}"
        n /= 1024.0


def container_memory():
    """The container's memory limit (bytes, None: none) and how many processes its OOM killer has
    killed since it started, from its own cgroup as LXC mounts it (v2: memory.max and memory.events,
    v1: memory.limit_in_bytes and memory.oom_control's oom_kill). A limit the cgroup does not show
    (Proxmox applies it a level above the container's cgroup namespace) is /proc/meminfo's MemTotal,
    which lxcfs makes the container's limit."""
    v2 = read_text("/sys/fs/cgroup/memory.max", 64)
    base = "/sys/fs/cgroup/" if v2 is not None else "/sys/fs/cgroup/memory/"
    limit = (v2 if v2 is not None else read_text(base + "memory.limit_in_bytes", 64) or "").strip()
    events = read_text(base + ("memory.events" if v2 is not None else "memory.oom_control"), 4000) or ""
    kills = next((int(f[1]) for f in map(str.split, events.splitlines())
                  if len(f) == 2 and f[0] == "oom_kill" and f[1].isdigit()), None)
    meminfo = (read_text("/proc/meminfo", 4000) or "").split()
    total = int(meminfo[1]) * 1024 if meminfo[:1] == ["MemTotal:"] and meminfo[1].isdigit() else None
    limits = [n for n in (int(limit) if limit.isdigit() else None, total) if n is not None and n < 1 << 62]
    return {"limit": min(limits) if limits else None, "oom_kills": kills}


def dir_usage(path):
    """Apparent size and number of files under path (no symlinks followed; stops at the deadline)."""
    size = files = 0
    if not os.path.isdir(path):
        return {"exists": False, "bytes": 0, "files": 0}
    for base, _dirs, names in os.walk(path):
        check_deadline(f"measuring {path}")
        for name in names:
            try:
                size += os.lstat(os.path.join(base, name)).st_size
                files += 1
            except OSError:
                pass
    return {"exists": True, "bytes": size, "files": files}


# --- the run primitives ----------------------------------------------------------------------------

def runs_lock(runs, shared=False, wait=0.0, create=True):
    """An fd holding the runs lock (exclusive, or shared), or None when it is held the other way (or,
    with create=False, when there is no lock file).

    The one implementation of the lock: launch, warm-up, stop, clean-caches, prune, and the probes of
    run_alive/alive_run. Waits up to `wait` seconds. Closing the fd (or the process ending) releases
    it, unless a child inherited it: that is how a run keeps it for its whole life.
    """
    import fcntl  # not at the top: deploy's probe reads no lock

    path = os.path.join(runs, LOCK)
    flags = os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags | ((os.O_CREAT | os.O_RDWR) if create else os.O_RDONLY), 0o644)
    except OSError:
        if create:
            message = f"cannot create the runs lock in {runs}: {free_text(runs)}"
            raise Refused("cannot-write", message) from None
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Refused("unsafe", f"{path} is not a regular file: refusing it as the runs lock")
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            return fd
        except OSError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.05)


def lock_held(runs):
    """'exclusive' (a run), 'shared' (a warm-up) or None: how the runs lock is held by others."""
    if not os.path.lexists(os.path.join(runs, LOCK)):
        return None  # no run was ever launched here
    fd = runs_lock(runs, shared=True, create=False)
    if fd is None:
        return "exclusive"
    os.close(fd)
    fd = runs_lock(runs, create=False)
    if fd is None:
        return "shared"
    os.close(fd)
    return None


def holds_runs_lock(pid, runs):
    """Does process `pid` have the runs lock file open (the fd the launch handed the wrapper)?"""
    try:
        lock = os.stat(os.path.join(runs, LOCK))
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (lock.st_dev, lock.st_ino):
            return True
    return False


ARGV_CAP = 4 << 20  # bytes of another process's command line read at most (a launch's holds the
# packed helper and its JSON payload, which ship.argv sends as two arguments)
LOADER_START = b"import base64,sys,zlib;_PACKED="  # how ship.LOADER begins (a unit test holds them equal)


def lock_openers(runs, wanted):
    """The argv (split on NUL, ARGV_CAP bytes read at most) of each process but this one whose argv
    `wanted` accepts and that has `runs`'s lock file open: the one walk of /proc behind
    lock_holder_run and launch_under_way. The argv is the process's own word, as good as what the
    caller checks of it: holding the lock file is the proof."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read(ARGV_CAP).split(b"\0")
        except OSError:
            continue
        if wanted(argv) and holds_runs_lock(pid, runs):
            yield argv


def _wrapper_of(argv, top):
    """The `<top>/<name>/run.sh` among the first three arguments (a run's wrapper), or None."""
    found = [a for a in argv[:3] if a.endswith(b"/run.sh") and os.path.dirname(os.path.dirname(a)) == top]
    return found[0] if found else None


def lock_holder_run(runs):
    """The run holding the runs lock, read from the lock's holders, never from `.current` (anyone in the
    container may write it): the run whose wrapper (`<runs>/<name>/run.sh` in its argv) has the lock
    file open. "?" when the lock is held exclusively by no run it can name (a launch starting), None
    when no run holds it."""
    if lock_held(runs) != "exclusive":
        return None
    top = os.path.normpath(runs).encode()
    names = {os.path.basename(os.path.dirname(_wrapper_of(argv, top))).decode("utf-8", "replace")
             for argv in lock_openers(runs, lambda argv: _wrapper_of(argv, top))}
    return names.pop() if len(names) == 1 else "?"


def _launch_of(argv, top):
    """Is `argv` ship.argv's `python -S -c LOADER <packed> launch <json>` for the runs at `top`?"""
    if (len(argv) < 7 or argv[1:3] != [b"-S", b"-c"] or argv[5] != b"launch"
            or not argv[3].startswith(LOADER_START)):
        return False
    try:
        payload = json.loads(argv[6])
    except (ValueError, RecursionError):
        return False
    return isinstance(payload, dict) and isinstance(payload.get("runs"), str) \
        and os.path.normpath(payload["runs"]) == top


def launch_under_way(runs):
    """Does a launch verb other than this process have `runs`'s lock file open: a launch between
    taking the lock and its wrapper's start (its preflight runs then, and lock_holder_run can name
    no run yet), or one waiting for the lock? Told by its argv (`_launch_of`), as lock_holder_run
    tells the wrappers. Says only that such a process exists, never which run will start."""
    top = os.path.normpath(runs)
    return next(lock_openers(runs, lambda argv: _launch_of(argv, top)), None) is not None


def current_run(runs):
    """The run `.current` names: the one last launched. Only a default for `--run`; never proof that
    it is alive (anyone in the container may write it)."""
    name = (read_text(os.path.join(runs, CURRENT), 200) or "").strip()
    return name or None


def run_alive(runs, name, holder=Ellipsis):
    """Is run `name` alive: its wrapper holds the runs lock (lock_holder_run; `holder`: its answer,
    when the caller has it already), whatever `.current` says."""
    if holder is Ellipsis:
        holder = lock_holder_run(runs)
    return bool(name) and holder == name


def alive_run(runs):
    """The name of the run holding the runs lock ("?" when no run it can name holds it), or None."""
    return lock_holder_run(runs)


def default_run(runs):
    """The run a task means without --run: the alive one, else the one `.current` names."""
    holder = lock_holder_run(runs)
    return holder if holder not in (None, "?") else current_run(runs)


RUN_LIST_CAP = 200         # run names a no-run refusal lists at most (the newest)


def run_names(runs):
    """The runs under `runs`: names of its real directories (no dot names, no symlinks), newest first,
    at most RUN_LIST_CAP; [] when there is none (or no such directory)."""
    try:
        entries = os.listdir(runs)
    except OSError:
        return []
    found = []
    for entry in entries:
        if entry.startswith(".") or len(entry) > 200:
            continue
        try:
            st = os.lstat(os.path.join(runs, entry))
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            found.append((st.st_mtime, entry))
    return [entry for _, entry in sorted(found, reverse=True)[:RUN_LIST_CAP]]


def resolve_run(runs, name=None):
    """(name, run dir) of run `name`, or of the alive or latest one (default_run); Refused("no-run")
    when there is none, with the name asked for and the runs that exist (`runs`, newest first): the
    local side words it (dflash_ops/runs.py no_such_run), the same for every verb."""
    name = name or default_run(runs)
    if not name:
        raise Refused("no-run", f"no run yet under {runs}", name=None, runs=run_names(runs))
    path = os.path.join(runs, name)
    if ("/" in name or name.startswith(".") or "\0" in name or not os.path.isdir(path)
            or os.path.islink(path)):
        raise Refused("no-run", f"no run named {name[:80]!r} under {runs}", name=name[:200],
                      runs=run_names(runs))
    return name, path


SEGMENT_MARK = b"dflash-ops: launch "  # the launch's first line in train.log: a segment starts there
SEGMENT_SCAN = 64 << 20   # bytes of train.log searched backwards for the last launch line at most


def segment_start(log):
    """The offset in train.log where the current segment starts: the last `dflash-ops: launch ...`
    line (each launch and resume writes one before the run's own lines), searched backwards at most
    SEGMENT_SCAN bytes and until the call's deadline; 0 when none is found (or no log)."""
    try:
        fd = open_regular(log)
    except OSError:
        return 0
    with os.fdopen(fd, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        pos, carry = end, b""
        while pos > 0 and end - pos < SEGMENT_SCAN and time_left() > 0:
            start = max(0, pos - TAIL_WINDOW)
            f.seek(start)
            data = f.read(pos - start) + carry
            at = data.rfind(b"\n" + SEGMENT_MARK)
            if at >= 0:
                return start + at + 1
            if start == 0 and data.startswith(SEGMENT_MARK):
                return 0
            carry, pos = data[:len(SEGMENT_MARK)], start
    return 0


SPEC_CAP = 1 << 16        # launch.json (a run's spec) larger than this is not read


def read_spec(path):
    """Run dir `path`'s spec: launch.json as its last launch wrote it (config, sets, max_steps,
    devices, code version), or None."""
    spec = read_json(os.path.join(path, "launch.json"), SPEC_CAP)
    return spec if isinstance(spec, dict) else None


SEGMENTS = "segments.jsonl"  # in a run dir: one start line per launch, resume or restart, one end line each
SEGMENT_KINDS = ("launch", "resume", "restart")
SEGMENTS_CAP = 1 << 18    # bytes of segments.jsonl read (its end): a thousand segments and more
SEGMENTS_MAX = 1000       # segments sent at most (the newest)


def _count(value):
    """A JSON integer >= 0 of sane size, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 53 else None


def read_segments(path):
    """Run dir `path`'s segments, oldest first, from segments.jsonl (the container's data: its end,
    SEGMENTS_CAP bytes, each line checked). Each launch, resume or automatic restart of the run is
    one: {"n", "kind", "start", "log_offset", "metrics_offset", "from_step"} as the launch (or the
    restart) wrote it (a restart also: "restart", its number in a row, and "after", the exit it
    followed), and the end its wrapper wrote when the training process ended: "end",
    "exit" (`0`, `N`, `signal N`), "last_step" (its last logged train step), "stopped" (a stop on
    request ended it); None while it runs or when its wrapper was killed too."""
    data, start = read_end(os.path.join(path, SEGMENTS), SEGMENTS_CAP)
    found = {}
    for line in end_lines(data or b"", start):
        try:
            record = json.loads(line.decode("utf-8", "replace"))
        except (ValueError, RecursionError):
            continue
        n = _count(record.get("n")) if isinstance(record, dict) else None
        if not n:
            continue
        if record.get("kind") in SEGMENT_KINDS:
            found[n] = {"n": n, "kind": record["kind"], "start": _count(record.get("start")),
                        "log_offset": _count(record.get("log_offset")),
                        "metrics_offset": _count(record.get("metrics_offset")) or 0,
                        "from_step": _count(record.get("from_step")) or 0,
                        "restart": _count(record.get("restart")),
                        "after": record["after"][:40] if isinstance(record.get("after"), str) else None,
                        "end": None, "exit": None, "last_step": None, "stopped": False}
        elif n in found and "end" in record:
            code = record.get("exit")
            found[n].update(end=_count(record.get("end")),
                            exit=code[:40] if isinstance(code, str) else None,
                            last_step=_count(record.get("last_step")), stopped=record.get("stopped") is True)
    return [found[n] for n in sorted(found)][-SEGMENTS_MAX:]


def current_segment(path):
    """The run's current segment (its last launch, resume or restart): where it starts in train.log
    ("log_offset": the size of train.log before its `dflash-ops: launch|restart ...` line) and when
    ("start", epoch seconds), its "n", "kind", "from_step", and its end once it has one (see
    read_segments); None for a run without segments.jsonl (launched before it existed)."""
    segments = read_segments(path)
    return segments[-1] if segments else None


def last_record(path, kind="train", since=0, window=1 << 16):
    """The last record of `kind` in a JSON-lines metrics file (its last `window` bytes), if it starts
    at or after byte `since`; else {}."""
    data, start = read_end(path, window)
    if not data:
        return {}
    end = start + len(data)
    for line in reversed(data.split(b"\n")):
        end -= len(line) + 1  # where the line starts, less one: the newline before it
        if end + 1 < since:
            break
        try:
            record = json.loads(line.decode("utf-8", "replace"))
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict) and record.get("kind", "train") == kind:
            return record
    return {}


def run_files(path):
    """The run's small files (pid, pgid, started, ...): their first FILE_CAP bytes on one line each."""
    files = {}
    for name in RUN_FILES:
        text = read_text(os.path.join(path, name))
        if text is not None:
            files[name] = " ".join(text.split("\n")).strip()
    return files


def number(text):
    """The leading integer of a run file's text, or None."""
    word = (text or "").split()[:1]
    return int(word[0]) if word and word[0].isdigit() and len(word[0]) < 19 else None


def last_activity(path, files):
    """The newest of the run's start, end, and its log's and metrics' mtimes (container clock), or None."""
    times = [number(files.get("started")), number(files.get("ended")),
             mtime(os.path.join(path, LOG_FILE)), mtime(os.path.join(path, "metrics.jsonl"))]
    times = [t for t in times if t]
    return max(times) if times else None


def describe_exit(code):
    """`signal 9` -> `killed by signal 9 (SIGKILL)`; `3` -> `exit 3`; None -> why there is none."""
    if code is None:
        return "no exit code recorded (its wrapper was killed too, or the container restarted)"
    if code.startswith("signal "):
        import signal

        num = number(code[7:])
        try:
            name = signal.Signals(num).name
        except (TypeError, ValueError):
            name = "?"
        return f"killed by signal {num} ({name})"
    return f"exit {code}"


STOPPED_HOW = {"term": "stopped with SIGTERM", "kill": "stopped with SIGKILL after the grace period",
               "requested": "stop was requested"}


def run_state(files, alive, idle_s, stall_after):
    """The one state machine of a run: (state, detail) from its files, whether it holds the runs lock,
    and how long it has been quiet. States: running, stalled, stopped, finished, crashed."""
    if alive:
        if idle_s is not None and idle_s > stall_after:
            return "stalled", f"no new log line or metric for {idle_s} s (threshold {stall_after:g} s)"
        return "running", ""
    code, stopped = files.get("exit_code"), files.get("stopped")
    if stopped is not None:
        how = (stopped.split() or [""])[0]
        detail = STOPPED_HOW.get(how, f"stopped ({stopped})")
        return "stopped", detail + (", " + describe_exit(code) if code is not None else "")
    if code == "0":
        return "finished", "exit 0"
    if files.get("pid") is None and code is None:
        return "crashed", "the training process never started"
    return "crashed", describe_exit(code)


def state_of_run(runs, name, path, now, stall_after, holder=Ellipsis):
    """run_state of a run directory, with what it was decided from: {state, detail, alive, files, idle_s}.
    `holder`: lock_holder_run's answer when the caller has it (a walk over every run)."""
    files = run_files(path)
    alive = run_alive(runs, name, holder)
    activity = last_activity(path, files)
    idle = max(0, now - activity) if activity is not None else None
    state, detail = run_state(files, alive, idle, stall_after)
    return {"state": state, "detail": detail, "alive": alive, "files": files, "idle_s": idle,
            "last_activity": activity}
