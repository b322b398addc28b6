"""Train a DFlash drafter against a frozen target.

    python train_dflash.py --config configs/tiny-cpu.yaml [--set key=value ...]
        [--target-devices cuda:0,cuda:1] [--drafter-devices cuda:5,cuda:6,cuda:7]
        [--run-dir DIR] [--max-steps N]

config -> devices -> data -> target -> drafters (resumed from RUN/checkpoints/latest) -> compile
-> warm-up (every shape, in the main thread) -> loop (one worker thread per drafter device,
gradients averaged every step, checkpoints). The first step of every launch is logged (the launch
waits for it), then every train.log_every steps. On SIGTERM writes a checkpoint and exits 0.
--max-steps N stops at step N; the LR schedule follows train.max_steps, lengthened to N when N is
larger (a finished run continued).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import checkpoints
import dflash_model as dm
import distributed
import objective
import target_model
import training
from batch_feed import BatchFeed
from dflash_data import DataError, Sampler, data_report, load_examples
from target_model import Target, TargetLoadError, load_tokenizer
from train_config import ConfigError, cli_parser, config_from_args, dump_yaml, resolve_path, setup_logging
from train_config import stop_step as stop_step_of

log = logging.getLogger("dflash.train")


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
    run_dir = open_run_dir(config)
    stop_step = stop_step_of(config, args.max_steps)
    training.seed_everything(config.train.seed)

    # devices
    target_devices, drafter_devices = training.configured_devices(config)
    log.info("run %s: target on %s, %d drafter worker(s) on %s", run_dir, ",".join(target_devices),
             len(drafter_devices), ",".join(drafter_devices))

    # data
    target_path = resolve_path(config.target.path)
    tokenizer = load_tokenizer(target_path)
    train_examples, heldout_examples = load_data(config, tokenizer, target_path, run_dir)
    sampler = Sampler(len(train_examples), config.train.seed)

    # target
    target = load_target(config, target_path, target_devices, run_dir)

    # drafters: one worker per drafter device, identical replicas, resumed from the latest checkpoint
    drafters = training.build_drafters(config, target, tokenizer, drafter_devices)
    workers = drafters.workers
    # multi-node (under torchrun): gradients, metrics and SIGTERM across nodes; else a no-op
    node = distributed.maybe_init_distributed(drafter_devices[0], len(workers), stop)
    step = resume(run_dir, config, node, workers, sampler)

    # compile
    log.info("compile: %s", training.apply_compile(config.compile, config.train.fast_paths,
                                                    target, drafters))
    eval_batches = make_eval_batches(config, target, drafters, heldout_examples)
    mark_ready(run_dir, step, len(workers))

    # warm-up: every shape the workers will run, in the main thread, before they start
    warm_examples = train_examples[: config.train.batch_size]
    timings = training.warm_up(workers, lambda w: training.worker_batch(
        config, target, drafters, w, warm_examples,
        training.anchor_generator(config.train.seed, -2, w.index)))
    log.info("warm-up (main thread) done in %.1f s for %d shape(s)%s", sum(timings.values()),
             len(timings), "" if config.compile.enabled else "; compile is off")

    # loop: one worker thread per drafter device, gradients averaged every step
    metrics = checkpoints.open_for_append(os.path.join(run_dir, "metrics.jsonl"))
    pool = ThreadPoolExecutor(max_workers=len(workers), thread_name_prefix="drafter")
    feed = BatchFeed(config, train_examples, sampler, node, target, drafters, stop_step)
    sampler_state = sampler.state_dict()
    window, window_start = [], time.perf_counter()
    devices = target_devices + drafter_devices
    first_step = step + 1  # always logged: the launch waits for this line (dflash_ops.remote.runs.STEP)
    if step == 0 and eval_batches:
        evaluate(workers[0], eval_batches, drafters, metrics, step)
    while step < stop_step and not stop.requested:
        step += 1
        batches, sampler_state = feed.next(step)
        results = list(pool.map(lambda wb: wb[0].forward_backward(wb[1]), zip(workers, batches, strict=True)))
        training.average_gradients(workers)
        node.all_reduce_grads(workers)
        results, tokens = node.gather_step(results, sum(b.tokens for b in batches), stop)
        lr = workers[0].scheduler.get_last_lr()[0]
        list(pool.map(lambda w: w.update(), workers))
        window.append((results, tokens))
        if step == first_step or step % config.train.log_every == 0 or step == stop_step:
            log_train(metrics, step, stop_step, window, time.perf_counter() - window_start, lr,
                      devices)
            window, window_start = [], time.perf_counter()
        if eval_batches and (step % config.train.eval_every == 0 or step == stop_step):
            evaluate(workers[0], eval_batches, drafters, metrics, step)
        if step % config.train.save_every == 0 or step == stop_step:
            save(run_dir, step, workers, sampler_state, config, node, metrics)
    feed.close()
    if stop.requested:
        if window:
            log_train(metrics, step, stop_step, window, time.perf_counter() - window_start,
                      workers[0].scheduler.get_last_lr()[0], devices)
        save(run_dir, step, workers, sampler_state, config, node, metrics)
        log.info("stopped by SIGTERM at step %d", step)
    pool.shutdown()
    metrics.close()
    node.close()
    return 0


def open_run_dir(config) -> str:
    """The run directory, made if new, with its log opened and the resolved config.yaml written; an
    earlier launch's `ready` is removed (the launch wait must see only ours)."""
    run_dir = resolve_path(config.train.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    ready_marker = os.path.join(run_dir, "ready")
    if os.path.exists(ready_marker):
        os.remove(ready_marker)
    setup_logging(run_dir)
    checkpoints.write_atomic(os.path.join(run_dir, "config.yaml"), dump_yaml(config))
    return run_dir


def resume(run_dir: str, config, node, workers, sampler) -> int:
    """The step to start from: that of RUN/checkpoints/latest, restored into every worker and the
    sampler (multi-node: rank 0's, shared first), or 0 (with train.init_from: from its weights)."""
    node.share_latest_checkpoint(run_dir, config.train.keep_last)
    resume_from = checkpoints.latest_checkpoint(run_dir)
    if not resume_from:
        if config.train.init_from:
            source = resolve_path(config.train.init_from)
            checkpoints.init_from(source, workers)
            log.info("initialised from %s: its weights; the optimizer and schedule start fresh",
                     source)
        return 0
    step = checkpoints.restore(resume_from, workers, sampler)
    log.info("resumed from %s at step %d", resume_from, step)
    return step


def mark_ready(run_dir: str, step: int, workers: int) -> None:
    """RUN/ready and the `ready:` line: the target and the drafters are built (the launch wait
    reports it when no step comes in time)."""
    checkpoints.write_atomic(os.path.join(run_dir, "ready"),
                             json.dumps({"step": step, "time": time.time()}) + "\n")
    log.info("ready: target and %d drafter worker(s) built, starting at step %d", workers, step)


def load_data(config, tokenizer, target_path: str, run_dir: str) -> tuple[list, list]:
    """Train and held-out examples; what they are (whose answers, held-out overlap) goes to the log
    and RUN/data.json."""
    read = dict(tokenizer=tokenizer, header=config.data.assistant_header,
                end=config.data.end_of_turn, max_length=config.data.max_length,
                max_bad_fraction=config.data.max_bad_fraction, log=lambda line: log.info("data: %s", line),
                cache_dir=config.data.cache_dir)
    data_paths = [resolve_path(p) for p in (config.data.train, config.data.heldout) if p]
    train_examples = load_examples(data_paths[0], **read)
    heldout_examples = load_examples(data_paths[1], **read) if config.data.heldout else []
    report = data_report(data_paths, target_path, train_examples, heldout_examples,
                         config.data.require_target_answers)
    checkpoints.write_atomic(os.path.join(run_dir, "data.json"), json.dumps(report))
    overlap = report.get("heldout_overlap", {})
    log.info("data: %d train, %d held-out conversations; held-out prompts also in train: %s",
             len(train_examples), len(heldout_examples),
             f"{overlap['in_train']}/{overlap['heldout']}" if overlap else "-")
    for warning in report["warnings"]:
        log.warning("DATA WARNING: %s", warning)
    return train_examples, heldout_examples


def load_target(config, path: str, devices: list[str], run_dir: str) -> Target:
    """The target with its taps (known from its config) and its placement (auto resolved now,
    said in the log and in RUN/placement.json)."""
    target_config = target_model.load_target_config(path)
    layer_ids = training.target_layer_ids(config, target_config)
    weights = target_model.checkpoint_weight_bytes(path, config.target.dtype)
    activations = target_model.activation_bytes(
        dm.text_config(target_config), config.train.batch_size, config.data.max_length,
        len(layer_ids), config.target.dtype)
    placement, why = target_model.choose_placement(
        config.target.placement, devices, weights, activations, target_model.free_memory(devices))
    log.info("target: placement %s over %s (%s)", placement, ",".join(devices), why)
    checkpoints.write_atomic(os.path.join(run_dir, "placement.json"), json.dumps({
        "requested": config.target.placement, "placement": placement, "why": why,
        "devices": devices, "weights_gib": round(weights / 2**30, 2),
        "activations_gib": round(activations / 2**30, 2)}) + "\n")
    started = time.perf_counter()
    target = Target(path, devices, config.target.dtype, layer_ids, placement,
                    fast_paths=config.train.fast_paths,
                    feature_cache_bytes=int(config.target.feature_cache_gib * 2**30),
                    feature_dtype=training.feature_dtype(config))
    log.info("target: %d replica(s) loaded in %.1f s", len(target.replicas),
             time.perf_counter() - started)
    return target


def make_eval_batches(config, target, drafters, heldout_examples) -> list:
    """Full held-out batches only: a smaller last batch is a shape the warm-up never compiled.
    Each batch (random anchors: the teacher-forced figures) with its examples' WalkSet (every
    anchor: the decode walk), on the same features."""
    size = config.train.batch_size
    count = min(len(heldout_examples) // size, config.train.eval_batches)
    batches = []
    for i in range(count):
        examples = heldout_examples[i * size:(i + 1) * size]
        batch = training.worker_batch(config, target, drafters, drafters.workers[0], examples,
                                      training.anchor_generator(config.train.seed, -1, i))
        batches.append((batch, training.walk_set(examples, config, batch)))
    if heldout_examples and not batches:
        raise DataError(f"held-out set has {len(heldout_examples)} usable conversations, fewer "
                        f"than one batch ({size})")
    return batches


def save(run_dir, step, workers, sampler_state: dict, config, node, metrics) -> None:
    """A checkpoint of `step` holding the sampler as of that step's picks (the feed may already
    have taken the next ones), and its line in the metrics."""
    if not node.writes_checkpoints:
        return
    path = checkpoints.save_training(run_dir, step, workers, sampler_state, config)
    diff = training.replica_max_diff(workers)
    write_metrics(metrics, {"kind": "checkpoint", "step": step, "path": path,
                            "replica_max_abs_diff": diff})
    if diff:  # the replicas are one model; a difference means they drifted apart
        log.warning("checkpoint %s: REPLICAS DIFFER by up to %.3g (the checkpoint holds worker 0's)",
                    path, diff)
    else:
        log.info("checkpoint %s (replicas identical)", path)


def write_metrics(stream, record: dict) -> None:
    stream.write(json.dumps(record) + "\n")
    stream.flush()


def log_train(metrics, step, stop_step, window, seconds, lr, devices) -> None:
    stats = objective.merge_stats([s for results, _ in window for _, s in results])
    losses = [loss for results, _ in window for loss, _ in results]
    tokens = sum(t for _, t in window)
    record = {
        "kind": "train", "step": step, "stop_step": stop_step, "loss": sum(losses) / len(losses),
        "slot_accuracy": objective.slot_accuracy(stats),
        "acceptance_length": objective.acceptance_length(stats),
        "worker_loss": [sum(r[i][0] for r, _ in window) / len(window)
                        for i in range(len(window[0][0]))],
        "tokens_per_s": tokens / max(seconds, 1e-9), "lr": lr,
        "memory_gib": training.memory_gib(devices), "time": time.time(),
    }
    write_metrics(metrics, record)
    acc = " ".join(f"{a:.2f}" for a in record["slot_accuracy"][:4])
    log.info("step %d/%d | loss %.4f | teacher-forced tau %.2f | acc[1:5] %s | %.0f tok/s | lr %.2e | "
             "mem %.2f GiB",
             step, stop_step, record["loss"], record["acceptance_length"], acc,
             record["tokens_per_s"], lr, record["memory_gib"])


def evaluate(worker, batches, drafters, metrics, step) -> None:
    """The held-out figures: loss, slot accuracy and acceptance teacher-forced at random anchors,
    and the acceptance of greedy decoding walked over the same answers (training.held_out_walk)."""
    results = [worker.evaluate(b) for b, _ in batches]
    stats = objective.merge_stats([s for _, s in results])
    walks = [training.held_out_walk(worker, w, drafters.mask_token_id, drafters.build_mask)
             for _, w in batches]
    tokens, steps = sum(t for t, _ in walks), sum(s for _, s in walks)
    record = {"kind": "eval", "step": step,
              "loss": sum(loss for loss, _ in results) / len(results),
              "slot_accuracy": objective.slot_accuracy(stats),
              "acceptance_length": objective.acceptance_length(stats),
              "decode_acceptance": tokens / steps if steps else None, "time": time.time()}
    write_metrics(metrics, record)
    log.info("eval step %d | held-out loss %.4f | teacher-forced tau %.2f | decode-walk tau %s | "
             "acc[1:5] %s", step, record["loss"], record["acceptance_length"],
             "-" if steps == 0 else f"{record['decode_acceptance']:.2f}",
             " ".join(f"{a:.2f}" for a in record["slot_accuracy"][:4]))


def main() -> int:
    args = cli_parser(__doc__.splitlines()[0]).parse_args()
    try:
        return train(args)
    except (ConfigError, DataError, TargetLoadError, dm.DrafterShapeError,
            checkpoints.CheckpointMismatch) as exc:
        print(f"train_dflash: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    assert threading.current_thread() is threading.main_thread()
    sys.exit(main())
