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

import json
import sys
import threading

from . import runs, terminal
from .errors import HostUnreachable, UsageError
from .remote import ship
from .remote.prelude import LINE_CAP

MARK = "==> dflash-ops:"
DEFAULT_LINES = 50
EXIT_INTERRUPTED = 130  # the verb's exit on SIGINT (Ctrl-C through the pty)
# a stopped run gone this long has ended (`invoke stop; invoke train --run NAME` is followed)
END_GRACE_S = 15
TAIL_TIMEOUT_S = 30.0


def follow_payload(runs: str, run: str | None, lines: int) -> dict:
    return {"runs": runs, "name": run, "lines": int(lines), "grace": END_GRACE_S}


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
         raw: bool = False) -> LogPrinter:
    """Print the last `lines` of the run's log; with `follow`, keep printing until the run ends.

    `raw`: the log's bytes as the container wrote them, escape sequences included (asked for)."""
    ct = t.container
    name = runs.validate_run_name(run) if run is not None else None
    if int(lines) < 0:
        raise UsageError(f"-n {lines}: must be >= 0")
    if out is None and t.grouped:  # one of several containers: label every line
        out = LabelledLines(ct.label)
    printer = LogPrinter(out=out, raw=raw)
    if not follow:
        return _last_lines(t, name, int(lines), printer)
    # A pty: Ctrl-C and hang-ups must reach the verb. Of the stream only its tail is kept (mux.OutputTail).
    stream = follow_stream(printer)
    result = t.session.run_in(ct, ship.line(ct, "runs", "follow", follow_payload(ct.paths.runs, name, lines)),
                              check=False, pty=True, out_stream=stream)
    stream.close()
    if t.dry_run:
        return printer
    answer = stream.answer
    if answer is not None and "error" in answer:
        try:
            ship.answer(json.dumps(answer), f"{ct.label}: logs")
        except ship.Refusal as refusal:
            ship.raise_common(refusal)
    if answer is None or not isinstance(answer.get("ok"), dict):
        if result.exited == EXIT_INTERRUPTED:
            printer.interrupted = True
            return printer
        raise HostUnreachable(f"{ct.label}: following the log of run {printer.run or name} ended early "
                              f"(exit {result.exited}): the connection was lost or the follower was killed; "
                              f"nothing is left running in the container: run `invoke logs --follow` again")
    printer.finished(answer["ok"])
    return printer


def _last_lines(t, name: str | None, lines: int, printer: LogPrinter) -> LogPrinter:
    """One round trip: the log's last `lines` lines, read from its end in the container."""
    ct = t.container
    payload = {"runs": ct.paths.runs, "name": name, "lines": lines}
    try:
        answer = ship.call(t, "runs", "logs-tail", payload, timeout=TAIL_TIMEOUT_S, what="logs")
    except ship.Refusal as refusal:
        ship.raise_common(refusal)
    if t.dry_run:
        return printer
    got = answer.get("lines") if isinstance(answer, dict) else None
    if not isinstance(got, list):
        raise ship.BadAnswer(f"{ct.label}: logs: the answer's field 'lines' is not a list")
    run = answer.get("run") if isinstance(answer.get("run"), str) else "?"
    printer.started(run)  # .current's text: the printer shows it visibly
    for line in got:
        printer.line(line[:LINE_CAP] if isinstance(line, str) else "")
    return printer
