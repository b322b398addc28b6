"""DFlash block-mask attention alone: compiled flex_attention variants against dense-mask SDPA.

FLOPs are counted on the unmasked (query, key) pairs P of the mask, per query head:
forward 4*P*D (QK^T and PV), backward 10*P*D (the five products of the flash backward), so
forward + backward = 14*P*D*Hq. Work on masked-out positions inside computed tiles is not counted.
"""

from __future__ import annotations

import dflash_model as dm
import torch
import torch.nn.functional as F
from common import time_fn

# (name, kernel_options, kv block size of the BlockMask, gqa_packed)
VARIANTS = [
    ("default", {}, 128, False),
    ("tma", {"USE_TMA": True}, 128, False),
    ("fwd128x128w8s2", {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8,
                        "fwd_num_stages": 2}, 128, False),
    ("fwd128x64w4s3", {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 4,
                       "fwd_num_stages": 3}, 128, False),
    ("bwd64x64w4s3", {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64,
                      "bwd_BLOCK_N2": 64, "bwd_num_warps": 4, "bwd_num_stages": 3}, 128, False),
    ("bwd64x128w8s2", {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128,
                       "bwd_BLOCK_N2": 64, "bwd_num_warps": 8, "bwd_num_stages": 2}, 128, False),
    ("bwd32x128w4s3", {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128,
                       "bwd_BLOCK_N2": 32, "bwd_num_warps": 4, "bwd_num_stages": 3}, 128, False),
    ("kvblock64", {"fwd_BLOCK_N": 64, "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64,
                   "bwd_BLOCK_N2": 64}, 64, False),
    ("gqa_packed", {}, 128, True),
    ("bwd64x128w8s3", {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128,
                       "bwd_BLOCK_N2": 64, "bwd_num_warps": 8, "bwd_num_stages": 3}, 128, False),
    # torch.compile(mode="max-autotune-no-cudagraphs"): inductor benchmarks its own list of
    # forward and backward configs and keeps the fastest (minutes of compile)
    ("autotune", {}, 128, False),
    ("autotune_kvblock64", {}, 64, False),
]
AUTOTUNE_MODE = "max-autotune-no-cudagraphs"


def make_inputs(device, batch=1, heads=32, kv_heads=8, context=3072, anchors=512, block=16,
                head_dim=128, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    anchor = torch.randperm(context - 1, generator=g)[:anchors].sort().values
    anchor = anchor[None].expand(batch, -1).contiguous().to(device)
    keep = torch.ones_like(anchor, dtype=torch.bool)
    q_len, kv_len = anchors * block, context + anchors * block

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_(True)

    q = rnd(batch, heads, q_len, head_dim)
    k = rnd(batch, kv_heads, kv_len, head_dim)
    v = rnd(batch, kv_heads, kv_len, head_dim)
    dout = torch.randn(batch, heads, q_len, head_dim, generator=g).to(device, dtype)
    return dict(q=q, k=k, v=v, dout=dout, anchors=anchor, keep=keep, context=context, block=block)


def block_mask(inp, kv_block: int = 128, gqa_group: int = 1):
    """The project's mask rule; gqa_group > 1: queries of a KV group packed along the Q axis."""
    from torch.nn.attention.flex_attention import create_block_mask

    anchors, keep, context, block = inp["anchors"], inp["keep"], inp["context"], inp["block"]
    batch, num_blocks = anchors.shape
    q_len = num_blocks * block
    rule = dm.dflash_mask_mod(anchors, keep, context, block)
    mod = rule if gqa_group == 1 else (lambda b, h, q, kv: rule(b, h, q % q_len, kv))
    return create_block_mask(mod, B=batch, H=None, Q_LEN=q_len * gqa_group,
                             KV_LEN=context + q_len, device=anchors.device,
                             BLOCK_SIZE=(128, kv_block))


def unmasked_pairs(inp) -> int:
    mask = dm.dense_dflash_mask(inp["anchors"], inp["keep"], inp["context"], inp["block"])
    return int(mask.sum())


def _grads(fn, inp):
    for t in (inp["q"], inp["k"], inp["v"]):
        t.grad = None
    out = fn()
    out.backward(inp["dout"])
    return [out.detach().float()] + [t.grad.detach().float() for t in (inp["q"], inp["k"], inp["v"])]


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def run(results, device, smoke: bool = False, variants=None, compare: bool = True):
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 512
    shape = dict(heads=4, kv_heads=2, context=96, anchors=8, block=8, head_dim=32,
                 dtype=torch.float32) if smoke else {}
    inp = make_inputs(device, **shape)
    q, k, v = inp["q"], inp["k"], inp["v"]
    heads, head_dim, q_len = q.shape[1], q.shape[-1], q.shape[2]
    pairs = unmasked_pairs(inp)
    flops_fwd = 4.0 * pairs * head_dim * heads
    flops = 14.0 * pairs * head_dim * heads
    kv_len = k.shape[2]
    density = pairs / (q.shape[0] * q_len * kv_len)
    scale = head_dim ** -0.5
    dense = dm.dense_dflash_mask(inp["anchors"], inp["keep"], inp["context"], inp["block"])

    def sdpa():
        return dm.dense_attention(q, k, v, dense, scale)

    ref = None
    if compare:  # float32 reference through the math of SDPA on upcast inputs
        up = {n: inp[n].detach().float().requires_grad_(True) for n in ("q", "k", "v")}
        out = F.scaled_dot_product_attention(up["q"], up["k"], up["v"], attn_mask=dense,
                                             scale=scale, enable_gqa=True)
        out.backward(inp["dout"].float())
        ref = [out.detach()] + [up[n].grad for n in ("q", "k", "v")]
        del up, out
    note = f"pairs={pairs} density={density:.3f}"
    base = _grads(sdpa, inp)
    errs = ",".join(f"{_rel(a, b):.1e}" for a, b in zip(base, ref, strict=True)) if ref else ""
    t_fwd = time_fn(lambda: sdpa(), device, 2, 5 if smoke else 10)
    t = time_fn(lambda: sdpa().backward(inp["dout"]), device, 2, 5 if smoke else 10)
    results.add("attention", "sdpa_dense_mask", ms=t["ms"], fwd_ms=t_fwd["ms"],
                tflops=flops / t["ms"] / 1e9, fwd_tflops=flops_fwd / t_fwd["ms"] / 1e9,
                rel_err_out_dq_dk_dv=errs, note=note)
    if smoke and device == "cpu":
        return  # flex_attention has no CPU backward in this torch
    plain = torch.compile(flex_attention, dynamic=False)
    autotuned = None
    best = None
    todo = [v for v in VARIANTS if not variants or v[0] in variants]
    rows = {}
    while todo:
        name, opts, kv_block, packed = todo.pop(0)
        try:
            if name.startswith("autotune"):
                autotuned = autotuned or torch.compile(flex_attention, dynamic=False,
                                                       mode=AUTOTUNE_MODE)
            compiled = autotuned if name.startswith("autotune") else plain
            group = heads // k.shape[1] if packed else 1
            bm = block_mask(inp, kv_block, group)
            if packed:
                b, hkv = k.shape[:2]

                def call(opts=opts, bm=bm, compiled=compiled, b=b, hkv=hkv, group=group):
                    qp = q.view(b, hkv, group * q_len, head_dim)  # heads of a group are adjacent
                    out = compiled(qp, k, v, block_mask=bm, scale=scale, kernel_options=opts)
                    return out.view(b, heads, q_len, head_dim)
            else:
                def call(opts=opts, bm=bm, compiled=compiled):
                    return compiled(q, k, v, block_mask=bm, scale=scale, enable_gqa=True,
                                    kernel_options=opts)
            got = _grads(call, inp)  # compiles fwd + bwd
            errs = ",".join(f"{_rel(a, b):.1e}" for a, b in zip(got, ref, strict=True)) if ref else ""
            agree = _rel(got[0], base[0])
            t_fwd = time_fn(lambda: call(), device, 3, 10 if not smoke else 3)
            t = time_fn(lambda: call().backward(inp["dout"]), device, 3, 20 if not smoke else 3)
            row = results.add("attention", f"flex_{name}", ms=t["ms"], fwd_ms=t_fwd["ms"],
                              bwd_ms=t["ms"] - t_fwd["ms"], tflops=flops / t["ms"] / 1e9,
                              fwd_tflops=flops_fwd / t_fwd["ms"] / 1e9,
                              bwd_tflops=(flops - flops_fwd) / (t["ms"] - t_fwd["ms"]) / 1e9,
                              rel_err_out_dq_dk_dv=errs, out_vs_sdpa=agree, options=opts,
                              note=f"kv_block={kv_block} packed={packed}"
                              + (f" mode={AUTOTUNE_MODE}" if name.startswith("autotune") else ""))
            rows[name] = row
            if kv_block == 128 and not packed and (best is None or row["ms"] < best["ms"]):
                best = row
            if not todo and "combined" not in rows and len(rows) > 2:
                combined = _combine(rows)
                if combined is not None:
                    todo.append(("combined", combined, 128, False))
        except Exception as exc:  # a config that does not compile (shared memory) is a result too
            rows[name] = None
            results.add("attention", f"flex_{name}", note=f"FAILED {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:160] if str(exc) else ''}", options=opts)
    return best


def _combine(rows):
    """Forward options of the fastest forward and backward options of the fastest backward."""
    ok = [r for n, r in rows.items() if r and r["note"] == "kv_block=128 packed=False"]
    if not ok:
        return None
    fwd = min(ok, key=lambda r: r["fwd_ms"])["options"]
    bwd = min(ok, key=lambda r: r["bwd_ms"])["options"]
    combined = {k: v for k, v in fwd.items() if not k.startswith("bwd_")}
    combined.update({k: v for k, v in bwd.items() if not k.startswith("fwd_")})
    return combined
