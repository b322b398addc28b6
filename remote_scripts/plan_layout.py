"""Measure what `invoke plan` needs: the target's and one drafter worker's tokens/s per device.

    python plan_layout.py --config FILE [--set k=v ...] [--target-devices L] [--drafter-devices L]
        [--run-dir D] [--iters N] [--save FILE]       (the training arguments, plus two)

At the configured shapes (train.batch_size x data.max_length, the config's taps, compile as
configured): the target's forward through training's own path (Target.context_features, compiled
layers on CUDA) on the first target device, one full copy (split over the target devices only
when one copy does not fit a device); then one drafter worker's training step (forward, backward,
update) on the first drafter device. Prints progress lines, then one `RESULT <json>` line; --save
also writes that JSON (atomically) for `invoke doctor`. Exit 2 on bad input.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import checkpoints
import dflash_model as dm
import target_model
import torch
import training
from dflash_data import DataError, collate
from target_model import Target, TargetLoadError
from train_config import ConfigError, cli_parser, config_from_args, resolve_path, setup_logging

log = logging.getLogger("dflash.plan")


def timed(fn, devices, iters: int) -> float:
    """Median seconds of fn() over `iters` calls after one untimed call (compiles, allocates)."""
    def synced():
        fn()
        for device in dict.fromkeys(devices):
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
    synced()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        synced()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def measure(args) -> dict:
    config = config_from_args(args)
    setup_logging(None)
    target_devices, drafter_devices = training.configured_devices(config)
    path = resolve_path(config.target.path)
    tokenizer = target_model.load_tokenizer(path)
    target_config = target_model.load_target_config(path)
    layer_ids = training.target_layer_ids(config, target_config)
    examples = training.one_batch_of_examples(config, tokenizer)
    batch, seq = config.train.batch_size, config.data.max_length
    weights = target_model.checkpoint_weight_bytes(path, config.target.dtype)
    activations = target_model.activation_bytes(dm.text_config(target_config), batch, seq,
                                                len(layer_ids), config.target.dtype)
    first = target_devices[0]
    device_bytes = torch.cuda.get_device_properties(first).total_memory \
        if first.startswith("cuda") else weights + activations + target_model.RESERVE_BYTES
    fits = weights + activations + target_model.RESERVE_BYTES <= device_bytes
    measured_on = [first] if fits else target_devices
    print(f"plan: loading the target ({weights / 2**30:.1f} GiB) on {','.join(measured_on)}",
          flush=True)
    target = Target(path, measured_on, config.target.dtype, layer_ids,
                    fast_paths=config.train.fast_paths, feature_dtype=training.feature_dtype(config))
    drafters = training.build_drafters(config, target, tokenizer, drafter_devices[:1])
    log.info("compile: %s", training.apply_compile(config.compile, config.train.fast_paths,
                                                    target, drafters))
    worker = drafters.workers[0]

    print("plan: timing the target's forward", flush=True)
    sample = training.worker_batch(config, target, drafters, worker, examples,
                                   # compiles the target's layers (CUDA) before the timing
                                   training.anchor_generator(config.train.seed, 0, 0))
    input_ids, attention, _ = collate(examples, seq, pad_id=0)
    tokens = int(attention.sum())
    target_s = timed(lambda: target.context_features(input_ids, attention, worker.device),
                     measured_on + [worker.device], args.iters)
    print(f"plan: target {tokens / target_s:,.0f} tok/s on {first}; timing one drafter step",
          flush=True)

    def step():
        worker.forward_backward(sample)
        worker.update()
    drafter_s = timed(step, [worker.device], args.iters)
    print(f"plan: drafter {tokens / drafter_s:,.0f} tok/s on {worker.device}", flush=True)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"kind": "plan", "time": time.time(), "gpus": gpus, "tokens_per_batch": tokens,
            "target_tok_s": tokens / target_s, "drafter_tok_s": tokens / drafter_s,
            "target_device": first, "drafter_device": worker.device,
            "weights_gib": weights / 2**30, "activations_gib": activations / 2**30,
            "device_gib": device_bytes / 2**30, "configured": {
                "target_devices": target_devices, "drafter_devices": drafter_devices,
                "placement": config.target.placement}}


def main() -> int:
    parser = cli_parser(__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5, help="timed calls of each (median)")
    parser.add_argument("--save", help="also write the RESULT JSON to this file")
    args = parser.parse_args()
    try:
        record = measure(args)
    except (ConfigError, DataError, TargetLoadError, dm.DrafterShapeError) as exc:
        print(f"plan_layout: error: {exc}", file=sys.stderr)
        return 2
    if args.save:
        checkpoints.write_atomic(args.save, json.dumps(record) + "\n")
    print("RESULT " + json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
