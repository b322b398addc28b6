"""Past one host: the per-container actions of a fan-out, and one training run over many nodes.

Fan-out (`--group NAME` or `--ct 200,201` on deploy, status, logs, stop, doctor, clean-cache) is
`cli.for_each` with the functions below as actions: each does the task on one container and returns
the short text of its row; a failure raises, and for_each turns it into a red row.

Multi-node training (`invoke train --group NAME`): every container of the group starts the same
run (same name, same config) under `torchrun`, through `remote_scripts/distributed.py`, which the
container's run wrapper starts like any training script. Rendezvous: elastic, c10d backend, its
store on the first container's node (`rdzv_address`, else its host's address) at `--rdzv-port`.
torch.distributed does the rest (remote_scripts/distributed.py); no scheduler of our own.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from dataclasses import asdict
from typing import Sequence

from . import jobs
from .errors import FanOutFailed, UsageError
from .inventory import Container

DEFAULT_RDZV_PORT = 29400
LAUNCHER = "distributed.py"  # in paths.code: runs torch.distributed.run (torchrun) in-process


def fans_out(ct, group) -> bool:
    """Several containers asked for: --group, or a --ct list."""
    return bool(group) or "," in str(ct or "")


# --- row actions for cli.for_each ------------------------------------------------------------------

def deploy_row(t) -> str:
    from . import deploy

    return deploy.describe(deploy.deploy(t)).removeprefix("deploy: ")


def status_row(t, run: str | None = None, stall_after: float = 600, collected: dict | None = None) -> str:
    """The compact status of one container: run, state, step, loss, acceptance length (tau)."""
    from . import status

    st = status.gather(t, run, stall_after)
    if st is None:  # dry run
        return "dry run"
    if collected is not None:
        collected[t.container.label] = st
    if st.state == "none":
        return "no run yet"
    fmt = status._fmt
    state = st.state + (f" ({st.detail})" if st.detail else "")
    findings = "".join(f"; {f['title']}: read {f['runbook']}" for f in st.findings)
    return (f"run {st.run}: {state} | step {fmt(st.step, 'd')} | loss {fmt(st.loss, '.4f')} "
            f"| tau {fmt(st.acceptance_length, '.2f')}{findings}")


def status_fan_out(c, run, stall_after, as_json, ct, group, inventory, dry_run) -> None:
    """`status --group`: one compact row per container; with --json the rows' facts as one JSON
    object {container: facts} on stdout, and the table on stderr."""
    from . import cli

    collected: dict = {}

    def row(t):
        return status_row(t, run, stall_after, collected)

    if not as_json:
        cli.for_each(c, row, ct, group, inventory, dry_run, title="status")
        return
    try:
        with contextlib.redirect_stdout(sys.stderr):
            cli.for_each(c, row, ct, group, inventory, dry_run, title="status")
    finally:
        print(json.dumps({label: asdict(st) for label, st in sorted(collected.items())}, indent=2))


def stop_row(t, run: str | None = None, grace: float = 30) -> str:
    result = jobs.stop(t, run, grace)
    if result.outcome == "dry-run":
        return "dry run"
    if result.outcome == "notalive":
        return f"run {result.run} is not running (exit code: {result.exit_code or 'none'})"
    how = "SIGTERM" if result.outcome == "term" else f"SIGKILL after {float(grace):g} s"
    return f"run {result.run} stopped ({how}, exit code: {result.exit_code or 'none'}); no process left"


def doctor_row(t) -> str:
    from . import doctor

    results = doctor.gather(t)
    failed = [c for c in results if not c.ok]
    if failed:
        fixes = "; ".join(f"{c.name}: {c.detail}" + (f" -> {c.fix}" if c.fix else "") for c in failed)
        raise doctor.DoctorFailed(f"{len(failed)} of {len(results)} checks failed: {fixes}")
    return f"all {len(results)} checks passed"


def clean_cache_row(t, force: bool = False) -> str:
    from . import caches

    return caches.describe(caches.clean_cache(t, force=force)).splitlines()[-1]


class LabelledLines(jobs.LineSink):
    """Where a fan-out's log lines go: each prefixed with its container, whole lines only."""

    _lock = threading.Lock()

    def __init__(self, label: str, out=None):
        self.label, self.out = label, out

    def line(self, line: str) -> None:
        with self._lock:
            print(f"{self.label} | {line}", file=self.out or sys.stdout, flush=True)

    def isatty(self) -> bool:
        return False


def logs_row(t, run: str | None = None, lines: int = 50, follow: bool = False) -> str:
    from . import logs

    printer = logs.show(t, run, lines, follow, out=LabelledLines(t.container.label))
    if t.dry_run:
        return "dry run"
    findings = "; ".join(printer.summary())
    ended = printer.ended or f"run {printer.run}"
    return ended + (f"; {findings}" if findings else "")


# --- multi-node training -----------------------------------------------------------------------------

def node_address(ct: Container) -> str:
    """The address other nodes reach this container at (rendezvous store, process group)."""
    return ct.rdzv_address or ct.host.address


def launcher_args(ct: Container, nodes: Sequence[Container], run: str, port: int) -> list[str]:
    """What goes between the container's python and train_dflash.py: torchrun's options. Pure.

    The first container of the group hosts the rendezvous store (is_host) on its node's address;
    every node says which address it is reached at (--local-addr), so nothing depends on the
    containers' host names resolving.
    """
    first = nodes[0]
    endpoint = f"{node_address(first)}:{int(port)}"
    return [f"{ct.paths.code}/{LAUNCHER}", f"--nnodes={len(nodes)}", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run}",
            f"--rdzv-conf=is_host={'1' if ct.ctid == first.ctid else '0'}",
            f"--local-addr={node_address(ct)}", "--max-restarts=0", "--monitor-interval=1"]


def check_group(nodes: Sequence[Container]) -> None:
    """Refuse layouts torch.distributed cannot run: one node, two nodes at one address, or unequal
    drafter worker counts.

    Two nodes at one address: the rendezvous tells nodes apart by (address, pid), and the launchers
    of two fresh containers often have the same pid in their own pid namespaces; they would be taken
    for one node and the rendezvous would wait forever.
    """
    if len(nodes) < 2:
        raise UsageError("multi-node training needs at least two containers (--group NAME or --ct 200,201)")
    seen: dict[str, str] = {}
    for ct in nodes:
        other = seen.setdefault(node_address(ct), ct.label)
        if other != ct.label:
            raise UsageError(f"{other} and {ct.label} would both be reached at {node_address(ct)}: give each "
                             f"container its own address in the inventory (rdzv_address)")
    counts = {ct.label: len([d for d in ct.roles.devices("drafter").split(",") if d]) for ct in nodes}
    if len(set(counts.values())) != 1:
        shown = ", ".join(f"{label}: {n}" for label, n in counts.items())
        raise UsageError(f"every node needs the same number of drafter devices (roles.drafter); got {shown}")


def launch_group(c, run: str | None, config, sets, max_steps, ct, group, inventory, dry_run,
                 port: int = DEFAULT_RDZV_PORT):
    """Start one run on every selected container under torchrun; stop those started if any launch fails."""
    from . import cli

    chosen = cli.targets(c, ct, group, inventory, dry_run)
    nodes = [t.container for t in chosen]
    check_group(nodes)
    if not 1 <= int(port) <= 65535:
        raise UsageError(f"--rdzv-port {port}: must be 1..65535")
    name = jobs.validate_run_name(run) if run is not None else jobs.default_run_name()
    started = []

    def start(t):
        launched = jobs.launch(t, name, config, sets, max_steps,
                               launcher=launcher_args(t.container, nodes, name, port))
        started.append(t)
        return f"run {launched.run}: pid {launched.pid}, code {launched.code_version}"

    try:
        cli.for_each(c, start, ct, group or None, inventory, dry_run,
                     title=f"train {name}: {len(nodes)} nodes, rendezvous "
                           f"{node_address(nodes[0])}:{int(port)}")
    except FanOutFailed:
        if started and not dry_run:
            print(f"stopping the {len(started)} node(s) that started, so none waits for the others")
            for t in started:
                jobs.stop(t, name, 0)
        raise
    return name

