"""Training runs in the container: launch (one node or many), the wait for the first step, warm-up, stop.

A run lives in `<paths.runs>/<name>/`:

    train.log        the training log (the script's own log file) + stderr + the wrapper's last line
    console.log      the process's stdout (the same log lines and anything printed)
    metrics.jsonl    written by the training script
    checkpoints/     written by the training script
    config.yaml      the resolved config (training script); config.given.yaml: the file as launched
    launch.json      the run's spec: config, every --set, --max-steps, devices, code version; argv,
                     container, who/when (its last launch's); env: the environment (secrets masked)
    code_version     `tree <hash>` of the deploy manifest the run started with; code_manifest.json: a copy
    run.sh           the wrapper that ran it; pgid: its pid (= process group); pid: the training process
    started, ended   epoch seconds; exit_code: `0`, `N` or `signal N`, written when the process ends
    stopped          written by `invoke stop` (requested, then `term` or `kill` + time)
    segments.jsonl   each launch, resume and automatic restart: start, end, exit, steps (`runs --history`)

One run at a time per container: the run's processes hold an exclusive `flock` on
`<paths.runs>/.lock` for their whole life (the launch takes it and hands it to the wrapper), so "a
run is alive" is exactly "someone holds the lock exclusively", the kernel releases it however the
run dies, and two launches at the same moment cannot both get it. `<paths.runs>/.current` names the
run that last took it. A warm-up holds the lock shared: no run starts during it, and it starts
during no run. Anything else that must not overlap a run (clean-cache) holds it exclusively meanwhile.

The container side of all this is remote/runs.py (launch, wait, stop, warmup verbs): this module
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

from . import commands, fanout, terminal
from .errors import PreflightFailed, RemoteCommandFailed, RunStateError, UsageError
from .inventory import SECRET_NAME, Container
from .payload import config_path, inventory_sets, payload_argv, validate_sets
from .remote import ship
from .remote.prelude import LOG_FILE, MANIFEST  # the container side's names, one definition
from .runs import (
    check_max_restarts,
    default_run_name,
    describe_exit,
    restart_policy,
    run_dir,
    shown_name,
    validate_run_name,
    why_it_failed,
)
from .target import Target

LAUNCH_TIMEOUT_S = 600.0  # the launch verb: the preflight (up to 300 s), the settle, the answer
STOP_TIMEOUT_S = 60.0     # the stop verb beyond the grace: SIGKILL, the lock's release, the answer
SPEC_TIMEOUT_S = 60.0     # the spec verb: launch.json and the deploy manifest read
WAIT_OUTPUT_CAP = 64 << 20  # the wait verb streams the log until the first step: a few MiB at most
TRAIN_SCRIPT = "train_dflash.py"
WARMUP_SCRIPT_NAME = "warmup_compile.py"
PREFLIGHT_SCRIPT = "preflight.py"
LAUNCH_SETTLE_S = 2  # the process must still be alive this long after it started
FINISHED_CHECKS = ("finished", "max_steps")  # the preflight's "this run already reached its last step"
DEFAULT_WAIT_S = 900  # `train` waits this long for the first step (a cold 27B start takes minutes)


# --- pure parts ------------------------------------------------------------------------------------

def masked_env_text(ct: Container, env: dict[str, str]) -> str:
    def secret(name):
        return name in ct.secret_env or SECRET_NAME.search(name)
    return "\n".join(f"{k}={commands.MASK if secret(k) and v else v}" for k, v in sorted(env.items()))


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
        return f"{self.run_dir}/{LOG_FILE}"

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

    def facts(self) -> dict:
        return {"run": self.run, "container": self.where, "run_dir": self.run_dir, "pid": self.pid,
                "pgid": self.pgid, "code_version": self.code_version, "log": self.log,
                "wait": self.verdict}

    def row(self) -> str:
        return f"run {self.run}: pid {self.pid}, code {self.code_version}"


def launch_argv(ct: Container, name: str, config: str | None = None, sets: Sequence[str] = (),
                max_steps: int | None = None, settle: float = LAUNCH_SETTLE_S,
                now: _dt.datetime | None = None, launcher: Sequence[str] = (),
                allow_change: bool = False, max_restarts: int | None = None) -> tuple[list[str], list[str]]:
    """(container argv of the `launch` verb, training argv). Pure.

    `launcher`: a script and its options that the python runs instead, the training script's
    argv after them (multi-node training's torchrun: launcher_args). `allow_change`: the preflight
    lets a run with checkpoints resume on other data or another target. `max_restarts`: how many
    times in a row the run's wrapper relaunches it after a transient crash (runs.restart_policy;
    the wrapper calls the `ended` verb, `hook`, whenever the training process ends)."""
    directory = run_dir(ct, name)
    train = payload_argv(ct, TRAIN_SCRIPT, config, sets, run_dir=directory, max_steps=max_steps)
    preflight = [ct.venv_python, f"{ct.paths.code}/{PREFLIGHT_SCRIPT}", *train[2:]]
    if allow_change:
        preflight.append("--allow-change")
    train[1:1] = list(launcher)
    record = {
        "run": name, "container": ct.ctid, "host": ct.host.name, "argv": train,
        "config": config_path(ct, config), "sets": list(sets), "inventory_sets": inventory_sets(ct),
        "max_steps": max_steps, "max_restarts": max_restarts, "devices": configured_devices(ct),
        "launched_at": (now or _dt.datetime.now(_dt.timezone.utc)).isoformat(timespec="seconds"),
        "launched_by": f"{getpass.getuser()}@{socket.gethostname()}",
    }
    payload = {
        "runs": ct.paths.runs, "name": name, "config": config_path(ct, config), "argv": train,
        "required": [ct.venv_python, f"{ct.paths.code}/{TRAIN_SCRIPT}"], "preflight": preflight,
        "manifest": f"{ct.paths.code}/{MANIFEST}", "settle": settle, "cwd": ct.paths.code,
        "launch": commands.mask(json.dumps(record, indent=1), ct.secret_values()),
        "env": masked_env_text(ct, ct.run_env()),
        "hook": ship.argv(ct, "runs", "ended", {"runs": ct.paths.runs, "name": name,
                                                "restart": restart_policy(max_restarts)}),
    }
    payload["hook"][4] = ""  # the helper's text: the launch verb's own (remote/runs.py `_hook`), sent once
    return ship.argv(ct, "runs", "launch", payload), train


def configured_devices(ct: Container) -> dict:
    """The devices the inventory gives a run's roles (None: the config's)."""
    return {role: ct.roles.devices(role) or None for role in ("target", "drafter")}


@dataclass
class Spec:
    """What a launch runs: the run's saved spec with this launch's values on top."""
    config: str | None          # --config (None: the inventory's train_config)
    sets: list                  # every --set, the saved ones first, a new value in its key's place
    max_steps: int | None
    changes: list = field(default_factory=list)  # `what: before -> after` lines, for the user
    saved: bool = False         # the run had a spec: this launch resumes it
    max_restarts: int | None = None  # automatic restarts after a transient crash (None: none)


def merge_spec(ct: Container, saved, config: str | None, sets: Sequence[str], max_steps: int | None,
               code_now: str | None = None, max_restarts: int | None = None) -> Spec:
    """A run's saved spec (its launch.json, read in the container: untrusted) + this launch's
    --config, --set and --max-steps. Pure.

    A new --set replaces the saved value of its key; --config and --max-steps replace theirs when
    given. `changes` also names what the inventory or a deploy changed since (devices, its --set
    values, the code version)."""
    if not isinstance(saved, dict):
        return Spec(config, list(sets), max_steps, max_restarts=max_restarts)
    merged: dict = {}
    try:
        for value in validate_sets([s for s in saved.get("sets") or [] if isinstance(s, str)]):
            key, _, val = value.partition("=")
            merged[key] = val
        old_config = config_path(ct, saved["config"]) if isinstance(saved.get("config"), str) else None
    except UsageError as exc:
        raise RemoteCommandFailed(f"{ct.label}: the run's saved spec (launch.json) is not usable: {exc}; "
                                  "start a new --run name") from None
    changes = []
    for value in sets:
        key, _, val = value.partition("=")
        if merged.get(key) != val:
            changes.append(f"--set {key}: {merged.get(key, '(the config file)')} -> {val}")
        merged[key] = val
    if config is not None and old_config is not None and config_path(ct, config) != old_config:
        changes.append(f"--config: {old_config} -> {config_path(ct, config)}")
    old_steps = saved.get("max_steps") if isinstance(saved.get("max_steps"), int) else None
    if max_steps is not None and max_steps != old_steps:
        changes.append(f"--max-steps: {old_steps or '(train.max_steps)'} -> {max_steps}")
    old_restarts = saved.get("max_restarts")
    if isinstance(old_restarts, bool) or not isinstance(old_restarts, int):
        old_restarts = None
    if max_restarts is not None and max_restarts != (old_restarts or 0):
        changes.append(f"--max-restarts: {old_restarts or 0} -> {max_restarts}")
    for what, before, now in (("devices", saved.get("devices"), configured_devices(ct)),
                              ("inventory --set", saved.get("inventory_sets"), inventory_sets(ct)),
                              ("code", saved.get("code_version"), code_now)):
        if before is not None and now is not None and before != now:
            changes.append(f"{what}: {json.dumps(before)} -> {json.dumps(now)}")
    return Spec(config if config is not None else old_config, [f"{k}={v}" for k, v in merged.items()],
                max_steps if max_steps is not None else old_steps, changes, saved=True,
                max_restarts=max_restarts if max_restarts is not None else old_restarts)


def describe_spec(name: str, spec: Spec) -> str:
    """What the user reads before a resume: the spec it runs, and what changed (printable text)."""
    shown = " ".join([f"--config {spec.config}"] * bool(spec.config) + [f"--set {s}" for s in spec.sets]
                     + [f"--max-steps {spec.max_steps}"] * (spec.max_steps is not None)
                     + [f"--max-restarts {spec.max_restarts}"] * bool(spec.max_restarts))
    lines = [f"run {name}: resuming with its saved spec: {shown or '(the defaults)'}"]
    lines += [f"  changed: {change}" for change in spec.changes] or ["  (nothing changed)"]
    return "\n".join(terminal.visible(line) for line in lines)


# --- remote operations -------------------------------------------------------------------------------

def saved_spec(t, name: str) -> tuple[dict | None, str | None]:
    """(the run's saved spec or None, the code version deployed now): one round trip."""
    ct = t.container
    line = ship.line(ct, "runs", "spec", {"runs": ct.paths.runs, "name": name,
                                          "manifest": f"{ct.paths.code}/{MANIFEST}"})
    result = t.session.run_in(ct, line, timeout=SPEC_TIMEOUT_S, limit=ship.ANSWER_CAP)
    answer = read_answer(ct, result.stdout, "reading the run's spec")
    code = answer.get("code_version")
    return (answer.get("spec") if isinstance(answer.get("spec"), dict) else None,
            code if isinstance(code, str) else None)


def launch(t, run: str | None = None, config: str | None = None, sets: Sequence[str] = (),
           max_steps: int | None = None, launcher: Sequence[str] = (), confirm_change: bool = False,
           console=None, max_restarts: int | None = None) -> Launch:
    """Preflight, then start a detached training run; refuse while another run is alive.

    An existing run (`--run NAME`) resumes from its saved spec with this launch's values on top;
    what changed is shown first (one round trip more). A run with checkpoints given other data or
    another target is refused by the preflight unless `confirm_change`."""
    ct = t.container
    name = validate_run_name(run) if run is not None else default_run_name()
    spec = Spec(config, validate_sets(sets), max_steps, max_restarts=check_max_restarts(max_restarts))
    if run is not None and not t.dry_run:  # a dry run prints the commands that act; this one reads
        saved, code_now = saved_spec(t, name)
        spec = merge_spec(ct, saved, config, spec.sets, max_steps, code_now, spec.max_restarts)
        if spec.saved:
            (console or terminal.console(stderr=False)).print(describe_spec(name, spec), markup=False,
                                                              highlight=False, soft_wrap=True)
    argv, train = launch_argv(ct, name, spec.config, spec.sets, spec.max_steps, launcher=launcher,
                              allow_change=confirm_change, max_restarts=spec.max_restarts)
    result = t.session.exec(ct, argv, env=ct.run_env(), cwd=ct.paths.code, timeout=LAUNCH_TIMEOUT_S,
                            limit=ship.ANSWER_CAP)
    out = Launch(run=name, run_dir=run_dir(ct, name), argv=train, where=ct.label, ctid=ct.ctid)
    if t.dry_run:
        return out
    answer = read_answer(ct, result.stdout, "launch")
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


def read_answer(ct: Container, text: str, what: str, own: dict | None = None) -> dict:
    """A runs verb's answer (ship.answer): its object, or the error of its refusal: the caller's `own`
    {kind: refusal -> error} first, then `refused`'s."""
    try:
        value = ship.answer(text, f"{ct.label}: {what}")
    except ship.Refusal as refusal:
        if refusal.kind in (own or {}):
            raise own[refusal.kind](refusal) from None
        refused(ct, {**refusal.extra, "error": refusal.kind, "message": refusal.message}, what)
        raise
    if not isinstance(value, dict):
        raise ship.BadAnswer(f"{ct.label}: {what}: the answer is not an object")
    return value


def refused(ct: Container, answer: dict, what: str) -> None:
    """A verb's refusal -> the error a user reads (one line, naming what to do)."""
    kind = answer.get("error")
    if not kind:
        return
    message = terminal.visible(str(answer.get("message") or ""))[:400]
    if kind == "busy-warmup":
        raise RunStateError(f"a warm-up is running on {ct.label}; start the run when it has finished")
    if kind == "busy":
        alive = shown_name(answer.get("run"))
        raise RunStateError(f"run {alive!r} is alive on {ct.label}: follow it with `invoke logs --follow`, "
                            f"or stop it with `invoke stop --run {alive}` before starting another")
    if kind == "no-run":
        raise RunStateError(f"{ct.label}: {message}")
    if kind == "not-deployed":
        raise RemoteCommandFailed(f"{ct.label}: {message}; run `invoke deploy`")
    if kind == "no-config":  # bad input found in the container, before anything started: as a preflight
        raise PreflightFailed(f"{ct.label}: {message}; check --config (relative to paths.code); "
                              "nothing was launched")
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

    def facts(self) -> dict:
        return {"run": self.run, "container": self.where, "outcome": self.outcome,
                "exit_code": self.exit_code or None, "grace": self.grace}

    def row(self) -> str:
        return self._says(f"run {self.run}")

    def _says(self, run: str) -> str:
        code = self.exit_code or "none"
        if self.outcome == "notalive":
            return f"{run} is not running (exit code: {code})"
        how = "SIGTERM" if self.outcome == "term" else f"SIGKILL after {self.grace:g} s"
        return f"{run} stopped ({how}, exit code: {code}); no process left"


def stop(t, run: str | None = None, grace: float = 30) -> Stop:
    """SIGTERM the run's process group, SIGKILL after `grace` s, confirm nothing is left, record it.

    One round trip; the container resolves the latest run itself when `run` is None, and signals a
    group only once it has proven it is this run's wrapper (remote/runs.py prove_group).
    """
    ct = t.container
    if float(grace) < 0:
        raise UsageError(f"--grace {grace}: must be >= 0 seconds")
    name = validate_run_name(run) if run is not None else None
    line = ship.line(ct, "runs", "stop", {"runs": ct.paths.runs, "name": name, "grace": float(grace)})
    result = t.session.run_in(ct, line, timeout=float(grace) + STOP_TIMEOUT_S, limit=ship.ANSWER_CAP)
    if t.dry_run:
        return Stop(name or "(latest)", "dry-run")
    answer = read_answer(ct, result.stdout, "stop", own={"unproven": lambda refusal: RunStateError(
        f"run {shown_name(refusal.extra.get('run') or name)} on {ct.label}: not signalled: "
        f"{refusal.message}; look with `invoke status`")})
    shown = shown_name(answer.get("run") or name)
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
        self.started = time.monotonic()
        self.status = None
        self.stream = ship.Stream(self.item)

    def __enter__(self):
        self.status = self.console.status(self._text(""), spinner="dots")
        self.status.__enter__()
        return self

    def __exit__(self, *exc):
        self.status.__exit__(*exc)

    def _text(self, last: str) -> str:
        waited = time.monotonic() - self.started
        return (f"waiting for run {self.run} on {self.label} to take its first step "
                f"({waited:.0f} s of {self.timeout:g} s)"
                + (f": {terminal.markup(last[:80])}" if last else ""))

    # a file-like out_stream for the transport: the wait verb's items, through the one stream reader
    def write(self, data: str) -> int:
        return self.stream.write(data)

    def flush(self) -> None:
        pass

    @property
    def verdict(self) -> dict:
        answer = self.stream.answer or {}
        return answer["ok"] if isinstance(answer.get("ok"), dict) else answer

    def item(self, item: dict) -> None:
        line = item.get("line")
        if isinstance(line, str):
            self.lines = (self.lines + [line])[-400:]
            self.console.print(terminal.markup(line), highlight=False, soft_wrap=True)
            if self.status is not None:
                self.status.update(self._text(line))


def crashed(run: str, label: str, exit_code, lines: list[str]) -> RemoteCommandFailed:
    """A run that died before its first step: one line with its last error line and the runbook."""
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
        result = t.session.run_in(ct, ship.line(ct, "runs", "wait", payload), check=False, pty=True,
                                  out_stream=watch, timeout=float(timeout) + STOP_TIMEOUT_S,
                                  limit=WAIT_OUTPUT_CAP)
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

    remote/runs.py's `warmup` verb takes the runs lock shared, then becomes the warm-up (exec)."""
    return ship.argv(ct, "runs", "warmup", {"runs": ct.paths.runs,
                                          "argv": payload_argv(ct, WARMUP_SCRIPT_NAME, config, sets)})


SHAPE_DONE = re.compile(r"compile warm-up: shape \('(?P<kind>\w+)', (?P<worker>\d+)\) took (?P<s>[\d.]+) s")


class WarmupProgress(terminal.LineSink):
    """Streams the warm-up's output and adds one progress line per device as its shapes complete."""

    def __init__(self, devices: list, out=None):
        self.devices, self.out = devices, out
        self.lines: list[str] = []
        self.done: dict[str, list] = {}

    def line(self, line: str) -> None:
        out = self.out or sys.stdout
        first = not self.lines
        self.lines = (self.lines + [line])[-400:]
        if first and refusal([line]):  # the verb's refusal (busy, ...): the task's error line says it
            return
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


def warmup(t, config: str | None = None, sets: Sequence[str] = (), out=None,
           timeout: float | None = None) -> WarmupProgress:
    """Run warmup_compile.py in the container, streamed, over a pty (Ctrl-C stops it there), within
    `timeout` s (payload.TIMEOUTS' by default)."""
    from . import payload

    ct = t.container
    timeout = payload.timeout_of("warmup", timeout)
    config_file = config_path(ct, config)  # one round trip before the script imports torch (15-20 s)
    payload.require(t, [payload.Need(config_file, "f", PreflightFailed(
        f"{ct.label}: config {config_file} not found in the container; check --config (relative to "
        "paths.code); nothing was started"))])
    devices = [d for d in ct.roles.devices("drafter").split(",") if d]
    progress = WarmupProgress(devices=devices, out=out)
    with payload.deadline(ct, "the warm-up", timeout):
        result = t.session.exec(ct, warmup_argv(ct, config, sets), env=ct.run_env(), cwd=ct.paths.code,
                                check=False, pty=True, out_stream=progress, timeout=timeout)
    if t.dry_run or (result.exited == 0 and not refusal(progress.lines)):
        return progress
    if result.exited == 130:  # Ctrl-C reached the warm-up through the pty; it has stopped there
        raise KeyboardInterrupt
    answer = refusal(progress.lines)
    if answer.get("error") == "busy":
        raise RunStateError(f"run {shown_name(answer.get('run'))} is alive on {ct.label}: warm up before "
                            f"starting a run, or stop it with `invoke stop`")
    refused(ct, answer, "warm-up")
    progress.close()
    # Its output was streamed above: the error is one line, as a launch that crashes says it.
    raise RemoteCommandFailed(f"warm-up failed on {ct.label} (exit {result.exited}): "
                              f"{why_it_failed(progress.lines)}",
                              exited=result.exited)


# --- one run over many nodes ------------------------------------------------------------------------
# Multi-node training (`invoke train --group NAME`): every container of the group starts the same
# run (same name, same config) under `torchrun`, through `remote_scripts/distributed.py`, which the
# container's run wrapper starts like any training script. Rendezvous: elastic, c10d backend, its
# store on the first container's node (`rdzv_address`, else its host's address) at `--rdzv-port`.
# torch.distributed does the rest (remote_scripts/distributed.py); no scheduler of our own.

DEFAULT_RDZV_PORT = 29400
LAUNCHER = "distributed.py"  # in paths.code: runs torch.distributed.run (torchrun) in-process


def node_address(ct: Container) -> str:
    """The address other nodes reach this container at (rendezvous store, process group)."""
    return ct.rdzv_address or ct.host.address


def launcher_args(ct: Container, nodes: Sequence[Container], run: str, port: int) -> list[str]:
    """What goes between the container's python and train_dflash.py: torchrun's options. Pure.

    The first container of the group hosts the rendezvous store (is_host) on its node's address;
    every node says which address it is reached at (--local-addr), so nothing depends on the
    containers' host names resolving.
    """
    first = nodes[0]
    endpoint = f"{node_address(first)}:{int(port)}"
    return [f"{ct.paths.code}/{LAUNCHER}", f"--nnodes={len(nodes)}", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run}",
            f"--rdzv-conf=is_host={'1' if ct.ctid == first.ctid else '0'}",
            f"--local-addr={node_address(ct)}", "--max-restarts=0", "--monitor-interval=1"]


def check_group(nodes: Sequence[Container]) -> None:
    """Refuse layouts torch.distributed cannot run: one node, two nodes at one address, or unequal
    drafter worker counts.

    Two nodes at one address: the rendezvous tells nodes apart by (address, pid), and the launchers
    of two fresh containers often have the same pid in their own pid namespaces; they would be taken
    for one node and the rendezvous would wait forever.
    """
    if len(nodes) < 2:
        raise UsageError("multi-node training needs at least two containers (--group NAME or --ct 200,201)")
    seen: dict[str, str] = {}
    for ct in nodes:
        other = seen.setdefault(node_address(ct), ct.label)
        if other != ct.label:
            raise UsageError(f"{other} and {ct.label} would both be reached at {node_address(ct)}: give each "
                             f"container its own address in the inventory (rdzv_address)")
    counts = {ct.label: len([d for d in ct.roles.devices("drafter").split(",") if d]) for ct in nodes}
    if len(set(counts.values())) != 1:
        shown = ", ".join(f"{label}: {n}" for label, n in counts.items())
        raise UsageError(f"every node needs the same number of drafter devices (roles.drafter); got {shown}")


@dataclass
class GroupLaunch:
    """One run started on several nodes: a row per node; if any failed, those that started were
    stopped (so none waits for the others) and `error` says which failed."""

    rows: fanout.Rows
    stopped: int = 0
    pipe_width = None  # on a pipe: $COLUMNS or 80 columns, as rich chooses

    def describe(self) -> list:
        stopped = [f"stopped the {self.stopped} node(s) that started, so none waits for the others"]
        return [self.rows.describe(), *(stopped if self.stopped else [])]

    def facts(self) -> dict:
        return {"nodes": self.rows.facts(), "stopped": self.stopped}

    @property
    def error(self):
        return self.rows.error


def launch_group(targets: list[Target], run: str | None, config, sets, max_steps,
                 port: int = DEFAULT_RDZV_PORT) -> GroupLaunch:
    """Start one run on every target under torchrun; stop those started if any launch fails."""
    nodes = [t.container for t in targets]
    check_group(nodes)
    if not 1 <= int(port) <= 65535:
        raise UsageError(f"--rdzv-port {port}: must be 1..65535")
    name = validate_run_name(run) if run is not None else default_run_name()

    def start(t):
        return launch(t, name, config, sets, max_steps,
                      launcher=launcher_args(t.container, nodes, name, port))

    outcomes = fanout.run(targets, start)
    result = GroupLaunch(fanout.Rows(f"train {name}: {len(nodes)} nodes, rendezvous "
                                     f"{node_address(nodes[0])}:{int(port)}", outcomes))
    started = [o.target for o in outcomes if o.ok]
    if result.error is not None and started and not targets[0].dry_run:
        for t in started:
            stop(t, name, 0)
        result.stopped = len(started)
    return result
