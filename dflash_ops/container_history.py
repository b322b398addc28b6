"""Every run under paths.runs, and pruning old ones, in the container (`invoke runs`, `invoke prune`).

Sent per call like container_facts.py (stdlib only, Python >= 3.8): one JSON argument in, one
JSON object out. Parsing and display live on the local side (dflash_ops.history).

    list   {"runs", "lock", "current", "stall_after"} -> {"now", "alive", "runs": [record...]}
    prune  {... , "keep", "older_than", "act"} -> {"now", "alive", "runs", "plan": [...], "removed", "lock"}

A run is alive while its processes hold `<runs>/.lock` (jobs.py). `prune` never touches the alive
run, keeps the `keep` newest runs, and of those it removes only checkpoints beyond the run's own
`train.keep_last` (never the one `checkpoints/latest` names) and leftovers of interrupted saves.
While it deletes it holds the runs lock, so no run can start (or resume) under it; while a run is
alive that run holds the lock, which excludes launches just as well, and prune takes the lock the
moment the run ends. Each directory is renamed out of view before it is deleted.
"""

import fcntl
import json
import os
import re
import shutil
import sys
import time

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
STEP_DIR = re.compile(r"^step-(\d+)$")
LEFTOVER = re.compile(r"^\.(?:tmp-step-\d+-\d+|del-step-\d+-\d+)$")  # interrupted checkpoint saves/deletes
KEEP_LAST = re.compile(r"^\s+keep_last:\s*(\d+)\s*$")


def read(path, limit=300):
    try:
        with open(path, errors="replace") as f:
            return f.read(limit).strip()
    except OSError:
        return None


def number(text):
    try:
        return int(str(text).split()[0])
    except (TypeError, ValueError, IndexError):
        return None


def disk_usage(path):
    """Bytes on disk under path (allocated blocks, each inode once, symlinks not followed)."""
    total, seen = 0, set()
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def last_train_record(path):
    """The last `train` line of metrics.jsonl (its last 64 KiB), or {}."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - (1 << 16)))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind", "train") == "train":
            return record
    return {}


def keep_last_of(run_dir):
    """`train.keep_last` from the run's resolved config.yaml (a flat YAML the trainer writes), or None."""
    section = None
    try:
        with open(os.path.join(run_dir, "config.yaml")) as f:
            for line in f:
                if line[:1].isalpha():
                    section = line.split(":")[0]
                elif section == "train" and KEEP_LAST.match(line):
                    return int(KEEP_LAST.match(line).group(1))
    except OSError:
        pass
    return None


def checkpoints_of(run_dir):
    root = os.path.join(run_dir, "checkpoints")
    latest = read(os.path.join(root, "latest"))
    steps, leftovers = [], []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        names = []
    for name in names:
        m = STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)) and not os.path.islink(os.path.join(root, name)):
            steps.append({"name": name, "step": int(m.group(1)),
                          "bytes": disk_usage(os.path.join(root, name))})
        elif LEFTOVER.match(name):
            leftovers.append({"name": name, "bytes": disk_usage(os.path.join(root, name))})
    steps.sort(key=lambda c: c["step"])
    return latest, steps, leftovers


def state_of(run_dir, alive, now, last_activity, stall_after):
    """The same states as `invoke status` (status.parse_status), from the run directory's files."""
    if alive:
        return "stalled" if now - last_activity > stall_after else "running"
    code = read(os.path.join(run_dir, "exit_code"))
    if read(os.path.join(run_dir, "stopped")) is not None:
        return "stopped"
    if code == "0":
        return "finished"
    return "crashed"


def run_record(runs, name, alive_name, now, stall_after):
    run_dir = os.path.join(runs, name)
    started = number(read(os.path.join(run_dir, "started")))
    ended = number(read(os.path.join(run_dir, "ended")))
    mtimes = []
    for f in ("train.log", "metrics.jsonl"):
        try:
            mtimes.append(int(os.stat(os.path.join(run_dir, f)).st_mtime))
        except OSError:
            pass
    last_activity = max([t for t in [started, ended] + mtimes if t] or [int(os.stat(run_dir).st_mtime)])
    alive = name == alive_name
    train = last_train_record(os.path.join(run_dir, "metrics.jsonl"))
    latest, steps, leftovers = checkpoints_of(run_dir)
    return {
        "name": name, "state": state_of(run_dir, alive, now, last_activity, stall_after), "alive": alive,
        "step": train.get("step"), "loss": train.get("loss"),
        "acceptance_length": train.get("acceptance_length"),
        "started": started, "ended": ended, "last_activity": last_activity,
        "duration_s": ((ended if ended and not alive else now) - started) if started else None,
        "exit_code": read(os.path.join(run_dir, "exit_code")), "bytes": disk_usage(run_dir),
        "latest_checkpoint": latest, "checkpoints": steps, "leftovers": leftovers,
        "keep_last": keep_last_of(run_dir),
    }


def lock_state(fd):
    """'exclusive' or 'shared' if we now hold the runs lock (shared: a warm-up holds it too, which
    also keeps launches out), None while a run holds it."""
    for how, flag in (("exclusive", fcntl.LOCK_EX), ("shared", fcntl.LOCK_SH)):
        try:
            fcntl.flock(fd, flag | fcntl.LOCK_NB)
            return how
        except OSError:
            pass
    return None


def current_alive(args):
    """The alive run's name, or None. Call it while holding no lock of our own."""
    try:
        probe = os.open(args["lock"], os.O_RDONLY)
    except OSError:
        return None  # no lock file: no run was ever launched here
    try:
        fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except OSError:
        return read(args["current"]) or "?"
    finally:
        os.close(probe)


def everything(args, alive):
    runs, now = args["runs"], int(time.time())
    try:
        names = sorted(n for n in os.listdir(runs)
                       if RUN_NAME.match(n) and os.path.isdir(os.path.join(runs, n))
                       and not os.path.islink(os.path.join(runs, n)))
    except OSError:
        names = []
    records = [run_record(runs, n, alive, now, float(args.get("stall_after", 600))) for n in names]
    records.sort(key=lambda r: (r["started"] or r["last_activity"], r["name"]), reverse=True)  # newest first
    return now, records


def list_runs(args):
    alive = current_alive(args)
    now, records = everything(args, alive)
    return {"now": now, "alive": alive, "runs": records}


def plan(records, keep, older_than, now):
    """What prune removes, newest run first: [{"run", "path" (relative to runs), "what", "bytes", "why"}]."""
    out = []
    for rank, r in enumerate(records):
        if r["alive"]:
            continue
        if rank >= keep and (older_than is None or now - r["last_activity"] >= older_than):
            idle = (now - r["last_activity"]) / 86400
            why = f"not among the {keep} newest runs" + ("" if older_than is None
                                                         else f", idle {idle:.1f} days")
            out.append({"run": r["name"], "path": r["name"], "what": "run", "bytes": r["bytes"], "why": why})
            continue
        keep_last = r["keep_last"]
        if keep_last is not None:
            kept = {c["name"] for c in r["checkpoints"][-keep_last:]} | {r["latest_checkpoint"]}
            out += [{"run": r["name"], "path": f"{r['name']}/checkpoints/{c['name']}", "what": "checkpoint",
                     "bytes": c["bytes"], "why": f"beyond the run's keep_last {keep_last}"}
                    for c in r["checkpoints"] if c["name"] not in kept]
        out += [{"run": r["name"], "path": f"{r['name']}/checkpoints/{x['name']}", "what": "leftover",
                 "bytes": x["bytes"], "why": "an interrupted checkpoint save"} for x in r["leftovers"]]
    return out


def open_lock(args):
    if not os.path.isdir(args["runs"]):
        return None
    try:
        return os.open(args["lock"], os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:
        return None


def prune(args):
    keep, older_than = int(args["keep"]), args.get("older_than")
    fd = open_lock(args) if args.get("act") else None
    held = None
    try:
        held = lock_state(fd) if fd is not None else None
        alive = current_alive(args) if held is None else None
        now, records = everything(args, alive)
        todo = plan(records, keep, older_than, now)
        removed = []
        for item in todo if args.get("act") else []:
            if held is None and fd is not None:
                held = lock_state(fd)  # the alive run ended: from now on we hold the lock
                if held is None and current_alive(args) == item["run"]:
                    continue  # a run of this name was started meanwhile: not ours to delete
            path = os.path.join(args["runs"], item["path"])
            doomed = os.path.join(os.path.dirname(path), f".prune-{os.path.basename(path)}-{os.getpid()}")
            try:
                os.rename(path, doomed)
            except OSError:
                continue
            shutil.rmtree(doomed, ignore_errors=True)
            if not os.path.exists(doomed):
                removed.append(item["path"])
        return {"now": now, "alive": alive, "runs": records, "plan": todo, "removed": removed, "lock": held}
    finally:
        if fd is not None:
            os.close(fd)


if __name__ == "__main__":
    verb, payload = sys.argv[1], json.loads(sys.argv[2])
    result = {"list": list_runs, "prune": prune}[verb](payload)
    sys.stdout.write(json.dumps(result) + "\n")
