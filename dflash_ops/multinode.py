"""One training run over many nodes.

Multi-node training (`invoke train --group NAME`): every container of the group starts the same
run (same name, same config) under `torchrun`, through `remote_scripts/distributed.py`, which the
container's run wrapper starts like any training script. Rendezvous: elastic, c10d backend, its
store on the first container's node (`rdzv_address`, else its host's address) at `--rdzv-port`.
torch.distributed does the rest (remote_scripts/distributed.py); no scheduler of our own.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import fanout, jobs
from .errors import FanOutFailed, UsageError
from .inventory import Container
from .target import Target

DEFAULT_RDZV_PORT = 29400
LAUNCHER = "distributed.py"  # in paths.code: runs torch.distributed.run (torchrun) in-process


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


def launch_group(targets: list[Target], run: str | None, config, sets, max_steps,
                 port: int = DEFAULT_RDZV_PORT) -> str:
    """Start one run on every target under torchrun; stop those started if any launch fails."""
    nodes = [t.container for t in targets]
    check_group(nodes)
    if not 1 <= int(port) <= 65535:
        raise UsageError(f"--rdzv-port {port}: must be 1..65535")
    name = jobs.validate_run_name(run) if run is not None else jobs.default_run_name()
    started = []

    def start(t):
        launched = jobs.launch(t, name, config, sets, max_steps,
                               launcher=launcher_args(t.container, nodes, name, port))
        started.append(t)
        return launched.row()

    try:
        fanout.for_each(targets, start, title=f"train {name}: {len(nodes)} nodes, rendezvous "
                                              f"{node_address(nodes[0])}:{int(port)}")
    except FanOutFailed:
        if started and not targets[0].dry_run:
            print(f"stopping the {len(started)} node(s) that started, so none waits for the others")
            for t in started:
                jobs.stop(t, name, 0)
        raise
    return name
