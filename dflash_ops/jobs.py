"""Training runs in the container: the run directory, launch, stop and the "is a run alive" fact.

A run lives in `<paths.runs>/<name>/`:

    train.log        the training log (the script's own log file) + stderr + the wrapper's last line
    console.log      the process's stdout (the same log lines and anything printed)
    metrics.jsonl    written by the training script
    checkpoints/     written by the training script
    config.yaml      the resolved config (training script); config.given.yaml: the file as launched
    launch.json      argv, --set values, container, who/when; env: the environment (secrets masked)
    code_version     `tree <hash>` of the deploy manifest the run started with; code_manifest.json: a copy
    run.sh           the wrapper that ran it; pgid: its pid (= process group); pid: the training process
    started, ended   epoch seconds; exit_code: `0`, `N` or `signal N`, written when the process ends
    stopped          written by `invoke stop` (requested, then `term` or `kill` + time)

One run at a time per container: the wrapper holds an exclusive `flock` on `<paths.runs>/.lock`
for its whole life (and its children inherit it), so "a run is alive" is exactly "someone holds the
lock exclusively" (a shared probe fails), the kernel releases it however the run dies, and two
launches at the same moment cannot both get it. `<paths.runs>/.current` names the run that last
took it. A warm-up holds the lock shared: no run starts during it, and it starts during no run.
Anything else that must not overlap a run (clean-cache) can hold the lock exclusively meanwhile.

Every script here is a constant; user values reach it only as positional arguments.
"""

from __future__ import annotations

import datetime as _dt
import getpass
import json
import re
import socket
import sys
from dataclasses import dataclass
from typing import Sequence

from . import commands
from .errors import RemoteCommandFailed, RunStateError, UsageError
from .inventory import SECRET_NAME, Container

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SET_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
LOCK = ".lock"
CURRENT = ".current"
MANIFEST = ".dflash-manifest.json"  # written by deploy into paths.code
TRAIN_SCRIPT = "train_dflash.py"
WARMUP_SCRIPT_NAME = "warmup_compile.py"
LAUNCH_SETTLE_S = 2  # the process must still be alive this long after it started
EXIT_BUSY, EXIT_DIED, EXIT_NOT_DEPLOYED, EXIT_NO_CONFIG, EXIT_NO_RUN, EXIT_LEFTOVER = 75, 76, 77, 78, 3, 80

# Shell function shared by the scripts below: true while a process of run $2 holds the runs lock.
RUN_ALIVE_FN = r'''
run_alive() {
  [ "$(cat "$1/.current" 2>/dev/null)" = "$2" ] || return 1
  flock -n -s -E 99 "$1/.lock" true 2>/dev/null
  [ $? -eq 99 ]
}
'''

# $1 = runs dir. Prints the name of the alive run, or nothing.
ALIVE_RUN_SCRIPT = RUN_ALIVE_FN + r'''
name=$(cat "$1/.current" 2>/dev/null) || exit 0
if run_alive "$1" "$name"; then printf '%s\n' "$name"; fi
exit 0
'''

# The wrapper (run.sh): runs the training argv, records pid, exit code or signal. $1 = run dir.
WRAPPER_SCRIPT = r'''# dflash-ops run wrapper: $1 = run dir, then the training argv.
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

# One round trip: check the payload, take the lock (or report the alive run), record, detach, verify.
# $1 runs  $2 name  $3 config  $4 manifest  $5 settle seconds  $6 launch.json  $7 env text
# $8 wrapper text, then the training argv.
LAUNCH_SCRIPT = r'''
runs=$1 name=$2 config=$3 manifest=$4 settle=$5 launch=$6 envtext=$7 wrapper=$8
shift 8
dir=$runs/$name
for f in "$1" "$2"; do
  [ -e "$f" ] || { echo "dflash: $f is missing in the container" >&2; exit 77; }
done
[ -f "$config" ] || { echo "dflash: config $config not found in the container" >&2; exit 78; }
mkdir -p -- "$runs" || exit 79
exec 9>>"$runs/.lock"
if ! flock -w 2 9; then
  if flock -n -s "$runs/.lock" true; then echo "busy-warmup"; else echo "busy $(cat "$runs/.current" 2>/dev/null)"; fi
  exit 75
fi
mkdir -p -- "$dir" || exit 79
rm -f -- "$dir/exit_code" "$dir/stopped" "$dir/pid" "$dir/pgid" "$dir/ended"
# A full disk must not turn into an empty run.sh that "exits at once" without a word.
nospace() { echo "dflash: cannot write the run directory $dir ($(df -h --output=avail "$dir" | tail -n 1 | tr -d ' ') free): disk full? read docs/runbooks/disk-full.md" >&2; exit 79; }
printf '%s\n' "$launch" 2>/dev/null > "$dir/launch.json" || nospace
printf '%s\n' "$envtext" 2>/dev/null > "$dir/env" || nospace
cp -- "$config" "$dir/config.given.yaml" 2>/dev/null || nospace
if [ -f "$manifest" ]; then
  cp -- "$manifest" "$dir/code_manifest.json"
  tree=$(sed -n 's/^ *"tree": *"\([0-9a-f]*\)".*/\1/p' "$manifest")
  echo "tree ${tree:-unknown}"
else
  echo "unknown (no deploy manifest at $manifest)"
fi > "$dir/code_version"
printf '%s\n' "$wrapper" 2>/dev/null > "$dir/run.sh" || nospace
printf '%s\n' "$name" > "$runs/.current.tmp" && mv -f -- "$runs/.current.tmp" "$runs/.current"
echo "dflash-ops: launch $(date -u +%Y-%m-%dT%H:%M:%SZ) of run $name" >> "$dir/train.log"
setsid -f sh "$dir/run.sh" "$dir" "$@" </dev/null >>"$dir/train.log" 2>&1
i=0
while [ ! -s "$dir/pid" ] && [ "$i" -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
sleep "$settle"
if [ -s "$dir/exit_code" ] || [ ! -s "$dir/pid" ]; then
  echo "died $(cat "$dir/exit_code" 2>/dev/null)"
  tail -n 40 -- "$dir/train.log"
  exit 76
fi
echo "started $(cat "$dir/pid") $(cat "$dir/pgid") $(cat "$dir/code_version")"
'''

# $1 runs  $2 name ("" = the latest)  $3 grace in tenths of a second.
# SIGTERM to the group, wait, SIGKILL, confirm. Prints `<outcome> <name> <exit code>`.
STOP_SCRIPT = RUN_ALIVE_FN + r'''
runs=$1 name=$2 tenths=$3
[ -n "$name" ] || name=$(cat "$runs/.current" 2>/dev/null)
[ -n "$name" ] || { echo "dflash: no run yet under $runs" >&2; exit 3; }
dir=$runs/$name
[ -d "$dir" ] || { echo "dflash: no run named $name under $runs" >&2; exit 3; }
if ! run_alive "$runs" "$name"; then echo "notalive $name $(cat "$dir/exit_code" 2>/dev/null)"; exit 0; fi
pgid=$(cat "$dir/pgid" 2>/dev/null)
case $pgid in ''|*[!0-9]*) echo "dflash: run $name holds the lock but has no process group recorded" >&2; exit 81;; esac
echo "requested $(date +%s)" > "$dir/stopped"
how=term
kill -s TERM -- "-$pgid" 2>/dev/null
i=0
while kill -s 0 -- "-$pgid" 2>/dev/null && [ "$i" -lt "$tenths" ]; do sleep 0.1; i=$((i + 1)); done
if kill -s 0 -- "-$pgid" 2>/dev/null; then
  how=kill
  kill -s KILL -- "-$pgid" 2>/dev/null
  i=0
  while kill -s 0 -- "-$pgid" 2>/dev/null && [ "$i" -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
fi
if kill -s 0 -- "-$pgid" 2>/dev/null || ! flock -w 5 -s "$runs/.lock" true; then
  echo "left"
  ps -eo pid,pgid,args
  exit 80
fi
echo "$how $(date +%s)" > "$dir/stopped"
echo "$how $name $(cat "$dir/exit_code" 2>/dev/null)"
'''


# --- pure parts ------------------------------------------------------------------------------------

def validate_run_name(name: str) -> str:
    """A run name becomes a directory: letters, digits, '.', '_', '-', at most 64, no leading dot."""
    if not isinstance(name, str) or not RUN_NAME.match(name) or name.endswith("\n"):
        shown = repr(name)[:80]
        raise UsageError(f"--run {shown}: a run name is 1-64 characters of letters, digits, '.', '_' "
                         f"or '-', starting with a letter or digit")
    return name


def default_run_name(now: _dt.datetime | None = None) -> str:
    return (now or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y%m%d-%H%M%S")


def validate_sets(values: Sequence[str] | None) -> list[str]:
    """`--set key=value`: the key is a dotted config name; the value is passed literally."""
    out = []
    for value in values or ():
        key, sep, _ = str(value).partition("=")
        if not sep or not SET_KEY.match(key):
            raise UsageError(f"--set {str(value)[:60]!r}: expected key=value with a dotted key, e.g. train.lr=1e-4")
        out.append(value)  # NUL and non-UTF-8 are refused by the command builder
    return out


def config_path(ct: Container, config: str | None) -> str:
    """--config is a path in the container, relative to paths.code (default: the inventory's)."""
    config = config or ct.train_config
    if not config or "\n" in config or config.startswith("-"):
        raise UsageError(f"--config {config!r}: expected a config path such as configs/tiny-cpu.yaml")
    return config if config.startswith("/") else f"{ct.paths.code}/{config}"


def inventory_sets(ct: Container) -> list[str]:
    """What the inventory decides for every run: where the target is, the shared compile cache."""
    sets = [f"target.path={json.dumps(ct.paths.model)}",
            f"compile.cache_dir={json.dumps(ct.paths.caches.inductor)}"]
    if ct.paths.data:
        sets.append(f"data.train={json.dumps(ct.paths.data)}")
    return sets


def payload_argv(ct: Container, script: str, config: str | None = None, sets: Sequence[str] = (),
                 run_dir: str | None = None, max_steps: int | None = None) -> list[str]:
    """The argv of train_dflash.py / warmup_compile.py: same config, sets and devices for both.

    Options are written `--opt=value` so a value starting with '-' is never read as an option.
    """
    argv = [ct.venv_python, f"{ct.paths.code}/{script}", f"--config={config_path(ct, config)}"]
    argv += [f"--set={s}" for s in inventory_sets(ct) + validate_sets(sets)]
    for role in ("target", "drafter"):
        devices = ct.roles.devices(role)
        if devices:
            argv.append(f"--{role}-devices={devices}")
    if run_dir is not None:
        argv.append(f"--run-dir={run_dir}")
    if max_steps is not None:
        if int(max_steps) < 1:
            raise UsageError(f"--max-steps {max_steps}: must be >= 1")
        argv.append(f"--max-steps={int(max_steps)}")
    return argv


def masked_env_text(ct: Container, env: dict[str, str]) -> str:
    def secret(name):
        return name in ct.secret_env or SECRET_NAME.search(name)
    return "\n".join(f"{k}={commands.MASK if secret(k) and v else v}" for k, v in sorted(env.items()))


def run_dir(ct: Container, name: str) -> str:
    return f"{ct.paths.runs}/{validate_run_name(name)}"


def lock_path(ct: Container) -> str:
    """The runs lock: held by every process of the alive run. A cleaner may `flock -n` it to exclude launches."""
    return f"{ct.paths.runs}/{LOCK}"


@dataclass
class Launch:
    run: str
    run_dir: str
    argv: list
    pid: int | None = None
    pgid: int | None = None
    code_version: str = ""

    @property
    def log(self) -> str:
        return f"{self.run_dir}/train.log"


def launch_argv(ct: Container, name: str, config: str | None = None, sets: Sequence[str] = (),
                max_steps: int | None = None, settle: float = LAUNCH_SETTLE_S,
                now: _dt.datetime | None = None, launcher: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """(container argv of the launch script, training argv). Pure.

    `launcher`: a script and its options that the python runs instead, the training script's
    argv after them (multi-node training's torchrun: multinode.launcher_args)."""
    directory = run_dir(ct, name)
    train = payload_argv(ct, TRAIN_SCRIPT, config, sets, run_dir=directory, max_steps=max_steps)
    train[1:1] = list(launcher)
    record = {
        "run": name, "container": ct.ctid, "host": ct.host.name, "argv": train,
        "config": config_path(ct, config), "sets": list(sets), "inventory_sets": inventory_sets(ct),
        "max_steps": max_steps,
        "launched_at": (now or _dt.datetime.now(_dt.timezone.utc)).isoformat(timespec="seconds"),
        "launched_by": f"{getpass.getuser()}@{socket.gethostname()}",
    }
    launch_json = commands.mask(json.dumps(record, indent=1), ct.secret_values())
    argv = commands.sh_script(LAUNCH_SCRIPT, ct.paths.runs, name, config_path(ct, config),
                              f"{ct.paths.code}/{MANIFEST}", f"{settle:g}", launch_json,
                              masked_env_text(ct, ct.run_env()), WRAPPER_SCRIPT, *train)
    return argv, train


# --- remote operations -------------------------------------------------------------------------------

def launch(t, run: str | None = None, config: str | None = None, sets: Sequence[str] = (),
           max_steps: int | None = None, launcher: Sequence[str] = ()) -> Launch:
    """Start a detached training run (one round trip); refuse while another run is alive."""
    ct = t.container
    name = validate_run_name(run) if run is not None else default_run_name()
    argv, train = launch_argv(ct, name, config, sets, max_steps, launcher=launcher)
    result = t.session.exec(ct, argv, env=ct.run_env(), cwd=ct.paths.code, check=False)
    out = Launch(run=name, run_dir=run_dir(ct, name), argv=train)
    if t.dry_run:
        return out
    first = (result.stdout.strip().splitlines() or [""])[0]
    if result.exited == EXIT_BUSY and first == "busy-warmup":
        raise RunStateError(f"a warm-up is running on {ct.label}; start the run when it has finished")
    if result.exited == EXIT_BUSY:
        alive = first.partition(" ")[2] or "?"
        raise RunStateError(f"run {alive!r} is alive on {ct.label}: follow it with `invoke logs --follow`, "
                            f"or stop it with `invoke stop --run {alive}` before starting another")
    if result.exited == EXIT_DIED:
        tail = "\n".join(result.stdout.strip().splitlines()[1:][-15:])
        raise RemoteCommandFailed(f"run {name} on {ct.label} exited at once ({first.partition(' ')[2] or 'no exit code'}); "
                                  f"its log ends:\n{tail}", exited=result.exited, stderr_tail=tail)
    if result.exited in (EXIT_NOT_DEPLOYED, EXIT_NO_CONFIG):
        hint = "run `invoke deploy`" if result.exited == EXIT_NOT_DEPLOYED else "check --config (relative to paths.code)"
        raise RemoteCommandFailed(f"{ct.label}: {result.stderr.strip()}; {hint}", exited=result.exited)
    if result.exited != 0 or not first.startswith("started "):
        raise RemoteCommandFailed(f"{ct.label}: launch failed (exit {result.exited}): "
                                  f"{(result.stderr or result.stdout).strip()[-400:]}", exited=result.exited)
    fields = first.split(" ", 3)
    out.pid, out.pgid = int(fields[1]), int(fields[2])
    out.code_version = fields[3] if len(fields) > 3 else ""
    return out


@dataclass
class Stop:
    run: str
    outcome: str  # term | kill | notalive
    exit_code: str = ""


def resolve_run(t, run: str | None) -> str:
    """--run, or the container's latest run (one round trip only when --run is not given)."""
    if run is not None:
        return validate_run_name(run)
    ct = t.container
    if t.dry_run:
        t.session.exec(ct, ["cat", f"{ct.paths.runs}/{CURRENT}"], check=False)
        return "LATEST"
    r = t.session.exec(ct, ["cat", f"{ct.paths.runs}/{CURRENT}"], check=False)
    name = r.stdout.strip()
    if r.exited != 0 or not name:
        raise RunStateError(f"no run yet on {ct.label} (nothing under {ct.paths.runs}); start one with `invoke train`")
    return validate_run_name(name)


def stop(t, run: str | None = None, grace: float = 30) -> Stop:
    """SIGTERM the run's process group, SIGKILL after `grace` s, confirm nothing is left, record it.

    One round trip: the script resolves the latest run itself when `run` is None.
    """
    ct = t.container
    if float(grace) < 0:
        raise UsageError(f"--grace {grace}: must be >= 0 seconds")
    name = validate_run_name(run) if run is not None else ""
    argv = commands.sh_script(STOP_SCRIPT, ct.paths.runs, name, str(int(float(grace) * 10)))
    result = t.session.exec(ct, argv, check=False)
    if t.dry_run:
        return Stop(name or "(latest)", "dry-run")
    words = (result.stdout.strip().splitlines() or [""])[0].split(" ", 2)
    if result.exited == EXIT_NO_RUN:
        raise RunStateError(f"{ct.label}: {result.stderr.strip().removeprefix('dflash: ')}")
    if result.exited == EXIT_LEFTOVER:
        raise RunStateError(f"run {name or '(latest)'} on {ct.label}: processes are left after SIGKILL:\n"
                            f"{result.stdout.strip()}")
    if result.exited != 0 or words[0] not in ("term", "kill", "notalive") or len(words) < 2:
        raise RemoteCommandFailed(f"{ct.label}: stop failed (exit {result.exited}): "
                                  f"{(result.stderr or result.stdout).strip()[-300:]}", exited=result.exited)
    return Stop(words[1], words[0], words[2] if len(words) > 2 else "")


def alive_run_script() -> str:
    """Constant script: `sh -c SCRIPT sh <runs dir>` prints the alive run's name, or nothing."""
    return ALIVE_RUN_SCRIPT


def alive_run(t) -> str | None:
    """The name of the run alive in the target's container, or None (one round trip)."""
    ct = t.container
    r = t.session.exec(ct, commands.sh_script(ALIVE_RUN_SCRIPT, ct.paths.runs))
    return r.stdout.strip() or None


# --- warm-up ------------------------------------------------------------------------------------------

# $1 runs dir, then the warm-up argv. Holds the runs lock shared: no run starts meanwhile.
WARMUP_SCRIPT = r'''
runs=$1; shift
mkdir -p -- "$runs" || exit 79
exec 9>>"$runs/.lock"
if ! flock -n -s 9; then echo "busy $(cat "$runs/.current" 2>/dev/null)"; exit 75; fi
for f in "$1" "$2"; do
  [ -e "$f" ] || { echo "dflash: $f is missing in the container" >&2; exit 77; }
done
exec "$@"
'''


def warmup_argv(ct: Container, config: str | None = None, sets: Sequence[str] = ()) -> list[str]:
    """The warm-up: same config, --set values, devices, env and compile caches as `train`."""
    return commands.sh_script(WARMUP_SCRIPT, ct.paths.runs,
                              *payload_argv(ct, WARMUP_SCRIPT_NAME, config, sets))


SHAPE_DONE = re.compile(r"compile warm-up: shape \('(?P<kind>\w+)', (?P<worker>\d+)\) took (?P<s>[\d.]+) s")


class LineSink:
    """A file-like `out_stream` for the transport: hands each complete line of remote output to `line`.

    pty output ends lines with CR LF and progress bars redraw with CR: both are dropped.
    """

    out = None
    _partial = ""

    def write(self, data: str) -> int:
        self._partial += data.replace("\r", "")
        *complete, self._partial = self._partial.split("\n")
        for line in complete:
            self.line(line)
        return len(data)

    def flush(self) -> None:
        (self.out or sys.stdout).flush()

    def close(self) -> None:
        if self._partial:
            partial, self._partial = self._partial, ""
            self.line(partial)

    def line(self, line: str) -> None:
        raise NotImplementedError


class WarmupProgress(LineSink):
    """Streams the warm-up's output and adds one progress line per device as its shapes complete."""

    def __init__(self, devices: list, out=None):
        self.devices, self.out = devices, out
        self.lines: list[str] = []
        self.done: dict[str, list] = {}

    def line(self, line: str) -> None:
        out = self.out or sys.stdout
        self.lines = (self.lines + [line])[-400:]
        print(line, file=out, flush=True)
        m = SHAPE_DONE.search(line)
        if m:
            worker = int(m["worker"])
            device = f"drafter {worker} ({self.devices[worker] if worker < len(self.devices) else '?'})"
            self.done.setdefault(device, []).append((m["kind"], float(m["s"])))
            shapes = ", ".join(f"{k} {s:.1f} s" for k, s in self.done[device])
            total = sum(len(v) for v in self.done.values())
            print(f"[warmup] {device}: {shapes}  ({total}/{2 * len(self.devices)} shapes)", file=out, flush=True)

    def failure_tail(self, n: int = 15) -> str:
        self.close()
        starts = [i for i, line in enumerate(self.lines) if line.startswith("Traceback (most recent call last)")]
        kept = self.lines[starts[-1]:] if starts else self.lines
        return "\n".join([line for line in kept if line.strip()][-n:])


def warmup(t, config: str | None = None, sets: Sequence[str] = (), out=None) -> WarmupProgress:
    """Run warmup_compile.py in the container, streamed, over a pty (Ctrl-C stops it there)."""
    from . import signatures

    ct = t.container
    devices = [d for d in ct.roles.devices("drafter").split(",") if d]
    progress = WarmupProgress(devices=devices, out=out)
    result = t.session.exec(ct, warmup_argv(ct, config, sets), env=ct.run_env(), cwd=ct.paths.code,
                            check=False, pty=True, out_stream=progress)
    if t.dry_run or result.exited == 0:
        return progress
    if result.exited == 130:  # Ctrl-C reached the warm-up through the pty; it has stopped there
        raise KeyboardInterrupt
    first = progress.lines[0] if progress.lines else ""
    if result.exited == EXIT_BUSY and first.startswith("busy"):
        raise RunStateError(f"run {first[5:] or '?'} is alive on {ct.label}: warm up before starting a run, "
                            f"or stop it with `invoke stop`")
    if result.exited == EXIT_NOT_DEPLOYED:
        raise RemoteCommandFailed(f"{ct.label}: {progress.failure_tail(2)}; run `invoke deploy`", exited=result.exited)
    tail = progress.failure_tail()
    advice = "".join(f"\n{signatures.advice(sig)}" for sig, _ in signatures.scan(progress.lines))
    raise RemoteCommandFailed(f"warm-up failed on {ct.label} (exit {result.exited}); the output ends:\n{tail}{advice}",
                              exited=result.exited, stderr_tail=tail)
