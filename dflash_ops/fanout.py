"""One action over several containers: hosts in parallel, one outcome per container.

`run(targets, action)` returns what each container's action returned or raised, and prints nothing
(as Fabric's ThreadingGroup returns a GroupResult); `Rows` is how the task layer shows them: one
table row per container, and FanOutFailed (one exit code) if any failed. A failing container or host
never hides the others' outcomes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from . import terminal
from .errors import ConnectError, DflashOpsError, FanOutFailed
from .target import Target


@dataclass
class Outcome:
    """One container's result in a fan-out: what its action returned (and its row), or the exception
    it raised."""

    target: Target
    result: object = None
    error: Exception | None = None
    row: str = "ok"

    @property
    def label(self) -> str:
        return self.target.container.label

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def detail(self) -> str:
        """The row's text: the error's one line, or the result's row; a fix it names (`invoke deploy`)
        names this container (`invoke deploy --ct 201`), as the row is one of several."""
        if self.error is None:
            text = self.row
        elif isinstance(self.error, DflashOpsError):
            text = str(self.error)
        else:
            text = f"{type(self.error).__name__}: {self.error}"
        return name_container(text, self.target.container.ctid)


# A command a message tells to run: `invoke TASK ARGS...`, in backquotes.
_FIX = re.compile(r"`invoke ([a-z][a-z.-]*)([^`]*)`")


def name_container(text: str, ctid: int) -> str:
    """Every `invoke TASK ...` in `text` that names no container gets `--ct CTID`."""
    def add(match: re.Match) -> str:
        task, args = match.groups()
        if re.search(r"(^|\s)(--ct|-c|--group|-g)(\s|=|$)", args) or task.startswith("sandbox"):
            return match.group()
        return f"`invoke {task}{args} --ct {ctid}`"
    return _FIX.sub(add, text)


def _row(result) -> str:
    """A result's row: text as it is, else its `row()` (which may raise: doctor's failed checks)."""
    if result is None or result == "":
        return "ok"
    return result if isinstance(result, str) else result.row()


def run(targets: list[Target], action: Callable[[Target], object]) -> list[Outcome]:
    """Run `action(target)` on every target; one Outcome each, in the targets' order. A result's
    `row()` is taken here too: one that raises makes the container's outcome an error.

    Hosts run in parallel (one thread and one SSH connection per host), containers of one host in
    order; once a host cannot be reached, its remaining containers get that host's error.
    """
    by_host: dict[str, list[Target]] = {}
    for t in targets:
        by_host.setdefault(t.container.host.name, []).append(t)

    def run_host(host_targets):
        outcomes, host_down = [], None
        for t in host_targets:
            if host_down is not None:
                outcomes.append(Outcome(t, error=host_down))
                continue
            try:
                result = action(t)
                outcomes.append(Outcome(t, result, row=_row(result)))
            except ConnectError as exc:
                host_down = exc
                outcomes.append(Outcome(t, error=exc))
            except Exception as exc:  # one container's failure (or bug) must not hide the others
                outcomes.append(Outcome(t, error=exc))
        return outcomes

    with ThreadPoolExecutor(max_workers=max(1, len(by_host))) as pool:
        found = {id(o.target): o for outcomes in pool.map(run_host, by_host.values()) for o in outcomes}
    return [found[id(t)] for t in targets]


@dataclass
class Rows:
    """Outcomes as the task layer shows them (`cli.show`): a table, one row per container, then
    FanOutFailed naming the failed ones."""

    title: str
    outcomes: list[Outcome]
    pipe_width = None  # on a pipe: $COLUMNS or 80 columns, as rich chooses

    def describe(self):
        # rich is imported here: a one-container task (every CLI call imports this module) needs none.
        from rich.table import Table

        table = Table(title=terminal.markup(self.title))
        for column in ("container", "ok", "detail"):
            table.add_column(column)
        for o in self.outcomes:
            table.add_row(terminal.markup(o.label), "[green]yes[/]" if o.ok else "[red]NO[/]",
                          terminal.markup(o.detail))
        return table

    def facts(self) -> dict:
        """`--json` over several containers: {container: its result's facts, or {"error": its line}}."""
        def one(o: Outcome):
            if not o.ok:
                return {"error": o.detail}
            facts = getattr(o.result, "facts", None)
            return facts() if facts is not None else {"row": o.row}
        return {o.label: one(o) for o in sorted(self.outcomes, key=lambda o: o.label)}

    @property
    def error(self) -> FanOutFailed | None:
        failed = [o.label for o in self.outcomes if not o.ok]
        if not failed:
            return None
        return FanOutFailed(f"{len(failed)} of {len(self.outcomes)} containers failed: {', '.join(failed)}")
