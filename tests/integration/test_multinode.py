"""Multi-node training through the real CLI: `invoke train --group` over two embedded hosts (container
200 on pve1, 201 on pve2, two CPU drafter workers each), torchrun with c10d rendezvous and gloo on
127.0.0.1; compared with one node running all four workers; then stop and resume of the group."""

import json
import socket

import pytest
import yaml
from ct_template import seed
from fanout_cli import Cli, rows

pytestmark = pytest.mark.integration

STEPS = 20
# Same global batch in both runs: 4 workers x 8 sequences; a metric every step.
SETS = ["--set", "data.heldout=null", "--set", "train.log_every=1", "--set", f"train.save_every={STEPS}",
        "--set", "train.batch_size=8"]
NODES = (("pve1", 200), ("pve2", 201))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inventory_with(sandbox, path, drafters_per_container):
    """The sandbox's inventory with other drafter roles, a group `pair`, and an address per node.

    The containers share the host's network, where 127.0.0.0/8 is all loopback: 127.0.0.1 and
    127.0.0.2 tell the two nodes apart as two real hosts' addresses would.
    """
    data = yaml.safe_load(open(sandbox.inventory))
    for ctid, count in drafters_per_container.items():
        data["containers"][ctid]["roles"]["drafter"] = ["cpu"] * count
        data["containers"][ctid]["rdzv_address"] = f"127.0.0.{ctid - 199}"
    data["groups"]["pair"] = [200, 201]
    path.write_text(yaml.safe_dump(data))
    return str(path)


class Nodes(Cli):
    def metrics(self, run, host, ctid, kind="train"):
        text = self.container(host, ctid, "cat", f"/root/runs/{run}/metrics.jsonl").stdout
        return [r for r in map(json.loads, text.splitlines()) if r["kind"] == kind]

    def file(self, run, host, ctid, name):
        return self.container(host, ctid, "cat", f"/root/runs/{run}/{name}")


@pytest.fixture(scope="module")
def nodes(sandbox_factory, tmp_path_factory, template):
    sb = sandbox_factory(containers=(200,), hosts=2)
    for host, ctid in NODES:
        seed(template, sb, host, ctid)  # the deploy below ships the code; no pip (see ct_template)
    cli = Nodes(sb)
    deployed = rows(cli("deploy", "--group", "all").stdout)
    assert all(ok for ok, _ in deployed.values()) and len(deployed) == 2, deployed
    tmp = tmp_path_factory.mktemp("multinode")
    cli.two = inventory_with(sb, tmp / "two.yaml", {200: 2, 201: 2})
    cli.one = inventory_with(sb, tmp / "one.yaml", {200: 4, 201: 2})
    return cli


def test_two_nodes_match_one_node_with_the_same_global_batch(nodes):
    port = free_port()
    started = rows(nodes("train", "--group", "pair", "--run", "two", "--max-steps", str(STEPS), *SETS,
                         "--rdzv-port", str(port), inventory=nodes.two).stdout)
    assert set(started) == {"pve1/200", "pve2/201"} and all(ok for ok, _ in started.values()), started
    followed = nodes("logs", "--follow", "--group", "pair", "--run", "two", inventory=nodes.two)
    for label in ("pve1/200", "pve2/201"):
        assert f"{label} | ==> dflash-ops: run two is not running (exit code: 0)" in followed.stdout
    status = json.loads(nodes("status", "--group", "pair", "--run", "two", "--json",
                              inventory=nodes.two).stdout)
    assert {k: (v["state"], v["step"]) for k, v in status.items()} == {
        "pve1/200": ("finished", STEPS), "pve2/201": ("finished", STEPS)}, status

    ranks = {}
    for host, ctid in NODES:
        log = nodes.file("two", host, ctid, "train.log").stdout
        line = next(line for line in log.splitlines() if "distributed: rank" in line)
        assert "of 2 (gloo" in line and "2 drafter worker(s) per node, 4 in all" in line, line
        ranks[ctid] = int(line.split("distributed: rank ")[1].split()[0])
    assert sorted(ranks.values()) == [0, 1]
    # Checkpoints by global rank 0 only.
    for host, ctid in NODES:
        has = nodes.container(host, ctid, "test", "-f",
                              f"/root/runs/two/checkpoints/step-{STEPS}/model.safetensors")
        assert (has.returncode == 0) == (ranks[ctid] == 0)
    # Every node logs the global step: both metrics files say the same.
    two = [nodes.metrics("two", host, ctid) for host, ctid in NODES]
    assert [m["loss"] for m in two[0]] == [m["loss"] for m in two[1]]
    assert [len(m["worker_loss"]) for m in two[0]] == [4] * STEPS

    nodes("train", "--ct", "200", "--run", "one", "--max-steps", str(STEPS), *SETS, inventory=nodes.one)
    nodes("logs", "--follow", "--ct", "200", "--run", "one", inventory=nodes.one)
    one = nodes.metrics("one", "pve1", 200)

    assert [m["step"] for m in one] == [m["step"] for m in two[0]] == list(range(1, STEPS + 1))
    rel = [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(two[0], one, strict=True)]
    print("step  one-node loss  two-node loss  relative difference")
    for a, b, r in zip(two[0], one, rel, strict=True):
        print(f"{a['step']:>4}  {b['loss']:.8f}  {a['loss']:.8f}  {r:.2e}")
    # Step 1 runs before any update: the same data and init on both sides, so only the order of the
    # float32 sums differs. Later steps add the gradient mean's summation order (one sum of 4 vs
    # two sums of 2 then a sum of 2), amplified a little by Adam over 20 steps: 1e-4 relative.
    assert rel[0] < 1e-6, rel
    assert max(rel) < 1e-4, rel
    # The per-worker losses line up too: global worker k of two nodes is worker k of one node.
    assert all(abs(x - y) <= 1e-4 * abs(y)
               for x, y in zip(two[0][0]["worker_loss"], one[0]["worker_loss"], strict=True))


def test_stop_stops_every_node_and_the_group_resumes(nodes):
    port = free_port()
    nodes("train", "--group", "pair", "--run", "long", "--max-steps", "400", *SETS, "--rdzv-port", str(port),
          inventory=nodes.two)
    nodes.wait_for("two steps on both nodes", lambda: all(
        (v["step"] or 0) >= 2
        for v in json.loads(nodes("status", "--group", "pair", "--run", "long", "--json",
                                                        inventory=nodes.two).stdout).values()))
    stopped = rows(nodes("stop", "--group", "pair", "--run", "long", "--grace", "90",
                         inventory=nodes.two).stdout)
    assert all(ok and d == "run long stopped (SIGTERM, exit code: 0); no process left"
               for ok, d in stopped.values()), \
        stopped
    for host, ctid in NODES:
        assert nodes.container(host, ctid, "pgrep", "-f", "train_dflash").stdout == ""
    steps = {ctid: nodes.metrics("long", host, ctid)[-1]["step"] for host, ctid in NODES}
    assert len(set(steps.values())) == 1, steps  # every node stopped after the same step
    at = steps[200]
    pointers = [nodes.file("long", host, ctid, "checkpoints/latest") for host, ctid in NODES]
    assert sorted(p.stdout for p in pointers) == ["", f"step-{at}\n"]  # rank 0 only

    nodes("train", "--group", "pair", "--run", "long", "--max-steps", str(at + 2), *SETS,
          "--rdzv-port", str(free_port()), inventory=nodes.two)
    nodes("logs", "--follow", "--group", "pair", "--run", "long", inventory=nodes.two)
    for host, ctid in NODES:
        log = nodes.file("long", host, ctid, "train.log").stdout
        assert f"resumed from /root/runs/long/checkpoints/step-{at} at step {at}" in log
        assert nodes.metrics("long", host, ctid)[-1]["step"] == at + 2
