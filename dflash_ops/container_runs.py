"""The run protocol, inside the container: launch, stop, status, metrics, the log's tail, the runs lock.

Sent per call through facts.py's loader to the container's own interpreter (`container.python`), so
it uses the standard library only and runs on Python >= 3.8. One verb and one JSON argument in, one
JSON object out (`wait` streams JSON lines, one per log line, then its verdict); a refusal or an
error is a field of that object (`error`, `message`), never an exit code to decode.

    python -c LOADER <this file, packed> status '{"runs": "/root/runs", "name": null}'

Everything read from a run directory is data: files are read with a size cap, split on `\n` only,
decoded with replacement, and sent back inside JSON strings, so a log line holding `\r` or a fake
fact stays a string of that log line. Shell remains only where a process must outlive the session:
the run wrapper (WRAPPER below, written to `run.sh`). The local side is jobs.py / status.py /
logs.py / metrics.py / caches.py.

A run is alive while its processes hold `<runs>/.lock` exclusively (flock, inherited from the
launch by the wrapper and the training process); `<runs>/.current` names the run that took it. A
warm-up holds it shared; clean-caches exclusively while deleting.
"""

import fcntl
import json
import os
import sys
import time

# `status` is the hot path (one interpreter start per `invoke status`): modules only some verbs need
# (subprocess, shutil, re, signal, errno) are imported by those verbs.

LOCK, CURRENT = ".lock", ".current"
RUN_FILES = ("pid", "pgid", "started", "ended", "exit_code", "stopped", "code_version")
FILE_CAP = 300            # bytes kept of each small run file (pid, exit_code, ...)
LINE_CAP = 2000           # characters kept of a log line
METRIC_LINE_CAP = 65536   # a metrics line longer than this is dropped (counted), never sent
EVAL_CAP = 20000          # eval.json larger than this is not sent
TAIL_WINDOW = 1 << 20     # bytes read from a file's end for its last lines
METRICS_CAP = 16 << 20    # bytes of metrics.jsonl / evals.jsonl sent at most (the newest ones)
# The training script's step line (train_dflash.log_train); it logs the first step of every launch,
# whatever train.log_every, and `wait` stops at the first (tests/remote ties the two together).
STEP = r"^\S+ INFO step \d+/\d+ \|"
READY = r"^\S+ INFO ready:"  # logged once the target and the drafters are built

# The wrapper: runs the training argv in the run's process group, records pid, exit code or signal.
# $1 = run dir, then the training argv. It inherits the runs lock from the launch and keeps it.
WRAPPER = r'''# dflash-ops run wrapper: $1 = run dir, then the training argv.
dir=$1; shift
echo $$ > "$dir/pgid"
date +%s > "$dir/started"
trap : TERM INT HUP
"$@" </dev/null >>"$dir/console.log" &
child=$!
echo "$child" > "$dir/pid.tmp" && mv -f "$dir/pid.tmp" "$dir/pid"
while :; do
  wait "$child"; rc=$?
  kill -0 "$child" 2>/dev/null || break
done
if [ "$rc" -gt 128 ]; then code="signal $((rc - 128))"; else code=$rc; fi
date +%s > "$dir/ended"
printf '%s\n' "$code" > "$dir/exit_code.tmp" && mv -f "$dir/exit_code.tmp" "$dir/exit_code"
echo "dflash-ops: training process $child ended: exit $code"
'''


class Refused(Exception):
    """A verb's answer is a refusal: {"error": kind, "message": one line, ...extra}."""

    def __init__(self, kind, message, **extra):
        Exception.__init__(self, message)
        self.answer = dict(extra, error=kind, message=message)


# --- the runs lock --------------------------------------------------------------------------------

def runs_lock(runs, shared=False, wait=0.0, create=True):
    """An fd holding the runs lock (exclusive, or shared), or None when it is held the other way.

    The one implementation of the lock: launch, warm-up, stop's check and clean-caches use it.
    Waits up to `wait` seconds. Closing the fd (or the process ending) releases it, unless a child
    inherited it: that is how a run keeps it for its whole life.
    """
    path = os.path.join(runs, LOCK)
    try:
        fd = os.open(path, (os.O_CREAT | os.O_RDWR) if create else os.O_RDONLY, 0o644)
    except OSError:
        return None if not create else _raise_unwritable(runs)
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


def _raise_unwritable(runs):
    raise Refused("cannot-write", f"cannot create the runs lock in {runs}: {_free_text(runs)}")


def read_text(path, cap=FILE_CAP):
    """The first `cap` bytes of a file as text (None if absent); never more, whatever the file is."""
    try:
        with open(path, "rb") as f:
            return f.read(cap).decode("utf-8", "replace")
    except OSError:
        return None


def current_run(runs):
    name = (read_text(os.path.join(runs, CURRENT), 200) or "").strip()
    return name or None


def run_alive(runs, name):
    """Is run `name` alive: .current names it and someone holds the runs lock exclusively."""
    if not name or current_run(runs) != name:
        return False
    fd = runs_lock(runs, shared=True, create=False)
    if fd is None:
        return os.path.exists(os.path.join(runs, LOCK))
    os.close(fd)
    return False


def alive_run(runs):
    """The name of the run holding the runs lock ("?" when .current is unreadable), or None."""
    if not os.path.exists(os.path.join(runs, LOCK)):
        return None  # no run was ever launched here
    fd = runs_lock(runs, create=False)
    if fd is None:
        return current_run(runs) or "?"
    os.close(fd)
    return None


# --- reading files: bounded, split on \n only --------------------------------------------------------

def read_end(path, window):
    """(at most the last `window` bytes of a file, the offset they start at); (None, 0) if unreadable."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - window)
            f.seek(start)
            return f.read(size - start), start
    except OSError:
        return None, 0


def end_lines(data, start):
    """The complete lines of a file's end read from offset `start` (the first one is
    cut unless start is 0)."""
    lines = data.split(b"\n")
    return lines[1:] if start > 0 else lines


def tail_lines(path, count, window=TAIL_WINDOW, cap=LINE_CAP):
    """The last `count` lines of a file, reading at most `window` bytes from its end."""
    data, start = read_end(path, window) if count > 0 else (None, 0)
    if not data:
        return []
    lines = end_lines(data, start)
    if lines and lines[-1] == b"":
        lines.pop()
    return [line[:cap * 4].decode("utf-8", "replace")[:cap] for line in lines[-count:]]


def jsonl_tail(path, cap=METRICS_CAP, line_cap=METRIC_LINE_CAP):
    """The newest lines of a JSON-lines file, at most `cap` bytes: (lines, bytes left out, lines dropped)."""
    data, start = read_end(path, cap)
    if data is None:
        return None, 0, 0
    kept, dropped = [], 0
    for line in end_lines(data, start):
        if not line.strip():
            continue
        if len(line) > line_cap:
            dropped += 1
            continue
        kept.append(line.decode("utf-8", "replace"))
    return kept, start, dropped


def mtime(path):
    try:
        return int(os.stat(path).st_mtime)
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


def _free_text(path):
    free = free_near(path)
    return "unknown free" if free is None else f"{human(free)} free"


def human(n):
    """df -h's way: 0, 512K, 1.5M, 20G."""
    for unit in ("", "K", "M", "G", "T"):
        if n < 1024 or unit == "T":
            return f"{int(n)}{unit}" if unit == "" or n >= 10 else f"{n:.1f}{unit}"
        n /= 1024.0


def resolve(args):
    """(runs, name, run dir) of the payload's run, or the latest; Refused when there is none."""
    runs = args["runs"]
    name = args.get("name") or current_run(runs)
    if not name:
        raise Refused("no-run", f"no run yet under {runs}")
    if "/" in name or name.startswith("."):
        raise Refused("no-run", f"no run named {name[:80]!r} under {runs}")
    path = os.path.join(runs, name)
    if not os.path.isdir(path):
        raise Refused("no-run", f"no run named {name} under {runs}")
    return runs, name, path


# --- status -----------------------------------------------------------------------------------------

def gpu_lines():
    smi = next((os.path.join(d, "nvidia-smi") for d in os.environ.get("PATH", "").split(":")
                if d and os.access(os.path.join(d, "nvidia-smi"), os.X_OK)), None)
    if smi is None:
        return None
    import subprocess

    try:
        r = subprocess.run([smi, "--query-gpu=index,utilization.gpu,memory.used,memory.total,temperature.gpu",
                            "--format=csv,noheader,nounits"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=10)
        out = r.stdout[:8192]
    except (OSError, subprocess.TimeoutExpired) as exc:
        out = str(exc).encode()
    return [line.decode("utf-8", "replace")[:400] for line in out.split(b"\n") if line.strip()][:64]


def status(args):
    """The facts of one run (the named one, or the latest) and the GPUs; the local side judges them."""
    runs = args["runs"]
    name = args.get("name") or current_run(runs)
    out = {"now": int(time.time()), "name": name, "exists": False, "gpus": gpu_lines(),
           "free_runs": free_near(runs), "free_shm": free_bytes("/dev/shm")}
    path = os.path.join(runs, name) if name and "/" not in name and not name.startswith(".") else None
    if path is None or not os.path.isdir(path):
        return out
    files = {f: read_text(os.path.join(path, f)) for f in RUN_FILES}
    log, metrics = os.path.join(path, "train.log"), os.path.join(path, "metrics.jsonl")
    out.update(exists=True, alive=run_alive(runs, name),
               files={f: " ".join(v.split("\n")).strip() for f, v in files.items() if v is not None},
               mtime_log=mtime(log), mtime_metrics=mtime(metrics), free=free_bytes(path),
               metrics=tail_lines(metrics, int(args.get("metric_lines", 20)), cap=METRIC_LINE_CAP),
               log=tail_lines(log, int(args.get("log_lines", 40))))
    out["data"] = read_text(os.path.join(path, "data.json"), 4000)
    latest = os.path.join(path, "checkpoints", "latest")
    if os.path.isfile(latest):
        out["checkpoint"] = {"latest": (read_text(latest, 100) or "").strip(), "mtime": mtime(latest)}
    evaluation = os.path.join(path, "eval.json")
    try:
        small = os.path.getsize(evaluation) <= EVAL_CAP
    except OSError:
        small = None
    out["eval"] = read_text(evaluation, EVAL_CAP) if small else None
    if small is False:
        out["eval_error"] = f"eval.json is larger than {EVAL_CAP} bytes"
    return out


def alive(args):
    return {"alive": alive_run(args["runs"])}


def logs_tail(args):
    runs, name, path = resolve(args)
    return {"run": name, "lines": tail_lines(os.path.join(path, "train.log"), int(args.get("lines", 50)),
                                             window=max(TAIL_WINDOW, 4096 * int(args.get("lines", 50))))}


def metrics(args):
    """metrics.jsonl and evals.jsonl: their newest lines, METRICS_CAP bytes each at most."""
    runs, name, path = resolve(args)
    out = {"run": name}
    for key, fname in (("metrics", "metrics.jsonl"), ("evals", "evals.jsonl")):
        lines, left_out, dropped = jsonl_tail(os.path.join(path, fname), int(args.get("cap", METRICS_CAP)))
        out[key] = lines or []
        out[key + "_left_out"], out[key + "_dropped"] = left_out, dropped
    return out


# --- launch -----------------------------------------------------------------------------------------

def _write(path, text):
    import errno

    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            directory = os.path.dirname(path)
            raise Refused("disk-full",
                          f"cannot write the run directory {directory} ({_free_text(directory)}): disk "
                          "full? read docs/runbooks/disk-full.md") from None
        raise Refused("cannot-write", f"cannot write {path}: {exc.strerror}") from None


def _busy(runs):
    shared = runs_lock(runs, shared=True, create=False)
    if shared is not None:
        os.close(shared)
        return Refused("busy-warmup", "a warm-up is running")
    return Refused("busy", "run %s is alive" % (current_run(runs) or "?"), run=current_run(runs) or "?")


def preflight(args):
    """The payload's own checks (remote_scripts/preflight.py), before anything is created."""
    import subprocess

    argv = args.get("preflight")
    if not argv:
        return None
    if not os.path.exists(argv[1]):
        raise Refused("not-deployed", f"{argv[1]} is missing in the container")
    try:
        r = subprocess.run(argv, capture_output=True, timeout=300,
                           cwd=args.get("cwd"))
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Refused("preflight", f"the preflight did not run: {exc}", check="preflight",
                      fix="run `invoke deploy`, then `invoke doctor`") from None
    last = ([line for line in r.stdout[-65536:].split(b"\n") if line.strip()] or [b""])[-1]
    try:
        verdict = json.loads(last.decode("utf-8", "replace"))
    except ValueError:
        verdict = None
    if not isinstance(verdict, dict):
        err = ([line for line in r.stderr[-4096:].split(b"\n") if line.strip()] or [b"no output"])[-1]
        raise Refused("preflight", f"the preflight failed (exit {r.returncode}): "
                      + err.decode("utf-8", "replace")[:400], check="preflight", fix="read the message above")
    if verdict.get("ok") is not True or r.returncode != 0:
        raise Refused("preflight", str(verdict.get("error") or "check failed")[:400],
                      check=str(verdict.get("check") or "?")[:80], fix=str(verdict.get("fix") or "")[:400])
    return verdict


def launch(args):
    """Check, take the lock, preflight, record, detach the wrapper, and see it alive after `settle`."""
    runs = args["runs"]
    directory = os.path.join(runs, args["name"])
    for path in args.get("required", ()):
        if not os.path.exists(path):
            raise Refused("not-deployed", f"{path} is missing in the container")
    if not os.path.isfile(args["config"]):
        raise Refused("no-config", f"config {args['config']} not found in the container")
    try:
        os.makedirs(runs, exist_ok=True)
    except OSError as exc:
        raise Refused("cannot-write", f"cannot create {runs}: {exc.strerror}") from None
    lock = runs_lock(runs, wait=float(args.get("lock_wait", 2)))
    if lock is None:
        raise _busy(runs)
    held = [lock]
    try:
        return _launch_locked(args, held, directory)
    finally:
        for fd in held:  # a refusal or a failure before the wrapper took the lock over
            os.close(fd)


def _launch_locked(args, held, directory):
    import re
    import subprocess

    lock = held[0]
    runs, name, argv = args["runs"], args["name"], args["argv"]
    checked = preflight(args)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise Refused("cannot-write",
                      f"cannot create {directory}: {exc.strerror} ({_free_text(runs)})") from None
    for stale in ("exit_code", "stopped", "pid", "pgid", "ended"):
        try:
            os.unlink(os.path.join(directory, stale))
        except OSError:
            pass
    _write(os.path.join(directory, "launch.json"), args.get("launch", "{}") + "\n")
    _write(os.path.join(directory, "env"), args.get("env", "") + "\n")
    _write(os.path.join(directory, "config.given.yaml"), read_text(args["config"], 1 << 20) or "")
    manifest = read_text(args.get("manifest") or "", 1 << 24)
    tree = None
    if manifest is not None:
        _write(os.path.join(directory, "code_manifest.json"), manifest)
        try:
            tree = json.loads(manifest).get("tree")
        except (ValueError, AttributeError):
            tree = None
    version = f"tree {tree}" if isinstance(tree, str) and re.match(r"^[0-9a-f]{1,128}$", tree) else (
        f"unknown (no deploy manifest at {args.get('manifest')})" if manifest is None else "tree unknown")
    _write(os.path.join(directory, "code_version"), version + "\n")
    _write(os.path.join(directory, "run.sh"), WRAPPER)
    _write(os.path.join(runs, CURRENT + ".tmp"), name + "\n")
    os.replace(os.path.join(runs, CURRENT + ".tmp"), os.path.join(runs, CURRENT))
    log = os.path.join(directory, "train.log")
    with open(log, "ab") as f:
        offset = f.tell()
        f.write((f"dflash-ops: launch {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} of "
                 f"run {name}\n").encode())
    # `setsid -f`: the wrapper leads its own session and process group, and is not our child (it
    # outlives this process; init reaps it). It inherits the lock's fd and with it the lock.
    with open(log, "ab") as out, open(os.devnull, "rb") as devnull:
        subprocess.run(["setsid", "-f", "sh", os.path.join(directory, "run.sh"), directory] + list(argv),
                       stdin=devnull, stdout=out, stderr=subprocess.STDOUT, pass_fds=(lock,),
                       cwd=args.get("cwd"))
    os.close(held.pop())  # the wrapper holds it now
    pid_file = os.path.join(directory, "pid")
    for _ in range(100):
        if read_text(pid_file):
            break
        time.sleep(0.1)
    time.sleep(float(args.get("settle", 2)))
    files = {f: (read_text(os.path.join(directory, f)) or "").strip() for f in ("pid", "pgid", "exit_code")}
    answer = {"run": name, "log_offset": offset, "code_version": version, "preflight": checked}
    if files["exit_code"] or not files["pid"]:
        answer.update(outcome="died", exit_code=files["exit_code"] or None, log=tail_lines(log, 40))
    else:
        answer.update(outcome="started", pid=_number(files["pid"]), pgid=_number(files["pgid"]))
    return answer


def _number(text):
    return int(text) if text.isdigit() else None


def wait(args):
    """Stream the run's new log lines (one JSON line each) until it is going, has died, or time is up."""
    import re
    import signal

    step, ready = re.compile(STEP), re.compile(READY)
    seen_ready = False
    directory, offset = os.path.join(args["runs"], args["name"]), int(args.get("offset", 0))
    deadline, partial = time.monotonic() + float(args["timeout"]), b""

    def emit(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    signal.signal(signal.SIGINT, lambda *_: (emit({"outcome": "interrupted"}), os._exit(130)))
    log = os.path.join(directory, "train.log")
    ended = None
    while True:
        try:
            with open(log, "rb") as f:
                f.seek(offset)
                data = f.read(TAIL_WINDOW)
        except OSError:
            data = b""
        offset += len(data)
        *lines, partial = (partial + data).split(b"\n")
        for raw in lines:
            line = raw.decode("utf-8", "replace")[:LINE_CAP]
            emit({"line": line})
            seen_ready = seen_ready or bool(ready.match(line))
            if step.match(line):
                return {"outcome": "step", "line": line}
        if ended is not None and not data:
            return {"outcome": "crashed", "exit_code": ended}
        code = (read_text(os.path.join(directory, "exit_code")) or "").strip()
        if code:
            ended = code  # one more read: the wrapper's last line follows the exit code
            continue
        if time.monotonic() >= deadline:
            return {"outcome": "timeout", "ready": seen_ready}
        time.sleep(0.2)


# --- stop -------------------------------------------------------------------------------------------

def _proc_text(pid, what):
    try:
        with open(f"/proc/{pid}/{what}", "rb") as f:
            return f.read(65536)
    except OSError:
        return None


def group_of(pid):
    stat = _proc_text(pid, "stat")
    if stat is None:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # the command name may hold spaces and ')'
    return int(fields[2]) if len(fields) > 2 else None


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


def prove_group(runs, directory, text):
    """The pgid file's group, once proven to be this run's wrapper; Refused with the reason otherwise."""
    text = (text or "").strip()
    if not text.isdigit():
        raise Refused("unproven", f"its pgid file holds {text[:40]!r}, not a process group id")
    pgid = int(text)
    if pgid in (0, 1) or pgid == os.getpgrp():
        raise Refused("unproven", f"its pgid file names process group {pgid}, which is never a run's")
    if group_of(pgid) != pgid:
        raise Refused("unproven", f"process group {pgid} has no leader: it is not this run's wrapper")
    argv = (_proc_text(pgid, "cmdline") or b"").split(b"\0")
    wrapper = os.path.join(directory, "run.sh").encode()
    if wrapper not in argv[:3] or directory.encode() not in argv[:3]:
        shown = b" ".join(argv)[:120].decode("utf-8", "replace")
        raise Refused("unproven", f"process group {pgid} is not this run's wrapper (it runs {shown!r})")
    if not holds_runs_lock(pgid, runs):
        raise Refused("unproven", f"process group {pgid} does not hold the runs lock")
    return pgid


def group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def wait_gone(pgid, seconds):
    deadline = time.monotonic() + seconds
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not group_alive(pgid)


def processes():
    out = []
    for entry in sorted(os.listdir("/proc"), key=lambda e: (len(e), e)):
        if entry.isdigit():
            argv = (_proc_text(int(entry), "cmdline") or b"").replace(b"\0", b" ").strip()
            out.append(f"{entry} {group_of(int(entry))} " + argv[:200].decode("utf-8", "replace"))
    return out[:200]


def stop(args):
    """SIGTERM the proven group, SIGKILL after the grace, confirm it is gone and the lock is free."""
    import signal

    runs, name, directory = resolve(args)
    exit_code = lambda: (read_text(os.path.join(directory, "exit_code")) or "").strip() or None  # noqa: E731
    if not run_alive(runs, name):
        return {"outcome": "notalive", "run": name, "exit_code": exit_code()}
    try:
        pgid = prove_group(runs, directory, read_text(os.path.join(directory, "pgid")))
    except Refused as refused:
        refused.answer.update(run=name)
        raise
    _write(os.path.join(directory, "stopped"), f"requested {int(time.time())}\n")
    how = "term"
    os.killpg(pgid, signal.SIGTERM)
    if not wait_gone(pgid, float(args.get("grace", 30))):
        how = "kill"
        os.killpg(pgid, signal.SIGKILL)
        wait_gone(pgid, 10)
    lock = runs_lock(runs, shared=True, wait=5, create=False)
    if group_alive(pgid) or lock is None:
        return {"outcome": "left", "run": name, "processes": processes()}
    os.close(lock)
    _write(os.path.join(directory, "stopped"), f"{how} {int(time.time())}\n")
    return {"outcome": how, "run": name, "exit_code": exit_code()}


# --- warm-up and the caches ---------------------------------------------------------------------------

def warmup(args):
    """Hold the runs lock shared and become the warm-up (exec): no run starts during it."""
    runs, argv = args["runs"], args["argv"]
    try:
        os.makedirs(runs, exist_ok=True)
    except OSError as exc:
        raise Refused("cannot-write", f"cannot create {runs}: {exc.strerror}") from None
    lock = runs_lock(runs, shared=True)
    if lock is None:
        raise Refused("busy", "run %s is alive" % (current_run(runs) or "?"), run=current_run(runs) or "?")
    for path in argv[:2]:
        if not os.path.exists(path):
            raise Refused("not-deployed", f"{path} is missing in the container")
    os.set_inheritable(lock, True)
    sys.stdout.flush()
    os.execv(argv[0], argv)


def dir_usage(path):
    """Apparent size and number of files under path (no symlinks followed)."""
    size = files = 0
    if not os.path.isdir(path):
        return {"exists": False, "bytes": 0, "files": 0}
    for base, _dirs, names in os.walk(path):
        for name in names:
            try:
                size += os.lstat(os.path.join(base, name)).st_size
                files += 1
            except OSError:
                pass
    return {"exists": True, "bytes": size, "files": files}


def clean_caches(args):
    """Remove the caches while holding the runs lock, so no run can start meanwhile;
    refuse if one is alive."""
    runs = args["runs"]
    fd = runs_lock(runs) if os.path.isdir(runs) else None
    busy = None if fd is not None or not os.path.isdir(runs) else (current_run(runs) or "?")
    if busy and not args.get("force"):
        return {"refused": busy}
    freed = {}
    for name, path in sorted(args["caches"].items()):
        usage = dir_usage(path)
        if usage["exists"]:
            import shutil

            shutil.rmtree(path, ignore_errors=True)
        usage["left"] = os.path.exists(path)
        usage["path"] = path
        freed[name] = usage
    if fd is not None:
        os.close(fd)
    return {"freed": freed, "alive": busy}


VERBS = {"status": status, "alive": alive, "logs-tail": logs_tail, "metrics": metrics, "launch": launch,
         "wait": wait, "stop": stop, "warmup": warmup, "clean-caches": clean_caches}


def serve(argv):
    """`<verb> <json>` -> one JSON line on stdout; a refusal or an unexpected failure is a field."""
    try:
        verb, payload = argv[1], json.loads(argv[2])
        answer = VERBS[verb](payload)
    except Refused as refused:
        answer = refused.answer
    except Exception as exc:  # a bug or an odd container: still one line the local side can show
        answer = {"error": "internal", "message": f"{type(exc).__name__}: {str(exc)[:300]}"}
    sys.stdout.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv))
