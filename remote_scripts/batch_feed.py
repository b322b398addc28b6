"""The batch feed: each step's batches, one per drafter worker, made a step ahead.

A step's batches depend only on the sampler (which conversations), the step and the worker (the
anchors' generator is seeded by seed, step and worker) and the frozen target, never on the
drafters. So step n+1's batches are made in a background thread while the drafters train on step
n (train.prefetch_target), and with a replicated target each replica makes its workers' batches
in a thread of its own, at the same time as the others. The run is the same one either way
(tests/remote/test_training_runs.py). Every compiled call in these threads holds the same lock
as the drafters' (compile_safety).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import compile_safety
import training

log = logging.getLogger("dflash.train")


class BatchFeed:
    """`next(step)` -> (that step's batches in worker order, the sampler state a checkpoint
    written at that step must hold); steps are asked for in order. `close()` at the end."""

    def __init__(self, config, examples, sampler, node, target, drafters, stop_step: int):
        self.config, self.examples, self.sampler, self.node = config, examples, sampler, node
        self.target, self.drafters, self.stop_step = target, drafters, stop_step
        replicas = len({target.replica_for(w.index) for w in drafters.workers})
        self._replicas = ThreadPoolExecutor(replicas, thread_name_prefix="replica") \
            if replicas > 1 else None
        self._prefetch = ThreadPoolExecutor(1, thread_name_prefix="target") \
            if config.train.prefetch_target else None
        self._upcoming = None  # (step, sampler state, Future of its batches)

    def next(self, step: int) -> tuple[list, dict]:
        if self._upcoming is not None and self._upcoming[0] == step:
            _, state, future = self._upcoming
            batches = future.result()
        else:
            state, picks = self._take()
            batches = self._build(step, picks)
        self._upcoming = None
        if self._prefetch is not None and step < self.stop_step:
            next_state, next_picks = self._take()
            self._upcoming = (step + 1, next_state,
                              self._prefetch.submit(self._build, step + 1, next_picks))
        return batches, state

    def close(self) -> None:
        """Stop the threads; after a stop the prefetched batches are not used."""
        if self._prefetch is not None:
            self._prefetch.shutdown(wait=True, cancel_futures=True)
            upcoming = self._upcoming
            if upcoming is not None and not upcoming[2].cancelled() and upcoming[2].exception():
                log.warning("prefetch of step %d failed after the stop: %s", upcoming[0],
                            upcoming[2].exception())
        if self._replicas is not None:
            self._replicas.shutdown(wait=True)

    def _take(self) -> tuple[dict, list[list[int]]]:
        """This step's picks (the sampler advances now) and the sampler state right after."""
        picks = self.node.take(self.sampler, self.config.train.batch_size)
        return self.sampler.state_dict(), picks

    def _build(self, step: int, picks: list[list[int]]) -> list:
        compile_safety.apply_thread_settings()  # may run in the prefetch thread
        workers = self.drafters.workers
        if self._replicas is None:
            return [self._one(step, w, p) for w, p in zip(workers, picks, strict=True)]
        groups: dict[int, list] = {}
        for worker, pick in zip(workers, picks, strict=True):
            groups.setdefault(self.target.replica_for(worker.index), []).append((worker, pick))
        futures = [self._replicas.submit(self._group, step, group) for group in groups.values()]
        made = {w.index: batch for future in futures for w, batch in future.result()}
        return [made[w.index] for w in workers]

    def _group(self, step: int, group: list) -> list:
        compile_safety.apply_thread_settings()  # a replica's thread
        return [(worker, self._one(step, worker, pick)) for worker, pick in group]

    def _one(self, step: int, worker, pick: list[int]):
        generator = training.anchor_generator(self.config.train.seed, step,
                                              self.node.global_worker(worker.index))
        return training.worker_batch(self.config, self.target, self.drafters, worker,
                                     [self.examples[i] for i in pick], generator)
