"""`invoke status --watch`: the status view, refreshed in place (rich.live) until Ctrl-C.

Each refresh is the status task's own round trip (`status.gather`) and its own view
(`status.render`), captured and shown in a Live region, plus a footer with the refresh time.
A failed refresh (connection lost, container stopped) is shown in the footer and retried; the
view stays on the last good facts.
"""

from __future__ import annotations

import time

from .. import runs, terminal
from .. import status as status_mod
from ..errors import DflashOpsError, NoSuchRun


def _view(st, label: str, width: int):
    from rich.text import Text

    console = terminal.console(force_terminal=True, color_system="truecolor", width=width)
    with console.capture() as captured:
        status_mod.render(st, label, console=console)
    return Text.from_ansi(captured.get())


def watch(t, run: str | None = None, stall_after: float = status_mod.DEFAULT_STALL_AFTER,
          interval: float = 5.0, iterations: int | None = None, console=None) -> int:
    """Refresh every `interval` seconds; `iterations` bounds the loop (None: until Ctrl-C).
    Returns how many refreshes succeeded."""
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    if run is not None:
        runs.validate_run_name(run)  # a usage error fails at once, not once per refresh
    console = console or Console()
    label = t.container.label
    body, good, count = Text("gathering the first facts..."), 0, 0
    with Live(body, console=console, auto_refresh=False, transient=False) as live:
        try:
            while iterations is None or count < iterations:
                count += 1
                try:
                    st = status_mod.gather(t, run, stall_after)
                    body = _view(st, label, console.width)
                    note = Text(f"refreshed {time.strftime('%H:%M:%S')}, every {interval:g} s; Ctrl-C stops "
                                f"watching (the run goes on)", style="dim")
                    good += 1
                except NoSuchRun:
                    if not good:  # a mistyped name: the one unknown-run line, not a view of dashes
                        raise
                    note = Text(f"{time.strftime('%H:%M:%S')} the run is gone", style="bold red")
                except DflashOpsError as exc:  # keep the last good view, say why it is stale
                    note = Text(f"{time.strftime('%H:%M:%S')} refresh failed: {terminal.visible(str(exc))}",
                                style="bold red")
                live.update(Group(body, note), refresh=True)
                if iterations is not None and count >= iterations:
                    break
                time.sleep(interval)
        except KeyboardInterrupt:
            pass
    return good
