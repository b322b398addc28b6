"""remote_scripts/distributed.py with two real gloo processes on 127.0.0.1 (CPU), and
its torchrun launcher."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from conftest import REMOTE
from dflash_data import Sampler

# Runs in each of the two processes; prints what it saw as one JSON line.
SCENARIO = r'''
import json, os, signal, sys, types
import torch
import checkpoints, distributed
from dflash_data import Sampler

mode, run_dir = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
stop = types.SimpleNamespace(requested=False)
node = distributed.maybe_init_distributed("cpu", 3 if mode == "uneven" and rank == 1 else 2, stop)
out = {"rank": node.rank, "world": node.world_size, "global": [node.global_worker(i) for i in range(2)]}

sampler = Sampler(100, 3)
out["picks"] = [node.take(sampler, 4) for _ in range(2)]

class Worker:
    def __init__(self, value):
        self.params = list(torch.nn.Linear(3, 2).parameters())
        for p in self.params:
            p.grad = torch.full_like(p, value)
workers = [Worker(10.0 * rank + 1), Worker(10.0 * rank + 1)]  # the node's own mean, in every replica
node.all_reduce_grads(workers)
out["grads"] = sorted({v for w in workers for p in w.params for v in p.grad.flatten().tolist()})

if rank == 1:
    os.kill(os.getpid(), signal.SIGTERM)  # the node's handler marks the stop pending, nothing more
results, tokens = node.gather_step([(rank + 0.0, {"rank": rank}), (rank + 0.5, {})], 10 + rank, stop)
out.update(results=results, tokens=tokens, stop=stop.requested)

if rank == 0:
    def write(directory):
        for name, data in (("model.safetensors", b"weights"), ("training_state.pt", b"state")):
            open(os.path.join(directory, name), "wb").write(data)
    checkpoints.save_checkpoint(run_dir, 3, write, keep_last=2)
node.share_latest_checkpoint(run_dir, 2)
latest = checkpoints.latest_checkpoint(run_dir)
out["latest"] = {n: open(os.path.join(latest, n), "rb").read().decode() for n in sorted(os.listdir(latest))}
node.close()
print(json.dumps(out))
'''

# A training-script stand-in for the launcher test: one all_reduce, and where the process lives.
WORKER = r'''
import json, os, torch, torch.distributed as dist
import distributed
node = distributed.maybe_init_distributed("cpu", 1)
value = torch.tensor([float(node.rank + 1)])
dist.all_reduce(value)
print(json.dumps({"rank": node.rank, "sum": value.item(),
                  "same_group": os.getpgid(0) == os.getpgid(os.getppid()),
                  "lock_fd": os.path.exists(f"/proc/self/fd/{os.environ['LOCK_FD']}")}), flush=True)
node.close()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(rank: int, port: int) -> dict:
    return {**os.environ, "PYTHONPATH": REMOTE, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2",
            "TORCHELASTIC_RUN_ID": "test"}


def two_processes(mode: str, tmp_path) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", SCENARIO, mode, str(tmp_path / f"rank{r}")], cwd=REMOTE,
                              env=env_for(r, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def test_two_gloo_nodes_act_as_one_node_with_all_their_workers(tmp_path):
    done = two_processes("even", tmp_path)
    assert [p.returncode for p in done] == [0, 0], [p.stderr[-2000:] for p in done]
    seen = [json.loads(p.stdout.strip().splitlines()[-1]) for p in done]
    assert [(s["rank"], s["world"], s["global"]) for s in seen] == [(0, 2, [0, 1]), (1, 2, [2, 3])]

    # Data: the two nodes' shares, in rank order, are what one node with 4 workers draws per step.
    one_node = Sampler(100, 3)
    for step in range(2):
        expected = [one_node.take(4) for _ in range(4)]
        assert seen[0]["picks"][step] + seen[1]["picks"][step] == expected

    # Gradients: node means 1 and 11 -> 6 in every replica of both nodes.
    assert seen[0]["grads"] == seen[1]["grads"] == [6.0]

    # Metrics and stop: every worker's result in global order on both nodes; rank 1's SIGTERM stops both.
    for s in seen:
        assert s["results"] == [[0.0, {"rank": 0}], [0.5, {}], [1.0, {"rank": 1}], [1.5, {}]]
        assert s["tokens"] == 21 and s["stop"] is True

    # Only rank 0 wrote step 3; the start-up share gave rank 1 the same files.
    assert seen[0]["latest"] == seen[1]["latest"] == {"model.safetensors": "weights",
                                                      "training_state.pt": "state"}
    assert (tmp_path / "rank1" / "checkpoints" / "latest").read_text() == "step-3\n"


def test_unequal_worker_counts_fail_loudly_on_every_node(tmp_path):
    done = two_processes("uneven", tmp_path)
    for p in done:
        assert p.returncode != 0
        assert "every node needs the same number of drafter workers; got [2, 3]" in p.stderr


def test_plain_launch_is_a_no_op_node(monkeypatch):
    import distributed

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    node = distributed.maybe_init_distributed("cpu", 3)
    sampler, reference = Sampler(50, 1), Sampler(50, 1)
    assert node.take(sampler, 5) == [reference.take(5) for _ in range(3)]
    assert [node.global_worker(i) for i in range(3)] == [0, 1, 2] and node.writes_checkpoints
    assert node.gather_step([(1.0, {})], 7, None) == ([(1.0, {})], 7)


def test_launcher_runs_torchrun_with_the_worker_in_our_process_group(tmp_path):
    """Two `python distributed.py` launchers, c10d rendezvous on 127.0.0.1: the training process
    shares the launcher's process group (invoke stop signals it) and inherits its lock descriptor."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    port = free_port()
    lock = open(tmp_path / "lock", "w")  # stands in for the run wrapper's flock descriptor
    fd = lock.fileno()
    try:
        procs = [subprocess.Popen(
            [sys.executable, os.path.join(REMOTE, "distributed.py"), "--nnodes=2", "--nproc-per-node=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=t",
             f"--rdzv-conf=is_host={1 - i}", "--local-addr=127.0.0.1", "--max-restarts=0", str(worker)],
            cwd=REMOTE, env={**os.environ, "PYTHONPATH": REMOTE, "OMP_NUM_THREADS": "1", "LOCK_FD": str(fd)},
            pass_fds=(fd,),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
                 for i in (0, 1)]
        results = [p.communicate(timeout=180) for p in procs]
    finally:
        lock.close()
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    seen = sorted(json.loads(out.strip().splitlines()[-1])["rank"] for out, _ in results)
    assert seen == [0, 1]
    for out, _ in results:
        facts = json.loads(out.strip().splitlines()[-1])
        assert facts["sum"] == 3.0 and facts["same_group"] and facts["lock_fd"]
