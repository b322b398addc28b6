"""Train a DFlash drafter against a frozen target.

    python train_dflash.py --config configs/tiny-cpu.yaml [--set key=value ...]
        [--target-devices cuda:0,cuda:1] [--drafter-devices cuda:5,cuda:6,cuda:7]
        [--run-dir DIR] [--max-steps N]

config -> devices -> data -> target -> drafters -> compile (warm every shape in the main thread)
-> loop (one worker thread per drafter device, gradients averaged every step) -> checkpoints.
Resumes from RUN/checkpoints/latest automatically; on SIGTERM writes a checkpoint and exits 0.
--max-steps N stops at step N; the LR schedule still follows train.max_steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import checkpoints
import compile_safety
import distributed
import dflash_model as dm
import training
from dflash_data import DataError, Sampler, load_examples
from target_model import Target, TargetLoadError, load_tokenizer
from train_config import ConfigError, dump_yaml, load_config, resolve_path

log = logging.getLogger("dflash.train")


def cli_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set train.lr=1e-4 (repeatable)")
    parser.add_argument("--target-devices", help="e.g. cuda:0,cuda:1,cuda:2 or cpu")
    parser.add_argument("--drafter-devices", help="one worker per entry, e.g. cuda:5,cuda:6 or cpu,cpu")
    parser.add_argument("--run-dir", help="run directory (default: train.run_dir)")
    parser.add_argument("--max-steps", type=int, help="stop at this step (schedule unchanged)")
    return parser


def config_from_args(args):
    return load_config(args.config, args.set, {
        "devices.target": args.target_devices, "devices.drafter": args.drafter_devices,
        "train.run_dir": os.path.abspath(args.run_dir) if args.run_dir else None})


def setup_logging(run_dir: str | None) -> None:
    handlers = [logging.StreamHandler(sys.stdout)]
    if run_dir:
        handlers.append(logging.FileHandler(os.path.join(run_dir, "train.log")))
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")


class StopFlag:
    """SIGTERM sets it; the loop checks it between steps, checkpoints and exits 0."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True
        log.warning("SIGTERM received: checkpointing after the current step, then exiting")


def train(args) -> int:
    stop = StopFlag()
    # config
    config = config_from_args(args)
    run_dir = resolve_path(config.train.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    setup_logging(run_dir)
    checkpoints.write_atomic(os.path.join(run_dir, "config.yaml"), dump_yaml(config))
    stop_step = min(args.max_steps or config.train.max_steps, config.train.max_steps)
    training.seed_everything(config.train.seed)

    # devices
    target_devices = training.parse_devices(config.devices.target, "devices.target")
    drafter_devices = training.parse_devices(config.devices.drafter, "devices.drafter")
    training.check_attention(config, drafter_devices)
    log.info("run %s: target on %s, %d drafter worker(s) on %s", run_dir, ",".join(target_devices),
             len(drafter_devices), ",".join(drafter_devices))

    # data
    target_path = resolve_path(config.target.path)
    tokenizer = load_tokenizer(target_path) if os.path.isdir(target_path) else None
    if tokenizer is None:
        raise TargetLoadError(f"target checkpoint directory not found: {target_path}")
    read = dict(tokenizer=tokenizer, header=config.data.assistant_header,
                end=config.data.end_of_turn, max_length=config.data.max_length)
    train_examples = load_examples(resolve_path(config.data.train), **read)
    heldout_examples = load_examples(resolve_path(config.data.heldout), **read) \
        if config.data.heldout else []
    sampler = Sampler(len(train_examples), config.train.seed)
    log.info("data: %d train, %d held-out conversations", len(train_examples), len(heldout_examples))

    # target
    target = Target(target_path, target_devices, config.target.dtype)

    # drafters + compile settings (one worker per drafter device, identical replicas)
    drafters = training.build_drafters(config, target, tokenizer, drafter_devices)
    workers, mask_token_id, build_mask = drafters.workers, drafters.mask_token_id, drafters.build_mask
    # multi-node (under torchrun): gradients, metrics and SIGTERM across nodes; else a no-op
    node = distributed.maybe_init_distributed(drafter_devices[0], len(workers), stop)
    node.share_latest_checkpoint(run_dir, config.train.keep_last)

    step = 0
    resume_from = checkpoints.latest_checkpoint(run_dir)
    if resume_from:
        step = restore(resume_from, workers, sampler)
        log.info("resumed from %s at step %d", resume_from, step)

    def batch_for(worker, examples, generator):
        return training.prepare_batch(examples, config, target, worker.device, mask_token_id,
                                      build_mask, generator)

    # Full batches only: a smaller last batch would be a shape the warm-up never compiled.
    batch_size = config.train.batch_size
    eval_count = min(len(heldout_examples) // batch_size, config.train.eval_batches)
    eval_batches = [batch_for(workers[0], heldout_examples[i * batch_size:(i + 1) * batch_size],
                              training.anchor_generator(config.train.seed, -1, i))
                    for i in range(eval_count)]
    if heldout_examples and not eval_batches:
        raise DataError(f"held-out set has {len(heldout_examples)} usable conversations, fewer "
                        f"than one batch ({batch_size})")

    # compile: every shape the workers will run, in the main thread, before they start
    warm_examples = train_examples[: config.train.batch_size]
    timings = training.warm_up(workers, lambda w: batch_for(
        w, warm_examples, training.anchor_generator(config.train.seed, -2, w.index)))
    log.info("warm-up (main thread) done in %.1f s for %d shape(s)%s", sum(timings.values()),
             len(timings), "" if config.compile.enabled else "; compile is off")

    # loop
    metrics = checkpoints.open_for_append(os.path.join(run_dir, "metrics.jsonl"))
    pool = ThreadPoolExecutor(max_workers=len(workers), thread_name_prefix="drafter")
    window, window_start = [], time.perf_counter()

    sampler_state = sampler.state_dict()

    def save(step):
        if not node.writes_checkpoints:
            return
        # the sampler as of this step's picks: a prefetch may already have taken the next ones
        path = save_checkpoint(run_dir, step, workers, sampler_state, config)
        diff = training.replica_max_diff(workers)
        write_metrics(metrics, {"kind": "checkpoint", "step": step, "path": path,
                                "replica_max_abs_diff": diff})
        log.info("checkpoint %s (replicas differ by at most %.3g)", path, diff)

    def take_batches(step):
        """This step's picks (the sampler advances now) -> (sampler state, batch builder)."""
        picks = node.take(sampler, config.train.batch_size)
        state = sampler.state_dict()  # what a checkpoint written at `step` must hold

        def build():
            compile_safety.apply_thread_settings()  # may run in the prefetch thread
            return [batch_for(w, [train_examples[i] for i in p],
                              training.anchor_generator(config.train.seed, step,
                                                        node.global_worker(w.index)))
                    for w, p in zip(workers, picks)]
        return state, build

    # The target prepares step n+1 while the drafters train on step n (train.prefetch_target):
    # batches depend only on the sampler and (seed, step, worker), never on the drafters.
    prefetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target") \
        if config.train.prefetch_target else None
    upcoming = None  # (sampler state, Future of the batches) for step + 1

    if step == 0 and eval_batches:
        evaluate(workers[0], eval_batches, metrics, step)
    while step < stop_step and not stop.requested:
        step += 1
        if upcoming is None:
            sampler_state, build = take_batches(step)
            batches = build()
        else:
            sampler_state, batches = upcoming[0], upcoming[1].result()
            upcoming = None
        if prefetch is not None and step < stop_step:
            next_state, next_build = take_batches(step + 1)
            upcoming = (next_state, prefetch.submit(next_build))
        results = list(pool.map(lambda wb: wb[0].forward_backward(wb[1]), zip(workers, batches)))
        training.average_gradients(workers)
        node.all_reduce_grads(workers)
        results, tokens = node.gather_step(results, sum(b.tokens for b in batches), stop)
        lr = workers[0].scheduler.get_last_lr()[0]
        list(pool.map(lambda w: w.update(), workers))
        window.append((results, tokens))
        if step % config.train.log_every == 0 or step == stop_step:
            log_train(metrics, step, stop_step, window, time.perf_counter() - window_start, lr,
                      target_devices + drafter_devices)
            window, window_start = [], time.perf_counter()
        if eval_batches and (step % config.train.eval_every == 0 or step == stop_step):
            evaluate(workers[0], eval_batches, metrics, step)
        if step % config.train.save_every == 0 or step == stop_step:
            save(step)
    if prefetch is not None:  # after a stop the prefetched batches are not used
        prefetch.shutdown(wait=True, cancel_futures=True)
        if upcoming is not None and not upcoming[1].cancelled() and upcoming[1].exception():
            log.warning("prefetch of step %d failed after the stop: %s", step + 1,
                        upcoming[1].exception())
    if stop.requested:
        if window:
            log_train(metrics, step, stop_step, window, time.perf_counter() - window_start,
                      workers[0].scheduler.get_last_lr()[0], target_devices + drafter_devices)
        save(step)
        log.info("stopped by SIGTERM at step %d", step)
    pool.shutdown()
    metrics.close()
    node.close()
    return 0


def restore(directory: str, workers, sampler) -> int:
    from safetensors.torch import load_file

    weights = load_file(os.path.join(directory, "model.safetensors"))
    state = checkpoints.load_state(directory)
    for worker in workers:
        worker.drafter.load_state_dict(weights, strict=True)
        worker.optimizer.load_state_dict(state["optimizer"])
        worker.scheduler.load_state_dict(state["scheduler"])
    sampler.load_state_dict(state["sampler"])
    torch.set_rng_state(state["rng"]["torch"])
    return int(state["step"])


def save_checkpoint(run_dir, step, workers, sampler_state: dict, config) -> str:
    worker = workers[0]  # replicas are identical; one copy is the checkpoint

    def write(directory):
        dm.save_drafter(worker.drafter, directory)
        checkpoints.save_state(directory, {
            "step": step, "optimizer": worker.optimizer.state_dict(),
            "scheduler": worker.scheduler.state_dict(), "sampler": dict(sampler_state),
            "rng": {"torch": torch.get_rng_state()}, "config": config.to_dict(),
        })
    return checkpoints.save_checkpoint(run_dir, step, write, config.train.keep_last)


def write_metrics(stream, record: dict) -> None:
    stream.write(json.dumps(record) + "\n")
    stream.flush()


def log_train(metrics, step, stop_step, window, seconds, lr, devices) -> None:
    stats = dm.merge_stats([s for results, _ in window for _, s in results])
    losses = [loss for results, _ in window for loss, _ in results]
    tokens = sum(t for _, t in window)
    record = {
        "kind": "train", "step": step, "loss": sum(losses) / len(losses),
        "slot_accuracy": dm.slot_accuracy(stats), "acceptance_length": dm.acceptance_length(stats),
        "worker_loss": [sum(r[i][0] for r, _ in window) / len(window)
                        for i in range(len(window[0][0]))],
        "tokens_per_s": tokens / max(seconds, 1e-9), "lr": lr,
        "memory_gib": training.memory_gib(devices), "time": time.time(),
    }
    write_metrics(metrics, record)
    acc = " ".join(f"{a:.2f}" for a in record["slot_accuracy"][:4])
    log.info("step %d/%d | loss %.4f | tau %.2f | acc[1:5] %s | %.0f tok/s | lr %.2e | mem %.2f GiB",
             step, stop_step, record["loss"], record["acceptance_length"], acc,
             record["tokens_per_s"], lr, record["memory_gib"])


def evaluate(worker, batches, metrics, step) -> None:
    results = [worker.evaluate(b) for b in batches]
    stats = dm.merge_stats([s for _, s in results])
    record = {"kind": "eval", "step": step,
              "loss": sum(loss for loss, _ in results) / len(results),
              "slot_accuracy": dm.slot_accuracy(stats),
              "acceptance_length": dm.acceptance_length(stats), "time": time.time()}
    write_metrics(metrics, record)
    log.info("eval step %d | held-out loss %.4f | tau %.2f | acc[1:5] %s", step, record["loss"],
             record["acceptance_length"], " ".join(f"{a:.2f}" for a in record["slot_accuracy"][:4]))


def main() -> int:
    args = cli_parser(__doc__.splitlines()[0]).parse_args()
    try:
        return train(args)
    except (ConfigError, DataError, TargetLoadError, dm.DrafterShapeError) as exc:
        print(f"train_dflash: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    assert threading.current_thread() is threading.main_thread()
    sys.exit(main())
