"""`invoke status`: one round trip to remote/runs.py's `status` verb, and a strict parser of its answer.

The answer (remote/runs.py status, read by ship.answer) is one JSON object: `now` (container clock),
`name` (--run, or the latest), `free_runs` / `free_shm` (bytes free on paths.runs and /dev/shm,
with or without a run), `exists`, `state` and `detail` (the prelude's run_state, the one state
machine of a run: running, stalled, finished, crashed, stopped), `alive` (a process of the run holds
the runs lock), `idle_s` (seconds since the last log line or metric), `files` (pid, pgid, started,
ended, exit_code, stopped, code_version: their first 300 bytes),
`free` (bytes free where the run dir is), `checkpoint` (checkpoints/latest's text and mtime),
`metrics` (the last metrics.jsonl lines), `eval` (eval.json's text, when at most 20 kB), `data`
(data.json's first 4000 bytes: what training found about its data), `log` (the last train.log
lines), `gpus` (nvidia-smi's csv lines: index, utilisation %, memory used and total MiB,
temperature C; null without nvidia-smi). Every value is data: the parser takes each field only
with the type it expects and answers with a RunStatus or one ValueError line.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field

from . import fanout, runs, terminal
from .history import parse_segment
from .remote import ship
from .remote.prelude import LINE_CAP, RUN_FILES, STATES
from .runs import last_error_line

DEFAULT_STALL_AFTER = 600
LOW_SPACE = 1 << 20  # bytes free on the run directory's filesystem below which it counts as full
STATUS_TIMEOUT_S = 15.0  # the status verb's deadline (nvidia-smi gets 10 s of it)


@dataclass
class Gpu:
    index: int
    utilization: int | None
    memory_used_mib: int | None
    memory_total_mib: int | None
    temperature_c: int | None = None


@dataclass
class RunStatus:
    run: str | None
    state: str                      # none | missing | running | stalled | finished | crashed | stopped
    detail: str = ""                # exit code, signal, how it was stopped, why it is stalled
    pid: int | None = None
    uptime_s: int | None = None     # an alive run: since its launch (or resume)
    duration_s: int | None = None   # an ended run: its last launch's (or resume's) start to its end
    idle_s: int | None = None       # since the last log line or metric
    step: int | None = None         # the last train metric's step (of the current segment)
    total_steps: int | None = None  # where this launch stops (its step lines' N/M)
    percent: float | None = None    # step of total_steps
    loss: float | None = None       # the loss of `step` (the same train metric)
    steps_per_s: float | None = None  # over the current segment's last train metrics
    eta_s: int | None = None        # an alive run: (total_steps - step) at steps_per_s
    acceptance_length: float | None = None
    tokens_per_s: float | None = None
    lr: float | None = None
    eval_loss: float | None = None
    eval_step: int | None = None    # the last held-out evaluation's step
    eval_decode_acceptance: float | None = None  # its decode walk: the acceptance greedy decoding has
    slot_accuracy: list | None = None  # the last train metric's per-slot accuracy (slots 1..bs-1)
    checkpoint_step: int | None = None
    checkpoint_age_s: int | None = None
    replicas_differ: float | None = None  # the last checkpoint's replica_max_abs_diff when not 0
    free_runs: int | None = None    # bytes free on paths.runs' filesystem
    free_shm: int | None = None     # bytes free on /dev/shm
    memory_limit: int | None = None  # the container's memory limit in bytes (None: none found)
    oom_kills: int | None = None    # processes the container's OOM killer killed since it started
    last_eval: dict | None = None   # the last `invoke eval` (eval.json): step, acceptance, speedup, ...
    data_warnings: list = field(default_factory=list)  # data.json: answers not the target's, held-out overlap
    exit_code: str | None = None
    segment_started: int | None = None  # the current segment's start (container clock): launch or resume
    code_version: str | None = None
    gpus: list = field(default_factory=list)
    gpu_error: str | None = None
    findings: list = field(default_factory=list)  # [{key, title, runbook, line}]
    last_error: str | None = None   # a crashed run's last error line of its current segment
    spec: dict | None = None        # the run's spec (launch.json): config, sets, max_steps, devices, code
    segment: dict | None = None     # the current segment (segments.jsonl): n, kind, start, log_offset, ...

    def facts(self) -> dict:
        """`status --json` (cli.show prints it)."""
        return asdict(self)

    def row(self) -> str:
        """The compact status in a fan-out: run, state, step, loss, acceptance length (tau)."""
        if self.state == "none":
            return "no run yet"
        state = self.state + (f" ({self.detail})" if self.detail else "")
        findings = "".join(f"; {f['title']}: read {f['runbook']}" for f in self.findings)
        return (f"run {self.run}: {state} | step {describe_step(self)} | loss {fmt(self.loss, '.4f')} "
                f"| tau {fmt(self.acceptance_length, '.2f')}{findings}")


def _int(value):
    """An integer from a JSON int or a run file's text; None for anything else (bools, huge, junk)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        value = value.strip()
        if not re.fullmatch(r"-?\d{1,19}", value):
            return None
        value = int(value)
    return value if isinstance(value, int) and abs(value) < 1 << 63 else None


def _num(value):
    """A finite number of sane size from JSON, else None (strings, nulls, NaN, 1e999, 10**400)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int):
        return value if abs(value) < 1 << 63 else None
    return value if math.isfinite(value) and abs(value) < 1e300 else None


def _text(value, cap=2000):
    return value[:cap] if isinstance(value, str) else None


def _texts(value, cap=2000, count=1000):
    return [v[:cap] for v in value[-count:] if isinstance(v, str)] if isinstance(value, list) else []


def _gpu(text: str) -> Gpu | None:
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (4, 5) or _int(parts[0]) is None:
        return None
    return Gpu(*(_int(p) for p in parts))


def load_answer(text: str, where: str = "status") -> dict:
    """The verb's stdout -> its answer object (ship.answer); BadAnswer (a ValueError, one line) or
    Refusal otherwise."""
    answer = ship.answer(text, where)
    if not isinstance(answer, dict):
        raise ship.BadAnswer(f"{where}: the answer is not an object")
    return answer


ALIVE = ("running", "stalled")


def parse_status(text: str, where: str = "status", missing_ok: bool = True) -> RunStatus:
    """remote/runs.py status's answer -> RunStatus. Pure; tested on recorded and on arbitrary answers.
    The state is the container's run_state: taken only if it is one of the states, else BadAnswer.
    A named run that is not there: state `missing`, or with missing_ok=False the one unknown-run
    error (runs.no_such_run, naming the runs there are). Every number is of the current segment
    (the last launch or resume: the log's lines after its launch line, the metrics written since its
    start), so no step, loss or error of an earlier segment is shown as today's."""
    facts_ = load_answer(text, where)
    gpus, gpu_errors = [], []
    for line in _texts(facts_.get("gpus"), 400, 64):
        g = _gpu(line)
        (gpus.append(g) if g else gpu_errors.append(line))
    name = _text(facts_.get("name"), 200) or None
    st = RunStatus(run=name, state="none" if not name else "missing", gpus=gpus,
                   gpu_error=" | ".join(gpu_errors) or None,
                   free_runs=_int(facts_.get("free_runs")), free_shm=_int(facts_.get("free_shm")))
    memory = facts_.get("memory") if isinstance(facts_.get("memory"), dict) else {}
    st.memory_limit, st.oom_kills = _int(memory.get("limit")), _int(memory.get("oom_kills"))
    if facts_.get("exists") is not True:
        if name and not missing_ok:
            raise runs.no_such_run(name, where.partition(": ")[0], facts_.get("runs"))
        return st
    state = facts_.get("state")
    if state not in STATES or state in ("none", "missing"):
        raise ship.BadAnswer(f"{where}: the answer's field 'state' is not a run state")
    st.state, st.detail = state, (_text(facts_.get("detail"), 300) or "")
    files = facts_.get("files") if isinstance(facts_.get("files"), dict) else {}
    file = {k: _text(files.get(k), 300) for k in RUN_FILES}
    now = _int(facts_.get("now"))
    _apply_checkpoint(st, facts_.get("checkpoint"), now)
    started, ended = _int(file["started"]), _int(file["ended"])
    st.segment = parse_segment(facts_.get("segment"))
    started = (st.segment or {}).get("start") or started  # a restart starts a segment; `started` does not
    st.segment_started = started
    st.pid = _int(file["pid"])
    st.exit_code = file["exit_code"]
    st.code_version = file["code_version"]
    idle = _int(facts_.get("idle_s"))
    st.idle_s = idle if idle is not None and idle >= 0 else None
    logs = _texts(facts_.get("log"), LINE_CAP, 200)  # the current segment's last lines
    _apply_metrics(st, _texts(facts_.get("metrics"), 1 << 16, 200), started, logs)
    st.last_eval = _last_eval(facts_.get("eval"))
    st.data_warnings = _data_warnings(facts_.get("data"))
    st.spec = _spec(facts_.get("spec"))
    st.findings = [{"key": s.key, "title": s.title, "runbook": s.runbook, "line": line}
                   for s, line in runs.scan(logs)]
    free = _int(facts_.get("free"))
    if free is not None and free < LOW_SPACE and not any(f["key"] == "disk-full" for f in st.findings):
        # A full disk may have cut the log (and the wrapper's exit code) before any error line.
        sig = next(s for s in runs.SIGNATURES if s.key == "disk-full")
        st.findings.append({"key": sig.key, "title": sig.title, "runbook": sig.runbook,
                            "line": f"{free} bytes free on the run directory's filesystem"})
    if state in ALIVE:
        st.uptime_s = now - started if now is not None and started else None
        if st.steps_per_s and st.total_steps is not None and st.step is not None:
            st.eta_s = round(max(0, st.total_steps - st.step) / st.steps_per_s)
        if state == "stalled":
            sig = runs.STALLED
            st.findings.append({"key": sig.key, "title": sig.title, "runbook": sig.runbook, "line": ""})
        return st
    if started and ended and ended >= started:
        st.duration_s = ended - started
    if st.state == "crashed":
        st.last_error = last_error_line(logs, only_errors=True)
        if st.exit_code == "signal 9" and st.oom_kills:  # SIGKILL
            # Nobody asked it to stop and the container's OOM killer ran: its memory limit, likely.
            limit = f"{st.memory_limit >> 20} MiB" if st.memory_limit else "its limit"
            st.detail += f", likely out of memory: the container's OOM killer ran ({limit})"
            sig = runs.CONTAINER_OOM
            st.findings.append({"key": sig.key, "title": sig.title, "runbook": sig.runbook,
                                "line": f"{st.oom_kills} process(es) killed by the container's OOM killer "
                                        f"since it started; memory limit {limit}"})
    return st


STEP_LINE = re.compile(r"^\S+ INFO step (\d{1,12})/(\d{1,12}) \|")  # train_dflash.log_train's line
RATE_WINDOW = 10  # the current segment's last train metrics the rate (and the ETA) is taken over


def current_segment(records: list[dict], started: int | None) -> list[dict]:
    """The records written since the segment's start (`started`, the launch's epoch): those after the
    last one stamped earlier. Records without a time (checkpoint lines) go with their neighbours."""
    if started is None:
        return records
    for i in range(len(records) - 1, -1, -1):
        stamp = _num(records[i].get("time"))
        if stamp is not None and stamp < started:
            return records[i + 1:]
    return records


def _step(record: dict):
    return None if isinstance(record.get("step"), str) else _int(record.get("step"))


def _apply_metrics(st: RunStatus, lines: list[str], started: int | None = None, logs=()) -> None:
    """The current segment's last train metric (its step, and the loss and rates of that step), the
    steps per second over its last RATE_WINDOW, where it stops, the last held-out evaluation at or
    before that step, and the last checkpoint's replica difference."""
    records = [r for r in map(_record, lines) if r is not None]  # a torn or foreign line is skipped
    segment = current_segment(records, started)
    trains = [r for r in segment if r.get("kind", "train") == "train" and _step(r) is not None]
    train = trains[-1] if trains else None
    for record in records:
        if record.get("kind") == "checkpoint":
            st.replicas_differ = _num(record.get("replica_max_abs_diff")) or None
    if train:
        st.step = _step(train)
        st.loss = _num(train.get("loss"))
        st.acceptance_length = _num(train.get("acceptance_length"))
        st.tokens_per_s = _num(train.get("tokens_per_s"))
        st.lr = _num(train.get("lr"))
        slots = train.get("slot_accuracy")
        st.slot_accuracy = [_num(a) for a in slots[:256]] if isinstance(slots, list) else None
        st.total_steps = _step({"step": train.get("stop_step")})
        recent = trains[-RATE_WINDOW:]
        first, last = recent[0], recent[-1]
        t0, t1 = _num(first.get("time")), _num(last.get("time"))
        if t0 is not None and t1 is not None and t1 > t0 and _step(last) > _step(first):
            st.steps_per_s = (_step(last) - _step(first)) / (t1 - t0)
    else:  # nothing trained yet in this segment: where it is, from its checkpoint or eval lines
        steps = [s for s in map(_step, segment) if s is not None]
        st.step = steps[-1] if steps else None
    if st.total_steps is None:  # metrics of an older payload: the segment's last step line says it
        found = [STEP_LINE.match(line) for line in logs]
        found = [m for m in found if m]
        st.total_steps = int(found[-1].group(2)) if found else None
    if st.step is not None and st.total_steps:
        st.percent = round(100.0 * st.step / st.total_steps, 1)
    # The last evaluation of this segment; else one of before it, at or before the step this segment
    # resumed from (an earlier segment's later steps were redone: their evaluations are not this run's).
    evaluations = [r for r in segment if r.get("kind") == "eval" and _step(r) is not None]
    if not evaluations:
        first = next((s for s in map(_step, segment) if s is not None), st.step)
        evaluations = [r for r in records[:len(records) - len(segment)] if r.get("kind") == "eval"
                       and _step(r) is not None and (first is None or _step(r) <= first)]
    if evaluations:
        st.eval_loss = _num(evaluations[-1].get("loss"))
        st.eval_step = _step(evaluations[-1])
        st.eval_decode_acceptance = _num(evaluations[-1].get("decode_acceptance"))


def _spec(value) -> dict | None:
    """launch.json's spec fields, each of its type or None (read in the container: untrusted)."""
    if not isinstance(value, dict):
        return None
    devices = value.get("devices") if isinstance(value.get("devices"), dict) else {}
    steps, restarts = value.get("max_steps"), value.get("max_restarts")
    return {"config": _text(value.get("config"), 1000), "sets": _texts(value.get("sets"), 2000, 200),
            "max_steps": None if isinstance(steps, str) else _int(steps),
            "max_restarts": None if isinstance(restarts, str) else _int(restarts),
            "devices": {role: _text(devices.get(role), 400) for role in ("target", "drafter")},
            "inventory_sets": _texts(value.get("inventory_sets"), 2000, 50),
            "code_version": _text(value.get("code_version"), 300),
            "launched_at": _text(value.get("launched_at"), 100),
            "launched_by": _text(value.get("launched_by"), 300)}


def _apply_checkpoint(st: RunStatus, fact, now: int | None) -> None:
    """{"latest": "step-30", "mtime": 1764420980}: the latest checkpoint's step and how
    long ago it was written."""
    if not isinstance(fact, dict) or not isinstance(fact.get("latest"), str):
        return
    latest = fact["latest"].strip()
    if latest.startswith("step-"):
        st.checkpoint_step = _int(latest[5:])
        written = _int(fact.get("mtime")) if not isinstance(fact.get("mtime"), str) else None
        if now is not None and written is not None:
            st.checkpoint_age_s = max(0, now - written)


def _record(line) -> dict | None:
    """One JSON object from a line of a run file, or None (torn, foreign, too deep, not an object)."""
    if not isinstance(line, str) or len(line) > 1 << 16:
        return None
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


EVAL_KEYS = {"step": _int, "acceptance_length": _num, "tokens_per_target_forward": _num, "speedup": _num,
             "lossless": lambda v: v if isinstance(v, bool) else None, "prompts": _int, "time": _num}


def _last_eval(text) -> dict | None:
    """eval.json's headline numbers; None when absent or unreadable (being rewritten)."""
    record = _record(text) if isinstance(text, str) and len(text) <= 20000 else None
    if record is None:
        return None
    return {k: check(record.get(k)) if not isinstance(record.get(k), str) else None
            for k, check in EVAL_KEYS.items()}


def _data_warnings(text: str | None) -> list[str]:
    """data.json's warnings (strings only, a few, each cut to one line of 300 characters)."""
    record = _record(text) if isinstance(text, str) else None
    warnings = record.get("warnings") if isinstance(record, dict) else None
    return [w[:300] for w in warnings[:4] if isinstance(w, str)] if isinstance(warnings, list) else []


def describe_eval(last: dict) -> str:
    lossless = "lossless" if last.get("lossless") else "NOT LOSSLESS"
    return (f"acceptance {fmt(last.get('acceptance_length'), '.2f')}, "
            f"{fmt(last.get('tokens_per_target_forward'), '.2f')} tokens/target forward, speedup "
            f"{fmt(last.get('speedup'), '.2f')}x, {lossless} (step {last.get('step')}, "
            f"{last.get('prompts')} prompts)")


def status_payload(ct, run: str | None, stall_after: float = DEFAULT_STALL_AFTER) -> dict:
    return {"runs": ct.paths.runs, "name": run, "stall_after": float(stall_after)}


def gather(t, run: str | None = None, stall_after: float = DEFAULT_STALL_AFTER,
           missing_ok: bool = False) -> RunStatus | None:
    """One round trip within STATUS_TIMEOUT_S: the facts of --run (or the latest run), its state and
    the GPUs. None in a dry run. A bad answer: one line naming the container and the field. A named
    run that is not there: the one unknown-run error (NoSuchRun), or with missing_ok its `missing`
    state (watch --wait)."""
    ct = t.container
    name = runs.validate_run_name(run) if run is not None else None
    where = f"{ct.label}: status"
    payload = dict(status_payload(ct, name, stall_after), deadline_s=STATUS_TIMEOUT_S)
    result = ship.run(t, ship.line(ct, "runs", "status", payload), where, timeout=STATUS_TIMEOUT_S + 5,
                      cap=ship.ANSWER_CAP)
    if t.dry_run:
        return None
    return parse_status(result.stdout, where, missing_ok=missing_ok)


STATE_STYLE = {"running": "green", "finished": "bold green", "stalled": "bold yellow", "crashed": "bold red",
               "stopped": "yellow", "none": "dim", "missing": "red"}


@dataclass
class View:
    """One container's status as `invoke status` shows it: the tables (--json: its facts, cli.show)."""

    st: RunStatus
    label: str
    pipe_width = None  # on a pipe: $COLUMNS or 80 columns, as rich chooses

    def describe(self):
        return view(self.st, self.label)

    def facts(self) -> dict:
        return self.st.facts()

    def row(self) -> str:
        return self.st.row()


def fan_out(targets: list, run: str | None, stall_after: float) -> fanout.Rows:
    """`status --group`: one compact row per container (--json: {container: facts}, cli.show)."""
    def one(t):
        st = gather(t, run, stall_after)
        return "dry run" if st is None else st

    return fanout.Rows("status", fanout.run(targets, one))


def _fmt_duration(seconds) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def fmt(value, spec=".4g") -> str:
    """A number for a table cell; `-` for anything that is not one (missing, or text from a hostile file)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    try:
        return format(value, spec)
    except (ValueError, OverflowError):  # `d` of a float, or a float too large for `,.0f`
        return format(float(value), ".4g")


def describe_step(st: RunStatus) -> str:
    """`700 of 3000 (23.3%)`; the step alone when the total is unknown."""
    if st.step is None:
        return "-"
    if not st.total_steps:
        return fmt(st.step, "d")
    return f"{st.step} of {st.total_steps} ({fmt(st.percent, '.1f')}%)"


def describe_eta(st: RunStatus) -> str:
    """`1h02m03s (0.52 steps/s over this launch's last steps)`, or why there is none."""
    if st.eta_s is None:
        return "- (no rate yet: fewer than two steps logged since the launch)"
    return f"{_fmt_duration(st.eta_s)} ({fmt(st.steps_per_s, '.3g')} steps/s over this launch's last steps)"


def describe_checkpoint(st: RunStatus) -> str:
    """`step-500, written 3m12s ago`, or `none yet`."""
    if st.checkpoint_step is None:
        return "none yet"
    age = f", written {_fmt_duration(st.checkpoint_age_s)} ago" if st.checkpoint_age_s is not None else ""
    return f"step-{st.checkpoint_step}{age}"


def view(st: RunStatus, label: str):
    """The human view: a rich table of the run, one of the GPUs, and the runbook to read."""
    from rich.console import Group
    from rich.table import Table

    escape = terminal.markup  # every value below was read in the container
    table = Table(title=f"{label}: run {escape(st.run or '(none)')}", show_header=False)
    table.add_column("fact", style="bold")
    table.add_column("value")
    style = STATE_STYLE.get(st.state, "")
    table.add_row("state", (f"[{style}]{escape(st.state)}[/{style}]" if style else escape(st.state))
                  + (f" ({escape(st.detail)})" if st.detail else ""))
    table.add_row("pid", fmt(st.pid, "d"))
    if st.state in ALIVE:
        table.add_row("uptime", _fmt_duration(st.uptime_s))
    else:
        table.add_row("duration", _fmt_duration(st.duration_s))
    table.add_row("last activity", "-" if st.idle_s is None else f"{_fmt_duration(st.idle_s)} ago")
    table.add_row("step", describe_step(st))
    if st.state in ALIVE:
        table.add_row("ETA", describe_eta(st))
    table.add_row("loss", fmt(st.loss) + (f" (step {st.step})" if st.loss is not None else ""))
    table.add_row("teacher-forced acceptance", fmt(st.acceptance_length, ".3f"))
    table.add_row("tokens/s", fmt(st.tokens_per_s, ",.0f"))
    table.add_row("lr", fmt(st.lr, ".3g"))
    if st.eval_loss is not None:
        table.add_row("held-out loss", f"{fmt(st.eval_loss)} (step {fmt(st.eval_step, 'd')})")
    if st.eval_decode_acceptance is not None:
        table.add_row("held-out decode acceptance",
                      f"{fmt(st.eval_decode_acceptance, '.3f')} (step {fmt(st.eval_step, 'd')})")
    table.add_row("checkpoint", describe_checkpoint(st))
    if st.last_eval:
        table.add_row("last dflash eval", escape(describe_eval(st.last_eval)))
    for warning in st.data_warnings:
        table.add_row("[yellow]data warning[/yellow]", escape(warning))
    table.add_row("code version", escape(st.code_version or "-"))
    if st.replicas_differ:
        table.add_row("[yellow]replicas differ[/yellow]",
                      f"by up to {fmt(st.replicas_differ, '.3g')} at the last checkpoint (one model "
                      "expected; see the WARNING in the log)")
    if st.last_error:
        table.add_row("last error", escape(st.last_error))
    parts = [table]
    if st.gpus:
        gpus = Table(title="GPUs")
        for col in ("GPU", "util %", "memory used MiB", "memory total MiB"):
            gpus.add_column(col, justify="right")
        for g in st.gpus:
            gpus.add_row(str(g.index), fmt(g.utilization, "d"), fmt(g.memory_used_mib, "d"),
                         fmt(g.memory_total_mib, "d"))
        parts.append(gpus)
    if st.gpu_error:
        parts.append(f"[yellow]nvidia-smi: {escape(st.gpu_error)}[/yellow]")
    for f in st.findings:
        parts.append(f"[bold red]{escape(f['title'])}[/bold red]: read {escape(f['runbook'])}"
                     + (f"\n  {escape(f['line'])}" if f["line"] else ""))
    return Group(*parts)


def render(st: RunStatus, label: str, console=None) -> None:
    """`view` printed on `console` (status --watch captures it)."""
    (console or terminal.console()).print(view(st, label))
