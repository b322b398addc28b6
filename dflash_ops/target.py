"""What a task works on: `Target` (the inventory, one container, the session to its host), target
resolution from --ct/--group, and the one session per host that every target of an invocation shares.

The library takes `Target` or `list[Target]`; only the task layer (cli.py) knows about Invoke.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass

from .errors import UsageError
from .inventory import Container, Inventory, load_inventory
from .transport import HostSession


@dataclass
class Target:
    """What a task works on: the inventory, one container, and the session to its host."""

    inventory: Inventory
    container: Container
    session: HostSession
    dry_run: bool
    grouped: bool = False  # one of several containers of a fan-out: its output lines carry its label


def resolve(inventory: str | None, ct=None, group=None, dry_run: bool = False) -> list[Target]:
    """The containers `--ct` (one id or a comma list) and `--group` select, each with its host's session."""
    inv = load_inventory(inventory)
    chosen = inv.select(ct, group)
    grouped = bool(group) or len(chosen) > 1
    return [Target(inv, c, session_for(inv, c, dry_run), bool(dry_run), grouped) for c in chosen]


def resolve_one(inventory: str | None, ct=None, dry_run: bool = False) -> Target:
    chosen = resolve(inventory, ct, None, dry_run)
    if len(chosen) != 1:
        raise UsageError("this task works on one container; give a single --ct")
    return chosen[0]


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
def close_sessions() -> None:
    # DFLASH_OPS_STATS=1: how many SSH connections and round trips this invocation made, per host.
    if os.environ.get("DFLASH_OPS_STATS") and _SESSIONS:
        for name, counts in session_stats().items():
            print(f"ssh stats: {name}: {counts['connections']} connection(s), {counts['round_trips']} "
                  "round trip(s)",
                  file=sys.stderr)
    for s in _SESSIONS.values():
        s.close()
    _SESSIONS.clear()
