"""Invocation-wide plumbing for tasks.py: shared options, one session per host, errors -> exit codes.

`invoke warmup train --ct 200`: Invoke gives `--ct` to `train` only; `Executor` (named in the
project's invoke.yaml) sees every call of the invocation first and hands the one value of each
shared option to every task, refusing two different values.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import invoke
from invoke import Exit
from rich.console import Console
from rich.table import Table

from .errors import ConnectError, DflashOpsError, FanOutFailed, UsageError
from .inventory import Container, Inventory, load_inventory
from .transport import HostSession

# Options that mean the same thing for every task of one invocation, with their "not given" value.
SHARED_OPTIONS = {"ct": None, "inventory": None, "dry_run": False, "group": None, "run": None}
COMMON_HELP = {
    "ct": "container id(s), e.g. 200 or 200,201 (default: the inventory's default_container)",
    "inventory": "inventory YAML (default: $INVOKE_DFLASH_INVENTORY or inventory/production.yaml)",
    "dry_run": "print the exact host command lines and connect to nothing",
    "group": "an inventory group of containers",
    "run": "run name (default: the latest run); given once, it applies to every task of the invocation",
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
            raise Exit(f"error: conflicting values in one invocation: {shown}", code=2)
        if given:
            value = next(v for call in calls if (v := call.kwargs.get(name, unset)) not in (unset, None))
            chosen[name] = value
    return chosen


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


# --- one session per host for the whole invocation ---------------------------------------------
_SESSIONS: dict[tuple, HostSession] = {}


def session_for(inv: Inventory, container: Container, dry_run: bool = False) -> HostSession:
    host = container.host
    key = (inv.path, host.name, bool(dry_run))
    if key not in _SESSIONS:
        jump = inv.hosts[host.jump] if host.jump else None
        secrets = [v for c in inv.containers.values() for v in c.secret_values()]
        _SESSIONS[key] = HostSession(host, jump=jump, dry_run=dry_run, secrets=secrets)
    return _SESSIONS[key]


def session_stats() -> dict:
    return {name: {"connections": s.connections, "round_trips": s.round_trips}
            for (_, name, _), s in _SESSIONS.items()}


@atexit.register
def _close_sessions() -> None:
    # DFLASH_OPS_STATS=1: how many SSH connections and round trips this invocation made, per host.
    if os.environ.get("DFLASH_OPS_STATS") and _SESSIONS:
        for name, counts in session_stats().items():
            print(f"ssh stats: {name}: {counts['connections']} connection(s), {counts['round_trips']} round trip(s)",
                  file=sys.stderr)
    for s in _SESSIONS.values():
        s.close()
    _SESSIONS.clear()


@dataclass
class Target:
    """What a task works on: the inventory, one container, and the session to its host."""

    inventory: Inventory
    container: Container
    session: HostSession
    dry_run: bool


def inventory_path(c, inventory: str | None) -> str | None:
    if inventory:
        return inventory
    try:
        return c.config.dflash.inventory
    except (AttributeError, KeyError):
        return None


def target(c, ct=None, inventory=None, dry_run=False) -> Target:
    inv = load_inventory(inventory_path(c, inventory))
    containers = inv.select(ct)
    if len(containers) != 1:
        raise UsageError("this task works on one container; give a single --ct")
    container = containers[0]
    return Target(inv, container, session_for(inv, container, dry_run), dry_run)


def targets(c, ct=None, group=None, inventory=None, dry_run=False) -> list[Target]:
    inv = load_inventory(inventory_path(c, inventory))
    return [Target(inv, ct_, session_for(inv, ct_, dry_run), dry_run) for ct_ in inv.select(ct, group)]


@dataclass
class Outcome:
    """One container's result in a fan-out."""

    label: str
    ok: bool
    detail: str


def for_each(c, action, ct=None, group=None, inventory=None, dry_run=False, title="result"):
    """Run `action(target) -> str | None` on every selected container; one row per container.

    One container (no --group): plain behaviour, errors propagate as for any task. Several:
    hosts run in parallel (one thread and one SSH connection per host), containers of one host
    in order; a failing container or host never hides the others' rows; the exit code says
    whether all succeeded.
    """
    chosen = targets(c, ct, group, inventory, dry_run)
    if len(chosen) == 1 and not group:
        action(chosen[0])
        return [Outcome(chosen[0].container.label, True, "")]
    by_host: dict[str, list[Target]] = {}
    for t in chosen:
        by_host.setdefault(t.container.host.name, []).append(t)

    def run_host(host_targets):
        rows, host_down = [], None
        for t in host_targets:
            if host_down is not None:
                rows.append(Outcome(t.container.label, False, host_down))
                continue
            try:
                rows.append(Outcome(t.container.label, True, action(t) or "ok"))
            except ConnectError as exc:
                host_down = str(exc)
                rows.append(Outcome(t.container.label, False, host_down))
            except DflashOpsError as exc:
                rows.append(Outcome(t.container.label, False, str(exc)))
            except Exception as exc:  # one container's bug must not hide the other rows
                rows.append(Outcome(t.container.label, False, f"{type(exc).__name__}: {exc}"))
        return rows

    with ThreadPoolExecutor(max_workers=len(by_host)) as pool:
        outcomes = [row for rows in pool.map(run_host, by_host.values()) for row in rows]
    table = Table(title=title)
    for column in ("container", "ok", "detail"):
        table.add_column(column)
    for o in outcomes:
        table.add_row(o.label, "[green]yes[/]" if o.ok else "[red]NO[/]", o.detail)
    Console().print(table)
    failed = [o.label for o in outcomes if not o.ok]
    if failed:
        raise FanOutFailed(f"{len(failed)} of {len(outcomes)} containers failed: {', '.join(failed)}")
    return outcomes


def reports_errors(fn):
    """Turn a DflashOpsError into a one-line message on stderr and the error's exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DflashOpsError as exc:
            raise Exit(f"error: {exc}", code=exc.exit_code) from None
        except KeyboardInterrupt:
            raise Exit("interrupted", code=130) from None
        except BrokenPipeError:
            # `invoke status | head -3`: the reader left; stop quietly, as other CLI tools do.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise Exit(code=141) from None

    return wrapper


# Number-valued flags whose default is None (so Invoke cannot tell they are numbers).
NUMERIC_FLAGS = {"max_steps": int, "rdzv_port": int, "num_prompts": int, "max_new_tokens": int, "limit": int,
                 "batch_size": int, "hosts": int, "grace": float, "stall_after": float, "interval": float}


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


def op_task(*args, help=None, **kwargs):
    """`@task` with the shared options' help text, number parsing and error reporting applied."""
    def decorate(fn):
        params = inspect.signature(fn).parameters
        merged = {k: v for k, v in COMMON_HELP.items() if k in params}
        merged.update(help or {})
        return invoke.task(reports_errors(parse_numbers(fn)), help=merged, **kwargs)

    if args and callable(args[0]):
        return decorate(args[0])
    return decorate
