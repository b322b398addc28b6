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

One run at a time per container: the run's processes hold an exclusive `flock` on
`<paths.runs>/.lock` for their whole life (the launch takes it and hands it to the wrapper), so "a
run is alive" is exactly "someone holds the lock exclusively", the kernel releases it however the
run dies, and two launches at the same moment cannot both get it. `<paths.runs>/.current` names the
run that last took it. A warm-up holds the lock shared: no run starts during it, and it starts
during no run. Anything else that must not overlap a run (clean-cache) holds it exclusively meanwhile.

The container side of all this is container_runs.py (launch, wait, stop, warmup verbs): this module
builds their JSON arguments (pure) and turns their JSON answers into results or one-line errors.
"""

from __future__ import annotations

import datetime as _dt
import getpass
import json
import re
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from . import commands, facts, signatures, terminal
from .errors import PreflightFailed, RemoteCommandFailed, RunStateError, UsageError
from .inventory import SECRET_NAME, Container

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SET_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
LOCK = ".lock"
CURRENT = ".current"
MANIFEST = ".dflash-manifest.json"  # written by deploy into paths.code
TRAIN_SCRIPT = "train_dflash.py"
WARMUP_SCRIPT_NAME = "warmup_compile.py"
PREFLIGHT_SCRIPT = "preflight.py"
LAUNCH_SETTLE_S = 2  # the process must still be alive this long after it started
FINISHED_CHECKS = ("finished", "max_steps")  # the preflight's "this run already reached its last step"
DEFAULT_WAIT_S = 900  # `train` waits this long for the first step (a cold 27B start takes minutes)


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
            raise UsageError(f"--set {str(value)[:60]!r}: expected key=value with a dotted key, e.g. "
                             "train.lr=1e-4")
        if not commands.is_utf8(str(value)):
            raise UsageError(f"--set {str(value)[:60]!r}: the value is not valid UTF-8")
        out.append(value)  # NUL is refused by the command builder
    return out


def config_path(ct: Container, config: str | None) -> str:
    """--config is a path in the container, relative to paths.code (default: the inventory's)."""
    config = config or ct.train_config
    if not config or "\n" in config or config.startswith("-") or not commands.is_utf8(config):
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
    """The runs lock: held by every process of the alive run. A cleaner may `flock -n` it
    to exclude launches."""
    return f"{ct.paths.runs}/{LOCK}"


@dataclass
class Launch:
    run: str
    run_dir: str
    argv: list
    pid: int | None = None
    pgid: int | None = None
    code_version: str = ""
    where: str = ""            # the container's label
    ctid: int | None = None
    log_offset: int = 0  # train.log's size before this launch: the wait reads from here
    verdict: dict = field(default_factory=dict)  # the wait's: outcome step | timeout | interrupted

    @property
    def log(self) -> str:
        return f"{self.run_dir}/train.log"

    def describe(self) -> str:
        outcome = self.verdict.get("outcome")
        if outcome == "interrupted":
            said = f"stopped waiting; run {self.run} goes on on {self.where} (pid {self.pid})"
        else:
            said = f"run {self.run} started on {self.where}: pid {self.pid}, code {self.code_version}"
            if outcome == "timeout":
                said += (f"; no step yet after {self.verdict.get('waited', 0):g} s, "
                         + ("its target and drafters are built" if self.verdict.get("ready")
                            else "still starting"))
        return (f"{said}\nlog: {self.log} (in the container)\n"
                f"follow it: invoke logs --follow --run {self.run} --ct {self.ctid}")

    def row(self) -> str:
        return f"run {self.run}: pid {self.pid}, code {self.code_version}"


def _shown_name(value) -> str:
    """A run name from the container, for a message: itself when valid, else '?'."""
    return value if isinstance(value, str) and RUN_NAME.match(value) else "?"


def launch_argv(ct: Container, name: str, config: str | None = None, sets: Sequence[str] = (),
                max_steps: int | None = None, settle: float = LAUNCH_SETTLE_S,
                now: _dt.datetime | None = None, launcher: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """(container argv of the `launch` verb, training argv). Pure.

    `launcher`: a script and its options that the python runs instead, the training script's
    argv after them (multi-node training's torchrun: multinode.launcher_args)."""
    directory = run_dir(ct, name)
    train = payload_argv(ct, TRAIN_SCRIPT, config, sets, run_dir=directory, max_steps=max_steps)
    preflight = [ct.venv_python, f"{ct.paths.code}/{PREFLIGHT_SCRIPT}", *train[2:]]
    train[1:1] = list(launcher)
    record = {
        "run": name, "container": ct.ctid, "host": ct.host.name, "argv": train,
        "config": config_path(ct, config), "sets": list(sets), "inventory_sets": inventory_sets(ct),
        "max_steps": max_steps,
        "launched_at": (now or _dt.datetime.now(_dt.timezone.utc)).isoformat(timespec="seconds"),
        "launched_by": f"{getpass.getuser()}@{socket.gethostname()}",
    }
    payload = {
        "runs": ct.paths.runs, "name": name, "config": config_path(ct, config), "argv": train,
        "required": [ct.venv_python, f"{ct.paths.code}/{TRAIN_SCRIPT}"], "preflight": preflight,
        "manifest": f"{ct.paths.code}/{MANIFEST}", "settle": settle, "cwd": ct.paths.code,
        "launch": commands.mask(json.dumps(record, indent=1), ct.secret_values()),
        "env": masked_env_text(ct, ct.run_env()),
    }
    return facts.runs_argv(ct, "launch", payload), train


# --- remote operations -------------------------------------------------------------------------------

def launch(t, run: str | None = None, config: str | None = None, sets: Sequence[str] = (),
           max_steps: int | None = None, launcher: Sequence[str] = ()) -> Launch:
    """Preflight, then start a detached training run (one round trip); refuse while another run is alive."""
    ct = t.container
    name = validate_run_name(run) if run is not None else default_run_name()
    argv, train = launch_argv(ct, name, config, sets, max_steps, launcher=launcher)
    result = t.session.exec(ct, argv, env=ct.run_env(), cwd=ct.paths.code)
    out = Launch(run=name, run_dir=run_dir(ct, name), argv=train, where=ct.label, ctid=ct.ctid)
    if t.dry_run:
        return out
    answer = facts.parse_json_line(result.stdout, f"{ct.label}: launch")
    refused(ct, answer, "launch")
    if answer.get("outcome") == "died":
        log = answer.get("log") if isinstance(answer.get("log"), list) else []
        raise crashed(name, ct.label, answer.get("exit_code"),
                      [line for line in log if isinstance(line, str)])
    if answer.get("outcome") != "started":
        raise RemoteCommandFailed(f"{ct.label}: launch failed: unexpected answer "
                                  f"{result.stdout.strip()[-200:]!r}")
    out.pid, out.pgid = _int(answer.get("pid")), _int(answer.get("pgid"))
    out.code_version = terminal.visible(str(answer.get("code_version") or ""))[:200]
    out.log_offset = _int(answer.get("log_offset")) or 0
    return out


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def refused(ct: Container, answer: dict, what: str) -> None:
    """A verb's refusal -> the error a user reads (one line, naming what to do)."""
    kind = answer.get("error")
    if not kind:
        return
    message = terminal.visible(str(answer.get("message") or ""))[:400]
    if kind == "busy-warmup":
        raise RunStateError(f"a warm-up is running on {ct.label}; start the run when it has finished")
    if kind == "busy":
        alive = _shown_name(answer.get("run"))
        raise RunStateError(f"run {alive!r} is alive on {ct.label}: follow it with `invoke logs --follow`, "
                            f"or stop it with `invoke stop --run {alive}` before starting another")
    if kind == "no-run":
        raise RunStateError(f"{ct.label}: {message}")
    if kind == "not-deployed":
        raise RemoteCommandFailed(f"{ct.label}: {message}; run `invoke deploy`")
    if kind == "no-config":
        raise RemoteCommandFailed(f"{ct.label}: {message}; check --config (relative to paths.code)")
    if kind == "preflight":
        check = terminal.visible(str(answer.get("check") or "?"))[:80]
        fix = terminal.visible(str(answer.get("fix") or ""))[:400]
        if check in FINISHED_CHECKS:  # its message says what to give
            raise RunStateError(f"{ct.label}: {message}")
        raise PreflightFailed(f"{ct.label}: preflight {check}: {message}" + (f"; {fix}" if fix else "")
                              + "; nothing was launched")
    if kind in ("disk-full", "cannot-write"):
        raise RemoteCommandFailed(f"{ct.label}: {what} failed: dflash: {message}")
    raise RemoteCommandFailed(f"{ct.label}: {what} failed ({terminal.visible(str(kind))[:40]}): {message}")


@dataclass
class Stop:
    run: str
    outcome: str  # term | kill | notalive
    exit_code: str = ""
    where: str = ""    # the container's label
    grace: float = 30

    def describe(self) -> str:
        return self._says(f"run {self.run} on {self.where}")

    def row(self) -> str:
        return self._says(f"run {self.run}")

    def _says(self, run: str) -> str:
        code = self.exit_code or "none"
        if self.outcome == "notalive":
            return f"{run} is not running (exit code: {code})"
        how = "SIGTERM" if self.outcome == "term" else f"SIGKILL after {self.grace:g} s"
        return f"{run} stopped ({how}, exit code: {code}); no process left"


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
        raise RunStateError(f"no run yet on {ct.label} (nothing under {ct.paths.runs}); start one with "
                            "`invoke train`")
    return validate_run_name(name)


def stop(t, run: str | None = None, grace: float = 30) -> Stop:
    """SIGTERM the run's process group, SIGKILL after `grace` s, confirm nothing is left, record it.

    One round trip; the container resolves the latest run itself when `run` is None, and signals a
    group only once it has proven it is this run's wrapper (container_runs.prove_group).
    """
    ct = t.container
    if float(grace) < 0:
        raise UsageError(f"--grace {grace}: must be >= 0 seconds")
    name = validate_run_name(run) if run is not None else None
    line = facts.runs_line(ct, "stop", {"runs": ct.paths.runs, "name": name, "grace": float(grace)})
    result = t.session.run_in(ct, line)
    if t.dry_run:
        return Stop(name or "(latest)", "dry-run")
    answer = facts.parse_json_line(result.stdout, f"{ct.label}: stop")
    shown = _shown_name(answer.get("run") or name)
    if answer.get("error") == "unproven":
        raise RunStateError(f"run {shown} on {ct.label}: not signalled: "
                            f"{terminal.visible(str(answer.get('message')))[:300]}; look with "
                            "`invoke status`")
    refused(ct, answer, "stop")
    outcome = answer.get("outcome")
    if outcome == "left":
        listing = "\n".join(terminal.visible(p) for p in answer.get("processes") or [] if isinstance(p, str))
        raise RunStateError(f"run {shown} on {ct.label}: processes are left after SIGKILL:\n{listing}")
    if outcome not in ("term", "kill", "notalive"):
        raise RemoteCommandFailed(f"{ct.label}: stop failed: unexpected answer "
                                  f"{result.stdout.strip()[-200:]!r}")
    code = answer.get("exit_code")
    return Stop(shown, outcome, terminal.visible(code)[:40] if isinstance(code, str) else "", ct.label,
                float(grace))


# --- the launch's first steps ---------------------------------------------------------------------------

class LaunchWatch:
    """The `wait` verb's JSON lines -> the log lines shown under a progress line, and the verdict."""

    def __init__(self, run: str, label: str, timeout: float, console=None):
        self.run, self.label, self.timeout = run, label, timeout
        self.console = console or terminal.console(stderr=False)
        self.lines: list[str] = []
        self.verdict: dict = {}
        self.started = time.monotonic()
        self.status = None
        self._partial = ""

    def __enter__(self):
        self.status = self.console.status(self._text(""), spinner="dots")
        self.status.__enter__()
        return self

    def __exit__(self, *exc):
        self.status.__exit__(*exc)

    def _text(self, last: str) -> str:
        waited = time.monotonic() - self.started
        return (f"waiting for run {self.run} on {self.label} to log its first training step "
                f"(a `step N/M |` line in train.log; {waited:.0f} s of {self.timeout:g} s)"
                + (f": {terminal.markup(last[:80])}" if last else ""))

    # a file-like out_stream for the transport
    def write(self, data: str) -> int:
        self._partial += data
        *complete, self._partial = self._partial.split("\n")
        for raw in complete:
            self.record(raw.rstrip("\r"))
        return len(data)

    def flush(self) -> None:
        pass

    def record(self, raw: str) -> None:
        try:
            item = json.loads(raw) if raw.strip() else None
        except (ValueError, RecursionError):
            item = None
        if not isinstance(item, dict):
            return  # the pty's echo of ^C, or noise
        line = item.get("line")
        if "outcome" in item or "error" in item:
            self.verdict = item
        elif isinstance(line, str):
            self.lines = (self.lines + [line])[-400:]
            self.console.print(terminal.markup(line), highlight=False, soft_wrap=True)
            if self.status is not None:
                self.status.update(self._text(line))


def why_it_failed(lines: list[str], nothing: str = "(no output)") -> str:
    """A failed process's output -> `<its last error line>; <the runbook>`, visible, on one line."""
    from .status import last_error_line

    last = last_error_line(lines) or nothing
    found = signatures.scan(lines)
    hint = signatures.advice(found[-1][0]) if found else "read docs/runbooks/README.md"
    return f"{terminal.visible(last)[:300]}; {hint}"


def crashed(run: str, label: str, exit_code, lines: list[str]) -> RemoteCommandFailed:
    """A run that died before its first step: one line with its last error line and the runbook."""
    from .status import describe_exit

    code = terminal.visible(exit_code)[:40] if isinstance(exit_code, str) else None
    return RemoteCommandFailed(f"run {run} on {label} crashed ({describe_exit(code)}): "
                               f"{why_it_failed(lines, '(the log has no line since the launch)')}")


def wait_until_going(t, launched: Launch, timeout: float = DEFAULT_WAIT_S, console=None) -> dict:
    """Stream the run's log until its first step line; raise if it dies meanwhile.

    Ctrl-C ends the wait only: the run is in its own session in the container, the waiter is not
    its parent. Returns the verdict: {"outcome": "step"|"timeout"|"interrupted", "line": ..., "ready": ...}.
    """
    ct = t.container
    payload = {"runs": ct.paths.runs, "name": launched.run, "offset": launched.log_offset,
               "timeout": float(timeout)}
    watch = LaunchWatch(launched.run, ct.label, float(timeout), console)
    with watch:
        result = t.session.run_in(ct, facts.runs_line(ct, "wait", payload), check=False, pty=True,
                                  out_stream=watch)
    if t.dry_run:
        return {"outcome": "dry-run"}
    verdict = dict(watch.verdict, waited=float(timeout))
    if result.exited == 130 or verdict.get("outcome") == "interrupted":
        return {"outcome": "interrupted"}
    refused(ct, verdict, "waiting for the run")
    if verdict.get("outcome") == "crashed":
        raise crashed(launched.run, ct.label, verdict.get("exit_code"), watch.lines)
    if verdict.get("outcome") not in ("step", "timeout"):
        raise RemoteCommandFailed(f"{ct.label}: waiting for run {launched.run} ended without a verdict "
                                  f"(exit {result.exited}); check it with `invoke status`")
    return verdict


# --- warm-up ------------------------------------------------------------------------------------------

def warmup_argv(ct: Container, config: str | None = None, sets: Sequence[str] = ()) -> list[str]:
    """The warm-up: same config, --set values, devices, env and compile caches as `train`.

    container_runs.py's `warmup` verb takes the runs lock shared, then becomes the warm-up (exec)."""
    return facts.runs_argv(ct, "warmup", {"runs": ct.paths.runs,
                                          "argv": payload_argv(ct, WARMUP_SCRIPT_NAME, config, sets)})


SHAPE_DONE = re.compile(r"compile warm-up: shape \('(?P<kind>\w+)', (?P<worker>\d+)\) took (?P<s>[\d.]+) s")


class LineSink:
    """A file-like `out_stream` for the transport: hands each complete line of remote output to `line`.

    pty output ends lines with CR LF and progress bars redraw with CR: both are dropped. A line is
    kept in pieces until its end comes and joined once: linear in its length (appending to one string
    and splitting it again at every read was quadratic, 281 s for a 16 MiB line).
    """

    out = None

    def write(self, data: str) -> int:
        pieces = self.__dict__.setdefault("_pieces", [])
        *complete, rest = data.replace("\r", "").split("\n")
        if complete:
            pieces.append(complete[0])
            complete[0] = "".join(pieces)
            pieces.clear()
            for line in complete:
                self.line(line)
        if rest:
            pieces.append(rest)
        return len(data)

    def flush(self) -> None:
        (self.out or sys.stdout).flush()

    def close(self) -> None:
        pieces = self.__dict__.setdefault("_pieces", [])
        if pieces:
            partial = "".join(pieces)
            pieces.clear()
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
        print(terminal.visible(line), file=out, flush=True)
        m = SHAPE_DONE.search(line)
        if m:
            worker = int(m["worker"])
            device = f"drafter {worker} ({self.devices[worker] if worker < len(self.devices) else '?'})"
            self.done.setdefault(device, []).append((m["kind"], float(m["s"])))
            shapes = ", ".join(f"{k} {s:.1f} s" for k, s in self.done[device])
            total = sum(len(v) for v in self.done.values())
            print(f"[warmup] {device}: {shapes}  ({total}/{2 * len(self.devices)} shapes)", file=out,
                  flush=True)


def refusal(lines: list[str]) -> dict:
    """The warmup verb's refusal: its one JSON line, printed before it would become the warm-up."""
    try:
        answer = json.loads(lines[0]) if len(lines) == 1 else None
    except (ValueError, RecursionError):
        answer = None
    return answer if isinstance(answer, dict) and "error" in answer else {}


def warmup(t, config: str | None = None, sets: Sequence[str] = (), out=None) -> WarmupProgress:
    """Run warmup_compile.py in the container, streamed, over a pty (Ctrl-C stops it there)."""
    ct = t.container
    devices = [d for d in ct.roles.devices("drafter").split(",") if d]
    progress = WarmupProgress(devices=devices, out=out)
    result = t.session.exec(ct, warmup_argv(ct, config, sets), env=ct.run_env(), cwd=ct.paths.code,
                            check=False, pty=True, out_stream=progress)
    if t.dry_run or (result.exited == 0 and not refusal(progress.lines)):
        return progress
    if result.exited == 130:  # Ctrl-C reached the warm-up through the pty; it has stopped there
        raise KeyboardInterrupt
    answer = refusal(progress.lines)
    if answer.get("error") == "busy":
        raise RunStateError(f"run {_shown_name(answer.get('run'))} is alive on {ct.label}: warm up before "
                            f"starting a run, or stop it with `invoke stop`")
    refused(ct, answer, "warm-up")
    progress.close()
    # Its output was streamed above: the error is one line, as a launch that crashes says it.
    raise RemoteCommandFailed(f"warm-up failed on {ct.label} (exit {result.exited}): "
                              f"{why_it_failed(progress.lines)}",
                              exited=result.exited)
