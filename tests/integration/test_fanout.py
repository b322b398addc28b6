"""Fan-out across containers on several embedded hosts (one sshd each), one of them down."""


import pytest
from signals import sshd_stopped

from dflash_ops import cli, fanout, target
from dflash_ops.errors import FanOutFailed
from dflash_ops.inventory import load_inventory

pytestmark = pytest.mark.integration


def hostname(t):
    return t.session.exec(t.container, ["hostname"]).stdout.strip()


def test_one_row_per_container_in_parallel_across_hosts(sandbox_factory, capsys):
    sb = sandbox_factory(containers=(200,), hosts=2)
    inv = load_inventory(sb.inventory)
    assert sorted(inv.groups["all"]) == [200, 201]
    hosts = {c.host.name for c in inv.containers.values()}
    assert len(hosts) == 2

    outcomes = fanout.run(target.resolve(sb.inventory, group="all"), hostname)
    assert [(o.label, o.ok) for o in outcomes] == [("pve1/200", True), ("pve2/201", True)]
    assert outcomes[0].detail != outcomes[1].detail  # each ran in its own container
    assert capsys.readouterr().out == ""  # fanout.run returns; the task layer shows
    cli.show(fanout.Rows("hostname", outcomes))
    table = capsys.readouterr().out
    assert "pve1/200" in table and "pve2/201" in table

    # One host down: its row says why, the other host's row is still there, the call fails.
    sshd_stopped(sb.host("pve2"))
    target.close_sessions()
    outcomes = fanout.run(target.resolve(sb.inventory, "200,201"), hostname)
    with pytest.raises(FanOutFailed, match="1 of 2 containers failed: pve2/201"):
        cli.show(fanout.Rows("hostname", outcomes))
    table = capsys.readouterr().out
    assert "pve1/200" in table and "cannot reach pve2" in table


def test_single_container_keeps_plain_behaviour(sandbox):
    # op_task fans out only for a group or several containers; one container is the task's usual output
    (one,) = target.resolve(sandbox.inventory, "200")
    assert not one.grouped and hostname(one)
    assert all(t.grouped for t in target.resolve(sandbox.inventory, group="all"))
