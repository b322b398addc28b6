"""One action over several containers: hosts in parallel, one row per container, one exit code.

A failing container or host never hides the others' rows; FanOutFailed says which failed.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from . import terminal
from .errors import ConnectError, DflashOpsError, FanOutFailed
from .target import Target


@dataclass
class Outcome:
    """One container's result in a fan-out."""

    label: str
    ok: bool
    detail: str


def for_each(targets: list[Target], action: Callable[[Target], str | None],
             title: str = "result") -> list[Outcome]:
    """Run `action(target) -> row text` on every target and print one row per container.

    Hosts run in parallel (one thread and one SSH connection per host), containers of one host in
    order; once a host cannot be reached, its remaining containers get that host's row.
    """
    by_host: dict[str, list[Target]] = {}
    for t in targets:
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

    with ThreadPoolExecutor(max_workers=max(1, len(by_host))) as pool:
        outcomes = [row for rows in pool.map(run_host, by_host.values()) for row in rows]
    # rich is imported here: a one-container task (every CLI call imports this module) needs none.
    from rich.table import Table

    table = Table(title=title)
    for column in ("container", "ok", "detail"):
        table.add_column(column)
    for o in outcomes:
        table.add_row(terminal.markup(o.label), "[green]yes[/]" if o.ok else "[red]NO[/]",
                      terminal.markup(o.detail))
    terminal.console().print(table)
    failed = [o.label for o in outcomes if not o.ok]
    if failed:
        raise FanOutFailed(f"{len(failed)} of {len(outcomes)} containers failed: {', '.join(failed)}")
    return outcomes
