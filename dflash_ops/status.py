"""`invoke status`: one round trip to a constant script printing facts, and a pure parser for them.

The fact script prints one `key value` line per fact (values never contain a newline):

    now 1764421000              container clock, epoch seconds
    name tiny                   the run (--run, or the latest)
    exists 1 | alive 1          run directory present | a process of the run holds the runs lock
    pid 123 / pgid 120 / started ... / ended ... / exit_code signal 9 / stopped term 1764... / code_version ...
    mtime_log 1764420990 / mtime_metrics 1764420985 / free 5368709120 (bytes free where the run dir is)
    metric {...json...}         the last metrics.jsonl lines
    evaljson {...json...}       eval.json (the last `invoke eval`), newlines removed
    log ...                     the last train.log lines
    gpu 0, 97, 70000, 81559     nvidia-smi: index, utilisation %, memory used MiB, total MiB
    end
"""

from __future__ import annotations

import json
import signal as _signal
from dataclasses import asdict, dataclass, field

from . import commands, jobs, signatures

DEFAULT_STALL_AFTER = 600
LOW_SPACE = 1 << 20  # bytes free on the run directory's filesystem below which it counts as full

STATUS_SCRIPT = jobs.RUN_ALIVE_FN + r'''
runs=$1 name=$2
[ -n "$name" ] || name=$(cat "$runs/.current" 2>/dev/null)
echo "now $(date +%s)"
echo "name $name"
dir=$runs/$name
if [ -n "$name" ] && [ -d "$dir" ]; then
  echo "exists 1"
  if run_alive "$runs" "$name"; then echo "alive 1"; else echo "alive 0"; fi
  for f in pid pgid started ended exit_code stopped code_version; do
    [ -f "$dir/$f" ] && printf '%s %s\n' "$f" "$(head -c 300 "$dir/$f" | tr '\n' ' ')"
  done
  [ -f "$dir/train.log" ] && echo "mtime_log $(stat -c %Y "$dir/train.log")"
  echo "free $(df -Pk -- "$dir" 2>/dev/null | awk 'NR == 2 { print $4 * 1024 }')"
  [ -f "$dir/metrics.jsonl" ] && echo "mtime_metrics $(stat -c %Y "$dir/metrics.jsonl")"
  [ -f "$dir/metrics.jsonl" ] && tail -n 20 "$dir/metrics.jsonl" | sed 's/^/metric /'
  [ -f "$dir/eval.json" ] && echo "evaljson $(head -c 20000 "$dir/eval.json" | tr -d '\n')"
  [ -f "$dir/train.log" ] && tail -n 40 "$dir/train.log" | cut -c1-2000 | sed 's/^/log /'
else
  echo "exists 0"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  timeout 10 nvidia-smi --query-gpu=index,utilization.gpu,memory.used,memory.total \
    --format=csv,noheader,nounits 2>&1 | sed 's/^/gpu /'
fi
echo "end"
'''


@dataclass
class Gpu:
    index: int
    utilization: int | None
    memory_used_mib: int | None
    memory_total_mib: int | None


@dataclass
class RunStatus:
    run: str | None
    state: str                      # none | missing | running | stalled | finished | crashed | stopped
    detail: str = ""                # exit code, signal, how it was stopped, why it is stalled
    pid: int | None = None
    uptime_s: int | None = None
    idle_s: int | None = None       # since the last log line or metric
    step: int | None = None
    loss: float | None = None
    acceptance_length: float | None = None
    tokens_per_s: float | None = None
    lr: float | None = None
    eval_loss: float | None = None
    last_eval: dict | None = None   # the last `invoke eval` (eval.json): step, acceptance, speedup, ...
    exit_code: str | None = None
    code_version: str | None = None
    gpus: list = field(default_factory=list)
    gpu_error: str | None = None
    findings: list = field(default_factory=list)  # [{key, title, runbook, line}]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False)


def _int(text):
    try:
        return int(str(text).strip())
    except (TypeError, ValueError):
        return None


def _gpu(text: str) -> Gpu | None:
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 4 or _int(parts[0]) is None:
        return None
    return Gpu(_int(parts[0]), _int(parts[1]), _int(parts[2]), _int(parts[3]))


def describe_exit(code: str | None) -> str:
    """`signal 9` -> `killed by signal 9 (SIGKILL)`; `3` -> `exit 3`."""
    if code is None:
        return "no exit code recorded (its wrapper was killed too, or the container restarted)"
    if code.startswith("signal "):
        num = _int(code.split()[1])
        try:
            name = _signal.Signals(num).name
        except (TypeError, ValueError):
            name = "?"
        return f"killed by signal {num} ({name})"
    return f"exit {code}"


def parse_status(text: str, stall_after: float = DEFAULT_STALL_AFTER) -> RunStatus:
    """Facts printed by STATUS_SCRIPT -> RunStatus. Pure; tested on recorded outputs."""
    facts: dict[str, str] = {}
    metrics, logs, gpus, gpu_errors = [], [], [], []
    for raw in text.splitlines():
        key, _, value = raw.rstrip("\r").partition(" ")
        if key == "metric":
            metrics.append(value)
        elif key == "log":
            logs.append(value)
        elif key == "gpu":
            g = _gpu(value)
            (gpus.append(g) if g else gpu_errors.append(value))
        elif key:
            facts[key] = value.strip()
    if "end" not in facts:
        # A truncated answer (connection lost mid-way) must not look like a healthy run.
        raise ValueError("status facts are incomplete (no end marker)")
    name = facts.get("name") or None
    st = RunStatus(run=name, state="none" if not name else "missing", gpus=gpus,
                   gpu_error=" | ".join(gpu_errors) or None)
    if facts.get("exists") != "1":
        return st
    now = _int(facts.get("now"))
    started, ended = _int(facts.get("started")), _int(facts.get("ended"))
    st.pid = _int(facts.get("pid"))
    st.exit_code = facts.get("exit_code")
    st.code_version = facts.get("code_version")
    activity = [m for m in (_int(facts.get("mtime_log")), _int(facts.get("mtime_metrics")), started) if m]
    if now is not None and activity:
        st.idle_s = max(0, now - max(activity))
    _apply_metrics(st, metrics)
    st.last_eval = _last_eval(facts.get("evaljson"))
    st.findings = [{"key": s.key, "title": s.title, "runbook": s.runbook, "line": line}
                   for s, line in signatures.scan(logs)]
    free = _int(facts.get("free"))
    if free is not None and free < LOW_SPACE and not any(f["key"] == "disk-full" for f in st.findings):
        # A full disk may have cut the log (and the wrapper's exit code) before any error line.
        sig = next(s for s in signatures.SIGNATURES if s.key == "disk-full")
        st.findings.append({"key": sig.key, "title": sig.title, "runbook": sig.runbook,
                            "line": f"{free} bytes free on the run directory's filesystem"})

    alive = facts.get("alive") == "1"
    if alive:
        st.uptime_s = now - started if now is not None and started else None
        if st.idle_s is not None and st.idle_s > stall_after:
            st.state = "stalled"
            st.detail = f"no new log line or metric for {st.idle_s} s (threshold {stall_after:g} s)"
            sig = signatures.STALLED
            st.findings.append({"key": sig.key, "title": sig.title, "runbook": sig.runbook, "line": ""})
        else:
            st.state = "running"
        return st
    if started and ended:
        st.uptime_s = ended - started
    stopped = facts.get("stopped")
    if stopped is not None:
        st.state = "stopped"
        how = stopped.split()[0] if stopped.split() else ""
        st.detail = {"term": "stopped with SIGTERM", "kill": "stopped with SIGKILL after the grace period",
                     "requested": "stop was requested"}.get(how, f"stopped ({stopped})")
        if st.exit_code is not None:
            st.detail += f", {describe_exit(st.exit_code)}"
    elif st.exit_code == "0":
        st.state, st.detail = "finished", "exit 0"
    elif st.pid is None and st.exit_code is None:
        st.state, st.detail = "crashed", "the training process never started"
    else:
        st.state, st.detail = "crashed", describe_exit(st.exit_code)
    return st


def _apply_metrics(st: RunStatus, lines: list[str]) -> None:
    train = evaluation = None
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line being written as we read it
        if not isinstance(record, dict):
            continue
        kind = record.get("kind", "train")
        if kind == "train":
            train = record
        elif kind == "eval":
            evaluation = record
        if isinstance(record.get("step"), int):
            st.step = max(st.step or 0, record["step"])
    if train:
        st.loss = train.get("loss")
        st.acceptance_length = train.get("acceptance_length")
        st.tokens_per_s = train.get("tokens_per_s")
        st.lr = train.get("lr")
    if evaluation:
        st.eval_loss = evaluation.get("loss")


def _last_eval(text: str | None) -> dict | None:
    """eval.json's headline numbers; None when absent or unreadable (being rewritten)."""
    try:
        record = json.loads(text) if text else None
    except ValueError:
        return None
    keys = ("step", "acceptance_length", "tokens_per_target_forward", "speedup", "lossless", "prompts", "time")
    return {k: record.get(k) for k in keys} if isinstance(record, dict) else None


def describe_eval(last: dict) -> str:
    lossless = "lossless" if last.get("lossless") else "NOT LOSSLESS"
    return (f"acceptance {_fmt(last.get('acceptance_length'), '.2f')}, "
            f"{_fmt(last.get('tokens_per_target_forward'), '.2f')} tokens/target forward, speedup "
            f"{_fmt(last.get('speedup'), '.2f')}x, {lossless} (step {last.get('step')}, "
            f"{last.get('prompts')} prompts)")


def status_argv(runs: str, run: str | None) -> list[str]:
    return commands.sh_script(STATUS_SCRIPT, runs, run or "")


def gather(t, run: str | None = None, stall_after: float = DEFAULT_STALL_AFTER) -> RunStatus | None:
    """One round trip: the facts of --run (or the latest run) and the GPUs. None in a dry run."""
    ct = t.container
    name = jobs.validate_run_name(run) if run is not None else None
    result = t.session.exec(ct, status_argv(ct.paths.runs, name))
    if t.dry_run:
        return None
    return parse_status(result.stdout, stall_after)


STATE_STYLE = {"running": "green", "finished": "bold green", "stalled": "bold yellow", "crashed": "bold red",
               "stopped": "yellow", "none": "dim", "missing": "red"}


def _fmt_duration(seconds) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _fmt(value, spec=".4g") -> str:
    return "-" if value is None else format(value, spec)


def render(st: RunStatus, label: str, console=None) -> None:
    """The human view: a rich table of the run, one of the GPUs, and the runbook to read."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"{label}: run {st.run or '(none)'}", show_header=False)
    table.add_column("fact", style="bold")
    table.add_column("value")
    style = STATE_STYLE.get(st.state, "")
    table.add_row("state", f"[{style}]{st.state}[/{style}]" + (f" ({st.detail})" if st.detail else ""))
    table.add_row("pid", _fmt(st.pid, "d"))
    table.add_row("uptime", _fmt_duration(st.uptime_s))
    table.add_row("last activity", "-" if st.idle_s is None else f"{_fmt_duration(st.idle_s)} ago")
    table.add_row("step", _fmt(st.step, "d"))
    table.add_row("loss", _fmt(st.loss))
    table.add_row("acceptance length", _fmt(st.acceptance_length, ".3f"))
    table.add_row("tokens/s", _fmt(st.tokens_per_s, ",.0f"))
    table.add_row("lr", _fmt(st.lr, ".3g"))
    if st.eval_loss is not None:
        table.add_row("held-out loss", _fmt(st.eval_loss))
    if st.last_eval:
        table.add_row("last dflash eval", escape(describe_eval(st.last_eval)))
    table.add_row("code version", st.code_version or "-")
    console.print(table)
    if st.gpus:
        gpus = Table(title="GPUs")
        for col in ("GPU", "util %", "memory used MiB", "memory total MiB"):
            gpus.add_column(col, justify="right")
        for g in st.gpus:
            gpus.add_row(str(g.index), _fmt(g.utilization, "d"), _fmt(g.memory_used_mib, "d"),
                         _fmt(g.memory_total_mib, "d"))
        console.print(gpus)
    if st.gpu_error:
        console.print(f"[yellow]nvidia-smi: {st.gpu_error}[/yellow]")
    for f in st.findings:
        console.print(f"[bold red]{escape(f['title'])}[/bold red]: read {escape(f['runbook'])}"
                      + (f"\n  {escape(f['line'])}" if f["line"] else ""), highlight=False)
