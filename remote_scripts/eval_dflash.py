"""Evaluate a run's drafter with the official `dflash` inference code against the run's target.

    python eval_dflash.py --run-dir D [--checkpoint latest|step-N|init|DIR] [--prompts JSONL]
        [--num-prompts 16] [--max-new-tokens 64] [--device cuda:0|cpu] [--dtype float32]

Loads the checkpoint with `dflash.model.DFlashDraftModel.from_pretrained` (refused if any key is
missing or unexpected; `init` is the untrained baseline: the drafter the run's config initialises,
train.seed, before any step, saved once as RUN/untrained) and the target named by the run's
resolved config.yaml, then decodes each held-out prompt twice, greedily: plain (one target
forward per token) and speculatively with `dflash.model.dflash_generate`. Prompts come from the
held-out file only: any whose prompt also appears in the run's training data is skipped (and
counted). Reports whether every speculative output equals
the plain one (lossless), the mean acceptance length (tokens a verification step yields, the bonus token
included, as dflash's own stats count it), tokens per target forward, the wall-clock speedup, and
each prompt's new tokens and verification steps (per_prompt: which answers ran to the limit).
Writes RUN/eval.json (atomically) and appends the same record to RUN/evals.jsonl; the last stdout
line is `RESULT <json>`. Exit 0; 3 if the outputs differ (not lossless); 2 on bad input.

Counting without dflash's return_stats (which times with torch.cuda.synchronize and fails on CPU):
a forward pre-hook on the target sees every call; dflash crops the target's KV cache to the
accepted prefix before each verification, so the cache length at each call gives the tokens each
step produced.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import checkpoints
import target_model
import torch
import yaml
from chat_formats import DataError, prompt_key, read_dataset
from train_config import ConfigError, config_from_tree, resolve_path

EXIT_NOT_LOSSLESS, EXIT_BAD_INPUT = 3, 2


class EvalError(ValueError):
    """Bad run directory, checkpoint or prompts; the message is one line."""


# ----------------------------------------------------------------------------- inputs

def resolve_checkpoint(run_dir: str, checkpoint: str) -> str:
    """`latest`, `step-N` (under RUN/checkpoints) or a directory path."""
    if checkpoint == "latest":
        found = checkpoints.latest_checkpoint(run_dir)
        if found is None:
            raise EvalError(f"{run_dir}: no complete checkpoint under checkpoints/ yet")
        return found
    candidate = checkpoint if os.path.isabs(checkpoint) or os.sep in checkpoint else \
        os.path.join(checkpoints.checkpoint_root(run_dir), checkpoint)
    if not os.path.isfile(os.path.join(candidate, "config.json")):
        raise EvalError(f"checkpoint {checkpoint!r}: no config.json in {candidate}")
    return candidate


def initial_checkpoint(run_dir: str, config, tokenizer, target_path: str) -> str:
    """RUN/untrained: the drafter as the run's config initialises it (train.seed, built on the
    first drafter device's kind, as training builds it), before any step, in the dflash layout:
    the baseline a trained checkpoint's acceptance is compared with. Written once, atomically."""
    import training
    from dflash_model import text_config

    final = os.path.join(run_dir, "untrained")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    target_config = target_model.load_target_config(target_path)
    mask_token_id = training.resolve_mask_token_id(config, tokenizer,
                                                   text_config(target_config).vocab_size)
    first = config.devices.drafter.split(",")[0].strip()
    device = first if first.startswith("cuda") and torch.cuda.is_available() else "cpu"
    drafter = training.build_drafter_template(config, target_config, mask_token_id,
                                              training.target_layer_ids(config, target_config),
                                              device)
    temp = f"{final}.tmp-{os.getpid()}"
    checkpoints.save_drafter(drafter, temp)
    try:
        os.replace(temp, final)
    except OSError:  # another evaluation of this run wrote it first: the same seeded weights
        shutil.rmtree(temp, ignore_errors=True)
        if not os.path.isfile(os.path.join(final, "config.json")):
            raise
    return final


def run_config(run_dir: str):
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise EvalError(f"{run_dir}: no config.yaml (not a training run directory?)")
    with open(path) as f:
        return config_from_tree(yaml.safe_load(f), source=path)


def prompt_ids(tokenizer, path: str, count: int, train_path: str | None = None,
               log=print) -> list[list[int]]:
    """The first `count` conversations whose prompt is not in the training data, cut before their
    first assistant turn (a prompt the drafter trained on would flatter it)."""
    trained = {prompt_key(r.turns) for r in read_dataset(train_path)} if train_path else set()
    prompts, skipped = [], 0
    for row in read_dataset(path, log=lambda line: log(f"prompts: {line}")):
        if prompt_key(row.turns) in trained:
            skipped += 1
            continue
        first = next(i for i, t in enumerate(row.turns) if t["role"] == "assistant")
        if first > 0:
            prompts.append(target_model.chat_prompt_ids(tokenizer, row.turns[:first]))
        if len(prompts) == count:
            break
    if skipped:
        log(f"prompts: skipped {skipped} that also appear in the training data ({train_path})")
    if not prompts:
        raise EvalError(f"{path}: no held-out prompt (conversations starting with a prompt that "
                        f"is not in the training data)")
    return prompts


def load_drafter(path: str, device: str, dtype: torch.dtype):
    from dflash.model import DFlashDraftModel

    model, info = DFlashDraftModel.from_pretrained(path, dtype=dtype, output_loading_info=True)
    bad = {k: sorted(info[k]) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")
           if info[k]}
    if bad:
        raise EvalError(f"{path}: dflash cannot load this checkpoint cleanly: {bad}")
    return model.to(device).eval()


# ----------------------------------------------------------------------------- measuring

class ForwardCounter:
    """Counts target forwards; records the KV-cache length each call starts from."""

    def __init__(self, model):
        self.calls, self.cache_lengths = 0, []
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.calls += 1
        cache = kwargs.get("past_key_values")
        self.cache_lengths.append(cache.get_seq_length() if cache is not None else 0)

    def reset(self):
        self.calls, self.cache_lengths = 0, []

    def close(self):
        self._handle.remove()


def _now(device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter()


def step_lengths(cache_lengths: list[int], prompt_len: int, new_tokens: int) -> list[int]:
    """Tokens each verification produced: dflash crops the cache to `start` before each one."""
    starts = cache_lengths[1:]  # call 0 is the prefill (empty cache)
    if not starts:  # the prefill alone: no verification ran
        return []
    ends = starts[1:] + [prompt_len + new_tokens - 1]
    return [end - start for start, end in zip(starts, ends, strict=True)]


def evaluate(drafter, target, prompts, max_new_tokens: int, stops: list[int], device: str) -> dict:
    from dflash.model import dflash_generate

    counter = ForwardCounter(target)
    try:
        # one untimed pass of each: lazy initialisation and allocator warm-up stay out of the timing
        target_model.greedy_generate(target, prompts[:1], max_new_tokens, stops)
        dflash_generate(drafter, target, torch.tensor([prompts[0]], device=device),
                        max_new_tokens, stops)
        totals = dict(plain_s=0.0, spec_s=0.0, plain_forwards=0, spec_forwards=0)
        steps, mismatches, divergence, per_prompt = [], [], [], []
        for index, prompt in enumerate(prompts):
            counter.reset()
            start = _now(device)
            plain = target_model.greedy_generate(target, [prompt], max_new_tokens, stops)[0]
            totals["plain_s"] += _now(device) - start
            totals["plain_forwards"] += counter.calls

            counter.reset()
            start = _now(device)
            output = dflash_generate(drafter, target, torch.tensor([prompt], device=device),
                                     max_new_tokens, stops)
            totals["spec_s"] += _now(device) - start
            totals["spec_forwards"] += counter.calls
            spec = output[0, len(prompt):].tolist()
            if spec != plain:  # where: a bf16 near-tie differs late, a broken pairing at once
                mismatches.append(index)
                divergence.append(next((i for i, (a, b) in enumerate(zip(spec, plain, strict=False))
                                        if a != b),
                                       min(len(spec), len(plain))))
            produced = step_lengths(counter.cache_lengths, len(prompt), len(spec))
            steps += produced
            per_prompt.append([len(spec), len(produced)])
    finally:
        counter.close()
    block_size = drafter.block_size
    tokens = sum(new for new, _ in per_prompt)
    return {
        "lossless": not mismatches,
        "mismatched_prompts": mismatches,
        "first_divergence": divergence,  # per mismatched prompt: index of the first differing token
        "acceptance_length": sum(steps) / max(len(steps), 1),
        "acceptance_histogram": [steps.count(n) for n in range(1, block_size + 1)],
        "tokens_per_target_forward": tokens / max(totals["spec_forwards"], 1),
        "speedup": totals["plain_s"] / max(totals["spec_s"], 1e-9),
        "plain_tokens_per_s": tokens / max(totals["plain_s"], 1e-9),
        "spec_tokens_per_s": tokens / max(totals["spec_s"], 1e-9),
        "new_tokens": tokens,
        "target_forwards": {"plain": totals["plain_forwards"], "spec": totals["spec_forwards"]},
        "verify_steps": len(steps),
        "per_prompt": per_prompt,  # [new tokens, verification steps] of each prompt, in order
    }


# ----------------------------------------------------------------------------- main

def run(args) -> dict:
    run_dir = os.path.abspath(args.run_dir)
    config = run_config(run_dir)
    untrained = args.checkpoint == "init"
    checkpoint = None if untrained else resolve_checkpoint(run_dir, args.checkpoint)
    device = args.device or config.devices.target.split(",")[0].strip()
    dtype_name = args.dtype or config.target.dtype
    dtype = target_model.DTYPES[dtype_name]
    target_path = resolve_path(config.target.path)
    prompts_path = args.prompts or resolve_path(config.data.heldout)
    if not prompts_path:
        raise EvalError("no prompts: the run's config has no data.heldout; give --prompts JSONL")

    tokenizer, target = target_model.load_target(target_path, device, dtype_name)
    if untrained:
        checkpoint = initial_checkpoint(run_dir, config, tokenizer, target_path)
    drafter = load_drafter(checkpoint, device, dtype)
    prompts = prompt_ids(tokenizer, prompts_path, args.num_prompts, resolve_path(config.data.train),
                         log=lambda line: print(line, flush=True))
    print(f"eval: {os.path.relpath(checkpoint, run_dir)} vs target {target_path} on {device} "
          f"({dtype_name}), {len(prompts)} held-out prompts, <= {args.max_new_tokens} "
          f"new tokens", flush=True)
    measured = evaluate(drafter, target, prompts, args.max_new_tokens,
                        target_model.stop_token_ids(tokenizer, target), device)
    name = os.path.basename(checkpoint)
    step = 0 if untrained else int(name[5:]) if name.startswith("step-") and name[5:].isdigit() \
        else None
    record = {"kind": "dflash_eval", "time": time.time(), "run_dir": run_dir,
              "checkpoint": checkpoint, "step": step, "target": target_path, "device": device,
              "dtype": dtype_name, "prompts": len(prompts), "prompts_file": prompts_path,
              "max_new_tokens": args.max_new_tokens, "block_size": drafter.block_size, **measured}
    if args.write:
        checkpoints.write_atomic(os.path.join(run_dir, "eval.json"), json.dumps(record, indent=1))
        with open(os.path.join(run_dir, "evals.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, help="the training run's directory")
    parser.add_argument("--checkpoint", default="latest",
                        help="latest, step-N, init (the untrained drafter) or a directory")
    parser.add_argument("--prompts", help="chat JSONL (default: the run's data.heldout)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", help="default: the run's first target device")
    parser.add_argument("--dtype", choices=sorted(target_model.DTYPES),
                        help="the target's and the drafter's precision (default: the run's "
                             "target.dtype): float32 for a run whose features a bfloat16 target made, "
                             "so that bfloat16 near-ties cannot fail the lossless check")
    parser.add_argument("--no-write", dest="write", action="store_false",
                        help="measure only; leave eval.json and evals.jsonl alone")
    args = parser.parse_args()
    try:
        record = run(args)
    except (EvalError, ConfigError, DataError, target_model.TargetLoadError) as exc:
        print(f"eval_dflash: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"lossless {record['lossless']} | acceptance length {record['acceptance_length']:.2f} | "
          f"{record['tokens_per_target_forward']:.2f} tokens/target forward | speedup "
          f"{record['speedup']:.2f}x ({record['plain_tokens_per_s']:.0f} -> "
          f"{record['spec_tokens_per_s']:.0f} tok/s)", flush=True)
    print("RESULT " + json.dumps(record), flush=True)
    return 0 if record["lossless"] else EXIT_NOT_LOSSLESS


if __name__ == "__main__":
    sys.exit(main())
