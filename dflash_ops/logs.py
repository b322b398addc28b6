"""`invoke logs`: the last lines of a run's train.log, or follow it until the run ends.

The last lines come from container_runs.py's `logs-tail` verb: it reads at most a window from the
log's end, so `logs -n 50` costs the same on a 1 GiB log as on a small one. Following runs `tail -F` (survives
the log being rotated or recreated by a restart of the run) under a watchdog shell in the container, over a
pty so that Ctrl-C reaches it:
- Ctrl-C: the pty delivers SIGINT, the watchdog kills its `tail` and exits;
- connection lost: the pty hangs up (SIGHUP), same thing; `tail --pid` also exits on its own
  once the watchdog is gone, however it died;
- the run ends (nobody holds the runs lock; after a stop, for END_GRACE_S, so that a restart of
  the same run is followed): the watchdog stops `tail` and exits.
Nothing is left in the container in any of these cases.
"""

from __future__ import annotations

import sys
import threading

from . import commands, facts, runs, terminal
from .errors import HostUnreachable, RemoteCommandFailed, RunStateError, UsageError

MARK = "==> dflash-ops:"
DEFAULT_LINES = 50
EXIT_INTERRUPTED = 130  # the watchdog's exit on SIGINT (Ctrl-C through the pty)
# a stopped run gone this long has ended (`invoke stop; invoke train --run NAME` is followed)
END_GRACE_S = 15

# The follower: `tail -F` must outlive nothing but must follow a file, so it stays shell, under a
# watchdog that ends it with the run (true while a process of run $2 holds the runs lock).
# $1 runs  $2 name ("" = latest)  $3 lines  $4 seconds without the run before ending
FOLLOW_SCRIPT = r'''
run_alive() {
  [ "$(cat "$1/.current" 2>/dev/null)" = "$2" ] || return 1
  flock -n -s -E 99 "$1/.lock" true 2>/dev/null
  [ $? -eq 99 ]
}
runs=$1 name=$2 lines=$3 grace=$4
[ -n "$name" ] || name=$(cat "$runs/.current" 2>/dev/null)
[ -n "$name" ] || { echo "dflash: no run yet under $runs"; exit 1; }
dir=$runs/$name
[ -d "$dir" ] || { echo "dflash: no run named $name under $runs"; exit 1; }
echo "==> dflash-ops: run $name"
tail -n "$lines" -F --pid=$$ -- "$dir/train.log" &
t=$!
trap 'kill "$t" 2>/dev/null; exit 130' INT
trap 'kill "$t" 2>/dev/null; exit 129' HUP
trap 'kill "$t" 2>/dev/null; exit 143' TERM
gone=0
while kill -0 "$t" 2>/dev/null; do
  if run_alive "$runs" "$name"; then gone=0; else gone=$((gone + 1)); fi
  # A run that was stopped may be restarted under the same name: wait for that a little longer.
  limit=1; [ -f "$dir/stopped" ] && limit=$grace
  [ "$gone" -ge "$limit" ] && break
  sleep 1
done
sleep 1
kill "$t" 2>/dev/null
wait "$t" 2>/dev/null
echo "==> dflash-ops: run $name is not running (exit code: $(cat "$dir/exit_code" 2>/dev/null || echo none))"
'''


def follow_argv(runs: str, run: str | None, lines: int) -> list[str]:
    return commands.sh_script(FOLLOW_SCRIPT, runs, run or "", str(int(lines)), str(END_GRACE_S))


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

    def line(self, line: str) -> None:
        out = self.out or sys.stdout
        shown = line if self.raw else terminal.visible(line)
        if line == "^C":  # the pty's echo of our Ctrl-C
            return
        if line.startswith(MARK):
            rest = line[len(MARK):].strip()
            if rest.startswith("run ") and self.run is None:
                self.run = terminal.visible(rest[4:].split(" ", 1)[0])
            elif " is not running" in rest:
                self.ended = terminal.visible(rest)
            print(shown, file=out, flush=True)
            return
        sig = runs.match(line)
        if sig is None:
            print(shown, file=out, flush=True)
            return
        self.findings[sig.key] = (sig, line)
        red, reset = ("\x1b[1;31m", "\x1b[0m") if getattr(out, "isatty", lambda: False)() else ("", "")
        print(f"{red}{shown}{reset}", file=out, flush=True)
        print(f"{red}>>> {runs.advice(sig)}{reset}", file=out, flush=True)

    def summary(self) -> list[str]:
        return [runs.advice(sig) for sig, _ in self.findings.values()]

    def describe(self) -> str:
        """What follows the log lines: why following stopped, and the runbook for each finding."""
        return "\n".join(["stopped following; the run goes on"] * self.interrupted + self.summary())

    def row(self) -> str:
        findings = "; ".join(self.summary())
        ended = self.ended or f"run {self.run}"
        return ended + (f"; {findings}" if findings else "")


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
    # A pty: Ctrl-C and hang-ups must reach the remote tail.
    result = t.session.exec(ct, follow_argv(ct.paths.runs, name, lines), check=False, pty=True,
                            out_stream=printer)
    printer.close()
    if t.dry_run:
        return printer
    if printer.run is None and "dflash: no run" in result.stdout:  # said before any line of the log
        message = [ln for ln in result.stdout.split("\n") if "dflash: no run" in ln][-1].strip()
        raise RunStateError(f"{ct.label}: {terminal.visible(message.removeprefix('dflash: '))}; "
                            f"start one with `invoke train`")
    if printer.ended is None:
        if result.exited == EXIT_INTERRUPTED:
            printer.interrupted = True
            return printer
        raise HostUnreachable(f"{ct.label}: following the log of run {printer.run or name} ended early "
                              f"(exit {result.exited}): the connection was lost or the follower was killed; "
                              f"nothing is left running in the container: run `invoke logs --follow` again")
    return printer


def _last_lines(t, name: str | None, lines: int, printer: LogPrinter) -> LogPrinter:
    """One round trip: the log's last `lines` lines, read from its end in the container."""
    ct = t.container
    result = t.session.run_in(ct, facts.runs_line(ct, "logs-tail", {"runs": ct.paths.runs, "name": name,
                                                                     "lines": lines}))
    if t.dry_run:
        return printer
    answer = facts.parse_json_line(result.stdout, f"{ct.label}: logs")
    if answer.get("error") == "no-run":
        raise RunStateError(f"{ct.label}: {terminal.visible(str(answer.get('message')))[:300]}; "
                            f"start one with `invoke train`")
    if answer.get("error") or not isinstance(answer.get("lines"), list):
        raise RemoteCommandFailed(f"{ct.label}: reading the log failed: "
                                  f"{terminal.visible(str(answer.get('message')))[:300]}")
    run = answer.get("run") if isinstance(answer.get("run"), str) else "?"
    printer.line(f"{MARK} run {run[:200]}")  # .current's text: the printer shows it visibly
    for line in answer["lines"]:
        printer.line(line if isinstance(line, str) else "")
    return printer
