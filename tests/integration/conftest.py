"""Fixtures for tests against the embedded Proxmox host (real sshd on 127.0.0.1, real pct isolation).

`sandbox` (session-scoped): one sandbox host `pve1` with container 200 running and 201 created but
stopped; it is a `dflash_ops.sandbox.Sandbox` (inventory path, port, key, known_hosts, state_dir,
pct, host(name), ssh_argv(command)). Torn down at the end of the session.
`sandbox_factory(**layout)` (session-scoped): more sandboxes, each in its own state dir with its own
sshd(s), e.g. `sandbox_factory(containers=(200,), hosts=2)`; all torn down at the end. The state lives in a temporary dir,
or in $DFLASH_TEST_SANDBOX_STATE when set (kept between sessions, so a venv built in container 200
survives: faster reruns).
"""

import os

import pytest

from dflash_ops import sandbox as sandbox_mod


def bring_up(state_dir, **layout):
    """A sandbox in `state_dir`, its inventory next to its state; skipped (not failed) without root."""
    if os.geteuid() != 0:
        pytest.skip("the embedded host needs root (sshd, bubblewrap namespaces)")
    sb = sandbox_mod.up(state_dir, inventory_path=os.path.join(state_dir, "sandbox.yaml"), **layout)
    sandbox_mod.watch(sb.state_dir, os.getpid())  # a session killed before teardown leaves nothing running
    return sb


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory):
    state = os.environ.get("DFLASH_TEST_SANDBOX_STATE") or str(tmp_path_factory.mktemp("sandbox"))
    sb = bring_up(state, containers=(200,), stopped=(201,))
    try:
        yield sb
    finally:
        sandbox_mod.down(sb.state_dir)


@pytest.fixture(scope="session")
def sandbox_factory(tmp_path_factory):
    made = []

    def make(**layout):
        sb = bring_up(str(tmp_path_factory.mktemp("sandbox")), **layout)
        made.append(sb)
        return sb

    try:
        yield make
    finally:
        for sb in made:
            sandbox_mod.down(sb.state_dir)
