"""The host the conformance checks run on: the embedded one, or the one given with --inventory/--ct.

The checks are the product's (dflash_ops.conformance, what `invoke conformance` runs); here each is
one pytest test. The missing-container checks use an id that `pct list` does not show; the
stopped-container checks use the embedded host's stopped container, or --stopped-ct on a real host
(skipped without it).
"""

from __future__ import annotations

import pytest

from dflash_ops import conformance, target
from dflash_ops.errors import DflashOpsError
from dflash_ops.inventory import load_inventory


@pytest.fixture(scope="session")
def pct_host(request) -> conformance.PctHost:
    options = request.config.option
    if options.inventory:
        inv, stopped_id = load_inventory(options.inventory), options.stopped_ct
    else:
        inv, stopped_id = load_inventory(request.getfixturevalue("sandbox").inventory), 201
    ct = inv.container(options.ct)
    session = target.session_for(inv, ct)
    try:
        with conformance.opened(session, ct, inv.container(stopped_id) if stopped_id else None) as host:
            yield host
    except DflashOpsError as exc:
        pytest.exit(str(exc), returncode=exc.exit_status)
    finally:
        session.close()
