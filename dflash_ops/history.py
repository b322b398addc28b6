"""`invoke runs`, `invoke prune` and `invoke clean-cache`: what a container keeps on disk (every run,
its checkpoints, the compile caches) and removing what is no longer needed, one round trip each.

The work happens in the container (remote/history.py, shipped through remote/ship.py); here: the
flags' validation, the request, the answer's check (`checked`: every field with its type, or one line
naming it) and the tables. Names and paths in the answer come from the container and are shown
through terminal.markup (the rich table) or terminal.visible (plain lines).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass

from . import terminal
from .errors import RunStateError, UsageError
from .inventory import Container
from .remote import readings, ship
from .remote.prelude import STATES
from .remote.readings import human_bytes
from .target import Target
from .terminal import markup, visible

HISTORY_TIMEOUT_S = 300.0  # sizing every run directory on a slow disk
AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_age(text: str | None, flag: str = "--older-than") -> int | None:
    """`7d`, `12h`, `30m`, `2w`, `90s` -> seconds; None stays None."""
    if text is None:
        return None
    m = AGE.match(str(text))
    if not m:
        raise UsageError(f"{flag} {str(text)[:40]!r}: expected an age such as 7d, 12h, 30m or 2w")
    return int(float(m.group(1)) * UNITS[m.group(2)])


def check_keep(keep) -> int:
    if not isinstance(keep, int) or keep < 1:
        raise UsageError(f"--keep {keep}: keep at least 1 run (the newest); the alive run is always kept")
    return keep


def payload(ct, **extra) -> dict:
    return {"runs": ct.paths.runs, **extra}


def _ask(t, verb: str, args: dict, what: str | None = None, check=None) -> dict | None:
    """One verb of the history helper, its answer checked (`checked`, or `check`); None in a dry run."""
    what = what or ("runs" if verb == "list" else verb)
    try:
        answer = ship.call(t, "history", verb, args, timeout=HISTORY_TIMEOUT_S, what=what)
    except ship.Refusal as refusal:
        ship.raise_common(refusal)
    if t.dry_run:
        return None
    return (check or checked)(answer, f"{t.container.label}: {what}")


def require_run(t, run: str | None) -> str | None:
    """The run `run` names (or the latest) in one round trip: its name, or the one unknown-run error
    (runs.no_such_run, raised by ship.answer). None in a dry run."""
    answer = ship.call(t, "runs", "resolve", {"runs": t.container.paths.runs, "name": run}, what="run")
    return None if answer is None else ship.field(answer, "run", str, f"{t.container.label}: run")


def _int(value):
    return value if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 1 << 62 else None


def _float(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) and abs(value) < 1e300 else None


def _str(value, cap=200):
    return value[:cap] if isinstance(value, str) else None


def _record(r, where: str, i: int) -> dict:
    if not isinstance(r, dict) or not isinstance(r.get("name"), str):
        raise ship.BadAnswer(f"{where}: the answer's field 'runs[{i}].name' is not a run name")
    checkpoints = [c for c in (r.get("checkpoints") if isinstance(r.get("checkpoints"), list) else [])
                   if isinstance(c, dict) and isinstance(c.get("name"), str)]
    return {"name": r["name"][:200], "state": r.get("state") if r.get("state") in STATES else "?",
            "detail": _str(r.get("detail"), 300) or "", "alive": r.get("alive") is True,
            "step": _int(r.get("step")), "loss": _float(r.get("loss")),
            "acceptance_length": _float(r.get("acceptance_length")), "started": _int(r.get("started")),
            "ended": _int(r.get("ended")), "last_activity": _int(r.get("last_activity")),
            "duration_s": _int(r.get("duration_s")), "exit_code": _str(r.get("exit_code"), 40),
            "bytes": _int(r.get("bytes")), "latest_checkpoint": _str(r.get("latest_checkpoint"), 100),
            "checkpoints": [{"name": c["name"][:100], "step": _int(c.get("step")),
                             "bytes": _int(c.get("bytes"))} for c in checkpoints],
            "keep_last": _int(r.get("keep_last")), "pinned": r.get("pinned") is True}


PLAN_KINDS = ("run", "checkpoint", "leftover")


def checked(answer, where: str) -> dict:
    """The history helper's answer with every field of the type it should have; BadAnswer naming the
    first field that is not (a run list is what the whole answer is about)."""
    if not isinstance(answer, dict) or not isinstance(answer.get("runs"), list):
        raise ship.BadAnswer(f"{where}: the answer's field 'runs' is not a list of runs")
    unparsed = answer.get("unparsed") if isinstance(answer.get("unparsed"), list) else []
    out = {"now": _int(answer.get("now")), "alive": _str(answer.get("alive")),
           "runs": [_record(r, where, i) for i, r in enumerate(answer["runs"])],
           "unparsed": [n[:200] for n in unparsed[:100] if isinstance(n, str)]}
    if "plan" in answer:
        if not isinstance(answer.get("plan"), list):
            raise ship.BadAnswer(f"{where}: the answer's field 'plan' is not a list")
        plan = []
        for i, item in enumerate(answer["plan"]):
            if (not isinstance(item, dict) or item.get("what") not in PLAN_KINDS
                    or not isinstance(item.get("path"), str) or not isinstance(item.get("run"), str)):
                raise ship.BadAnswer(f"{where}: the answer's field 'plan[{i}]' is not a removal")
            plan.append({"run": item["run"][:200], "path": item["path"][:400], "what": item["what"],
                         "bytes": _int(item.get("bytes")), "why": _str(item.get("why"), 300) or ""})
        removed = answer.get("removed") if isinstance(answer.get("removed"), list) else []
        out.update(plan=plan, removed=[p[:400] for p in removed if isinstance(p, str)],
                   lock=_str(answer.get("lock"), 20))
    return out


def pin(t, run: str, pinned: bool = True) -> dict | None:
    """Pin (or unpin) a run so that prune never touches it; the list after it."""
    from .runs import validate_run_name

    return _ask(t, "pin", payload(t.container, run=validate_run_name(run), pin=bool(pinned)))


def list_runs(t, stall_after: float = 600) -> dict | None:
    """{"now", "alive", "runs": [record, newest first]} (see remote/history.py run_record)."""
    return _ask(t, "list", payload(t.container, stall_after=stall_after))


def prune(t, keep: int, older_than: str | None = None, act: bool = False) -> dict | None:
    """The plan (and with act, what was removed) for `--keep N [--older-than AGE]`."""
    args = payload(t.container, keep=check_keep(keep), older_than=parse_age(older_than), act=bool(act))
    return _ask(t, "prune", args)


def _when(epoch) -> str:
    try:
        return "-" if not epoch else time.strftime("%m-%d %H:%M", time.gmtime(epoch))
    except (OverflowError, OSError, ValueError):  # a date no clock gives
        return "-"


def _duration(seconds) -> str:
    if seconds is None:
        return "-"
    h, rem = divmod(int(seconds), 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def _num(value, spec) -> str:
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


@dataclass
class Row:
    cells: tuple

    @staticmethod
    def of(r: dict) -> Row:
        state = (r.get("state", "?") + (" (alive)" if r.get("alive") else "")
                 + (" (pinned)" if r.get("pinned") else ""))
        return Row((markup(str(r.get("name"))), state, _num(r.get("step"), "d"), _num(r.get("loss"), ".4f"),
                    _num(r.get("acceptance_length"), ".2f"), _when(r.get("started")),
                    _duration(r.get("duration_s")),
                    human_bytes(r.get("bytes")), markup(str(r.get("latest_checkpoint") or "-"))))


COLUMNS = ("run", "state", "steps", "loss", "tau", "started UTC", "took", "size", "latest")


def table(answer: dict, label: str):
    from rich.table import Table

    out = Table(title=f"{label}: {len(answer['runs'])} runs, "
                      f"{human_bytes(sum(r.get('bytes') or 0 for r in answer['runs']))}")
    for name in COLUMNS:
        out.add_column(name, justify="right" if name in ("steps", "loss", "tau", "size") else "left",
                       no_wrap=name != "run", min_width=8 if name == "run" else None)
    for r in answer["runs"]:
        out.add_row(*Row.of(r).cells)
    return out


def describe_prune(answer: dict, label: str, acted: bool) -> str:
    plan = answer.get("plan") or []
    total = sum(item.get("bytes") or 0 for item in plan)
    lines = [f"  {item['what']:<10} {human_bytes(item.get('bytes')):>10}  {visible(item['path'])}  "
             f"({item['why']})"
             for item in plan]
    if answer.get("alive"):
        lines.append(f"  kept       alive run {visible(answer['alive'])} (never touched)")
    unparsed = [visible(n)[:80] for n in (answer.get("unparsed") or [])[:20] if isinstance(n, str)]
    if unparsed:
        lines.append(f"  left alone, not runs: {', '.join(unparsed)}")
    pinned = [visible(r["name"]) for r in answer.get("runs") or [] if r.get("pinned")]
    lines += [f"  kept       pinned run {name} (never touched; `invoke runs --unpin {name}` lets prune "
              "see it)" for name in pinned]
    if not plan:
        return "\n".join([f"{label}: nothing to prune", *lines])
    if not acted:
        return "\n".join([f"{label}: would remove {len(plan)} item(s):", *lines,
                          f"would free {human_bytes(total)} ({total} bytes); run again with --yes to "
                          "remove them"])
    removed = set(answer.get("removed") or [])
    freed = sum(item.get("bytes") or 0 for item in plan if item["path"] in removed)
    missed = [visible(item["path"]) for item in plan if item["path"] not in removed]
    tail = [f"not removed (changed meanwhile or not removable): {', '.join(missed)}"] if missed else []
    return "\n".join([f"{label}: removed {len(removed)} item(s):", *lines, *tail,
                      f"freed {human_bytes(freed)} ({freed} bytes)"])


@dataclass
class Listing:
    """`invoke runs`: the table (a pipe gets 120 columns, rows on one line); --json: the answer."""

    answer: dict
    label: str
    pipe_width = 120

    def describe(self):
        return table(self.answer, self.label)

    def facts(self) -> dict:
        return self.answer

    def row(self) -> str:
        return f"{len(self.answer['runs'])} runs"


@dataclass
class Pruned:
    """`invoke prune`: what would go (or went) and the bytes it frees."""

    answer: dict
    label: str
    acted: bool

    def describe(self) -> str:
        return describe_prune(self.answer, self.label, self.acted)

    def facts(self) -> dict:
        """--json: the container's answer (plan: what, path, bytes, why; removed) and whether it acted."""
        return {"container": self.label, "acted": self.acted, **self.answer}

    def row(self) -> str:
        return self.describe().splitlines()[0]


# --- runs --history: one run's segments, like sacct's steps -----------------------------------------
# Each launch, resume or automatic restart of a run is a segment (remote/runs.py writes them into
# the run's segments.jsonl, prelude.read_segments reads them): when it started and ended, how its
# training process ended (exit code or signal), and the steps it covered.

SEGMENT_COLUMNS = ("segment", "kind", "start UTC", "end UTC", "elapsed", "exit", "steps")


def parse_segment(value) -> dict | None:
    """A segment of prelude.read_segments (the container's data), each field of its type or None."""
    if not isinstance(value, dict) or value.get("kind") not in ("launch", "resume", "restart"):
        return None
    number = {k: _int(value.get(k))
              for k in ("n", "start", "log_offset", "from_step", "end", "last_step", "restart")}
    if number["n"] is None:
        return None
    return {**number, "kind": value["kind"], "exit": _str(value.get("exit"), 40),
            "after": _str(value.get("after"), 40), "stopped": value.get("stopped") is True}


def segments(t, run: str, stall_after: float = 600) -> dict | None:
    """Run `run`'s segments, oldest first, checked (`checked_segments`); None in a dry run."""
    from .runs import validate_run_name

    return _ask(t, "segments", payload(t.container, run=validate_run_name(run), stall_after=stall_after),
                what="runs --history", check=checked_segments)


def checked_segments(answer, where: str) -> dict:
    """The segments verb's answer, every field of its type (status.segment: each segment's), with each
    segment's elapsed seconds (a running one's: until `now`) and the total. Pure."""
    if not isinstance(answer, dict) or not isinstance(answer.get("segments"), list):
        raise ship.BadAnswer(f"{where}: the answer's field 'segments' is not a list of segments")
    now, alive = _int(answer.get("now")), answer.get("alive") is True
    found = [s for s in map(parse_segment, answer["segments"][:1000]) if s is not None]
    for i, s in enumerate(found):
        running = alive and i == len(found) - 1 and s["end"] is None
        end = now if running else s["end"]
        s["running"] = running
        s["elapsed_s"] = max(0, end - s["start"]) if end is not None and s["start"] is not None else None
    return {"run": _str(answer.get("run")) or "?", "now": now, "alive": alive,
            "state": answer.get("state") if answer.get("state") in STATES else "?",
            "detail": _str(answer.get("detail"), 300) or "", "segments": found,
            "total_elapsed_s": sum(s["elapsed_s"] or 0 for s in found)}


def _exit(s: dict) -> str:
    """`0`, `exit 3`, `signal KILL`; `running`; `stopped` after a stop on request."""
    if s.get("running"):
        return "running"
    code = s.get("exit")
    if code is None:
        return "unrecorded" if s.get("end") is None else "-"
    if code.startswith("signal "):
        import signal

        num = code[7:]
        try:
            shown = "signal " + signal.Signals(int(num)).name.removeprefix("SIG")
        except ValueError:
            shown = code
    else:
        shown = code if code == "0" else f"exit {code}"
    return shown + (" (stopped)" if s.get("stopped") else "")


def _steps(s: dict) -> str:
    first, last = (s.get("from_step") or 0) + 1, s.get("last_step")
    if last is None or last < first:
        return f"from {first - 1} (none logged)"
    return f"{first}-{last}"


def segment_rows(answer: dict) -> list[tuple]:
    """One row of SEGMENT_COLUMNS per segment (text, not markup)."""
    return [(str(s["n"]), s["kind"] + (f" {s['restart']}" if s.get("restart") else ""), _when(s["start"]),
             "-" if s.get("running") else _when(s["end"]), _duration(s["elapsed_s"]), _exit(s), _steps(s))
            for s in answer["segments"]]


def describe_segments(answer: dict, label: str) -> str:
    """`runs --history NAME` as text: a header, one row per segment, the total elapsed."""
    rows = [SEGMENT_COLUMNS, *segment_rows(answer)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(SEGMENT_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    state = answer["state"] + (f" ({answer['detail']})" if answer["detail"] else "")
    head = f"run {visible(answer['run'])} on {label}: {state}"
    if not answer["segments"]:
        return f"{head}\n(no segments recorded: the run was launched before segments.jsonl existed)"
    total = _duration(answer["total_elapsed_s"])
    return "\n".join([head, *(visible(line) for line in lines),
                      f"total elapsed: {total} in {len(answer['segments'])} segment(s)"])


@dataclass
class Segments:
    """`invoke runs --history NAME`: the segments as text (--json: the answer, cli.show)."""

    answer: dict
    label: str

    def describe(self) -> str:
        return describe_segments(self.answer, self.label)

    def facts(self) -> dict:
        return self.answer

    def row(self) -> str:
        return (f"run {visible(self.answer['run'])}: {len(self.answer['segments'])} segment(s), "
                f"{_duration(self.answer['total_elapsed_s'])}")


# --- clean-cache: the compile caches the inventory names ---------------------------------------------
# The cleaner runs in the container (remote/runs.py `clean-caches`) and holds the runs lock while it
# deletes, so no run can start half-way; while a run holds that lock it refuses unless forced.

CLEAN_TIMEOUT_S = 600.0  # removing a compile cache of many files


@dataclass(frozen=True)
class Freed:
    name: str
    path: str
    bytes: int
    files: int
    existed: bool


def clean_payload(ct: Container, force: bool = False) -> dict:
    return {"runs": ct.paths.runs, "caches": ct.paths.caches.all(), "force": bool(force)}


def _count(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62 else 0


def parse_clean(ct: Container, answer: dict) -> list[Freed]:
    """The cleaner's answer -> what was freed, for the caches the inventory names (pure)."""
    freed = answer.get("freed") if isinstance(answer, dict) else None
    if not isinstance(freed, dict):
        raise ship.BadAnswer(f"{ct.label}: clean-cache: the answer's field 'freed' is not an object")
    out = []
    for name, path in sorted(ct.paths.caches.all().items()):
        usage = freed.get(name) if isinstance(freed.get(name), dict) else {}
        if usage.get("left") is not False:
            raise RunStateError(f"{ct.label}: {path} could not be removed completely")
        out.append(Freed(name, path, _count(usage.get("bytes")), _count(usage.get("files")),
                         usage.get("exists") is True))
    return out


@dataclass(frozen=True)
class Cleaned:
    """What clean-cache freed in one container."""

    freed: list[Freed]

    def describe(self) -> str:
        lines = [f"{f.name:<17} {readings.human_bytes(f.bytes):>10}  {f.files:>6} files  {f.path}"
                 + ("" if f.existed else "  (was empty)") for f in self.freed]
        return "\n".join([*lines, self.row()])

    def facts(self) -> dict:
        return {"freed": [asdict(f) for f in self.freed], "bytes": sum(f.bytes for f in self.freed)}

    def row(self) -> str:
        total = sum(f.bytes for f in self.freed)
        files = sum(f.files for f in self.freed)
        return f"freed {readings.human_bytes(total)} ({total} bytes) in {files} files"


def clean_cache(t: Target, force: bool = False) -> Cleaned:
    ct = t.container
    try:
        answer = ship.call(t, "runs", "clean-caches", clean_payload(ct, force), timeout=CLEAN_TIMEOUT_S,
                           what="clean-cache")
    except ship.Refusal as refusal:
        if refusal.kind == "busy":
            run = refusal.extra.get("run") if isinstance(refusal.extra.get("run"), str) else "?"
            raise RunStateError(f"run {terminal.visible(run)[:80]!r} is alive on {ct.label}: its compile "
                                "caches are in use; stop it first (`invoke stop`) or pass --force") from None
        ship.raise_common(refusal)
    if t.dry_run:
        return Cleaned([])
    return Cleaned(parse_clean(ct, answer))
