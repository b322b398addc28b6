"""One drafter training step (forward + backward + clip + AdamW) through training.DrafterWorker.

FLOPs counted (bf16 matrix work only; elementwise work, the optimizer and masked-out attention
tiles are not counted): every linear forward 2*m*k*n; backward 2x forward for the trainable
layers (input and weight gradients), weight gradient only for fc (the target features need no
gradient), input gradient only for the frozen LM head; attention 4*P*D*Hq forward and 10*P*D*Hq
backward on the P unmasked pairs.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time

import compile_safety
import dflash_model as dm
import fast_paths
import objective
import torch
import training
from common import QWEN3_8B, REMOTE, linear_flops, time_fn
from train_config import load_config
from transformers import Qwen3Config

TARGET_27B = dict(dm.DEFAULT_TARGET)


def make_config(cache_dir: str, smoke: bool, extra=()):
    sets = [f"compile.cache_dir={cache_dir}", "compile.enabled=true", "train.autocast=bfloat16"]
    if smoke:
        sets += ["model.attention=dense", "compile.enabled=false", "data.max_length=64",
                 "data.num_anchors=8", "model.block_size=4", "model.num_draft_layers=2",
                 "train.autocast=null"]
    return load_config(os.path.join(REMOTE, "configs", "production-27b.yaml"), sets + list(extra))


def step_flops(cfg, context: int, num_blocks: int, block: int, pairs: int, batch: int = 1) -> float:
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    nq, nkv, hd, vocab = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size
    taps = len(cfg.dflash_config["target_layer_ids"])
    q = batch * num_blocks * block
    kv = batch * context + q
    layer = (linear_flops(q, h, nq * hd) + 2 * linear_flops(kv, h, nkv * hd)
             + linear_flops(q, nq * hd, h) + 3 * linear_flops(q, h, inter))
    attn = 14.0 * pairs * hd * nq
    fc = 2 * linear_flops(batch * context, taps * h, h)
    head = 2 * linear_flops(q, h, vocab)
    return 3 * layers * layer + layers * attn + fc + head


def make_batch(config, dcfg, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq, block = config.data.max_length, config.model.block_size
    taps = len(dcfg.dflash_config["target_layer_ids"])
    input_ids = torch.randint(0, dcfg.vocab_size - 1, (1, seq), generator=g)
    loss_mask = torch.ones(1, seq)
    anchors, keep = objective.sample_anchors(loss_mask, config.data.num_anchors, g)
    noise_ids, position_ids = objective.block_inputs(input_ids, anchors, keep, block,
                                              dcfg.dflash_config["mask_token_id"])
    labels, valid = objective.block_labels(input_ids, loss_mask, anchors, keep, block)
    anchors, keep = anchors.to(device), keep.to(device)
    build = dm.dense_dflash_mask if config.model.attention == "dense" else dm.flex_dflash_mask
    dtype = torch.bfloat16 if config.train.autocast else torch.float32
    hidden = torch.randn(1, seq, taps * dcfg.hidden_size, generator=g).to(device, dtype)
    pairs = int(dm.dense_dflash_mask(anchors, keep, seq, block).sum())
    batch = training.Batch(target_hidden=hidden, noise_ids=noise_ids.to(device),
                           position_ids=position_ids.to(device),
                           mask=build(anchors, keep, seq, block), labels=labels.to(device),
                           valid=valid.to(device), num_blocks=anchors.shape[1], tokens=seq)
    return batch, pairs


def run_one(results, device, target_shape: dict, label: str, variants, smoke: bool,
            cache_dir: str, ceiling: float, iters: int = 8):
    config = make_config(cache_dir, smoke)
    training.configure_compile(config.compile)  # compile.cache_dir is cache_dir
    fast_paths.compile_lm_head_loss()  # the LM-head region, as training.apply_compile does
    target_cfg = Qwen3Config(**target_shape)
    vocab = target_shape["vocab_size"]
    with torch.device(device):
        template = training.build_drafter_template(
            config, target_cfg, vocab - 1, training.target_layer_ids(config, target_cfg))
    dcfg = template.config
    dtype = torch.bfloat16 if config.train.autocast else torch.float32
    g = torch.Generator(device=device).manual_seed(1)
    embed = (torch.randn(vocab, dcfg.hidden_size, generator=g, device=device) * 0.02).to(dtype)
    head = (torch.randn(vocab, dcfg.hidden_size, generator=g, device=device) * 0.02).to(dtype)
    batch, pairs = make_batch(config, dcfg, device)
    flops = step_flops(dcfg, config.data.max_length, batch.num_blocks, config.model.block_size,
                       pairs)
    for variant in variants:
        worker = step = None
        try:
            from torch.nn.attention.flex_attention import flex_attention
            # plain: the reference paths (fast_paths off); otherwise the project's training path
            fast = variant != "plain"
            variant_config = dataclasses.replace(
                config, train=dataclasses.replace(config.train, fast_paths=fast))
            opts = (fast_paths.flex_kernel_options(dcfg.head_dim) if fast else None) or {}
            if config.model.attention == "dense":
                attention = dm.dense_attention
            elif "compiled_layers" in variant:  # the layer's compile traces flex_attention itself
                def attention(q, k, v, mask, scale, _o=opts):
                    return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=True,
                                          kernel_options=_o)
            else:  # as training.make_attention, with this head_dim's options (no singleton)
                flex = compile_safety.safe_compile(flex_attention, "flex_attention")

                def attention(q, k, v, mask, scale, _f=flex, _o=opts):
                    return _f(q, k, v, block_mask=mask, scale=scale, enable_gqa=True,
                              kernel_options=_o)
            worker = training.DrafterWorker(0, device, template, variant_config, embed, head,
                                            attention)
            if "compiled_layers" in variant:
                for layer in worker.drafter.layers:
                    layer.compile(dynamic=False)
            torch.cuda.reset_peak_memory_stats(device) if device != "cpu" else None
            losses = []

            def step(worker=worker, losses=losses):
                loss, _ = worker.forward_backward(batch)
                worker.update()
                losses.append(loss)

            t0 = time.perf_counter()
            step()
            first = time.perf_counter() - t0
            t = time_fn(step, device, warmup=2, iters=3 if smoke else iters)
            mem = torch.cuda.max_memory_allocated(device) / 2**30 if device != "cpu" else 0.0
            tflops = flops / t["ms"] / 1e9
            results.add("drafter_step", f"{label}:{variant}", ms=t["ms"], ms_min=t["ms_min"],
                        ms_max=t["ms_max"], tflops=tflops, mfu_pct=100 * tflops / ceiling,
                        tokens_per_s=config.data.max_length / t["ms"] * 1e3,
                        block_tokens_per_s=batch.num_blocks * config.model.block_size
                        / t["ms"] * 1e3,
                        first_step_s=first, peak_gib=mem, step_tflop=flops / 1e12,
                        loss_first_last=[losses[0], losses[-1]],
                        params_m=dm.parameter_count(worker.drafter) / 1e6,
                        kernel_options=opts, note=f"pairs={pairs}")
        except Exception as exc:
            import traceback
            traceback.print_exc()
            results.add("drafter_step", f"{label}:{variant}",
                        note=f"FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        finally:
            worker = step = None  # drops the worker (step holds it too)
            gc.collect()
            if device != "cpu":
                torch.cuda.empty_cache()


def shape(kind: str, smoke: bool) -> dict:
    """Target shapes: Qwen3-8B, or the 27B-class default of dflash_model; tiny ones for --smoke."""
    full = dict(QWEN3_8B) if kind == "8b" else dict(TARGET_27B)
    if smoke:
        full.update(vocab_size=256, hidden_size=64 if kind == "8b" else 80, intermediate_size=96,
                    num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16 if kind == "8b" else 20, num_hidden_layers=8)
    return full
