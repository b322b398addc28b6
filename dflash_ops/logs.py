"""`invoke logs`: the last lines of a run's train.log, or follow it until the run ends.

The last lines come from remote/runs.py's `logs-tail` verb: it reads at most a window from the
log's end, so `logs -n 50` costs the same on a 1 GiB log as on a small one. Following is its `follow`
verb: `tail -F` (survives the log being rotated or recreated by a restart of the run) under a Python
loop in the container that streams each line as JSON (cut to a bounded length) and ends with the run,
over a pty so that Ctrl-C reaches it:
- Ctrl-C: the pty delivers SIGINT, the verb kills its `tail` and exits;
- connection lost: the pty hangs up (SIGHUP), same thing; `tail --pid` also exits on its own
  once the verb is gone, however it died;
- the run ends (nobody holds the runs lock; after a stop, for END_GRACE_S, so that a restart of
  the same run is followed): the verb stops `tail` and answers with the run's state (run_state).
Nothing is left in the container in any of these cases; here each line is shown as it comes and
the result keeps only the stream's tail (mux.OutputTail).
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import sys
import threading

from . import history, runs, terminal
from .errors import HostUnreachable, UsageError
from .remote import ship
from .remote.prelude import LINE_CAP
from .remote.readings import human_bytes

MARK = "==> dflash-ops:"
DEFAULT_LINES = 50
EXIT_INTERRUPTED = 130  # the verb's exit on SIGINT (Ctrl-C through the pty)
# a stopped run gone this long has ended (`invoke stop; invoke train --run NAME` is followed)
END_GRACE_S = 15
TAIL_TIMEOUT_S = 30.0


def follow_payload(runs: str, run: str | None, lines: int, chosen: dict | None = None) -> dict:
    return {"runs": runs, "name": run, "lines": int(lines), "grace": END_GRACE_S, **(chosen or {})}


GREP_CAP = 1000  # characters of a --grep pattern
SINCE_HELP = "an age such as 10m, 2h or 1d, or an ISO time such as 2026-01-01T12:00:00Z (no zone: local time)"


def check_grep(pattern: str | None) -> str | None:
    """--grep is a Python regular expression (the container's Python searches each line with it):
    compiled here first, so a bad one is one line before anything is sent."""
    if pattern is None:
        return None
    pattern = str(pattern)
    if len(pattern) > GREP_CAP:
        raise UsageError(f"--grep: {len(pattern)} characters; at most {GREP_CAP}")
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        shown = terminal.visible(pattern)[:80]
        raise UsageError(f"--grep {shown!r}: not a regular expression: {exc}") from None
    return pattern


def parse_since(text: str | None) -> dict | None:
    """--since: {"ago": seconds} (10m, 2h: counted on the container's clock) or {"at": epoch s}."""
    if text is None:
        return None
    text = str(text).strip()
    if history.AGE.match(text):
        return {"ago": history.parse_age(text, "--since")}
    try:
        when = _dt.datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
    except ValueError:
        raise UsageError(f"--since {terminal.visible(text)[:40]!r}: expected {SINCE_HELP}") from None
    return {"at": when.timestamp()}


def filters(grep: str | None, since: str | None) -> dict:
    """The payload's --grep and --since (checked here: a bad one is one line, exit 2)."""
    chosen = {"grep": check_grep(grep), "since": parse_since(since)}
    return {k: v for k, v in chosen.items() if v is not None}


class LogPrinter(terminal.LineSink):
    """Prints remote log lines as they come and highlights known failure runs.

    Lines are the container's text: shown through `terminal.visible` unless `raw` (`logs --raw`).
    """

    def __init__(self, out=None, raw: bool = False):
        self.out = out
        self.raw = raw
        self.run: str | None = None
        self.ended: str | None = None
        self.interrupted = False
        self.findings: dict = {}

    def _print(self, text: str) -> None:
        print(text, file=self.out or sys.stdout, flush=True)

    def note(self, text: str) -> None:
        self._print(f"{MARK} {text}")

    def started(self, run: str) -> None:
        self.run = terminal.visible(run)[:200]
        self._print(f"{MARK} run {self.run}")

    def finished(self, answer: dict) -> None:
        code = answer.get("exit_code") if isinstance(answer.get("exit_code"), str) else None
        self.ended = f"run {self.run} is not running (exit code: {terminal.visible(code or 'none')[:40]})"
        self._print(f"{MARK} {self.ended}")

    def line(self, line: str) -> None:
        out = self.out or sys.stdout
        shown = line if self.raw else terminal.visible(line)
        sig = runs.match(line)
        if sig is None:
            self._print(shown)
            return
        self.findings[sig.key] = (sig, line)
        red, reset = ("\x1b[1;31m", "\x1b[0m") if getattr(out, "isatty", lambda: False)() else ("", "")
        self._print(f"{red}{shown}{reset}")
        self._print(f"{red}>>> {runs.advice(sig)}{reset}")

    def summary(self) -> list[str]:
        return [runs.advice(sig) for sig, _ in self.findings.values()]

    def describe(self) -> str:
        """What follows the log lines: why following stopped, and the runbook for each finding."""
        return "\n".join(["stopped following; the run goes on"] * self.interrupted + self.summary())

    def row(self) -> str:
        findings = "; ".join(self.summary())
        ended = self.ended or f"run {self.run}"
        return ended + (f"; {findings}" if findings else "")


def follow_stream(printer: LogPrinter) -> ship.Stream:
    """The follow verb's items -> the printer: {"run"} first, then {"line"} per log line."""
    def item(value: dict) -> None:
        if isinstance(value.get("line"), str):
            printer.line(value["line"][:LINE_CAP])
        elif isinstance(value.get("run"), str) and printer.run is None:
            printer.started(value["run"])

    return ship.Stream(item)


class LabelledLines(terminal.LineSink):
    """Where a fan-out's log lines go: each prefixed with its container, whole lines only."""

    _lock = threading.Lock()

    def __init__(self, label: str, out=None):
        self.label, self.out = label, out

    def line(self, line: str) -> None:
        with self._lock:
            print(f"{self.label} | {line}", file=self.out or sys.stdout, flush=True)

    def isatty(self) -> bool:
        return False


def show(t, run: str | None = None, lines: int = DEFAULT_LINES, follow: bool = False, out=None,
         raw: bool = False, grep: str | None = None, since: str | None = None) -> LogPrinter:
    """Print the last `lines` of the run's log; with `follow`, keep printing until the run ends.

    `grep`: only the lines this regular expression matches; `since`: only those written since then
    (both for the last lines; `grep` for the followed ones too). `raw`: the log's bytes as the
    container wrote them, escape sequences included (asked for)."""
    ct = t.container
    name = runs.validate_run_name(run) if run is not None else None
    if int(lines) < 0:
        raise UsageError(f"-n {lines}: must be >= 0")
    chosen = filters(grep, since)
    if out is None and t.grouped:  # one of several containers: label every line
        out = LabelledLines(ct.label)
    printer = LogPrinter(out=out, raw=raw)
    if not follow:
        return _last_lines(t, name, int(lines), printer, chosen)
    # A pty: Ctrl-C and hang-ups must reach the verb. Of the stream only its tail is kept (mux.OutputTail).
    stream = follow_stream(printer)
    result = t.session.run_in(ct, ship.line(ct, "runs", "follow", follow_payload(ct.paths.runs, name, lines,
                                                                                 chosen)),
                              check=False, pty=True, out_stream=stream)
    stream.close()
    if t.dry_run:
        return printer
    answer = stream.answer
    if answer is not None and "error" in answer:
        try:
            ship.answer(json.dumps(answer), f"{ct.label}: logs")
        except ship.Refusal as refusal:
            refused(refusal, chosen)
    if answer is None or not isinstance(answer.get("ok"), dict):
        if result.exited == EXIT_INTERRUPTED:
            printer.interrupted = True
            return printer
        raise HostUnreachable(f"{ct.label}: following the log of run {printer.run or name} ended early "
                              f"(exit {result.exited}): the connection was lost or the follower was killed; "
                              f"nothing is left running in the container: run `invoke logs --follow` again")
    printer.finished(answer["ok"])
    return printer


def refused(refusal: ship.Refusal, chosen: dict) -> None:
    """The logs verbs' refusals: (--grep) a pattern the container's Python refused or that took too
    long is the operator's input, exit 2; the others as every task's (an unknown run: its one line)."""
    if "grep" in chosen and refusal.kind in ("bad-input", "timeout"):
        raise UsageError(str(refusal)) from None
    ship.raise_common(refusal)


def _last_lines(t, name: str | None, lines: int, printer: LogPrinter, chosen: dict) -> LogPrinter:
    """One round trip: the log's last `lines` lines (those --grep and --since choose), read from its
    end in the container."""
    ct = t.container
    payload = {"runs": ct.paths.runs, "name": name, "lines": lines, **chosen}
    try:
        answer = ship.call(t, "runs", "logs-tail", payload, timeout=TAIL_TIMEOUT_S, what="logs")
    except ship.Refusal as refusal:
        refused(refusal, chosen)
    if t.dry_run:
        return printer
    got = answer.get("lines") if isinstance(answer, dict) else None
    if not isinstance(got, list):
        raise ship.BadAnswer(f"{ct.label}: logs: the answer's field 'lines' is not a list")
    run = answer.get("run") if isinstance(answer.get("run"), str) else "?"
    printer.started(run)  # .current's text: the printer shows it visibly
    for line in got:
        printer.line(line[:LINE_CAP] if isinstance(line, str) else "")
    searched, size = answer.get("searched"), answer.get("size")
    if chosen and all(isinstance(v, int) and not isinstance(v, bool) for v in (searched, size)) \
            and searched < size:
        printer.note(f"searched the log's last {human_bytes(searched)} of {human_bytes(size)}")
    return printer
