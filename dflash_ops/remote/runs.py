"""The run protocol, inside the container: launch, stop, status, metrics, the log's tail, the runs lock.

Shipped after prelude.py (ship.py) to the container's own interpreter (`container.python`): standard
library only, Python >= 3.8, the prelude's one answer format (`wait` and `follow` stream `{"line"}`
lines first).

    python -S -c LOADER <prelude + this file, packed> status '{"runs": "/root/runs", "name": null}'

Everything read from a run directory is data, read through the prelude's bounded readers, and
sent back inside JSON strings, so a log line holding `\r` or a fake fact stays a string of that
log line. Shell remains only where a process must outlive the session: the run wrapper (WRAPPER
below, written to `run.sh`). The local side is launch.py / status.py / logs.py / metrics.py /
history.py.

The runs lock, run_alive, resolve_run and run_state are the prelude's.
"""

import json
import os
import sys
import time

from dflash_ops.remote.prelude import (
    CURRENT,
    LINE_CAP,
    LOG_FILE,
    SEGMENTS,
    TAIL_WINDOW,
    LineCutter,
    Refused,
    alive_run,
    container_memory,
    current_segment,
    decoded,
    default_run,
    dir_usage,
    emit,
    end_lines,
    free_bytes,
    free_near,
    free_text,
    holds_runs_lock,
    last_activity,
    last_record,
    launch_under_way,
    mtime,
    number,
    read_end,
    read_segments,
    read_spec,
    read_text,
    resolve_run,
    run_alive,
    run_files,
    run_names,
    runs_lock,
    segment_start,
    serve,
    state_of_run,
    tail_lines,
    time_left,
)

# `status` is the hot path (one interpreter start per `invoke status`): modules only some verbs need
# (subprocess, shutil, re, signal, errno) are imported by those verbs.

METRIC_LINE_CAP = 65536   # a metrics line longer than this is dropped (counted), never sent
EVAL_CAP = 20000          # eval.json larger than this is not sent
METRICS_CAP = 16 << 20    # bytes of metrics.jsonl / evals.jsonl sent at most (the newest ones)
# The training script's step line (train_dflash.log_train); it logs the first step of every launch,
# whatever train.log_every, and `wait` stops at the first (tests/remote ties the two together).
STEP = r"^\S+ INFO step \d+/\d+ \|"
READY = r"^\S+ INFO ready:"  # logged once the target and the drafters are built

# The wrapper: runs the training argv in the run's process group, records pid, exit code or signal,
# then asks the `ended` verb (below) whether to run it again (`train --max-restarts`).
# $1 = run dir, $2..$5 = that verb's python, loader, helper and JSON (ship.argv's), then the
# training argv. It inherits the runs lock from the launch and keeps it, restarts included.
WRAPPER = r'''# dflash-ops run wrapper: $1 = run dir, $2-$5 = the `ended` verb, then the training argv.
dir=$1 py=$2 loader=$3 helper=$4 hook=$5; shift 5
echo $$ > "$dir/pgid"
date +%s > "$dir/started"
trap : TERM INT HUP
while :; do
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
  [ -n "$py" ] || break
  case $("$py" -S -c "$loader" "$helper" ended "$hook" </dev/null 2>/dev/null) in
    '{"ok": "restart"}') [ -e "$dir/stopped" ] || continue ;;
  esac
  break
done
'''
RESTART_BACKOFF_S = 5     # the first automatic restart waits this long, each next one twice as long
RESTART_BACKOFF_CAP_S = 300


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


def resolve(args):
    """(runs, name, run dir) of the payload's run, or the latest; Refused when there is none."""
    name, path = resolve_run(args["runs"], args.get("name"))
    return args["runs"], name, path


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
    """The facts of one run (the named one, or the latest), its state (the prelude's run_state), and
    the GPUs; the local side checks every field."""
    runs = args["runs"]
    name = args.get("name") or default_run(runs)
    now = int(time.time())
    out = {"now": now, "name": name, "exists": False, "gpus": gpu_lines(),
           "free_runs": free_near(runs), "free_shm": free_bytes("/dev/shm"), "memory": container_memory()}
    try:
        name, path = resolve_run(runs, name) if name else (None, None)
    except Refused as refused:
        path = None
        out["runs"] = refused.answer["runs"]
    if path is None:
        out.setdefault("runs", run_names(runs))
        return out
    stall_after = float(args.get("stall_after", 600))
    state = state_of_run(runs, name, path, now, stall_after)
    log, metrics = os.path.join(path, LOG_FILE), os.path.join(path, "metrics.jsonl")
    # the current segment: its record (a launch, resume or automatic restart); a run launched before
    # segments.jsonl existed: its last launch line
    current = current_segment(path)
    segment = current["log_offset"] if current and current["log_offset"] is not None else segment_start(log)
    out.update(exists=True, alive=state["alive"], state=state["state"], detail=state["detail"],
               idle_s=state["idle_s"], files=state["files"], free=free_bytes(path),
               metrics=tail_lines(metrics, int(args.get("metric_lines", 200)), cap=METRIC_LINE_CAP),
               segment_offset=segment,
               log=tail_lines(log, int(args.get("log_lines", 40)), since=segment))
    out["data"] = read_text(os.path.join(path, "data.json"), 4000)
    out["spec"] = read_spec(path)
    out["segment"] = current
    latest = os.path.join(path, "checkpoints", "latest")
    text = read_text(latest, 100)
    if text is not None:
        out["checkpoint"] = {"latest": text.strip(), "mtime": mtime(latest)}
    text = read_text(os.path.join(path, "eval.json"), EVAL_CAP + 1)
    out["eval"] = text if text is not None and len(text.encode("utf-8", "replace")) <= EVAL_CAP else None
    if text is not None and out["eval"] is None:
        out["eval_error"] = f"eval.json is larger than {EVAL_CAP} bytes"
    return out


def spec(args):
    """What `train --run NAME` resumes from: the run's saved spec (None for a new run), and the
    code deployed now."""
    try:
        _, path = resolve_run(args["runs"], args["name"])
    except Refused:
        path = None  # no such run yet: the launch makes a new one
    return {"exists": path is not None, "spec": read_spec(path) if path else None,
            "code_version": code_version(args.get("manifest") or "")[0]}


def code_version(manifest_path):
    """(`tree <hash>` of the deploy manifest, or why it is unknown; the manifest's text or None)."""
    import re

    manifest = read_text(manifest_path, 1 << 24)
    tree = None
    if manifest is not None:
        try:
            tree = json.loads(manifest).get("tree")
        except (ValueError, AttributeError):
            tree = None
    version = f"tree {tree}" if isinstance(tree, str) and re.match(r"^[0-9a-f]{1,128}$", tree) else (
        f"unknown (no deploy manifest at {manifest_path})" if manifest is None else "tree unknown")
    return version, manifest


def resolve_verb(args):
    """The run `name` names (or the latest): {"run": name}; the no-run refusal (with the runs there
    are) otherwise. For the tasks whose work is no runs verb (`eval`)."""
    _, name, _ = resolve(args)
    return {"run": name}


def logs_tail(args):
    runs, name, path = resolve(args)
    out, _ = last_lines(os.path.join(path, LOG_FILE), args)
    return dict(out, run=name)


def metrics(args):
    """metrics.jsonl and evals.jsonl: their newest lines, METRICS_CAP bytes each at most."""
    runs, name, path = resolve(args)
    out = {"run": name}
    for key, fname in (("metrics", "metrics.jsonl"), ("evals", "evals.jsonl")):
        lines, left_out, dropped = jsonl_tail(os.path.join(path, fname), int(args.get("cap", METRICS_CAP)))
        out[key] = lines or []
        out[key + "_left_out"], out[key + "_dropped"] = left_out, dropped
    return out


# --- the log's last lines, filtered (logs -n, --grep, --since) --------------------------------------
# --grep and --since search at most GREP_WINDOW bytes of the log's end (the answer says when that is
# not all of it), within the call's deadline; a pattern that takes longer on one followed line than
# GREP_LINE_S is refused (Python's re checks for signals while it matches: the timer interrupts it).

GREP_WINDOW = 32 << 20
GREP_LINE_S = 1.0
STAMP = r"^(\d\d):(\d\d):(\d\d) "  # train.log's time of day (train_config.py: datefmt %H:%M:%S)


class Pattern:
    """The operator's --grep (compiled and checked here too: the container's Python may differ), its
    searches bounded in time by an interval timer."""

    def __init__(self, text):
        import re

        try:
            self.regex = re.compile(text)
        except (re.error, RecursionError, OverflowError) as exc:
            raise Refused("bad-input", "--grep: " + str(exc)[:200]) from None

    def search(self, line, seconds=GREP_LINE_S):
        return within(seconds, "--grep on one line", self.regex.search, line)


def within(seconds, what, fn, *args):
    """fn(*args), or Refused("timeout") once `seconds` have passed (SIGALRM interrupts even a regex)."""
    import signal

    def expired(*_):
        raise Refused("timeout", f"{what} took longer than {seconds:g} s: give a simpler --grep "
                                 "(or a shorter --since)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, max(0.001, seconds))
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def stamped_since(lines, since, end_time):
    """The index of the first line written at or after `since` (epoch s). A line's time is its own
    HH:MM:SS (local time, the day found walking back from the log's mtime `end_time`: a time later
    than the one after it means the day before), or else the time of the stamped line before it."""
    import re

    stamp = re.compile(STAMP)
    end = time.localtime(end_time)
    day = time.mktime((end.tm_year, end.tm_mon, end.tm_mday, 0, 0, 0, 0, 0, -1))
    later = end.tm_hour * 3600 + end.tm_min * 60 + end.tm_sec
    start = len(lines)
    for i in range(len(lines) - 1, -1, -1):
        m = stamp.match(lines[i])
        if not m:
            continue
        seconds = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + int(m.group(3))
        if seconds > later + 3600:  # written before midnight (the hour: lines of several ranks interleave)
            day -= 86400
        later = seconds
        if day + seconds < since:
            break
        start = i
    return start


def last_lines(path, args):
    """({"lines": the last args["lines"] lines (--grep: that match it; --since: written since then),
    "searched" and "size": the bytes looked at and the log's size, "matched": how many matched}, the
    offset of the log's end as read: a follower goes on from there)."""
    count = max(0, int(args.get("lines", 50)))
    grep, since = args.get("grep"), args.get("since")
    filtered = grep is not None or since is not None
    pattern = Pattern(grep) if grep is not None else None
    data, start = read_end(path, GREP_WINDOW if filtered else max(TAIL_WINDOW, 4096 * count) if count else 0)
    end = start + len(data or b"")
    raw = end_lines(data, start) if data else []
    if raw and raw[-1] == b"":
        raw.pop()
    lines = [decoded(line) for line in (raw if filtered else raw[-count:] if count else [])]
    if not filtered and 0 < len(raw) < count and start > 0:
        # fewer whole lines than asked in the window: a line longer than the window ends in it; it is
        # shown cut, as the follower cuts the lines it reads (its start lies before the window)
        lines.insert(0, "…" + decoded(data.split(b"\n", 1)[0]))

    def choose():
        chosen = lines
        if since is not None:
            at = since["at"] if "at" in since else time.time() - float(since["ago"])
            chosen = chosen[stamped_since(chosen, float(at), mtime(path) or time.time()):]
        return [line for line in chosen if pattern.regex.search(line)] if pattern is not None else chosen

    if filtered:
        lines = within(max(0.5, min(time_left() - 2, 3600.0)), "searching the log", choose)
    return {"lines": lines[-count:] if count else [], "matched": len(lines), "searched": end - start,
            "size": end}, end


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
                          f"cannot write the run directory {directory} ({free_text(directory)}): disk "
                          "full? read docs/runbooks/disk-full.md") from None
        raise Refused("cannot-write", f"cannot write {path}: {exc.strerror}") from None


def _busy(runs):
    shared = runs_lock(runs, shared=True, create=False)
    if shared is not None:
        os.close(shared)
        return Refused("busy-warmup", "a warm-up is running")
    alive = alive_run(runs) or "?"
    return Refused("busy", f"run {alive} is alive", run=alive)


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


LAUNCH_RACE_WAIT_S = 240  # how long a launch waits out another one under way (its preflight: up to
# 300 s; the client's LAUNCH_TIMEOUT_S of 600 covers this wait, this launch's own preflight and settle)


def _after_other_launches(runs):
    """The runs lock, once no other launch holds it; None when a run (or a warm-up, or anything
    unnamed that is no launch) holds it. Another launch holds the lock through its preflight, before
    its wrapper exists to be named: answering then would say `run ? is alive` of a run that may
    never start. So while the holder is unnamed and a launch is under way (launch_under_way), wait:
    the other launch either starts its run (then named: busy) or fails (the lock is free: this one
    goes on), up to LAUNCH_RACE_WAIT_S."""
    deadline = time.monotonic() + LAUNCH_RACE_WAIT_S
    while time.monotonic() < deadline:
        if alive_run(runs) != "?" or not launch_under_way(runs):
            return runs_lock(runs)  # free since the first try, or held by what a refusal names
        lock = runs_lock(runs, wait=0.5)
        if lock is not None:
            return lock
    return None


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
        lock = _after_other_launches(runs)
    if lock is None:
        raise _busy(runs)
    try:
        return _launch_locked(args, lock, directory)
    finally:
        os.close(lock)  # the wrapper has its own copy; or a refusal, or a failure before the wrapper


def _launch_locked(args, lock, directory):
    import subprocess

    runs, name, argv = args["runs"], args["name"], args["argv"]
    checked = preflight(args)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise Refused("cannot-write",
                      f"cannot create {directory}: {exc.strerror} ({free_text(runs)})") from None
    close_segment(directory, run_files(directory))  # the last one's end, if its wrapper could not write it
    kind = "resume" if read_segments(directory) or _latest_step(directory) else "launch"
    _unlink(directory, ("exit_code", "stopped", "pid", "pgid", "ended"))
    version, manifest = code_version(args.get("manifest") or "")
    record = json.loads(args.get("launch") or "{}")
    record["code_version"] = version
    _write(os.path.join(directory, "launch.json"), json.dumps(record, indent=1) + "\n")
    _write(os.path.join(directory, "env"), args.get("env", "") + "\n")
    _write(os.path.join(directory, "config.given.yaml"), read_text(args["config"], 1 << 20) or "")
    if manifest is not None:
        _write(os.path.join(directory, "code_manifest.json"), manifest)
    _write(os.path.join(directory, "code_version"), version + "\n")
    _write(os.path.join(directory, "run.sh"), WRAPPER)
    _write(os.path.join(runs, CURRENT + ".tmp"), name + "\n")
    os.replace(os.path.join(runs, CURRENT + ".tmp"), os.path.join(runs, CURRENT))
    log = os.path.join(directory, LOG_FILE)
    offset = open_segment(directory, kind, name)
    # `setsid -f`: the wrapper leads its own session and process group, and is not our child (it
    # outlives this process; init reaps it). It inherits the lock's fd and with it the lock.
    with open(log, "ab") as out, open(os.devnull, "rb") as devnull:
        subprocess.run(["setsid", "-f", "sh", os.path.join(directory, "run.sh"), directory]
                       + _hook(args.get("hook")) + list(argv),
                       stdin=devnull, stdout=out, stderr=subprocess.STDOUT, pass_fds=(lock,),
                       cwd=args.get("cwd"))
    # The wrapper holds the lock now, on the same open file; ours stays open until the answer (launch's
    # `finally`), so that until the wrapper runs as `sh <run>/run.sh` and can be named, a launch
    # (launch_under_way) has the lock file open: `setsid -f` forks and execs between the two.
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


def _unlink(directory, names):
    for name in names:
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass


def _hook(hook):
    """The wrapper's `ended` call, from ship.argv's [python, -S, -c, loader, helper, "ended", json]:
    [python, loader, helper, json] (four empty words without one: the wrapper then never restarts).
    An empty helper is this verb's own packed text (the loader's `_PACKED`), so the launch line
    carries it once."""
    if not hook:
        return ["", "", "", ""]
    if (not isinstance(hook, list) or len(hook) != 7 or not all(isinstance(w, str) for w in hook)
            or hook[1:3] != ["-S", "-c"] or hook[5] != "ended"):
        raise Refused("bad-input", "the hook is not the `ended` verb's argv")
    helper = hook[4] or globals().get("_PACKED")
    if not helper:
        raise Refused("bad-input", "the hook names no helper, and this one was not started by the loader")
    return [hook[0], hook[3], helper, hook[6]]


# --- segments: each launch, resume or automatic restart of a run (`invoke runs --history`) ----------
# segments.jsonl (prelude.read_segments reads it): the launch (or the `ended` verb, for a restart)
# appends a segment's start, the `ended` verb its end when the training process ends; a segment
# whose wrapper died with it (a stop's SIGKILL, a container restart) is closed by the next launch.

def _append(directory, record):
    import errno

    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(os.path.join(directory, SEGMENTS), flags, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")  # one write: lines never interleave
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise Refused("disk-full", f"cannot write {directory}/{SEGMENTS} ({free_text(directory)}): "
                          "disk full? read docs/runbooks/disk-full.md") from None
        raise Refused("cannot-write", f"cannot write {directory}/{SEGMENTS}: {exc.strerror}") from None


def _latest_step(directory):
    """The step of checkpoints/latest (`step-N`), or 0."""
    text = (read_text(os.path.join(directory, "checkpoints", "latest"), 100) or "").strip()
    return int(text[5:]) if text.startswith("step-") and text[5:].isdigit() and len(text) < 25 else 0


def _size(path):
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def open_segment(directory, kind, name, **extra):
    """A new segment: its `dflash-ops: launch|restart <time> of run <name>` line in train.log (a
    resume is a launch there, as it always was) and its start in segments.jsonl. Returns train.log's
    size before that line (where the segment's log starts)."""
    previous = read_segments(directory)
    now = int(time.time())
    with open(os.path.join(directory, LOG_FILE), "ab") as f:
        offset = f.tell()
        word = "restart" if kind == "restart" else "launch"
        f.write((f"dflash-ops: {word} {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(now))} of "
                 f"run {name}\n").encode())
    _append(directory, dict(extra, n=(previous[-1]["n"] + 1) if previous else 1, kind=kind, start=now,
                            log_offset=offset, from_step=_latest_step(directory),
                            metrics_offset=_size(os.path.join(directory, "metrics.jsonl"))))
    return offset


def close_segment(directory, files):
    """The current segment's end, written once, from the run's files as the wrapper left them (exit
    code, end time, whether a stop was requested); the segment, or None without one."""
    current = current_segment(directory)
    if current is None or current["end"] is not None:
        return current
    code, stopped = files.get("exit_code"), files.get("stopped")
    if code is None and (stopped or "").startswith("kill"):
        code = "signal 9"  # a stop's SIGKILL ended the wrapper with it
    end = number(files.get("ended")) or last_activity(directory, files) or int(time.time())
    last = last_record(os.path.join(directory, "metrics.jsonl"), since=current["metrics_offset"])
    current.update(end=max(end, current["start"] or 0), exit=code, stopped=stopped is not None,
                   last_step=last.get("step") if isinstance(last.get("step"), int) else None)
    _append(directory, {"n": current["n"], "end": current["end"], "exit": code,
                        "stopped": current["stopped"], "last_step": current["last_step"]})
    return current


def restart_reason(directory, code, segment, policy):
    """Why an ended training process may be restarted (a known transient failure), or None: a clean
    end, any other failure (a config error, CUDA out of memory: it would fail again). `policy`:
    the launch's {"signals": [numbers], "patterns": [regular expressions of the log's lines]}."""
    import re
    import signal

    if code is None or code == "0":
        return None
    if code.startswith("signal "):
        num = number(code[7:])
        if num in [n for n in policy.get("signals") or () if isinstance(n, int)]:
            try:
                shown = signal.Signals(num).name
            except ValueError:
                shown = "?"
            return f"the training process was killed by signal {num} ({shown})"
        return None
    patterns = []
    for text in (policy.get("patterns") or ())[:32]:
        try:
            patterns.append(re.compile(text[:500]))
        except (re.error, TypeError):
            continue
    start = (segment or {}).get("log_offset") or 0
    data, at = read_end(os.path.join(directory, LOG_FILE), TAIL_WINDOW)
    data = data or b""
    if at < start:  # the segment's own lines only
        data, at = data[start - at:], start
    lines = data.split(b"\n")[1 if at > start else 0:]  # the first is cut when read from mid-segment
    for raw in reversed(lines[-400:]):
        line = raw[:LINE_CAP * 4].decode("utf-8", "replace")[:LINE_CAP]
        if any(p.search(line) for p in patterns):
            return f"a transient error in its log ({line.strip()[:200]})"
    return None


def _note(directory, text):
    with open(os.path.join(directory, LOG_FILE), "ab") as f:
        f.write((text + "\n").encode("utf-8", "replace"))


def ended(args):
    """The wrapper's call once its training process has ended (WRAPPER): the segment's end, then
    "restart" when it may run again: a known transient failure (restart_reason), no stop requested,
    fewer automatic restarts in a row than the launch's --max-restarts. It waits the backoff first
    (5 s, doubling, at most 300 s; a stop meanwhile ends it), notes it in train.log and opens the
    restart's segment (the training process resumes from the latest checkpoint). Else "done"."""
    runs, name = args["runs"], args["name"]
    name, directory = resolve_run(runs, name)
    files = run_files(directory)
    current = close_segment(directory, files)
    policy = args.get("restart") if isinstance(args.get("restart"), dict) else {}
    most = policy.get("max") if isinstance(policy.get("max"), int) else 0
    why = None if files.get("stopped") is not None or most <= 0 else restart_reason(
        directory, files.get("exit_code"), current, policy)
    if why is None:
        return "done"
    done = 0
    for segment in reversed(read_segments(directory)):
        if segment["kind"] != "restart":
            break
        done += 1
    if done >= most:
        _note(directory, f"dflash-ops: not restarting run {name}: {why}; its {done} automatic restart(s) "
                         f"of --max-restarts {most} are used")
        return "done"
    delay = min(float(policy.get("backoff_s", RESTART_BACKOFF_S)) * 2 ** done, RESTART_BACKOFF_CAP_S)
    _note(directory, f"dflash-ops: {why}: restart {done + 1} of {most} in {delay:g} s, from the latest "
                     "checkpoint")
    time.sleep(delay)
    if os.path.lexists(os.path.join(directory, "stopped")):
        return "done"
    _unlink(directory, ("exit_code", "ended", "pid"))
    open_segment(directory, "restart", name, restart=done + 1, after=files.get("exit_code"))
    return "restart"


def wait(args):
    """Stream the run's new log lines (one JSON line each) until it is going, has died (its training
    process ended and its wrapper too: an automatic restart goes on to its first step), or time is up."""
    import re
    import signal

    step, ready = re.compile(STEP), re.compile(READY)
    seen_ready = False
    directory, offset = os.path.join(args["runs"], args["name"]), int(args.get("offset", 0))
    deadline, partial = time.monotonic() + float(args["timeout"]), b""

    def interrupted(*_):
        sys.stdout.write(json.dumps({"ok": {"outcome": "interrupted"}}) + "\n")
        sys.stdout.flush()
        os._exit(130)

    signal.signal(signal.SIGINT, interrupted)
    log = os.path.join(directory, LOG_FILE)
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
            emit(line)
            seen_ready = seen_ready or bool(ready.match(line))
            if step.match(line):
                return {"outcome": "step", "line": line}
        if ended is not None and not data:
            return {"outcome": "crashed", "exit_code": ended}
        code = (read_text(os.path.join(directory, "exit_code")) or "").strip()
        if code and not run_alive(args["runs"], args["name"]):  # alive: its wrapper may restart it
            ended = code  # one more read: the wrapper's last line follows the exit code
            continue
        if time.monotonic() >= deadline:
            return {"outcome": "timeout", "ready": seen_ready}
        time.sleep(0.2)


# --- follow ----------------------------------------------------------------------------------------

FOLLOW_READ = 1 << 16


def follow(args):
    """`logs --follow`: stream the run's log with `tail -F` (it survives the log being rotated or
    recreated by a restart) until the run ends, then answer how it ended.

    Streams {"run": name} first, then {"line": ...} per log line and per note of tail's ("file
    truncated"), each cut to LINE_CAP characters (a line of any length costs time linear in its
    length and memory bounded by the cut): the last `lines` lines (with `grep`, `since`: those that
    match, `last_lines`), then every line that tail reads after them that `grep` matches. The run has ended
    when nobody has held the runs lock for 1 s (after a stop: for `grace` s, so that a restart of the
    same run is followed). Ctrl-C (SIGINT through the pty) or a hang-up ends tail and this process:
    `tail --pid` also ends once this process is gone, however it died; nothing is left behind.
    """
    import subprocess

    runs = args["runs"]
    name, path = resolve_run(runs, args.get("name"))
    grace = float(args.get("grace", 15))
    pattern = Pattern(args["grep"]) if args.get("grep") is not None else None
    log = os.path.join(path, LOG_FILE)
    emit(run=name)
    first, end = last_lines(log, args)  # the last -n lines (--grep, --since: those that match) ...
    for line in first["lines"]:
        emit(line)
    # ... then every line written after them: tail from the byte after the end they were read to
    tail = subprocess.Popen(["tail", "-c", f"+{end + 1}", "-F", f"--pid={os.getpid()}", "--", log],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        return _follow_tail(tail, runs, name, path, grace, pattern, args)
    finally:
        tail.kill()
        tail.wait()


def _follow_tail(tail, runs, name, path, grace, pattern, args):
    """follow's loop: tail's lines (those --grep matches) streamed until the run ends."""
    import select
    import signal

    def end(code):
        def handler(*_):
            tail.kill()
            os._exit(code)
        return handler

    for sig, code in ((signal.SIGINT, 130), (signal.SIGHUP, 129), (signal.SIGTERM, 143)):
        signal.signal(sig, end(code))
    reader = LineCutter(LINE_CAP)
    fd = tail.stdout.fileno()

    def pass_on():
        """What tail has written, line by line (those --grep matches); False once it has ended."""
        data = os.read(fd, FOLLOW_READ)
        for line in reader.feed(data):
            if pattern is None or pattern.search(line):
                emit(line)
        return bool(data)

    gone, last_check = 0, time.monotonic()
    while True:
        if select.select([fd], [], [], 1.0)[0] and not pass_on():
            break  # tail ended (its --pid, or the file system went away)
        if time.monotonic() - last_check >= 1.0:
            last_check = time.monotonic()
            gone = 0 if run_alive(runs, name) else gone + 1
            limit = grace if os.path.lexists(os.path.join(path, "stopped")) else 1
            if gone >= limit:
                break
    deadline = time.monotonic() + 1.0  # the wrapper's last line follows the end
    while time.monotonic() < deadline and select.select([fd], [], [], 0.2)[0] and pass_on():
        pass
    tail.kill()
    tail.wait()
    for line in reader.rest():
        if pattern is None or pattern.search(line):
            emit(line)
    state = state_of_run(runs, name, path, int(time.time()), float(args.get("stall_after", 600)))
    return {"run": name, "state": state["state"], "detail": state["detail"],
            "exit_code": state["files"].get("exit_code")}


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
    if how == "kill":  # the wrapper went with the group: the segment's end is ours to write
        close_segment(directory, run_files(directory))
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
        alive = alive_run(runs) or "?"
        raise Refused("busy", f"run {alive} is alive", run=alive)
    for path in argv[:2]:
        if not os.path.exists(path):
            raise Refused("not-deployed", f"{path} is missing in the container")
    os.set_inheritable(lock, True)
    sys.stdout.flush()
    os.execv(argv[0], argv)


def clean_caches(args):
    """Remove the caches while holding the runs lock, so no run can start meanwhile;
    refuse if one is alive."""
    runs = args["runs"]
    fd = runs_lock(runs) if os.path.isdir(runs) else None
    busy = None if fd is not None or not os.path.isdir(runs) else (alive_run(runs) or "?")
    if busy and not args.get("force"):
        raise Refused("busy", f"run {busy} is alive", run=busy)
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


VERBS = {"status": status, "logs-tail": logs_tail, "follow": follow, "metrics": metrics, "launch": launch,
         "wait": wait, "stop": stop, "warmup": warmup, "clean-caches": clean_caches,
         "spec": spec, "resolve": resolve_verb, "ended": ended}


if __name__ == "__main__":
    serve(VERBS)
