"""Multi-node pieces that need no host: the rdzv_address key, the torchrun options, group checks."""

import copy

import pytest

from dflash_ops import launch
from dflash_ops.errors import InventoryError, UsageError
from dflash_ops.inventory import parse_inventory

BASE = {
    "hosts": {"pve1": {"address": "pve1.example"}, "pve2": {"address": "pve2.example"}},
    "containers": {
        200: {"host": "pve1", "roles": {"target": [0], "drafter": [1, 2]}},
        201: {"host": "pve2", "roles": {"target": [0], "drafter": [1, 2]}, "rdzv_address": "127.0.0.2"},
    },
    "groups": {"pair": [200, 201]},
}


def inventory(**edits):
    data = copy.deepcopy(BASE)
    for ctid, values in edits.items():
        data["containers"][int(ctid[2:])].update(values)
    return parse_inventory(data, "inv.yaml")


def test_rdzv_address_is_optional_and_defaults_to_the_host_address():
    inv = inventory()
    assert inv.containers[200].rdzv_address is None
    assert [launch.node_address(c) for c in inv.select(group="pair")] == ["pve1.example", "127.0.0.2"]
    assert inventory(ct200={"rdzv_address": "[::1]"}).containers[200].rdzv_address == "[::1]"


@pytest.mark.parametrize("value,reason", [
    ("::1", "write an IPv6 address in brackets"),
    ("-oProxyCommand=x", "not a host name or address"),
    ("127.0.0.1 127.0.0.2", "not a host name or address"),
    (5, "must be str"),
])
def test_bad_rdzv_address_is_refused_with_file_key_and_reason(value, reason):
    with pytest.raises(InventoryError) as err:
        inventory(ct200={"rdzv_address": value})
    assert str(err.value).startswith("inv.yaml: containers.200.rdzv_address: ") and reason in str(err.value)


def test_torchrun_options_per_node():
    nodes = inventory().select(group="pair")
    first, second = (launch.launcher_args(c, nodes, "r1", 29500) for c in nodes)
    common = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-endpoint=pve1.example:29500",
              "--rdzv-id=r1"]
    assert first == ["/root/dflash/distributed.py", *common, "--rdzv-conf=is_host=1",
                     "--local-addr=pve1.example",
                     "--max-restarts=0", "--monitor-interval=1"]
    assert second == ["/root/dflash/distributed.py", *common, "--rdzv-conf=is_host=0",
                      "--local-addr=127.0.0.2",
                      "--max-restarts=0", "--monitor-interval=1"]


def test_the_launcher_runs_the_training_script_with_its_usual_argv():
    nodes = inventory().select(group="pair")
    _, plain = launch.launch_argv(nodes[0], "r1")
    _, multi = launch.launch_argv(nodes[0], "r1",
                                launcher=launch.launcher_args(nodes[0], nodes, "r1", 29500))
    assert multi[0] == plain[0] and multi[1] == "/root/dflash/distributed.py"
    assert multi[-len(plain) + 1:] == plain[1:]  # train_dflash.py and every option unchanged


def test_groups_torch_distributed_cannot_run_are_refused():
    with pytest.raises(UsageError, match="at least two containers"):
        launch.check_group(inventory().select("200"))
    uneven = inventory(ct201={"roles": {"target": [0], "drafter": [1]}}).select(group="pair")
    with pytest.raises(UsageError, match="same number of drafter devices .* pve1/200: 2, pve2/201: 1"):
        launch.check_group(uneven)
    shared = inventory(ct201={"rdzv_address": None, "host": "pve1"}).select(group="pair")
    with pytest.raises(UsageError,
                       match="pve1/200 and pve1/201 would both be reached at pve1.example: .*rdzv_address"):
        launch.check_group(shared)
