"""`invoke logs`: the last lines of a run's train.log, or follow it until the run ends.

Following runs `tail -F` (survives the log being rotated or recreated by a restart of the run) under
a watchdog shell in the container, over a pty so that Ctrl-C reaches it:
- Ctrl-C: the pty delivers SIGINT, the watchdog kills its `tail` and exits;
- connection lost: the pty hangs up (SIGHUP), same thing; `tail --pid` also exits on its own
  once the watchdog is gone, however it died;
- the run ends (nobody holds the runs lock; after a stop, for END_GRACE_S, so that a restart of
  the same run is followed): the watchdog stops `tail` and exits.
Nothing is left in the container in any of these cases.
"""

from __future__ import annotations

import io
import sys

from . import commands, jobs, signatures
from .errors import HostUnreachable, RunStateError, UsageError

MARK = "==> dflash-ops:"
DEFAULT_LINES = 50
EXIT_INTERRUPTED = 130  # the watchdog's exit on SIGINT (Ctrl-C through the pty)
END_GRACE_S = 15  # a stopped run gone this long has ended (`invoke stop; invoke train --run NAME` is followed)

# $1 runs  $2 name ("" = latest)  $3 lines  $4 follow (1|0)  $5 seconds without the run before ending
LOGS_SCRIPT = jobs.RUN_ALIVE_FN + r'''
runs=$1 name=$2 lines=$3 follow=$4 grace=$5
[ -n "$name" ] || name=$(cat "$runs/.current" 2>/dev/null)
[ -n "$name" ] || { echo "dflash: no run yet under $runs" >&2; exit 3; }
dir=$runs/$name
[ -d "$dir" ] || { echo "dflash: no run named $name under $runs" >&2; exit 3; }
echo "==> dflash-ops: run $name"
if [ "$follow" != 1 ]; then
  [ -f "$dir/train.log" ] && tail -n "$lines" -- "$dir/train.log"
  exit 0
fi
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


def logs_argv(runs: str, run: str | None, lines: int, follow: bool) -> list[str]:
    return commands.sh_script(LOGS_SCRIPT, runs, run or "", str(int(lines)), "1" if follow else "0",
                              str(END_GRACE_S))


class LogPrinter(jobs.LineSink):
    """Prints remote log lines as they come and highlights known failure signatures."""

    def __init__(self, out=None):
        self.out = out
        self.run: str | None = None
        self.ended: str | None = None
        self.interrupted = False
        self.findings: dict = {}

    def line(self, line: str) -> None:
        out = self.out or sys.stdout
        if line == "^C":  # the pty's echo of our Ctrl-C
            return
        if line.startswith(MARK):
            rest = line[len(MARK):].strip()
            if rest.startswith("run ") and self.run is None:
                self.run = rest[4:].split(" ", 1)[0]
            elif " is not running" in rest:
                self.ended = rest
            print(line, file=out, flush=True)
            return
        sig = signatures.match(line)
        if sig is None:
            print(line, file=out, flush=True)
            return
        self.findings[sig.key] = (sig, line)
        red, reset = ("\x1b[1;31m", "\x1b[0m") if getattr(out, "isatty", lambda: False)() else ("", "")
        print(f"{red}{line}{reset}", file=out, flush=True)
        print(f"{red}>>> {signatures.advice(sig)}{reset}", file=out, flush=True)

    def summary(self) -> list[str]:
        return [signatures.advice(sig) for sig, _ in self.findings.values()]


def show(t, run: str | None = None, lines: int = DEFAULT_LINES, follow: bool = False, out=None) -> LogPrinter:
    """Print the last `lines` of the run's log; with `follow`, keep printing until the run ends."""
    ct = t.container
    name = jobs.validate_run_name(run) if run is not None else None
    if int(lines) < 0:
        raise UsageError(f"-n {lines}: must be >= 0")
    printer = LogPrinter(out=out)
    argv = logs_argv(ct.paths.runs, name, lines, follow)
    # A pty only when following: Ctrl-C and hang-ups must reach the remote tail.
    result = t.session.exec(ct, argv, check=False, pty=follow, out_stream=printer,
                            err_stream=None if follow else io.StringIO())  # stderr: kept in the result
    printer.close()
    if t.dry_run:
        return printer
    if result.exited == jobs.EXIT_NO_RUN or (follow and "dflash: no run" in result.stdout):
        message = (result.stderr or result.stdout).strip().splitlines()[-1]
        raise RunStateError(f"{ct.label}: {message.removeprefix('dflash: ')}; start one with `invoke train`")
    if follow and printer.ended is None:
        if result.exited == EXIT_INTERRUPTED:
            printer.interrupted = True
            return printer
        raise HostUnreachable(f"{ct.label}: following the log of run {printer.run or name} ended early "
                              f"(exit {result.exited}): the connection was lost or the follower was killed; "
                              f"nothing is left running in the container: run `invoke logs --follow` again")
    return printer

