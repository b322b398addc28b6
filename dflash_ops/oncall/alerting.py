"""The on-call surfaces of `status` and `watch`: gather the facts, hand them to the pure formatters.

- `check(...)`: `status --check`, the monitoring-plugin verdict (monitoring.py) of one or several
  containers; every failure, even a bad flag, is a verdict (UNKNOWN), never a traceback.
- `export_metrics(...)`: `status --prometheus [FILE]`, the text format (prometheus.py), to stdout or
  atomically to FILE.
- `watch(...)`: `invoke watch --run NAME`, events (events.py) to stdout and to the sinks (notify.py).
Each container costs one round trip (`status.gather`); hosts are read in parallel.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

from .. import runs
from .. import status as status_mod
from ..errors import ConnectError, ContainerError, DflashOpsError, RunStateError, UsageError
from ..terminal import visible
from . import events, monitoring, notify, prometheus


def collect(targets, run, stall_after) -> list[tuple]:
    """[(target, RunStatus or None, error or None)] in the targets' order; one thread per host."""
    by_host: dict[str, list] = {}
    for t in targets:
        by_host.setdefault(t.container.host.name, []).append(t)

    def read_host(host_targets):
        out, down = [], None
        for t in host_targets:
            if down is not None:  # one timeout per host is enough
                out.append((t, None, down))
                continue
            try:
                out.append((t, status_mod.gather(t, run, stall_after), None))
            except ConnectError as exc:
                down = exc
                out.append((t, None, exc))
            except (DflashOpsError, ValueError) as exc:
                out.append((t, None, exc))
        return out

    with ThreadPoolExecutor(max_workers=max(1, len(by_host))) as pool:
        found = {id(row[0]): row for rows in pool.map(read_host, by_host.values()) for row in rows}
    return [found[id(t)] for t in targets]


def _verdict(t, st, error, th) -> monitoring.Verdict:
    label = t.container.label
    if isinstance(error, ContainerError):  # the container is down: no run can be going on in it
        return monitoring.Verdict(monitoring.CRITICAL, label, f"{error}; read {runs.CONTAINER.runbook}")
    if error is not None:
        return monitoring.unknown(label, str(error))
    return monitoring.verdict(st, label, th)


def check(select, run) -> int:
    """Print the verdict (one line | perfdata, then one line per container) and return the plugin code.
    `select()` returns (Thresholds, targets); an error there (bad inventory, bad size) is UNKNOWN too."""
    try:
        th, targets = select()
        rows = collect(targets, run, th.stall_after)
    except DflashOpsError as exc:
        print(f"UNKNOWN - {visible(str(exc))}")
        return monitoring.UNKNOWN
    if any(t.dry_run for t in targets):
        return monitoring.OK
    code, text = monitoring.report([_verdict(t, st, error, th) for t, st, error in rows])
    print("\n".join(visible(line) for line in text.splitlines()))
    return code


def export_metrics(targets, run, stall_after, path: str | None) -> str | None:
    """The metrics of every target; written atomically to `path`, else printed. A container that
    cannot be read is `dflash_up 0` (and one line on stderr), not a failure of the whole file."""
    rows = collect(targets, run, stall_after)
    if any(t.dry_run for t in targets):
        return None
    all_samples = []
    for t, st, error in rows:
        if error is not None:
            print(visible(f"{t.container.label}: {error}"), file=sys.stderr)
        all_samples += prometheus.samples(t.container.host.name, t.container.ctid, st)
    text = prometheus.exposition(all_samples)
    if path in (None, "-", True):
        sys.stdout.write(text)
        return None
    try:
        return prometheus.write_atomic(path, text)
    except OSError as exc:
        raise UsageError(f"--prometheus {path}: cannot write it: {exc.strerror or exc}") from None


def watch(t, run, every, stall_after, hang_after, webhook=None, notify_cmd=None, out=None) -> str:
    """Poll until the run ends; print each event and hand it to the sinks. Returns the final state;
    raises RunStateError when the run crashed or vanished, so the exit code says so."""
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
            status_mod.gather(t, run, stall_after)
            return "dry-run"

        def emit(event):
            record = event.to_dict()
            print(visible(f"{event.time} {event.event}: {event.text}"), file=out, flush=True)
            for sink in sinks:
                sink.send(record)

        try:
            final = events.watch_run(t, run, every, stall_after, hang_after, emit)
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
