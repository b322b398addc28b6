"""Invocation-wide plumbing for tasks.py: shared options, targets and fan-out, errors -> exit codes.

`invoke warmup train --ct 200`: Invoke gives `--ct` to `train` only; `Executor` (named in the
project's invoke.yaml) sees every call of the invocation first and hands the one value of each
shared option to every task, refusing two different values.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import inspect
import json
import os
import sys

import invoke
from invoke import Exit
from invoke.exceptions import ParseError

from . import fanout, terminal
from .errors import DflashOpsError, ExitStatus, UsageError
from .inventory import DEFAULT_INVENTORY
from .target import Target, resolve, resolve_one

ROWS = "rows"  # op_task(fan_out=ROWS): several containers give one row each

# Python's last garbage collections at exit walk every object the imports made (Invoke, paramiko,
# fabric): 0.3-0.5 s of a one-round-trip task on a loaded 2-core host (bench/RESULTS.md, issue 19).
# Frozen, they are left to the process's end. The atexit handlers registered before this one (the
# sessions closed, logging flushed) run after it; stdout and stderr are flushed as always.
atexit.register(gc.freeze)

# Options that mean the same thing for every task of one invocation, with their "not given" value.
SHARED_OPTIONS = {"ct": None, "inventory": None, "dry_run": False, "group": None, "run": None}
COMMON_HELP = {
    "ct": "container id(s), e.g. 200 or 200,201 (default: the inventory's default_container)",
    "inventory": "inventory YAML (default: $INVOKE_DFLASH_INVENTORY or inventory/production.yaml)",
    "dry_run": "print the exact host command lines and connect to nothing",
    "group": "an inventory group of containers",
    "run": "run name (default: the latest run); given once, it applies to every task of the invocation",
    "json": "print the result as JSON for scripts (several containers: {container: result})",
    "verbose": "with --dry-run: also the exact host lines (packed helper code elided)",
}


def unify_shared_options(calls) -> dict:
    """One value per shared option across all calls; two different given values is an error."""
    chosen = {}
    for name, unset in SHARED_OPTIONS.items():
        given = {}
        for call in calls:
            value = call.kwargs.get(name, unset)
            if value != unset and value is not None:
                given.setdefault(str(value), call.called_as or call.task.name)
        if len(given) > 1:
            shown = ", ".join(f"--{name.replace('_', '-')} {v} ({t})" for v, t in given.items())
            raise Exit(f"error: conflicting values in one invocation: {shown}", code=ExitStatus.USAGE)
        if given:
            value = next(v for call in calls if (v := call.kwargs.get(name, unset)) not in (unset, None))
            chosen[name] = value
    return chosen


def _usage_errors_exit_2() -> None:
    """Invoke exits 1 when it cannot parse the task part of the command line (an unknown task or
    flag, a flag without its value); every usage error of this tool exits 2 (ExitStatus.USAGE), so
    those do too. Invoke has no hook for it: its Program.parse_tasks is wrapped once, when tasks.py
    imports this module (the core options, parsed before, keep Invoke's own handling)."""
    parse_tasks = invoke.Program.parse_tasks
    if getattr(parse_tasks, "usage_exit", False):
        return

    @functools.wraps(parse_tasks)
    def parse_tasks_or_usage(self):
        try:
            return parse_tasks(self)
        except ParseError as exc:
            raise Exit(f"error: {terminal.visible(str(exc))}", code=ExitStatus.USAGE) from None

    parse_tasks_or_usage.usage_exit = True
    invoke.Program.parse_tasks = parse_tasks_or_usage


_usage_errors_exit_2()


def _quiet_stdout() -> None:
    """The reader of stdout left (`invoke --list | head -1`): later writes, and the flush at exit, go
    to /dev/null instead of raising BrokenPipeError again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _stops_quietly(method):
    """A Program step that writes or runs tasks (the help, --list, the tasks), made to end as every
    task does: a closed pipe stops quietly (exit 141), Ctrl-C prints `interrupted` (exit 130), never a
    traceback. The output is flushed inside it, so a closed pipe is seen here, not at the exit."""

    @functools.wraps(method)
    def quietly(self, *args, **kwargs):
        try:
            result = method(self, *args, **kwargs)
            sys.stdout.flush()
            return result
        except BrokenPipeError:
            _quiet_stdout()
            raise Exit(code=ExitStatus.BROKEN_PIPE) from None
        except KeyboardInterrupt:
            raise Exit("interrupted", code=ExitStatus.INTERRUPTED) from None

    quietly.stops_quietly = True
    return quietly


def _program_steps_stop_quietly() -> None:
    """Invoke's Program prints the help and --list in parse_cleanup and runs the tasks in execute,
    both after tasks.py is imported; they are wrapped once here (a reader that leaves or a Ctrl-C
    earlier, while Python imports, is Python's own)."""
    for name in ("parse_cleanup", "execute"):
        method = getattr(invoke.Program, name)
        if not getattr(method, "stops_quietly", False):
            setattr(invoke.Program, name, _stops_quietly(method))


_program_steps_stop_quietly()


class Executor(invoke.Executor):
    def expand_calls(self, calls):
        calls = super().expand_calls(calls)
        chosen = unify_shared_options(calls)
        for call in calls:
            params = inspect.signature(call.task.body).parameters
            for name, value in chosen.items():
                if name in params:
                    call.kwargs[name] = value
        return calls


def inventory_path(c, inventory: str | None) -> str | None:
    if inventory:
        return inventory
    try:
        return c.config.dflash.inventory
    except (AttributeError, KeyError):
        return None


def target(c, ct=None, inventory=None, dry_run=False) -> Target:
    return resolve_one(inventory_path(c, inventory), ct, dry_run)


def targets(c, ct=None, group=None, inventory=None, dry_run=False) -> list[Target]:
    return resolve(inventory_path(c, inventory), ct, group, dry_run)


def show(result, as_json: bool = False) -> None:
    """THE output of a task: print what it returned, then raise its `error` if it has one (doctor:
    the table first, then exit 1; a fan-out: the rows, then exit 8).

    `describe()` is text (shown visibly: results quote the container), a rich renderable or a list
    of both; an `aside()` (`status --check`'s lines) goes to stderr first. A result may carry
    `exit_with` (status --check: the monitoring-plugin code) instead of an error.

    `as_json` (a task's --json): `facts()` instead, as JSON on stdout, the same for every task (a
    fan-out: {container: facts}, its table on stderr); the error and exit code are the same.
    """
    if result is None:
        return
    width = getattr(result, "pipe_width", 240)
    aside = getattr(result, "aside", None)
    if as_json:
        if isinstance(result, fanout.Rows):  # the rows for a person, the facts for the script
            _print(result.describe(), stderr=True, width=width)
        print(as_json_text(result.facts()), file=_JSON_OUT[0] if _JSON_OUT else sys.stdout)
    else:
        if aside is not None:
            _print(aside(), stderr=True, width=width)
        _print(result.describe(), width=width)
    error = getattr(result, "error", None)
    if error is not None:
        raise error
    code = getattr(result, "exit_with", 0)
    if code:
        raise Exit(code=code)


_JSON_OUT: list = []  # with --json: the stdout the JSON goes to, while the task's progress goes to stderr


@contextlib.contextmanager
def working_output(as_json: bool):
    """Where a task's progress goes while it works (pip's output, a log until the first step, an
    evaluation's lines): stdout, or with --json stderr, so that stdout holds the JSON alone (`show`
    prints it to the stdout of the outermost --json, however nested: `status` shows through
    `on_targets`)."""
    if not as_json:
        yield
        return
    _JSON_OUT.append(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _JSON_OUT.pop()


def as_json_text(facts) -> str:
    """A result's facts as `--json` prints them: indented, ASCII only (a container's control
    characters and escape sequences arrive as JSON escapes, never as terminal bytes)."""
    return json.dumps(facts, indent=2, ensure_ascii=True, default=str)


class Changed:
    """A result that did something (sandbox up/down): one line per change, then the result."""

    def __init__(self, result):
        self.result = result

    def describe(self) -> str:
        changes = self.result.changed or ("nothing to do: already as asked",)
        return "\n".join([*changes, self.result.describe()])

    def row(self) -> str:
        return "; ".join(self.result.changed) or "nothing to do"


def _print(text, stderr: bool = False, width: int | None = 240) -> None:
    """Text visibly, a renderable through rich, a list part by part; on a pipe, `width` columns (a
    result's `pipe_width`; None: rich's own choice, $COLUMNS or 80)."""
    if isinstance(text, list):
        for part in text:
            _print(part, stderr, width)
    elif isinstance(text, str):
        if text:
            print(terminal.visible(text, newlines=True), file=sys.stderr if stderr else sys.stdout)
    elif text is not None:
        console = terminal.console(stderr=stderr)
        if not console.is_terminal and width:  # logs and pipes: one line per row, not wrapped at 80
            console = terminal.console(stderr=stderr, width=width)
        console.print(text)


def on_targets(fn, fan_out):
    """The task body `fn(t, **options)` run on the containers --ct/--group select, its result shown.

    One container (no --group): the body's result is shown (`describe()`), nothing in a dry run.
    Several: `fan_out` decides, once for every task: None refuses, ROWS runs the body on each
    (`fanout.run`: hosts in parallel) and shows one row per container (`row()`), a function takes the
    targets and the options and returns the result to show (train: one run over many nodes).
    """
    @functools.wraps(fn)
    def run(c, **options):
        dry_run = bool(options.get("dry_run"))
        chosen = resolve(inventory_path(c, options.get("inventory")), options.get("ct"), options.get("group"),
                         dry_run)
        as_json = bool(options.get("json"))
        if len(chosen) == 1 and not chosen[0].grouped:
            with working_output(as_json):
                result = fn(chosen[0], **options)
            if not dry_run or getattr(result, "shown_in_dry_run", False):  # deploy's plan
                show(result, as_json)
            return
        if fan_out is None:
            raise UsageError("this task works on one container; give a single --ct")
        if fan_out is not ROWS:
            with working_output(as_json):
                result = fan_out(chosen, **options)
            show(result, as_json)
            return

        def row(t):
            result = fn(t, **options)
            shown = result is not None and (not dry_run or getattr(result, "shown_in_dry_run", False))
            return result if shown else "dry run"

        with working_output(as_json):
            outcomes = fanout.run(chosen, row)
        show(fanout.Rows(fn.__name__.replace("_", "-"), outcomes), as_json)

    return run


def status(c, run=None, json=False, stall_after=600, ct=None, group=None, inventory=None, dry_run=False,
           watch=False, interval=5, check=False, hang_after=1800, min_free="10G", min_free_shm="512M",
           prometheus=None):
    """`invoke status`, routed once: --check and --prometheus take every selected container as it is
    (a bad inventory is UNKNOWN too: oncall/alerting.py); the view fans out like any task."""
    from .oncall import alerting

    def chosen():
        return targets(c, ct, group, inventory, dry_run)

    if json and (check or prometheus is not None):
        raise UsageError("--json is the view's; --check and --prometheus have their own formats: give one")
    if check:
        return alerting.plugin_check(chosen, run, stall_after, hang_after, min_free, min_free_shm)
    if prometheus is not None:
        return alerting.export_metrics(chosen(), run, float(stall_after),
                                       None if prometheus is True else prometheus)
    on_targets(alerting.status_one, fan_out=alerting.status_rows)(
        c, run=run, json=json, stall_after=stall_after, ct=ct, group=group, inventory=inventory,
        dry_run=dry_run, watch=watch, interval=interval)
    return None


def shows(fn):
    """A task body that takes Invoke's context: what it returns is shown (`show`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = bool(kwargs.get("json"))
        with working_output(as_json):
            result = fn(*args, **kwargs)
        show(result, as_json)

    return wrapper


def example_inventory_note(fn, args, kwargs) -> str:
    """`; the inventory was the example ...` when a task that reads an inventory was given none (no
    --inventory, no INVOKE_DFLASH_INVENTORY): its errors name the example's hosts, say so."""
    if "inventory" not in inspect.signature(fn).parameters or kwargs.get("inventory"):
        return ""
    c = args[0] if args else None
    if not isinstance(c, invoke.Context) or inventory_path(c, None):
        return ""
    return (f"; the inventory was the example {DEFAULT_INVENTORY} (no --inventory given and "
            "INVOKE_DFLASH_INVENTORY not set)")


def reports_errors(fn):
    """Turn a DflashOpsError into a one-line message on stderr and the error's exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DflashOpsError as exc:
            # Messages quote remote stderr and container files: shown visibly, on one line.
            raise Exit(f"error: {terminal.visible(str(exc))}{example_inventory_note(fn, args, kwargs)}",
                       code=exc.exit_status) from None
        except KeyboardInterrupt:
            raise Exit("interrupted", code=ExitStatus.INTERRUPTED) from None
        except BrokenPipeError:
            # `invoke status | head -3`: the reader left; stop quietly, as other CLI tools do.
            _quiet_stdout()
            raise Exit(code=ExitStatus.BROKEN_PIPE) from None

    return wrapper


# Number-valued flags whose default is None (so Invoke cannot tell they are numbers).
NUMERIC_FLAGS = {"max_steps": int, "rdzv_port": int, "num_prompts": int, "max_new_tokens": int, "limit": int,
                 "max_restarts": int, "batch_size": int, "hosts": int, "grace": float, "stall_after": float,
                 "interval": float, "keep": int, "hang_after": float, "every": float, "timeout": float,
                 "samples": int, "temperature": float, "seed": int, "self_prompts": int,
                 "lead_words": int}


def parse_numbers(fn):
    """Number flags arrive as text and are converted here, so `-n abc` is a one-line usage error.

    Invoke converts a flag with an int default itself and lets a ValueError escape as a
    traceback; the signature shown to Invoke therefore has text defaults, and this wrapper turns
    them back into numbers (or raises UsageError naming the flag).
    """
    sig = inspect.signature(fn)
    kinds = {name: type(p.default) for name, p in sig.parameters.items()
             if type(p.default) in (int, float)}
    kinds.update({name: kind for name, kind in NUMERIC_FLAGS.items() if name in sig.parameters})
    if not kinds:
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for name, kind in kinds.items():
            value = kwargs.get(name)
            if isinstance(value, str):
                try:
                    kwargs[name] = kind(value)
                except ValueError:
                    flag = ("-" if len(name) == 1 else "--") + name.replace("_", "-")
                    what = "an integer" if kind is int else "a number"
                    raise UsageError(f"{flag} {value[:60]!r}: expected {what}") from None
        return fn(*args, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=[
        p.replace(default=str(p.default)) if type(p.default) in (int, float) else p
        for p in sig.parameters.values()])
    return wrapper


# Short flags. `-h` after a task name is Invoke's help (`invoke deploy -h`), so no option takes it;
# an option of several tasks has the same letter in all of them (these, where Invoke's automatic
# letters would differ), and no other option has that letter; every other option gets Invoke's
# automatic letter.
SHORT_FLAGS = {"ct": "c", "group": "g", "inventory": "i", "dry_run": "d", "run": "r", "verbose": "v",
               "device": "e", "target": "t", "wait": "w", "timeout": "T"}
HELP_FLAG = "h"
# `-n` is a count everywhere (`logs -n 200`, `metrics -n 50`): only a parameter named n has it. And a
# dash is never a short flag (Invoke would pick the `-` of `min-free-shm`: `--=STRING` in the help).
NEVER_AUTOMATIC = {"n", "-"}


class OpTask(invoke.Task):
    """Invoke's Task with the short-flag rule above."""

    def arg_opts(self, name, default, taken_names):
        # SHORT_FLAGS' letters are theirs in every task, even one without that option (`-t` is never
        # `--to` in one task and `--target` in another)
        reserved = set(SHORT_FLAGS.values())
        opts = super().arg_opts(name, default, set(taken_names) | reserved | {HELP_FLAG} | NEVER_AUTOMATIC)
        if name in SHORT_FLAGS and self.auto_shortflags:
            opts["names"] = [opts["names"][0], SHORT_FLAGS[name]]
        return opts


def requires_values(fn):
    """A parameter without a default is a required flag (not an Invoke positional, which would take
    `-h` or `--help` as its value): missing, it is a one-line usage error naming the flag."""
    sig = inspect.signature(fn)
    required = [name for name, p in list(sig.parameters.items())[1:] if p.default is p.empty]
    if not required:
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        given = sig.bind_partial(*args, **kwargs).arguments
        missing = [name for name in required if given.get(name) is None]
        if missing:
            flags = ", ".join("--" + name.replace("_", "-") for name in missing)
            raise UsageError(f"{flags} required")
        return fn(*args, **kwargs)

    return wrapper


def op_task(*args, help=None, fan_out=None, **kwargs):
    """`@task` with the shared options' help text, number parsing and error reporting applied.

    A task whose first parameter is `t` (instead of Invoke's context) works on containers: it is
    called with one Target and returns a result offering `describe()` and `row()`; `fan_out` says
    what several containers mean (see `on_targets`).
    """
    def decorate(fn):
        params = inspect.signature(fn).parameters
        merged = {k: v for k, v in COMMON_HELP.items() if k in params}
        merged.update(help or {})
        body = on_targets(fn, fan_out) if next(iter(params), None) == "t" else shows(fn)
        return invoke.task(reports_errors(requires_values(parse_numbers(body))), help=merged, klass=OpTask,
                           positional=[], **kwargs)

    if args and callable(args[0]):
        return decorate(args[0])
    return decorate
