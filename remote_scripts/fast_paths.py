"""GPU-speed pieces for drafter training; each computes exactly what the plain path computes.

- `lm_head_loss`: the DFlash loss through the frozen LM head, chunked over the query tokens, with
  the gradient computed during the forward (the LM head is frozen, so d loss / d hidden is known
  once the loss is). The plain path materialises [B*N*bs, V] logits in bf16, then fp32, then the
  log-softmax and its gradient (about 20 GB at V = 151936, 8192 tokens); this keeps one chunk.
  The per-chunk softmax/gradient arithmetic is one compiled (fused) region on CUDA
  (`compile_lm_head_loss`, called by training.apply_compile), behind compile_safety's lock like
  every compiled call; eager elsewhere.
- `FLEX_KERNEL_OPTIONS`: flex_attention kernel options measured on an H200 (bench/RESULTS.md).
- `adamw`: AdamW with the fused CUDA kernel where the parameters are on CUDA.
- `target_features`: the target's tapped hidden states without the padding mask (SDPA's causal
  flash kernel instead of a materialised mask) and without the layers after the last tap;
  target_model.Target.context_features uses it.
Training takes them when `train.fast_paths` is true (the default); false: the reference paths (full
logits, foreach AdamW, torch's flex kernel options, the target's padding-mask forward, nothing of the
target compiled). training.apply_compile and DrafterWorker decide, from the config; nothing here
reads a global switch.
"""

from __future__ import annotations

import compile_safety
import objective
import torch

# Chunk rows so that one chunk's fp32 logits stay near 1 GiB (2048 rows at V = 151936).
_CHUNK_ELEMENTS = 2048 * 151936

# flex_attention kernel options for the DFlash mask on an H200, by head_dim (bench/RESULTS.md:
# 3.62 ms vs 3.85 ms fwd+bwd at head_dim 128, torch 2.11); other head dims keep torch's defaults
# (untested there: a larger tile can exceed shared memory at head_dim 256).
FLEX_KERNEL_OPTIONS: dict[int, dict] = {
    128: {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
          "bwd_num_warps": 8, "bwd_num_stages": 2},
}


def flex_kernel_options(head_dim: int | None) -> dict | None:
    """Tuned options for this head_dim on CUDA, or None (torch's defaults)."""
    if head_dim is None or not torch.cuda.is_available():
        return None
    return FLEX_KERNEL_OPTIONS.get(int(head_dim))


def _ce_chunk(logits, labels, token_weights, need_grad: bool):
    """Weighted CE sum, argmax and (optionally) d(sum)/d(logits) for one chunk of bf16 logits."""
    logits_f = logits.float()
    lse = torch.logsumexp(logits_f, dim=-1)
    target = logits_f.gather(1, labels[:, None]).squeeze(1)
    loss = ((lse - target) * token_weights).sum()
    argmax = logits.argmax(dim=-1)
    if not need_grad:
        return loss, argmax, None
    probs = torch.exp(logits_f - lse[:, None])
    onehot = torch.zeros_like(probs).scatter_(1, labels[:, None], 1.0)
    grad = (probs - onehot) * token_weights[:, None]
    return loss, argmax, grad.to(logits.dtype)


_compiled: dict[bool, object] = {}  # need_grad -> the compiled chunk (compile_lm_head_loss)


def compile_lm_head_loss() -> int:
    """Compile the chunk arithmetic of lm_head_loss (one region per need_grad value), each call
    behind COMPILE_LOCK; it runs compiled on CUDA only. Returns the number of regions compiled."""
    if not compile_safety.current_settings().enabled:
        return 0
    for need_grad in (True, False):
        if need_grad not in _compiled:
            def chunk(lg, lb, w, _need=need_grad):
                return _ce_chunk(lg, lb, w, _need)
            _compiled[need_grad] = compile_safety.safe_compile(
                chunk, f"lm_head_ce_grad{int(need_grad)}", dynamic=False)
    return len(_compiled)


def _chunk_fn(device: torch.device, need_grad: bool):
    """The compiled chunk function on CUDA once compile_lm_head_loss ran; eager otherwise."""
    compiled = _compiled.get(need_grad)
    if device.type != "cuda" or compiled is None:
        return lambda lg, lb, w: _ce_chunk(lg, lb, w, need_grad)
    return compiled


class _LMHeadCE(torch.autograd.Function):
    """sum_t w_t * CE(hidden_t @ W^T, label_t) with W frozen; grad wrt hidden made in forward.
    With an `fp8` head (speed.Fp8Head) the logits are its FP8 product; the gradient product
    stays bf16 with the unquantized weight."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, token_weights, chunk: int, fp8=None):
        rows = hidden.shape[0]
        need_grad = ctx.needs_input_grad[0]
        with torch.autocast(hidden.device.type, enabled=False):
            return _LMHeadCE._run(ctx, hidden, weight, labels, token_weights, chunk, rows,
                                  need_grad, fp8)

    @staticmethod
    def _run(ctx, hidden, weight, labels, token_weights, chunk, rows, need_grad, fp8):
        compute = hidden.to(weight.dtype)
        fn = _chunk_fn(hidden.device, need_grad)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        argmax = torch.empty(rows, dtype=torch.long, device=hidden.device)
        grad_hidden = torch.empty_like(compute) if need_grad else None
        for start in range(0, rows, chunk):
            stop = min(start + chunk, rows)
            logits = compute[start:stop] @ weight.t() if fp8 is None \
                else fp8.logits(compute[start:stop])
            part, argmax[start:stop], grad_logits = fn(logits, labels[start:stop],
                                                       token_weights[start:stop])
            loss += part
            if need_grad:  # (FP8 logits are bf16: a no-op cast unless the head is fp32)
                torch.matmul(grad_logits.to(weight.dtype), weight, out=grad_hidden[start:stop])
        ctx.hidden_dtype = hidden.dtype
        ctx.save_for_backward(grad_hidden if need_grad else None)
        ctx.mark_non_differentiable(argmax)
        return loss, argmax

    @staticmethod
    def backward(ctx, grad_loss, _grad_argmax):
        (grad_hidden,) = ctx.saved_tensors
        grad = (grad_hidden.float() * grad_loss).to(ctx.hidden_dtype)
        return grad, None, None, None, None, None


def lm_head_loss(hidden, lm_head_weight, labels, valid, gamma: float, chunk: int | None = None,
                 fp8=None, runs: bool = False):
    """Same result as dflash_model.dflash_loss(draft_logits(hidden, W, N, bs), labels, valid, gamma).

    hidden [B, Q, H]; labels, valid [B, N, bs]; the LM head weight must be frozen. `fp8`: the
    same head as a speed.Fp8Head (speed.fp8_lm_head), whose FP8 product gives the logits.
    """
    if lm_head_weight.requires_grad:
        raise ValueError("lm_head_loss needs a frozen LM head (weight.requires_grad is True)")
    batch, num_blocks, block_size = labels.shape
    weights = valid * objective.slot_weights(block_size, gamma, hidden.device)
    token_weights = (weights / weights.sum().clamp(min=1e-6)).flatten().float()
    if chunk is None:
        chunk = max(1, _CHUNK_ELEMENTS // lm_head_weight.shape[0])
    flat = hidden.reshape(-1, hidden.shape[-1])
    loss, argmax = _LMHeadCE.apply(flat, lm_head_weight, labels.flatten(), token_weights, chunk,
                                   fp8)
    return loss, objective.prediction_stats(argmax.view_as(labels), labels, valid, runs)


def adamw(params, fused: bool = True, **kwargs) -> torch.optim.AdamW:
    """AdamW; with `fused`, the fused CUDA kernel (one launch per step) when every parameter is on
    CUDA."""
    params = list(params)
    fused = fused and bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, fused=fused, **kwargs) if fused else \
        torch.optim.AdamW(params, **kwargs)


class _StopForward(Exception):
    pass


def moved(tensor: torch.Tensor, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`tensor` on `device`, cast to `dtype` (if given) first, where it is: fewer bytes to copy."""
    return (tensor if dtype is None else tensor.to(dtype)).to(device)


@torch.no_grad()
def target_features(model, input_ids, layer_ids, out_device,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """Same features as target_model.Target.context_features for every real token (in `dtype`,
    the target's own if None).

    Batches are right-padded (dflash_data.collate), so under the plain causal mask a real token
    sees exactly what it saw with the padding mask; only pad positions differ, and nothing reads
    them (anchors are real tokens and a block sees context strictly before its anchor). The
    forward stops after the last tapped layer: the layers after it do not change the taps.
    """
    layers = model.model.layers  # the layout target_model.has_fast_path checks
    captured: dict[int, torch.Tensor] = {}
    last = max(layer_ids)

    def hook(index):
        def capture(module, args, output):
            captured[index] = output[0] if isinstance(output, tuple) else output
            if index == last:
                raise _StopForward
        return capture

    handles = [layers[i].register_forward_hook(hook(i)) for i in sorted(set(layer_ids))]
    try:
        model.model(input_ids=input_ids, use_cache=False)
    except _StopForward:
        pass
    finally:
        for handle in handles:
            handle.remove()
    if last == len(layers) - 1:  # hidden_states[-1] is taken after the final norm
        captured[last] = model.model.norm(captured[last])
    return torch.cat([moved(captured[i], out_device, dtype) for i in layer_ids], dim=-1)
