"""The host the conformance suite checks: the embedded one, or the one given with --inventory/--ct.

On the host and in the container the suite writes only a scratch directory of its own under /tmp
(`mktemp -d`), removed at the end; it never starts or stops a container. The missing-container
checks use an id that `pct list` does not show; the stopped-container checks use the embedded
host's stopped container, or --stopped-ct on a real host (skipped without it).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from pct_host import SCRATCH, PctHost, missing_id, shown

from dflash_ops import commands, target
from dflash_ops.inventory import Container, load_inventory


@pytest.fixture(scope="session")
def pct_host(request) -> PctHost:
    options = request.config.option
    if options.inventory:
        inv, embedded = load_inventory(options.inventory), False
        stopped_id = options.stopped_ct
    else:
        inv, embedded = load_inventory(request.getfixturevalue("sandbox").inventory), True
        stopped_id = 201
    ct = inv.container(options.ct)
    session = target.session_for(inv, ct)
    listing = session.run(commands.pct_line(ct.host.pct_command, "list"), check=False)
    if not listing.ok:
        pytest.exit(f"`{ct.host.pct} list` on {ct.host.name} failed ({shown(listing)}): fix the "
                    "inventory or the host's pct first", returncode=4)
    host = PctHost(session, ct, dataclasses.replace(ct, ctid=missing_id(listing.stdout)),
                   inv.container(stopped_id) if stopped_id else None, embedded)
    if not re.search(rf"^{ct.ctid}\s+running\s", listing.stdout, re.M):
        pytest.exit(f"container {ct.ctid} is not running on {ct.host.name} (pct list: "
                    f"{listing.stdout!r}); the suite never starts one: give a running container with --ct",
                    returncode=4)
    if host.stopped is not None and not re.search(rf"^{host.stopped.ctid}\s+stopped\s", listing.stdout, re.M):
        pytest.exit(f"--stopped-ct {host.stopped.ctid} is not a stopped container on {ct.host.name}",
                    returncode=4)
    host.ct_scratch = session.exec(ct, ["mktemp", "-d", SCRATCH],
                                   env={"PATH": commands.SYSTEM_PATH}).stdout.strip()
    host.host_scratch = session.run(commands.shell_line(["mktemp", "-d", SCRATCH])).stdout.strip()
    try:
        yield host
    finally:
        session.exec(ct, ["rm", "-rf", "--", host.ct_scratch], env={"PATH": commands.SYSTEM_PATH},
                     check=False)
        session.run(commands.shell_line(["rm", "-rf", "--", host.host_scratch]), check=False)
        session.close()


@pytest.fixture
def stopped(pct_host) -> Container:
    if pct_host.stopped is None:
        pytest.skip("no stopped container to check with: give --stopped-ct ID (the suite never stops one)")
    return pct_host.stopped
