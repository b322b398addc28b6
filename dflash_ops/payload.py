"""The payload's scripts (remote_scripts/) as the tasks start them.

- argv builders: `payload_argv` gives train_dflash.py, warmup_compile.py and plan_layout.py the same
  config, --set values (the inventory's first) and device lists, written `--opt=value`;
- `run_script`: a script in the foreground with the run environment, its progress streamed (visibly),
  its own one-line error (`<script>: error: ...`) kept for the task's error, and its `RESULT <json>`
  lines parsed (`invoke eval`, `regenerate`, `plan`). One round trip, within its deadline.
- deadlines: every task's work in the container has one, `TIMEOUTS[task]` seconds or the task's
  `--timeout`. When it passes, the transport closes the command's SSH session, and the session's end
  ends the command's process group in the container (commands.SESSION_SCRIPT: SIGTERM, SIGKILL 5 s
  later, to the group that script made itself, never a pid read from the container); the task
  exits TIMED_OUT (13) with one line. Without one: `shell` (interactive) and `logs --follow`
  (it ends when the run does; Ctrl-C).
"""

from __future__ import annotations

import json
import math
import posixpath
import re
import sys
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from . import commands, terminal
from .errors import DflashOpsError, RemoteCommandFailed, TimedOut, UsageError
from .inventory import Container
from .remote import ship

SET_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
RESULT = "RESULT "


# --- deadlines ---------------------------------------------------------------------------------------
# Each task's default deadline in seconds for its work in the container (`--timeout` overrides it):
# a warm-up compiles every shape, an evaluation decodes its prompts twice, a regeneration a dataset.
TIMEOUTS = {"warmup": 3600.0, "eval": 3600.0, "regenerate": 43200.0, "plan": 1800.0, "stage": 3600.0,
            "exec": 3600.0}
REQUIRE_TIMEOUT_S = 60.0  # checking the paths a script needs (the facts helper's needs verb)


def timeout_of(task: str, given: float | None = None) -> float:
    """The deadline of `task`'s work: --timeout when given (seconds > 0), else TIMEOUTS[task]."""
    value = TIMEOUTS[task] if given is None else given
    if not (isinstance(value, (int, float)) and 0 < value < math.inf):
        raise UsageError(f"--timeout {given}: give the seconds the task may run in the container (> 0; "
                         f"default {TIMEOUTS[task]:g})")
    return float(value)


@contextmanager
def deadline(ct: Container, what: str, timeout: float, fix: str = "give a longer --timeout"):
    """The transport's TimedOut as the task's one line: what ran past which deadline, and the fix."""
    try:
        yield
    except TimedOut:
        raise TimedOut(f"{ct.label}: {what} ran past its deadline of {timeout:g} s and was ended in the "
                       f"container (its process group with it); {fix}") from None


# --- argv builders (pure) --------------------------------------------------------------------------

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
    """The argv of train_dflash.py / warmup_compile.py / plan_layout.py: same config, sets and devices.

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


# --- running one in the foreground ------------------------------------------------------------------

def results_of(stdout: str) -> list[dict]:
    """The JSON object of every `RESULT ` line (a script prints one per result). Lines are split on
    `\n` only, as the script writes them; a RESULT line that is not a JSON object is one error line."""
    found = []
    for line in stdout.split("\n"):
        if not line.startswith(RESULT):
            continue
        try:
            value = json.loads(line[len(RESULT):])
        except (ValueError, RecursionError):
            value = None
        if not isinstance(value, dict):
            raise RemoteCommandFailed(f"unreadable result line from the container: "
                                      f"{terminal.visible(line)[:200]}")
        found.append(value)
    return found


def script_error(argv: Sequence[str]) -> str:
    """The prefix of the script's own one-line error: `eval_dflash: error: ` for .../eval_dflash.py."""
    return f"{posixpath.splitext(posixpath.basename(argv[1]))[0]}: error: "


class ShowLines(terminal.LineSink):
    """A stream that prints what the script says, except the machine-readable RESULT lines, the
    weight-loading progress bars and lines starting with one of `hide`."""

    def __init__(self, echo=print, hide: tuple[str, ...] = ()):
        self._echo, self._hide = echo, hide

    def line(self, line: str) -> None:
        if not line.startswith((RESULT, *self._hide)) and "Loading weights" not in line:
            self._echo(terminal.visible(line))


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --- fail fast: the paths a script needs, checked before it imports torch ---------------------------

@dataclass(frozen=True)
class Need:
    """A path a script needs in the container (relative ones: under paths.code, the script's cwd):
    `test` is test(1)'s d (a directory), f (a file) or e (either); `error` is raised when it is not."""

    path: str
    test: str
    error: DflashOpsError


def require(t, needs: Sequence[Need]) -> None:
    """One round trip before the slow work (a payload script imports torch for 15-20 s before it
    reads its arguments): the facts helper's `needs` verb tests the paths in the container, and the
    first need that fails raises its error, as train's preflight does."""
    if not needs:
        return
    ct = t.container
    for need in needs:
        if need.test not in ("d", "f", "e"):
            raise ValueError(f"test {need.test!r}")
    payload = {"cwd": ct.paths.code, "needs": [[need.test, need.path] for need in needs]}
    try:
        with deadline(ct, "checking the paths the task needs", REQUIRE_TIMEOUT_S,
                      "a stat(2) of a few paths hung there: check its file systems (`invoke doctor`)"):
            value = ship.call(t, "facts", "needs", payload, timeout=REQUIRE_TIMEOUT_S,
                              what="checking the paths")
    except ship.Refusal as refusal:
        if refusal.kind == "no-cwd":
            raise RemoteCommandFailed(f"{ct.label}: {ct.paths.code} does not exist: "
                                      "run `invoke deploy`") from None
        ship.raise_common(refusal)
    if t.dry_run:
        return
    where = f"{ct.label}: checking the paths"
    missing = ship.field(value, "missing", list, where)
    if not all(type(i) is int and 0 <= i < len(needs) for i in missing):
        raise ship.BadAnswer(f"{where}: the answer's field 'missing' is not a list of the paths' indexes")
    if missing:
        raise needs[min(missing)].error


def run_script(t, argv: list[str], what: str, timeout: float, echo=print, ok: tuple[int, ...] = (0,),
               summary: tuple[str, ...] = ()):
    """Run `argv` (a payload script) in the container within `timeout` seconds (TimedOut past it, the
    script's process group ended there); (result, [RESULT records]). Output lines starting with one of
    `summary` are the script's own summary of its RESULT, which the task shows itself: not echoed, so
    the results are printed once.

    An exit code outside `ok`, or no RESULT line, is RemoteCommandFailed naming the script's own
    error line (its stderr's last line otherwise), with the fix when the code or venv is missing."""
    ct = t.container
    own_error = script_error(argv)
    with deadline(ct, what, timeout):
        result = t.session.exec(ct, argv, env=ct.run_env(), cwd=ct.paths.code, check=False, timeout=timeout,
                                out_stream=ShowLines(echo, summary),
                                err_stream=ShowLines(_to_stderr, (own_error,)))
    if t.dry_run:
        return result, []
    found = results_of(result.stdout)
    if result.exited not in ok or not found:
        said = result.stderr.strip().splitlines() or ["(no output)"]
        last = next((line for line in reversed(said) if line.startswith(own_error)), said[-1])
        hint = " (run `invoke deploy` first?)" if "No such file" in result.stderr else ""
        if "No module named" in result.stderr:
            hint = " (the container's venv predates remote_scripts/requirements.txt: run `invoke deploy`)"
        raise RemoteCommandFailed(f"{ct.label}: {what} failed (exit {result.exited}): {last}{hint}",
                                  exited=result.exited, stderr_tail=last)
    return result, found
