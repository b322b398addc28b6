"""Every run under paths.runs, and pruning old ones, in the container (`invoke runs`, `invoke prune`).

Shipped after prelude.py (stdlib only, Python >= 3.8): one verb and one JSON object in, the
prelude's one answer out. Parsing and display live on the local side (dflash_ops.history).

    list   {"runs", "stall_after"} -> {"now", "alive", "runs": [record...], "unparsed"}
    prune  {... , "keep", "older_than", "act"} -> {"now", "alive", "runs", "plan": [...], "removed", "lock",
                                                    "unparsed"}
    pin    {"runs", "run", "pin": bool} -> the list's answer, once `<run>/pinned` is made (or removed)

A run is alive while its processes hold `<runs>/.lock`; its state is the prelude's run_state, the
same as `invoke status` says. Which run prune keeps as the alive one is read from the lock's holders
(prelude.lock_holder_run), not from `.current`, which anyone in the container may write; a lock held
by no run it can name ("?": a launch starting) removes nothing. `prune` never touches the alive
run, keeps the `keep` newest runs, and of those it removes only checkpoints beyond the run's own
`train.keep_last` (never the one `checkpoints/latest` names) and leftovers of interrupted saves; a
pinned run (`<run>/pinned`, `invoke runs --pin NAME`) is never touched, like the alive one.
While it deletes it holds the runs lock, so no run can start (or resume) under it; while a run is
alive that run holds the lock, which excludes launches just as well, and prune takes the lock the
moment the run ends. Each directory is renamed out of view before it is deleted, and only when no
component of its path under the runs dir is a symlink (a `checkpoints` link out of the runs dir is
never followed). Entries of the runs dir that are not runs are listed in `unparsed`, never touched.
"""

import os
import re
import shutil
import time

from dflash_ops.remote.prelude import (
    Refused,
    check_deadline,
    last_record,
    lock_holder_run,
    number,
    read_segments,
    read_spec,
    read_text,
    resolve_run,
    runs_lock,
    serve,
    state_of_run,
)

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
STEP_DIR = re.compile(r"^step-(\d+)$")
LEFTOVER = re.compile(r"^\.(?:tmp-step-\d+-\d+|del-step-\d+-\d+)$")  # interrupted checkpoint saves/deletes
PIN_FILE = "pinned"  # in a run's directory: prune never touches the run
KEEP_LAST = re.compile(r"^\s+keep_last:\s*(\d+)\s*$")


def read(path, limit=300):
    text = read_text(path, limit)
    return text.strip() if text is not None else None


def disk_usage(path):
    """Bytes on disk under path (allocated blocks, each inode once, symlinks not followed)."""
    total, seen = 0, set()
    for folder, dirs, files in os.walk(path):
        check_deadline(f"measuring {path}")
        for name in dirs + files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def keep_last_of(run_dir):
    """`train.keep_last` from the run's resolved config.yaml (a flat YAML the trainer writes), or None."""
    section = None
    for line in (read_text(os.path.join(run_dir, "config.yaml"), 1 << 20) or "").split("\n"):
        if line[:1].isalpha():
            section = line.split(":")[0]
        elif section == "train" and KEEP_LAST.match(line):
            return int(KEEP_LAST.match(line).group(1))
    return None


def checkpoints_of(run_dir):
    root = os.path.join(run_dir, "checkpoints")
    if os.path.islink(root) or not os.path.isdir(root):
        return None, [], []  # a link is not the run's own directory: nothing in it is the run's
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


def run_record(runs, name, now, stall_after, holder):
    run_dir = os.path.join(runs, name)
    state = state_of_run(runs, name, run_dir, now, stall_after, holder)
    started, ended = number(state["files"].get("started")), number(state["files"].get("ended"))
    last_activity = state["last_activity"]
    if last_activity is None:
        last_activity = int(os.lstat(run_dir).st_mtime)
    alive = state["alive"]
    train = last_record(os.path.join(run_dir, "metrics.jsonl"))
    latest, steps, leftovers = checkpoints_of(run_dir)
    return {
        "name": name, "state": state["state"], "detail": state["detail"], "alive": alive,
        "step": train.get("step"), "loss": train.get("loss"),
        "acceptance_length": train.get("acceptance_length"),
        "started": started, "ended": ended, "last_activity": last_activity,
        "duration_s": ((ended if ended and not alive else now) - started) if started else None,
        "exit_code": state["files"].get("exit_code"), "bytes": disk_usage(run_dir),
        "latest_checkpoint": latest, "checkpoints": steps, "leftovers": leftovers,
        "keep_last": keep_last_of(run_dir), "spec": read_spec(run_dir),
        "pinned": os.path.isfile(os.path.join(run_dir, PIN_FILE)),
    }


def everything(args, alive):
    """(now, run records newest first, entries that are not runs: at most 100 names). `alive`: the run
    the lock's holders name, the one marked alive."""
    runs, now = args["runs"], int(time.time())
    try:
        entries = sorted(os.listdir(runs))
    except OSError:
        entries = []
    names, unparsed = [], []
    for n in entries:
        path = os.path.join(runs, n)
        if RUN_NAME.match(n) and os.path.isdir(path) and not os.path.islink(path):
            names.append(n)
        elif not n.startswith("."):  # .lock, .current, prune's and launch's own
            unparsed.append(n[:200])
    records = [run_record(runs, n, now, float(args.get("stall_after", 600)), alive) for n in names]
    records.sort(key=lambda r: (r["started"] or r["last_activity"], r["name"]), reverse=True)  # newest first
    return now, records, unparsed[:100]


def own_path(runs, rel):
    """Whether every component of `rel` under `runs` is a real directory entry, not a symlink."""
    path = runs
    for part in rel.split("/"):
        path = os.path.join(path, part)
        if part in ("", ".", "..") or os.path.islink(path):
            return False
    return True


def list_runs(args):
    alive = lock_holder_run(args["runs"])
    now, records, unparsed = everything(args, alive)
    return {"now": now, "alive": alive, "runs": records, "unparsed": unparsed}


def plan(records, keep, older_than, now):
    """What prune removes, newest run first: [{"run", "path" (relative to runs), "what", "bytes", "why"}]."""
    out = []
    for rank, r in enumerate(records):
        if r["alive"] or r["pinned"]:
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


def take_lock(runs):
    """(fd, "exclusive" | "shared") holding the runs lock (shared: a warm-up holds it too, which also
    keeps launches out), or (None, None) while a run holds it or there is no runs directory."""
    if not os.path.isdir(runs):
        return None, None
    for how, shared in (("exclusive", False), ("shared", True)):
        fd = runs_lock(runs, shared=shared)
        if fd is not None:
            return fd, how
    return None, None


def prune(args):
    keep, older_than, runs = int(args["keep"]), args.get("older_than"), args["runs"]
    fd, held = take_lock(runs) if args.get("act") else (None, None)
    try:
        alive = lock_holder_run(runs) if held is None else None
        now, records, unparsed = everything(args, alive)
        todo = plan(records, keep, older_than, now)
        removed = []
        for item in todo if args.get("act") else []:
            if held is None:
                fd, held = take_lock(runs)  # the alive run ended: from now on we hold the lock
                if held is None and lock_holder_run(runs) in (item["run"], "?"):
                    continue  # this run is alive (started meanwhile), or we cannot tell which is
            if not own_path(runs, item["path"]):
                continue
            path = os.path.join(runs, item["path"])
            doomed = os.path.join(os.path.dirname(path), f".prune-{os.path.basename(path)}-{os.getpid()}")
            try:
                os.rename(path, doomed)
            except OSError:
                continue
            shutil.rmtree(doomed, ignore_errors=True)
            if not os.path.exists(doomed):
                removed.append(item["path"])
        return {"now": now, "alive": alive, "runs": records, "plan": todo, "removed": removed, "lock": held,
                "unparsed": unparsed}
    finally:
        if fd is not None:
            os.close(fd)


def pin(args):
    """Pin (or unpin) one run: `<run>/pinned` made or removed; then the list."""
    runs, name = args["runs"], args["run"]
    run_dir = os.path.join(runs, name)
    if not RUN_NAME.match(name) or not os.path.isdir(run_dir) or os.path.islink(run_dir):
        resolve_run(runs, name)  # the no-run refusal, with the runs there are
        raise Refused("no-run", f"no run {name!r} in {runs}", name=name[:200], runs=[])
    marker = os.path.join(run_dir, PIN_FILE)
    before = os.lstat(run_dir)  # a run without start records is dated by its directory's mtime: kept
    if args.get("pin", True):
        with open(marker, "w") as f:
            f.write(f"{int(time.time())}\n")
    elif os.path.lexists(marker):
        os.unlink(marker)
    os.utime(run_dir, ns=(before.st_atime_ns, before.st_mtime_ns))
    return list_runs(args)


def segments(args):
    """`invoke runs --history NAME`: run `run`'s segments (prelude.read_segments), oldest first, its
    state, and the running segment's last logged step so far."""
    runs, name = args["runs"], args["run"]
    run_dir = os.path.join(runs, name)
    if not RUN_NAME.match(name) or not os.path.isdir(run_dir) or os.path.islink(run_dir):
        raise Refused("no-run", f"no run {name!r} in {runs}: `invoke runs` lists them")
    now = int(time.time())
    state = state_of_run(runs, name, run_dir, now, float(args.get("stall_after", 600)))
    found = read_segments(run_dir)
    if found and found[-1]["end"] is None:
        last = last_record(os.path.join(run_dir, "metrics.jsonl"), since=found[-1]["metrics_offset"])
        found[-1]["last_step"] = last.get("step") if isinstance(last.get("step"), int) else None
    return {"run": name, "now": now, "state": state["state"], "detail": state["detail"],
            "alive": state["alive"], "segments": found}


VERBS = {"list": list_runs, "prune": prune, "pin": pin, "segments": segments}


if __name__ == "__main__":
    serve(VERBS)
