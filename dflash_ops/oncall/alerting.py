"""The on-call surfaces of `status` and `watch`: gather the facts, hand them to the pure formatters.

- `check(...)`: `status --check`, the monitoring-plugin verdict (monitoring.py) of one or several
  containers; every failure, even a bad flag, is a verdict (UNKNOWN), never a traceback.
- `export_metrics(...)`: `status --prometheus [FILE]`, the text format (prometheus.py), to stdout or
  atomically to FILE.
- `watch(...)`: `invoke watch --run NAME`, events (events.py) to stdout and to the sinks (notify.py).
- `status_one` / `status_rows`: the view of `invoke status` on one container (status.py; --watch: the
  live view, oncall/watch.py) and on several; cli.status routes the task between them and the two above.
Each container costs one round trip (`status.gather`); hosts are read in parallel.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from .. import fanout, runs
from .. import status as status_mod
from ..errors import ContainerError, DflashOpsError, RunStateError, UsageError
from ..terminal import plugin, visible
from . import events, monitoring, notify, prometheus
from . import watch as live


def collect(targets, run, stall_after) -> list[tuple]:
    """[(target, RunStatus or None, error or None)] in the targets' order; hosts in parallel
    (fanout.run: one timeout per host is enough)."""
    return [(o.target, o.result, o.error)
            for o in fanout.run(targets, lambda t: status_mod.gather(t, run, stall_after))]


def _verdict(t, st, error, th) -> monitoring.Verdict:
    label = t.container.label
    if isinstance(error, ContainerError):  # the container is down: no run can be going on in it
        return monitoring.Verdict(monitoring.CRITICAL, label, f"{error}; read {runs.CONTAINER.runbook}")
    if error is not None:
        return monitoring.unknown(label, str(error))
    return monitoring.verdict(st, label, th)


@dataclass
class Report:
    """What `status --check` / `--prometheus` show: text on stdout, lines on stderr (`aside`), and
    the monitoring-plugin exit code."""

    text: str = ""
    notes: list = field(default_factory=list)
    exit_with: int = 0  # the monitoring-plugin code (cli.show exits with it)

    def aside(self) -> str:
        return "\n".join(self.notes)

    def describe(self) -> str:
        return self.text

    def row(self) -> str:
        return self.text.splitlines()[0] if self.text else ""


def check(select, run) -> Report:
    """The verdict (one line | perfdata, then one line per container) and the plugin code.
    `select()` returns (Thresholds, targets); an error there (bad inventory, bad size) is UNKNOWN too."""
    try:
        th, targets = select()
        rows = collect(targets, run, th.stall_after)
    except Exception as exc:  # noqa: BLE001 - a failure of the check itself is UNKNOWN, never OK or WARNING
        said = str(exc) if isinstance(exc, DflashOpsError) else repr(exc)
        return Report(f"UNKNOWN - {plugin(said)}", exit_with=monitoring.UNKNOWN)
    if any(t.dry_run for t in targets):
        return Report(exit_with=monitoring.OK)
    code, text = monitoring.report([_verdict(t, st, error, th) for t, st, error in rows])
    # Its lines are plugin-safe already (terminal.plugin): split only where report() joined them.
    return Report(text, exit_with=code)


def export_metrics(targets, run, stall_after, path: str | None) -> Report:
    """The metrics of every target; written atomically to `path` (the report says where), else the
    report is the text. A container that cannot be read is `dflash_up 0` (and one line on stderr),
    not a failure of the whole file."""
    rows = collect(targets, run, stall_after)
    if any(t.dry_run for t in targets):
        return Report()
    all_samples, notes = [], []
    for t, st, error in rows:
        if error is not None:
            notes.append(visible(f"{t.container.label}: {error}"))
        all_samples += prometheus.samples(t.container.host.name, t.container.ctid, st)
    text = prometheus.exposition(all_samples)
    if path in (None, "-", True):
        return Report(text.removesuffix("\n"), notes)
    try:
        return Report(f"wrote {prometheus.write_atomic(path, text)}", notes)
    except OSError as exc:
        raise UsageError(f"--prometheus {path}: cannot write it: {exc.strerror or exc}") from None


def watch(t, run, every, stall_after, hang_after, webhook=None, notify_cmd=None, out=None,
          wait: bool = False) -> str:
    """Poll until the run ends; print each event and hand it to the sinks. Returns the final state;
    raises RunStateError when the run crashed or vanished, so the exit code says so, and NoSuchRun
    when it is not there at the first poll (with `wait`: waits for it)."""
    events.check_watchable(run, every, stall_after, hang_after)
    out = out or sys.stdout

    def report(line):  # a sink's trouble: one line on stderr, the watch goes on
        print(visible(line), file=sys.stderr, flush=True)

    sinks = []
    try:
        if webhook:
            sinks.append(notify.Webhook(webhook, report))
        if notify_cmd:
            sinks.append(notify.Command(notify_cmd, report))
        if t.dry_run:
            status_mod.gather(t, run, stall_after, missing_ok=wait)
            return "dry-run"

        def emit(event):
            record = event.to_dict()
            print(visible(f"{event.time} {event.event}: {event.text}"), file=out, flush=True)
            for sink in sinks:
                sink.send(record)

        try:
            final = events.watch_run(t, run, every, stall_after, hang_after, emit, wait=wait)
        except KeyboardInterrupt:
            print("stopped watching; the run goes on", file=out, flush=True)
            for sink in sinks:
                sink.close(wait=2)
            sinks = []
            return "interrupted"
    finally:
        for sink in sinks:
            sink.close()
    if final in ("crashed", "missing", "none"):
        raise RunStateError(f"run {run} on {t.container.label} {final if final == 'crashed' else 'is gone'}")
    return final


# --- `invoke status` (routed by cli.status) -----------------------------------------------------------

def plugin_check(select, run, stall_after, hang_after, min_free, min_free_shm) -> Report:
    """`status --check`: the thresholds parsed and the targets selected (`select()`) inside check(), so
    that a bad size or a bad inventory is UNKNOWN too."""
    def thresholds_and_targets():
        return (monitoring.Thresholds(float(stall_after), float(hang_after),
                                      monitoring.parse_size(min_free, "--min-free"),
                                      monitoring.parse_size(min_free_shm, "--min-free-shm")),
                select())

    return check(thresholds_and_targets, run)


def status_one(t, run=None, json=False, stall_after=600, dry_run=False, watch=False, interval=5, **_):
    """The view of one container (a View; --watch: the live view, which draws itself: None)."""
    if watch and not (json or dry_run):
        live.watch(t, run, float(stall_after), float(interval))
        return None
    st = status_mod.gather(t, run, float(stall_after))
    return None if st is None else status_mod.View(st, t.container.label)


def status_rows(targets, run=None, json=False, stall_after=600, **_):
    """Several containers: one compact row each; --json: {container: facts} on stdout (cli.show)."""
    return status_mod.fan_out(targets, run, stall_after)
