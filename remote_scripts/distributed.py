"""Multi-node training on torch.distributed: one process per node, its drafter workers as threads.

Launched by torchrun (this file's `__main__`, see below), train_dflash.py gets a `Node` from
`maybe_init_distributed()`; launched plainly, it gets the single-node `Node`, whose every method
changes nothing. Per step, on every node:
- data: each node draws the whole global batch from the same seeded sampler and keeps its own
  workers' share (global worker = rank * local workers + local index), so N nodes x W workers see
  exactly what one node with N*W workers sees, in the same order, with the same anchors;
- gradients: averaged over the node's workers first (training.average_gradients, as on one node),
  then summed across nodes with all_reduce (NCCL on GPUs, gloo on CPU) and divided by the node
  count: the mean over all global workers;
- metrics: every node's losses and token counts are gathered, so every node logs the global step
  (status on any node shows the run's loss); SIGTERM is agreed on (any node asked = all stop at
  the same step), because a node that left the loop alone would leave the others waiting forever;
- checkpoints: written by global rank 0 only (checkpoints.py writes them atomically); on start,
  the node holding the newest checkpoint sends it to the others, so a resume starts every node
  from the same state whichever container rank 0 lands on.

    python distributed.py [torchrun options] train_dflash.py [training options]

runs torch.distributed.run (torchrun) in this process with one change: the training process stays
in the wrapper's process group and keeps its run lock (torchrun would start it in a session of its
own, out of reach of `invoke stop`'s signal to the group and of the "run alive" lock).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys

import torch
import torch.distributed as dist

log = logging.getLogger("dflash.train")
BUCKET_ELEMENTS = 1 << 26  # all_reduce gradients in buckets of 64 Mi elements (256 MiB float32)


class Node:
    """This process's place in the run; this single-node version changes nothing."""

    rank = 0
    world_size = 1

    def __init__(self, local_workers: int):
        self.local_workers = local_workers

    @property
    def writes_checkpoints(self) -> bool:
        return self.rank == 0

    def global_worker(self, index: int) -> int:
        return self.rank * self.local_workers + index

    def take(self, sampler, batch_size: int) -> list[list[int]]:
        """Example indices for this node's workers: the global batch drawn in order, our share kept."""
        picks = [sampler.take(batch_size) for _ in range(self.world_size * self.local_workers)]
        first = self.rank * self.local_workers
        return picks[first:first + self.local_workers]

    def all_reduce_grads(self, workers) -> None:
        """After the node's own average: the mean over every node (here: nothing to do)."""

    def gather_step(self, results: list, tokens: int, stop) -> tuple[list, int]:
        """Every node's (loss, stats) per worker and token count; agrees on SIGTERM."""
        return results, tokens

    def share_latest_checkpoint(self, run_dir: str, keep_last: int) -> None:
        """Give every node the newest checkpoint any node has (one node: it has it already)."""

    def close(self) -> None:
        pass


class DistributedNode(Node):
    def __init__(self, local_workers: int, stop):
        super().__init__(local_workers)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        counts = self._everyone(local_workers)
        if len(set(counts)) != 1:
            from train_config import ConfigError
            raise ConfigError(f"devices.drafter: every node needs the same number of drafter workers; "
                              f"got {counts} (by rank)")
        self.stop = stop
        if stop is not None:  # a SIGTERM already received is agreed on at the first step
            stop.pending, stop.requested = stop.requested, False
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        self.stop.pending = True
        log.warning("SIGTERM received: every node checkpoints after the current step, then exits")

    def _everyone(self, value) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    @torch.no_grad()
    def all_reduce_grads(self, workers) -> None:
        # Worker 0 holds the node's mean (average_gradients gave every replica the same bits).
        params = workers[0].params
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        start = 0
        while start < len(params):
            end, size = start, 0
            while end < len(params) and (end == start or size + params[end].numel() <= BUCKET_ELEMENTS):
                size += params[end].numel()
                end += 1
            grads = [p.grad for p in params[start:end]]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            flat /= self.world_size
            for worker in workers:
                for p, mean in zip(worker.params[start:end],
                                   torch._utils._unflatten_dense_tensors(flat, grads),
                                   strict=True):
                    if p.grad is None:
                        p.grad = mean.to(p.device, copy=True)
                    else:
                        p.grad.copy_(mean, non_blocking=True)
            start = end

    def gather_step(self, results: list, tokens: int, stop) -> tuple[list, int]:
        pending = bool(getattr(stop, "pending", False) or getattr(stop, "requested", False))
        everyone = self._everyone((results, int(tokens), pending))
        if stop is not None:
            stop.requested = any(p for _, _, p in everyone)
        return [r for node_results, _, _ in everyone for r in node_results], sum(t for _, t, _ in everyone)

    def share_latest_checkpoint(self, run_dir: str, keep_last: int) -> None:
        import checkpoints

        latest = checkpoints.latest_checkpoint(run_dir)
        mine = int(os.path.basename(latest).split("-")[1]) if latest else 0
        steps = self._everyone(mine)
        newest = max(steps)
        if newest == 0 or min(steps) == newest:
            return
        source = steps.index(newest)
        payload = [None]
        if self.rank == source:
            payload = [{name: open(os.path.join(latest, name), "rb").read() for name in os.listdir(latest)
                        if os.path.isfile(os.path.join(latest, name))}]
        dist.broadcast_object_list(payload, src=source)
        if mine != newest:
            def write(directory):
                for name, data in payload[0].items():
                    with open(os.path.join(directory, name), "wb") as f:
                        f.write(data)
            path = checkpoints.save_checkpoint(run_dir, newest, write, keep_last)
            log.info("resume: received step %d from rank %d into %s", newest, source, path)

    def close(self) -> None:
        dist.destroy_process_group()
        # The run is over (and checkpointed). A SIGTERM still on its way (`invoke stop` reaching
        # this node after another node's stop ended the run) must not turn the clean exit into
        # "killed by SIGTERM": Python restores SIG_DFL for its handlers at interpreter exit.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def maybe_init_distributed(device: str, local_workers: int, stop=None) -> Node:
    """The process group when torchrun started us (NCCL for a CUDA device, gloo for cpu), else a no-op Node.

    `stop` (train_dflash.StopFlag) is taken over: SIGTERM marks it pending, and `gather_step` sets
    `stop.requested` on every node at the same step.
    """
    if not launched_by_torchrun():
        return Node(local_workers)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
    # The first collective waits for the slowest node's start-up (compile warm-up included).
    timeout = datetime.timedelta(seconds=float(os.environ.get("DFLASH_DIST_TIMEOUT_S", "1800")))
    dist.init_process_group(backend, timeout=timeout,
                            device_id=torch.device(device) if backend == "nccl" else None)
    node = DistributedNode(local_workers, stop)
    log.info("distributed: rank %d of %d (%s, rendezvous %s:%s), %d drafter worker(s) per node, %d in all; "
             "checkpoints by rank 0", node.rank, node.world_size, backend, os.environ.get("MASTER_ADDR"),
             os.environ.get("MASTER_PORT"), local_workers, local_workers * node.world_size)
    return node


# ----------------------------------------------------------------------------- launcher (torchrun)

def _keep_workers_in_our_group() -> list:
    """Make torchrun start the training process in our process group, with our run lock.

    torchrun starts workers with start_new_session=True and close_fds, and signals them with
    os.killpg. Here: same group, inherited descriptors (the wrapper's flock on the runs lock), and
    a plain signal to the process. Checked, not assumed: a torch whose internals moved fails loudly.
    """
    from subprocess import Popen

    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as sh

    handler = getattr(sh, "SubprocessHandler", None)
    if handler is None or not all(hasattr(handler, name) for name in ("_popen", "close")):
        raise SystemExit("distributed.py: this torch's torchrun internals changed "
                         "(SubprocessHandler._popen/close); update _keep_workers_in_our_group")
    started = []

    def _popen(self, args, env):
        proc = Popen(args=args, env=env, stdout=self._stdout, stderr=self._stderr, close_fds=False)
        started.append(proc)
        return proc

    def close(self, death_sig=None):
        if self.proc.poll() is None:
            self.proc.send_signal(death_sig or signal.SIGTERM)
        for stream in (self._stdout, self._stderr):
            if stream:
                stream.close()

    handler._popen, handler.close = _popen, close
    return started


def launch(argv: list[str]) -> int:
    """torchrun with `argv`; on SIGTERM the training process checkpoints: exit 0 if it exited 0."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    started = _keep_workers_in_our_group()
    try:
        run(get_args_parser().parse_args(argv))
    except SignalException as exc:
        codes = [p.wait() for p in started]
        print(f"distributed.py: torchrun got signal {exc.sigval}; training process exit code(s): {codes}",
              file=sys.stderr, flush=True)
        return 0 if codes and all(code == 0 for code in codes) else 128 + int(exc.sigval)
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))
