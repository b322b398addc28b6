"""The DFlash training objective: anchors, block inputs and labels, the loss and its statistics.

Anchors are sampled among the positions whose loss mask is 1; each anchors a block of
`block_size` slots whose slot k predicts the token at anchor + k (slot 0 is the anchor itself,
given). The loss is the decay-weighted cross-entropy of dflash_loss; the statistics (per-slot
accuracy, acceptance length) are sums, so they merge exactly over steps and workers.
fast_paths.lm_head_loss computes the same loss without materialising the logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int,
                   generator: torch.Generator | None = None):
    """`num_anchors` random anchors per row among positions whose loss_mask is 1 (sorted).

    Always N = num_anchors columns (a fixed shape: one compiled graph); rows with fewer valid
    positions are padded with keep=False blocks (anchor 0), which see and predict nothing.
    Returns anchors [B, N] (long) and keep [B, N] (bool).
    """
    batch, seq_len = loss_mask.shape
    if not 1 <= num_anchors <= seq_len - 1:
        raise ValueError(f"num_anchors={num_anchors} must be in [1, seq_len - 1 = {seq_len - 1}]")
    valid = anchor_positions(loss_mask)
    counts = valid.sum(dim=1)
    scores = torch.rand(valid.shape, generator=generator).to(loss_mask.device)
    scores = torch.where(valid, scores, torch.full_like(scores, 2.0))
    picked = scores.argsort(dim=1)[:, :num_anchors]
    keep = torch.arange(num_anchors, device=loss_mask.device)[None] < counts[:, None]
    anchors = torch.where(keep, picked, torch.zeros_like(picked))
    order = torch.where(keep, anchors, torch.full_like(anchors, seq_len)).argsort(dim=1)
    return anchors.gather(1, order), keep.gather(1, order)


def anchor_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, S - 1] bool: where a block may be anchored: a position whose loss_mask is 1, not the
    last one (an anchor needs at least one label after it)."""
    return loss_mask[:, : loss_mask.shape[1] - 1] > 0.5


def every_anchor(loss_mask: torch.Tensor, num_anchors: int):
    """Every position sample_anchors could draw, in chunks of `num_anchors` columns (the training's
    shape): [(anchors [B, N], keep [B, N]), ...], each row's positions in order, padded as
    sample_anchors pads (keep=False blocks at anchor 0)."""
    batch, seq_len = loss_mask.shape
    valid = anchor_positions(loss_mask)
    columns = torch.arange(seq_len - 1, device=loss_mask.device).expand(batch, -1)
    order = torch.where(valid, columns, torch.full_like(columns, seq_len)).sort(dim=1).values
    chunks = []
    for start in range(0, int(valid.sum(dim=1).max()), num_anchors):
        picked = order[:, start:start + num_anchors]
        if picked.shape[1] < num_anchors:
            picked = torch.cat([picked, torch.full((batch, num_anchors - picked.shape[1]), seq_len,
                                                   dtype=picked.dtype, device=picked.device)], dim=1)
        keep = picked < seq_len
        chunks.append((torch.where(keep, picked, torch.zeros_like(picked)), keep))
    return chunks


def decode_walk(runs: torch.Tensor, loss_mask: torch.Tensor) -> tuple[int, int]:
    """Greedy speculative decoding of each row's first answer (its first run of loss_mask 1: what
    eval_dflash.py decodes), given the run of the block anchored at every position (runs [B, S]):
    (tokens, verification steps).

    As dflash_generate does on a lossless target: the answer's first token comes from the
    prefill; a step anchored at a yields its accepted slots plus the target's own token, at most
    up to the answer's last token (the stop token), and the next step is anchored where it ended.
    tokens / steps is the acceptance length decoding measures. The teacher-forced average over
    random anchors weighs every position alike; decoding spends more steps where the drafter
    misses, so on text with easy and hard stretches the walk is lower."""
    tokens = steps = 0
    for row_runs, row_mask in zip(runs.tolist(), (loss_mask > 0.5).tolist(), strict=True):
        if True not in row_mask:
            continue
        anchor = last = row_mask.index(True)
        while last + 1 < len(row_mask) and row_mask[last + 1]:
            last += 1
        while anchor < last:
            produced = min(max(row_runs[anchor], 0) + 1, last - anchor)
            tokens, steps, anchor = tokens + produced, steps + 1, anchor + produced
    return tokens, steps


def block_inputs(input_ids, anchors, keep, block_size: int, mask_token_id: int):
    """Noise token ids [B, N*bs] (anchor token, then MASK) and position ids [B, S + N*bs]."""
    batch, seq_len = input_ids.shape
    num_blocks = anchors.shape[1]
    noise = torch.full((batch, num_blocks, block_size), mask_token_id, dtype=input_ids.dtype,
                       device=input_ids.device)
    anchor_tokens = input_ids.gather(1, anchors)
    noise[:, :, 0] = torch.where(keep, anchor_tokens, torch.full_like(anchor_tokens, mask_token_id))
    offsets = torch.arange(block_size, device=input_ids.device)
    block_positions = (anchors[:, :, None] + offsets).view(batch, -1)
    context_positions = torch.arange(seq_len, device=input_ids.device).expand(batch, -1)
    return noise.view(batch, -1), torch.cat([context_positions, block_positions], dim=1)


def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """exp(-(k-1)/gamma) for slot k >= 1; slot 0 (the given anchor) has weight 0."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    weights = torch.exp(-(k - 1).clamp(min=0) / gamma)
    weights[0] = 0.0
    return weights


def block_labels(input_ids, loss_mask, anchors, keep, block_size: int):
    """Slot k of the block at anchor a predicts input_ids[a + k]; validity [B, N, bs] (0/1)."""
    seq_len = input_ids.shape[1]
    index = anchors[:, :, None] + torch.arange(block_size, device=input_ids.device)
    in_range = index < seq_len
    index = index.clamp(max=seq_len - 1)
    num_blocks = anchors.shape[1]
    labels = input_ids[:, None].expand(-1, num_blocks, -1).gather(2, index)
    label_mask = loss_mask[:, None].expand(-1, num_blocks, -1).gather(2, index)
    valid = keep[:, :, None] & in_range & (label_mask > 0.5)
    valid[:, :, 0] = False
    return labels, valid.float()


def dflash_loss(logits, labels, valid, gamma: float, runs: bool = False):
    """Decay-weighted CE, normalised by the weight sum; per-slot accuracy; acceptance length.

    logits [B, N, bs, V]; labels, valid [B, N, bs]. Acceptance length tau is the expected number
    of tokens a verification step yields: 1 (the target's own token) + the run of correct slots
    from slot 1; a slot without a valid label ends the run.
    """
    block_size = labels.shape[-1]
    weights = valid * slot_weights(block_size, gamma, logits.device)
    ce = F.cross_entropy(logits.flatten(0, 2).float(), labels.flatten(), reduction="none")
    loss = (ce.view_as(weights) * weights).sum() / weights.sum().clamp(min=1e-6)
    return loss, prediction_stats(logits.detach().argmax(-1), labels, valid, runs)


@torch.no_grad()
def prediction_stats(predicted, labels, valid, runs: bool = False) -> dict:
    """Per-slot correct/count sums and the acceptance run of each real block ([B, N, bs] each);
    with `runs`, also every block's run (the held-out evaluation's decode_walk)."""
    correct = (predicted == labels) & (valid > 0)
    real_blocks = valid[:, :, 1] > 0
    run = correct[:, :, 1:].long().cumprod(dim=-1).sum(dim=-1).float()
    return {
        "slot_correct": correct.float().sum(dim=(0, 1))[1:].tolist(),
        "slot_count": valid.sum(dim=(0, 1))[1:].tolist(),
        "accept_sum": float((1 + run)[real_blocks].sum()),
        "blocks": int(real_blocks.sum()),
        **({"runs": run.long().tolist()} if runs else {}),  # [B][N], for decode_walk
    }


def merge_stats(parts: list[dict]) -> dict:
    """Sum stats dicts from several steps or workers (counts add, so ratios stay exact)."""
    merged = {"slot_correct": None, "slot_count": None, "accept_sum": 0.0, "blocks": 0}
    for part in parts:
        for key in ("slot_correct", "slot_count"):
            merged[key] = list(part[key]) if merged[key] is None else \
                [a + b for a, b in zip(merged[key], part[key], strict=True)]
        merged["accept_sum"] += part["accept_sum"]
        merged["blocks"] += part["blocks"]
    return merged


def slot_accuracy(stats: dict) -> list[float]:
    return [c / n if n else 0.0 for c, n in zip(stats["slot_correct"], stats["slot_count"], strict=True)]


def acceptance_length(stats: dict) -> float:
    return stats["accept_sum"] / max(stats["blocks"], 1)


def draft_logits(hidden, lm_head_weight, num_blocks: int, block_size: int):
    """The target's (frozen) LM head on the draft hidden states -> [B, N, bs, V]."""
    logits = F.linear(hidden, lm_head_weight)
    return logits.view(hidden.shape[0], num_blocks, block_size, -1)
