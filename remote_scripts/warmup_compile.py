"""Fill the compile cache that training reads: run the training step for every shape, then exit.

    python warmup_compile.py --config FILE [--set k=v ...] [--target-devices L]
        [--drafter-devices L] [--run-dir D] [--max-steps N]      (same arguments as training)

For each drafter device in turn, in the main thread: the training forward AND backward with grad
enabled (the incident's warm-up ran under no_grad, which compiles a different graph) and the
evaluation forward without grad, on batches of exactly the shapes training uses, through the same
model, config and compile settings (imported, never copied). The target's weights are not loaded:
compiled graphs depend on shapes and dtypes only, so random features of the target's width stand
in. On CUDA it also compiles the target's decoder-layer graph (the fast path's compiled layers),
on a random-weight model of the target's config cut to one layer of each kind. Exits non-zero
with a one-line message on failure.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback

import compile_safety
import training
from dflash_data import DataError
from target_model import (
    ShapeOnlyTarget,
    TargetLoadError,
    load_target_config,
    load_tokenizer,
    warm_compiled_layers,
)
from train_config import ConfigError, cli_parser, config_from_args, resolve_path, setup_logging

log = logging.getLogger("dflash.warmup")


def warm(args) -> int:
    config = config_from_args(args)
    setup_logging(None)
    target_devices, drafter_devices = training.configured_devices(config)

    target_path = resolve_path(config.target.path)
    tokenizer = load_tokenizer(target_path)
    examples = training.one_batch_of_examples(config, tokenizer)
    layer_ids = training.target_layer_ids(config, load_target_config(target_path))
    target = ShapeOnlyTarget(target_path, config.target.dtype, layer_ids,
                             training.feature_dtype(config))
    drafters = training.build_drafters(config, target, tokenizer, drafter_devices)
    log.info("compile: %s", training.apply_compile(config.compile, config.train.fast_paths,
                                                    target, drafters))

    started = time.perf_counter()
    timings = training.warm_up(drafters.workers, lambda worker: training.worker_batch(
        config, target, drafters, worker, examples,
        training.anchor_generator(config.train.seed, -2, worker.index)))
    layers = warm_compiled_layers(target_path, config.target.dtype, target_devices,
                                  config.train.batch_size, config.data.max_length,
                                  config.train.fast_paths)
    if layers["layers"]:
        log.info("target: %d decoder layer graph(s) compiled on %d device(s) in %.1f s",
                 layers["layers"], layers["devices"], layers["seconds"])
    stats = compile_safety.stats()
    if config.compile.enabled:
        log.info("warm-up done: %d shape(s) on %s in %.1f s; compiled calls %d, fallbacks %d; "
                 "peak memory %.1f GiB; cache %s", len(timings), ",".join(drafter_devices),
                 time.perf_counter() - started, stats["calls"], stats["fallbacks"],
                 training.memory_gib(drafter_devices), compile_safety.current_settings().cache_dir)
        if stats["fallbacks"]:
            raise RuntimeError(f"{stats['fallbacks']} compile fallback(s): attention would run "
                               "uncompiled; raise compile.recompile_limit")
    else:
        log.info("warm-up done: %d shape(s) on %s in %.1f s; compile is off (%s attention): "
                 "the step ran uncompiled and there is nothing to cache", len(timings),
                 ",".join(drafter_devices), time.perf_counter() - started, config.model.attention)
    return 0


def main() -> int:
    args = cli_parser(__doc__.splitlines()[0]).parse_args()
    try:
        return warm(args)
    except (ConfigError, DataError, TargetLoadError) as exc:
        print(f"warmup_compile: error: {exc}", file=sys.stderr)
    except Exception as exc:  # a compile failure: say what failed, keep the trace for the log
        traceback.print_exc()
        first_line = (str(exc).strip().splitlines() or [""])[0]
        print(f"warmup_compile: error: warm-up failed: {type(exc).__name__}: {first_line}",
              file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
