"""`invoke status --check`: a run's facts as a monitoring-plugin verdict (Nagios, Icinga, Sensu, ...).

The plugin convention is its own exit-code table, used by `--check` only (the other tasks use
`errors.ExitStatus`): 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN. The output is one line, then `|` and
the performance data; with several containers the worst verdict comes first and each container
gets a line of its own after it. Pure: `verdict(RunStatus)` and `report([Verdict])`. Every text in a
line goes through terminal.plugin (one line, no `|`, whatever the container wrote in a run file);
perfdata values are numbers or `U`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .. import runs
from ..errors import UsageError
from ..status import DEFAULT_STALL_AFTER, RunStatus
from ..terminal import plugin

OK, WARNING, CRITICAL, UNKNOWN = 0, 1, 2, 3
NAMES = {OK: "OK", WARNING: "WARNING", CRITICAL: "CRITICAL", UNKNOWN: "UNKNOWN"}
# Which verdict wins a group: a container we could not read hides less than one that has crashed.
SEVERITY = {OK: 0, WARNING: 1, UNKNOWN: 2, CRITICAL: 3}

DEFAULT_HANG_AFTER = 1800.0
DEFAULT_MIN_FREE_RUNS = 10 << 30
DEFAULT_MIN_FREE_SHM = 512 << 20
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Thresholds:
    stall_after: float = DEFAULT_STALL_AFTER   # alive but silent this long: WARNING (stalled)
    hang_after: float = DEFAULT_HANG_AFTER     # ... this long: CRITICAL (hung)
    min_free_runs: int = DEFAULT_MIN_FREE_RUNS  # bytes free on paths.runs below which: WARNING
    min_free_shm: int = DEFAULT_MIN_FREE_SHM    # bytes free on /dev/shm below which: WARNING

    def __post_init__(self):
        if not 0 < self.stall_after <= self.hang_after:
            raise UsageError(f"--hang-after {self.hang_after:g} must be at least --stall-after "
                             f"{self.stall_after:g} (both > 0 seconds)")


def parse_size(text, flag: str = "size") -> int:
    """`10G`, `512M`, `1.5GiB`, `1048576` -> bytes (binary units); a bad value is a one-line usage error."""
    m = SIZE.match(str(text))
    if not m:
        raise UsageError(f"{flag} {str(text)[:40]!r}: expected a size such as 10G, 512M or a number of bytes")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))


@dataclass
class Verdict:
    code: int
    label: str                      # pve1/200
    summary: str                    # what the line says after the label
    perfdata: dict = field(default_factory=dict)  # name -> (value or None, unit)

    def line(self) -> str:
        return f"{NAMES[self.code]} - {plugin(self.label)}: {plugin(self.summary)}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def verdict(st: RunStatus, label: str, th: Thresholds = Thresholds()) -> Verdict:
    """One container's verdict from its status facts (gathered with th.stall_after)."""
    code, parts = OK, []
    run = f"run {st.run}" if st.run else "no run yet"
    if st.state == "running":
        parts.append(f"{run} running")
    elif st.state == "stalled":
        hung = st.idle_s is not None and st.idle_s >= th.hang_after
        code = CRITICAL if hung else WARNING
        why = (f"no new log line or metric for {st.idle_s} s (hang threshold {th.hang_after:g} s)" if hung
               else st.detail)
        parts.append(f"{run} {'hung' if hung else 'stalled'}: {why}; read {runs.STALLED.runbook}")
    elif st.state == "crashed":
        code = CRITICAL
        parts.append(f"{run} crashed: {st.detail}")
    elif st.state == "missing":
        code = UNKNOWN
        parts.append(f"{run} does not exist")
    elif st.state in ("finished", "stopped"):
        parts.append(f"{run} {st.state} ({st.detail})")
    else:
        parts.append(run)
    for f in st.findings:
        if f["key"] != runs.STALLED.key:
            code = max(code, CRITICAL, key=SEVERITY.get)
            parts.append(f"{f['title']} in the log: read {f['runbook']}")
    for what, free, least in (("runs dir", st.free_runs, th.min_free_runs),
                              ("/dev/shm", st.free_shm, th.min_free_shm)):
        if free is not None and free < least:
            code = max(code, WARNING, key=SEVERITY.get)
            parts.append(f"low space: {_gib(free)} free on the {what} (threshold {_gib(least)})")
    if st.step is not None:
        parts.append(f"step {st.step}")
    if st.loss is not None:
        parts.append(f"loss {st.loss:.4g}")
    perf = {"step": (st.step, ""), "loss": (st.loss, ""), "acceptance": (st.acceptance_length, ""),
            "tok_s": (st.tokens_per_s, ""), "idle": (st.idle_s, "s"),
            "free_runs": (st.free_runs, "B"), "free_shm": (st.free_shm, "B")}
    return Verdict(code, label, ", ".join(parts), perf)


def unknown(label: str, reason: str) -> Verdict:
    """The host could not be reached or refused us: we do not know how the run is."""
    return Verdict(UNKNOWN, label, reason)


def _perf_value(value) -> str:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return "U"  # the plugin convention's "no value"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def perfdata(verdicts: list[Verdict]) -> str:
    """`step=12 loss=3.21 ...`; with several containers each name is prefixed `<ctid>_`."""
    many = len(verdicts) > 1
    items = []
    for v in verdicts:
        prefix = (v.label.rpartition("/")[2] + "_") if many else ""
        items += [f"{prefix}{name}={_perf_value(value)}{unit if value is not None else ''}"
                  for name, (value, unit) in v.perfdata.items()]
    return " ".join(items)


def report(verdicts: list[Verdict]) -> tuple[int, str]:
    """(exit code, text): the worst verdict's line with every container's perfdata, then, with
    several containers, one line per container, worst first."""
    ordered = sorted(verdicts, key=lambda v: -SEVERITY[v.code])
    worst = ordered[0]
    perf = perfdata(verdicts)
    if len(verdicts) == 1:
        return worst.code, worst.line() + (f" | {perf}" if perf else "")
    counts = ", ".join(f"{sum(v.code == c for v in verdicts)} {NAMES[c]}"
                       for c in (CRITICAL, UNKNOWN, WARNING, OK)
                       if any(v.code == c for v in verdicts))
    first = (f"{NAMES[worst.code]} - {len(verdicts)} containers ({counts}); worst {plugin(worst.label)}: "
             f"{plugin(worst.summary)}")
    return worst.code, "\n".join([first + (f" | {perf}" if perf else ""), *(v.line() for v in ordered)])
