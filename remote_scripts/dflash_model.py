"""The DFlash drafter: architecture and attention mask.

Parameter names and the config layout match the official inference package
(`dflash.model.DFlashDraftModel`), so a directory written by `checkpoints.save_drafter` loads there with
`from_pretrained` and no missing or unexpected keys. The drafter owns no embedding or LM head:
the target's (frozen) ones are passed in.

Shapes: S context tokens, N blocks of `block_size` (bs) slots, Q = N * bs queries.
  target_hidden   [B, S, n_taps * H]   tapped target layers concatenated on the last dim
  noise_embedding [B, Q, H]            slot 0 of each block = the anchor token, the rest = MASK
  position_ids    [B, S + Q]           0..S-1 for the context, anchor + k for slot k
KV = [context (S) | block 0 | ... | block N-1]. A block sees the context strictly before its
anchor, itself bidirectionally, no other block; an invalid (padding) block sees nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

# Defaults when no target config is given: a Qwen3.6-27B-class text model (H = 5120).
DEFAULT_TARGET = dict(
    vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
    num_attention_heads=24, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
    max_position_embeddings=262144, rope_theta=10_000_000.0,
)
DEFAULT_BLOCK_SIZE = 16


class DrafterShapeError(ValueError):
    """An input to the drafter has the wrong shape; the message says the expected one."""


# ----------------------------------------------------------------------------- config

def text_config(config):
    """Multimodal configs (Qwen3.5/3.6 style) keep the language model's config in text_config."""
    return getattr(config, "text_config", None) or config


def build_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Taps spread evenly from layer 1 to L-3, as the DFlash reference implementations do."""
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_taps - 1)) for i in range(num_taps)]


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" not in params and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10_000.0)))


def create_drafter_config(num_draft_layers: int = 5, target_config=None, **overrides) -> Qwen3Config:
    """A Qwen3Config in dflash's layout: + `num_target_layers` and `dflash_config`.

    Widths come from the target (the drafter reads the target's embeddings and LM head, so
    hidden_size and vocab_size must match it). `overrides` may set any Qwen3Config field and
    `block_size`, `mask_token_id`, `target_layer_ids`.
    """
    if target_config is not None:
        t = text_config(target_config)
        base = dict(
            vocab_size=t.vocab_size, hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size, num_hidden_layers=t.num_hidden_layers,
            num_attention_heads=t.num_attention_heads,
            num_key_value_heads=getattr(t, "num_key_value_heads", None) or t.num_attention_heads,
            head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
            rms_norm_eps=t.rms_norm_eps, max_position_embeddings=t.max_position_embeddings,
            rope_theta=_rope_theta(t),
        )
    else:
        base = dict(DEFAULT_TARGET)
    num_target_layers = base.pop("num_hidden_layers")
    block_size = int(overrides.pop("block_size", DEFAULT_BLOCK_SIZE))
    mask_token_id = overrides.pop("mask_token_id", None)
    if mask_token_id is None:
        mask_token_id = base["vocab_size"] - 1
    layer_ids = overrides.pop("target_layer_ids", None)
    if layer_ids is None:
        layer_ids = build_target_layer_ids(num_target_layers, num_draft_layers)
    if max(layer_ids) >= num_target_layers or min(layer_ids) < 0:
        raise ValueError(f"target_layer_ids {layer_ids} out of range for a "
                         f"{num_target_layers}-layer target")
    base.update(overrides)
    rope_theta = base.pop("rope_theta")
    config = Qwen3Config(
        num_hidden_layers=num_draft_layers,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=False, use_cache=False, **base,
    )
    config.architectures = ["DFlashDraftModel"]
    config.num_target_layers = num_target_layers
    config.dflash_config = {"target_layer_ids": list(layer_ids), "block_size": block_size,
                            "mask_token_id": int(mask_token_id)}
    return config


def block_size_of(config) -> int:
    return int(config.dflash_config["block_size"])


# ----------------------------------------------------------------------------- attention mask

def dflash_mask_mod(anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int):
    """The DFlash visibility rule as a flex_attention mask_mod (also evaluated densely)."""
    num_blocks = anchors.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        safe_block = q_block.clamp(max=num_blocks - 1)
        anchor = anchors[b, safe_block]
        sees_context = (kv_idx < context_len) & (kv_idx < anchor)
        own_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == q_block)
        return (sees_context | own_block) & keep[b, safe_block] & (q_block < num_blocks)

    return mask_mod


def dense_dflash_mask(anchors, keep, context_len: int, block_size: int) -> torch.Tensor:
    """Boolean [B, 1, Q, KV] mask, True = may attend. Same rule as the flex block mask."""
    batch, num_blocks = anchors.shape
    q_idx = torch.arange(num_blocks * block_size, device=anchors.device).view(1, -1, 1)
    kv_idx = torch.arange(context_len + num_blocks * block_size, device=anchors.device).view(1, 1, -1)
    b_idx = torch.arange(batch, device=anchors.device).view(-1, 1, 1)
    return dflash_mask_mod(anchors, keep, context_len, block_size)(b_idx, None, q_idx, kv_idx)[:, None]


def flex_dflash_mask(anchors, keep, context_len: int, block_size: int):
    """flex_attention BlockMask. H=None: one mask shared by all heads (per-head masks OOM)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, num_blocks = anchors.shape
    return create_block_mask(
        dflash_mask_mod(anchors, keep, context_len, block_size), B=batch, H=None,
        Q_LEN=num_blocks * block_size, KV_LEN=context_len + num_blocks * block_size,
        device=anchors.device,
    )


def dense_attention(q, k, v, mask, scale):
    """Reference attention: SDPA with the dense boolean mask; fully masked rows (padding blocks)
    give 0, as flex_attention's do. SDPA itself is not asked to attend to nothing: CUDA's kernels
    return NaN there, or a NaN gradient (a GPU run: loss finite at step 1, NaN at step 50), where
    the CPU's return 0. Such rows attend to every key and their output is zeroed, so no gradient
    leaves them."""
    visible = mask.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~visible, scale=scale,
                                         enable_gqa=True)
    return out * visible


def make_flex_attention(flex_fn: Callable) -> Callable:
    """Wrap a (compiled) flex_attention so it has the same signature as dense_attention."""
    def attention(q, k, v, block_mask, scale):
        return flex_fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
    return attention


# ----------------------------------------------------------------------------- model

def _apply_rope(q, k, cos, sin):
    """Queries are the last Q positions; keys span context + blocks (as dflash does)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_len = q.shape[-2]
    q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
    k = k * cos + rotate_half(k) * sin
    return q, k


class DrafterAttention(nn.Module):
    """Qwen3 attention with KV injection: K/V = concat(proj(context), proj(block))."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.head_dim = config.head_dim
        self.scaling = self.head_dim ** -0.5
        hidden, n_q, n_kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(hidden, n_q * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(n_q * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden, context, position_embeddings, mask, attention):
        batch, q_len = hidden.shape[:2]
        kv_len = context.shape[1] + q_len
        q = self.q_norm(self.q_proj(hidden).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        k = torch.cat([self.k_proj(context), self.k_proj(hidden)], dim=1)
        v = torch.cat([self.v_proj(context), self.v_proj(hidden)], dim=1)
        k = self.k_norm(k.view(batch, kv_len, -1, self.head_dim)).transpose(1, 2)
        v = v.view(batch, kv_len, -1, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, k, *position_embeddings)
        # Under autocast the fp32 norms/RoPE leave q, k in fp32 and v in bf16; flex_attention (not
        # an autocast op) needs one dtype.
        out = attention(q.to(v.dtype), k.to(v.dtype), v, mask, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))


class DrafterLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DrafterAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, context, position_embeddings, mask, attention):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context,
                                         position_embeddings, mask, attention)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDrafter(nn.Module):
    """Module tree and parameter names identical to dflash.model.DFlashDraftModel."""

    def __init__(self, config: Qwen3Config, gradient_checkpointing: bool = False):
        super().__init__()
        self.config = config
        self.target_layer_ids = list(config.dflash_config["target_layer_ids"])
        self.block_size = block_size_of(config)
        self.mask_token_id = int(config.dflash_config["mask_token_id"])
        self.gradient_checkpointing = gradient_checkpointing
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)  # inv_freq is a non-persistent buffer
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size,
                            bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """The Qwen3PreTrainedModel init: normal(0, initializer_range) linears, unit norms."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, self.config.initializer_range)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, Qwen3RMSNorm):
                module.weight.fill_(1.0)

    def check_shapes(self, target_hidden, noise_embedding, position_ids):
        hidden = self.config.hidden_size
        taps = len(self.target_layer_ids)
        if target_hidden.dim() != 3 or target_hidden.shape[-1] != taps * hidden:
            raise DrafterShapeError(
                f"target_hidden has shape {list(target_hidden.shape)}; expected "
                f"[batch, seq, {taps * hidden}] ({taps} tapped target layers x hidden {hidden}, "
                f"concatenated on the last dim, e.g. torch.cat(taps, dim=-1))")
        batch, context_len = target_hidden.shape[:2]
        if noise_embedding.dim() != 3 or noise_embedding.shape[0] != batch \
                or noise_embedding.shape[-1] != hidden:
            raise DrafterShapeError(
                f"noise_embedding has shape {list(noise_embedding.shape)}; expected "
                f"[{batch}, num_blocks * block_size, {hidden}]")
        expected = [batch, context_len + noise_embedding.shape[1]]
        if list(position_ids.shape) != expected:
            raise DrafterShapeError(
                f"position_ids has shape {list(position_ids.shape)}; expected {expected} "
                f"(context positions, then each block's anchor + k)")

    def forward(self, target_hidden, noise_embedding, position_ids, mask,
                attention: Callable = dense_attention):
        """Returns the normed draft hidden states [B, Q, H]; logits = target_lm_head(hidden)."""
        self.check_shapes(target_hidden, noise_embedding, position_ids)
        context = self.hidden_norm(self.fc(target_hidden))
        position_embeddings = self.rotary_emb(noise_embedding, position_ids)
        hidden = noise_embedding
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                hidden = checkpoint(layer, hidden, context, position_embeddings, mask, attention,
                                    use_reentrant=False)
            else:
                hidden = layer(hidden, context, position_embeddings, mask, attention)
        return self.norm(hidden)


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
