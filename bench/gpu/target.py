"""Target hidden-state extraction: a random-weight Qwen3-8B or 27B-class transformers model in bf16.

The 27B class is dflash_model.DEFAULT_TARGET (the production target's widths: H 5120, 64 layers,
24 q / 4 kv heads of 256, vocab 248320; every layer full attention), the shape the drafter
section's 27B rows use too. Taps: 5, spread as training spreads them.

FLOPs counted: 2 * (decoder-layer parameters run) * tokens for the matrix products, plus causal
attention 2 * S^2 * D * Hq per layer and sequence (QK^T and PV over the S^2/2 visible pairs).
The LM head (logits_to_keep=1) and elementwise work are not counted.
"""

from __future__ import annotations

import gc

import dflash_model as dm
import fast_paths
import torch
from common import QWEN3_8B, time_fn
from target_model import Target, random_weights_model


def build_model(device, smoke: bool, kind: str = "8b"):
    from transformers import Qwen3Config

    shape = dict(QWEN3_8B) if kind == "8b" else dict(dm.DEFAULT_TARGET)
    if smoke:
        shape.update(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    theta = shape.pop("rope_theta")
    config = Qwen3Config(**shape, rope_parameters={"rope_type": "default", "rope_theta": theta},
                         tie_word_embeddings=False, use_cache=False)
    config._attn_implementation = "sdpa"
    dtype = torch.float32 if smoke else torch.bfloat16
    return random_weights_model(config, dtype, device), config


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def run(results, device, smoke, ceiling, batches=(4, 1), compile_layers=True, kind="8b",
        variants=None):
    model, config = build_model(device, smoke, kind)
    layers = model.model.layers
    per_layer = sum(p.numel() for p in layers[0].parameters())
    taps = dm.build_target_layer_ids(len(layers), 5)
    seq = 3072 if not smoke else 64
    target = Target.from_model(model, [device], taps)  # the project's extraction path
    label = f"{kind}: " if kind != "8b" else ""

    def flops(batch, layers_run):
        attn = 2.0 * seq * seq * config.head_dim * config.num_attention_heads
        return layers_run * batch * (2.0 * per_layer * seq + attn)

    g = torch.Generator().manual_seed(0)
    # reference: transformers with the padding mask, every layer (the baseline); eager fast path
    # (no mask, stop after the last tap); the project's path, Target.context_features, which on
    # CUDA is the fast path with each layer compiled through compile_safety (on first call).
    every = [("reference(mask,all layers)", False), ("fast eager(no mask, stop after tap)", False)]
    if compile_layers:
        every.append(("project: Target.context_features (fast + compiled layers)", True))
    variants = [v for v in every if variants is None or v[0].split(":")[0].split("(")[0].strip()
                in variants]
    # inputs and references first, before anything is compiled (the compiled layers would
    # otherwise serve the reference too): the reference with the padding mask (right padding on
    # the last row, as collate pads) and with an all-ones mask (transformers drops it: SDPA's
    # causal kernel, the one the fast path uses)
    inputs, refs = {}, {}
    for batch in batches:
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[-1, seq - 100:] = 0
        inputs[batch] = ids, mask
        refs[batch] = (target.reference_features(ids, mask, device).float(),
                       target.reference_features(ids, torch.ones_like(mask), device).float())
        if batch > 1:  # what the choice of SDPA kernel alone moves, on the unpadded rows
            masked, ones = refs[batch]
            results.add("target_extraction", f"{label}kernel noise B={batch}",
                        rel_err_masked_vs_causal_kernel=_rel(masked[:-1], ones[:-1]),
                        note="reference with padding mask vs all-ones mask, rows without padding")

    for name, project in variants:
        for batch in batches:
            ids, mask = inputs[batch]
            if name.startswith("reference"):
                fn = lambda ids=ids, mask=mask: target.reference_features(ids, mask, device)  # noqa: E731
                run_layers = len(layers)
            elif project:
                target.compile_layers()  # training.apply_compile's first region
                fn = lambda ids=ids, mask=mask: target.context_features(ids, mask, device)  # noqa: E731
                run_layers = max(taps) + 1
            else:
                ids_dev = ids.to(device)
                fn = lambda ids_dev=ids_dev: fast_paths.target_features(model, ids_dev, taps, device)  # noqa: E731
                run_layers = max(taps) + 1
            try:
                graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
                first = time_fn(fn, device, warmup=0, iters=1)["ms"]
                graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
                t = time_fn(fn, device, warmup=1, iters=3 if smoke else 6)
                got = fn().float()
                masked, ones = refs[batch]
                real = mask.bool().to(device)
                err = _rel(got[real], masked[real])
                err_causal = _rel(got[:-1], ones[:-1]) if batch > 1 else None
                f = flops(batch, run_layers)
                results.add("target_extraction", f"{label}{name} B={batch}", ms=t["ms"],
                            tflops=f / t["ms"] / 1e9, mfu_pct=100 * f / t["ms"] / 1e9 / ceiling,
                            tokens_per_s=batch * seq / t["ms"] * 1e3, first_call_ms=first,
                            rel_err_vs_reference=err, rel_err_unpadded_vs_causal_ref=err_causal,
                            layers_run=run_layers, compiled_layers=target.compiled_layers,
                            new_dynamo_graphs_first_call=graphs, params_b=_params(model) / 1e9,
                            note=f"S={seq} taps={taps}")
            except Exception as exc:
                import traceback
                traceback.print_exc()
                results.add("target_extraction", f"{label}{name} B={batch}",
                            note=f"FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    model = target = None  # drops them (the timed lambdas hold them through their closures too)
    gc.collect()
