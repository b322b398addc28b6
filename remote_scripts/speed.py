"""Speed switches for the drafter step (the `speed:` section of the config), each off by default.

Each switch changes how the step is computed, not what it computes; what each one costs in
precision is said next to it, and bench/bench_peers.py compares the loss curves with every switch
on against every switch off.

- `speed.compile_layers`: each draft layer runs through torch.compile (one graph, shared by the
  layers), with flex_attention traced inside it. Fuses the RMSNorms, RoPE, SiLU x up, the
  residual adds and the casts around them; without it they are separate passes over memory
  (about 40% of the step's GPU time on an H200, bench/RESULTS.md). CUDA only; every call holds
  compile_safety's lock like every compiled call.
- `speed.param_dtype: bfloat16`: the drafter's linear weights (and their gradients) in bf16,
  with fp32 master weights and fp32 AdamW moments in the optimizer (`MasterAdamW`): no per-step
  casts of the weights under autocast, half the gradient memory. The forward sees the same bf16
  weights autocast would make; the RMSNorm weights stay fp32. The master weights are part of the
  optimizer's state_dict, so a resumed run continues from the fp32 values.
- `speed.fp8_lm_head`: the frozen LM head's forward product (the logits) in FP8 e4m3 with a
  scale per row of each operand (`Fp8Head`). The gradient with respect to the draft hidden states
  stays a bf16 product with the unquantized head, and the loss and its softmax stay fp32. The
  input-gradient product ran in FP8 too until 2026-12-03: its quantized head (2.7% error per
  element, the same every step) biased the training loss low by 1-3% over 300 steps (mean of three
  tiny CPU runs), where quantizing the gradient alone or the logits alone stays within 1%
  (bench/bench_numerics.py; bench/RESULTS.md). CUDA with FP8 matrix units (sm_89+); elsewhere the
  same quantization is emulated (dequantize, then an fp32 product), which is what the CPU tests
  check.
"""

from __future__ import annotations

import logging

import compile_safety
import torch

log = logging.getLogger("dflash.speed")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


# ----------------------------------------------------------------------------- bf16 + fp32 master

class MasterAdamW(torch.optim.AdamW):
    """AdamW that keeps fp32 master copies of low-precision model parameters.

    The model's parameters (bf16) receive the gradients; `step()` copies them into the fp32
    masters' .grad, runs AdamW on the masters (the fused CUDA kernel where the masters are on
    CUDA), and writes the masters back into the model's parameters (rounded to bf16).
    `grad_params()` loads the gradients first and returns the masters, so clipping works on the
    fp32 gradients.
    """

    def __init__(self, params, fused: bool = True, **kwargs):
        self.model_params = [p for p in params]
        masters = [p.detach().float().clone() for p in self.model_params]
        fused = fused and bool(masters) and all(m.is_cuda for m in masters)
        super().__init__(masters, fused=fused or None, **kwargs)
        self.masters = masters
        self._loaded = False

    def grad_params(self) -> list[torch.Tensor]:
        """Copy the model's gradients into the masters' .grad (fp32); return the masters."""
        if not self._loaded:
            for model_param, master in zip(self.model_params, self.masters, strict=True):
                master.grad = None if model_param.grad is None else model_param.grad.float()
            self._loaded = True
        return self.masters

    @torch.no_grad()
    def step(self, closure=None):
        self.grad_params()
        loss = super().step(closure)
        torch._foreach_copy_(self.model_params, self.masters)
        self._loaded = False
        for master in self.masters:  # the fp32 gradients are transient (memory)
            master.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for param in self.model_params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()
        for master in self.masters:
            master.grad = None
        self._loaded = False

    def set_masters(self, tensors) -> None:
        """The masters from `tensors` (one per model parameter, in order, any float dtype), and the
        model's parameters from the masters."""
        with torch.no_grad():
            for master, tensor in zip(self.masters, tensors, strict=True):
                master.copy_(tensor)
            torch._foreach_copy_(self.model_params, self.masters)

    def state_dict(self):
        state = super().state_dict()
        state["master_weights"] = [m.detach().clone() for m in self.masters]
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_weights", None)
        super().load_state_dict(state_dict)
        with torch.no_grad():
            if masters is None:  # a checkpoint of fp32 parameters: the model's values are exact
                for model_param, master in zip(self.model_params, self.masters, strict=True):
                    master.copy_(model_param)
            else:
                for master, saved in zip(self.masters, masters, strict=True):
                    master.copy_(saved)
                torch._foreach_copy_(self.model_params, self.masters)


def load_weights(drafter, optimizer, weights: dict) -> None:
    """A state dict into the drafter (strict: every key, no other); with MasterAdamW the fp32
    masters from `weights` as they are, not from the bf16 parameters they round into (masters on
    the bf16 grid would not move under a warm-up's small updates)."""
    drafter.load_state_dict(weights, strict=True)
    if isinstance(optimizer, MasterAdamW):
        names = {id(param): name for name, param in drafter.named_parameters()}
        optimizer.set_masters([weights[names[id(param)]] for param in optimizer.model_params])


def param_dtype(config) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.speed.param_dtype]


def cast_parameters(drafter, config):
    """The drafter's linear weights in speed.param_dtype. The RMSNorm weights stay fp32 (a few
    KB; in bf16 an update smaller than 1/256 of 1.0 would be lost, and with a warm-up's small
    learning rate the first hundreds of steps are), and so do buffers (RoPE's inv_freq)."""
    dtype = param_dtype(config)
    with torch.no_grad():
        for module in drafter.modules():
            if isinstance(module, torch.nn.Linear):
                for param in module.parameters(recurse=False):
                    param.data = param.data.to(dtype)
    return drafter


def make_optimizer(drafter, params, config):
    """The worker's optimizer: fast_paths.adamw, or for bf16 parameters MasterAdamW, whose fp32
    masters are taken from the (fp32) parameters before cast_parameters rounds them. (Masters
    that start on the bf16 grid stay there: an update under half a bf16 step, such as every
    update of a learning-rate warm-up, then never moves the model's weights.)"""
    import fast_paths

    params = list(params)
    kwargs = dict(lr=config.train.lr, weight_decay=config.train.weight_decay)
    if param_dtype(config) == torch.float32:
        return fast_paths.adamw(params, fused=config.train.fast_paths, **kwargs)
    optimizer = MasterAdamW(params, fused=config.train.fast_paths, **kwargs)
    cast_parameters(drafter, config)
    return optimizer


def grad_params(optimizer, params):
    """The tensors whose .grad to clip: the fp32 masters (gradients loaded) or `params`."""
    return optimizer.grad_params() if isinstance(optimizer, MasterAdamW) else params


# ----------------------------------------------------------------------------- compiled layers

def compile_layers_wanted(config, device: str) -> bool:
    return bool(config.speed.compile_layers and config.compile.enabled
                and config.model.attention == "flex" and str(device).startswith("cuda"))


def compile_layers(workers, kernel_options: dict | None) -> int:
    """speed.compile_layers, for training.apply_compile: each wanting worker's draft layers
    compiled, and its attention the traceable flex_attention. Returns layers per worker."""
    count = 0
    for worker in workers:
        if compile_layers_wanted(worker.config, worker.device):
            count = compile_drafter_layers(worker.drafter)
            worker.attention = layer_attention(kernel_options)
    return count


def compile_drafter_layers(drafter) -> int:
    """Each draft layer's forward through one compiled function (behind COMPILE_LOCK); returns
    the number of layers. The attention passed to a compiled layer must be traceable (the plain
    flex_attention, `layer_attention`), not the separately compiled wrapper."""
    compiled = compile_safety.safe_compile(_layer_forward, "drafter_layer", dynamic=False)
    for layer in drafter.layers:
        layer.forward = _bound(compiled, layer)
    return len(drafter.layers)


def _layer_forward(layer, hidden, context, position_embeddings, mask, attention):
    return type(layer).forward(layer, hidden, context, position_embeddings, mask, attention)


def _bound(compiled, layer):
    def forward(hidden, context, position_embeddings, mask, attention):
        return compiled(layer, hidden, context, position_embeddings, mask, attention)
    return forward


def layer_attention(kernel_options: dict | None):
    """flex_attention with the drafter's signature, to be traced inside a compiled layer."""
    from torch.nn.attention.flex_attention import flex_attention

    def attention(q, k, v, block_mask, scale):
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True,
                              kernel_options=kernel_options)
    return attention


# ----------------------------------------------------------------------------- FP8 LM head

def quantize_rows(x: torch.Tensor):
    """x [M, K] -> (e4m3 [M, K], fp32 scale [M, 1]) with x ~= q * scale row by row."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    # row-major whatever x's layout (a transposed view stays transposed through .float())
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).contiguous(), scale


def fp8_supported(device) -> bool:
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm(a_q, a_scale, b_q_t, b_scale, out_dtype=torch.bfloat16):
    """(a_q * a_scale) @ (b_q_t * b_scale)^T: a_q [M, K] row-major, b_q_t [N, K] row-major,
    scales [M, 1] and [N, 1] (fp32). torch._scaled_mm on FP8 hardware; emulated elsewhere."""
    if fp8_supported(a_q.device):  # cuBLASLt: A row-major, B column-major
        return torch._scaled_mm(a_q.contiguous(), b_q_t.contiguous().t(), scale_a=a_scale,
                                scale_b=b_scale.t(),
                                out_dtype=out_dtype)
    out = (a_q.float() * a_scale) @ (b_q_t.float() * b_scale).t()
    return out.to(out_dtype)


class Fp8Head:
    """The frozen LM head W [V, H] in e4m3 for the logits h @ W^T, quantized once with a scale
    per vocabulary row. Only the forward product: the input gradient g @ W stays bf16 with W
    itself (speed.fp8_lm_head says why)."""

    def __init__(self, weight: torch.Tensor):
        with torch.no_grad():
            self.rows_q, self.rows_scale = quantize_rows(weight)              # [V, H], [V, 1]
        self.vocab_size, self.hidden_size = weight.shape

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] (any float dtype) -> bf16 logits [M, V]."""
        q, scale = quantize_rows(hidden)
        return scaled_mm(q, scale, self.rows_q, self.rows_scale)


def fp8_head(weight: torch.Tensor, config) -> Fp8Head | None:
    if not config.speed.fp8_lm_head:
        return None
    if not fp8_supported(weight.device):
        log.warning("speed.fp8_lm_head: no FP8 matrix units on %s; the FP8 products are "
                    "emulated (same numbers, slower)", weight.device)
    return Fp8Head(weight)


def describe(config) -> str:
    s = config.speed
    return (f"speed: compile_layers={s.compile_layers} param_dtype={s.param_dtype} "
            f"fp8_lm_head={s.fp8_lm_head}")
