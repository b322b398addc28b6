"""The drafter's architecture, mask and objective on CPU (real torch, no mocks)."""

from __future__ import annotations

import warnings

import dflash_model as dm
import objective
import pytest
import torch
from transformers import Qwen3Config

BLOCK = 4


def small_target_config(**extra) -> Qwen3Config:
    return Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, **extra)


def small_drafter(seed=0, **kwargs) -> dm.DFlashDrafter:
    config = dm.create_drafter_config(2, small_target_config(), block_size=BLOCK,
                                      mask_token_id=96)
    torch.manual_seed(seed)
    return dm.DFlashDrafter(config, **kwargs)


def random_inputs(drafter, batch=2, context=10, num_anchors=3, seed=1, all_valid=False):
    generator = torch.Generator().manual_seed(seed)
    loss_mask = torch.ones(batch, context)
    if not all_valid:  # row 1 has fewer anchor positions than num_anchors: padding blocks
        loss_mask[1, : context - num_anchors] = 0
    anchors, keep = objective.sample_anchors(loss_mask, num_anchors, generator)
    hidden = drafter.config.hidden_size
    target_hidden = torch.randn(batch, context, 2 * hidden, generator=generator)
    noise = torch.randn(batch, num_anchors * BLOCK, hidden, generator=generator)
    _, positions = objective.block_inputs(torch.zeros(batch, context, dtype=torch.long), anchors, keep,
                                   BLOCK, 96)
    return anchors, keep, target_hidden, noise, positions


@pytest.mark.parametrize("context, num_anchors", [(10, 3), (300, 40)])
def test_flex_forward_equals_dense_reference(context, num_anchors):
    """(300, 40): 160 queries x 460 keys spans several 128-blocks of the BlockMask, some empty."""
    from torch.nn.attention.flex_attention import flex_attention

    drafter = small_drafter().eval()
    anchors, keep, target_hidden, noise, positions = random_inputs(drafter, context=context,
                                                                   num_anchors=num_anchors)
    assert not keep.all(), "the inputs must include a padding block"
    dense_mask = dm.dense_dflash_mask(anchors, keep, target_hidden.shape[1], BLOCK)
    block_mask = dm.flex_dflash_mask(anchors, keep, target_hidden.shape[1], BLOCK)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        dense = drafter(target_hidden, noise, positions, dense_mask, dm.dense_attention)
        flex = drafter(target_hidden, noise, positions, block_mask,
                       dm.make_flex_attention(flex_attention))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def softmax_attention(q, k, v, attn_mask=None, scale=None, enable_gqa=False):
    """SDPA as CUDA's kernels behave on a fully masked row: the softmax of all -inf, NaN."""
    if enable_gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    return torch.softmax(scores.masked_fill(~attn_mask, float("-inf")), dim=-1) @ v


def test_dense_attention_never_asks_sdpa_to_attend_to_nothing(monkeypatch):
    """Padding blocks are fully masked rows. On CPU, SDPA gives them 0; on CUDA, NaN (forward or
    gradient): a GPU run with dense attention: loss finite at step 1, NaN at step 50. Under an SDPA
    that gives NaN there, the drafter's output (padding rows 0) and gradients stay finite and
    equal what the CPU's SDPA gives."""
    drafter = small_drafter()
    anchors, keep, target_hidden, noise, positions = random_inputs(drafter, all_valid=False)
    assert not keep.all(), "the inputs must include a padding block"
    mask = dm.dense_dflash_mask(anchors, keep, target_hidden.shape[1], BLOCK)
    assert not mask.any(dim=-1).all(), "the mask must have fully masked rows"

    def run():
        drafter.zero_grad()
        out = drafter(target_hidden, noise, positions, mask, dm.dense_attention)
        out.square().mean().backward()
        return out.detach(), [p.grad.clone() for p in drafter.parameters() if p.grad is not None]

    reference, reference_grads = run()
    monkeypatch.setattr(dm.F, "scaled_dot_product_attention", softmax_attention)
    out, grads = run()
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    for grad, expected in zip(grads, reference_grads, strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)


def test_mask_semantics():
    anchors = torch.tensor([[2, 5]])
    keep = torch.tensor([[True, False]])
    context = 8
    mask = dm.dense_dflash_mask(anchors, keep, context, BLOCK)[0, 0]
    assert mask.shape == (2 * BLOCK, context + 2 * BLOCK)
    for q in range(BLOCK):  # block 0, anchor 2
        assert mask[q, :context].tolist() == [True, True] + [False] * 6  # strictly before anchor
        assert mask[q, context:context + BLOCK].all()                   # own block, both ways
        assert not mask[q, context + BLOCK:].any()                      # not the other block
    assert not mask[BLOCK:].any()                                       # padding block: nothing


def test_mask_from_block_mask_matches_dense():
    anchors = torch.tensor([[0, 3, 6], [1, 2, 0]])
    keep = torch.tensor([[True, True, True], [True, True, False]])
    block_mask = dm.flex_dflash_mask(anchors, keep, 9, BLOCK)
    dense = dm.dense_dflash_mask(anchors, keep, 9, BLOCK)
    as_dense = block_mask.to_dense()  # block granularity: every True must be covered
    assert as_dense.shape[0] == 2
    mod = block_mask.mask_mod
    q = torch.arange(3 * BLOCK).view(1, -1, 1)
    kv = torch.arange(9 + 3 * BLOCK).view(1, 1, -1)
    assert torch.equal(mod(torch.arange(2).view(-1, 1, 1), None, q, kv), dense[:, 0])


def test_labels_slot_k_predicts_anchor_plus_k_and_slot0_excluded():
    input_ids = torch.arange(100, 112).view(1, -1)
    loss_mask = torch.ones(1, 12)
    loss_mask[0, 9] = 0  # one non-assistant token
    anchors, keep = torch.tensor([[3, 7, 10]]), torch.tensor([[True, True, True]])
    labels, valid = objective.block_labels(input_ids, loss_mask, anchors, keep, BLOCK)
    assert labels[0, 0].tolist() == [103, 104, 105, 106]
    assert valid[0, 0].tolist() == [0, 1, 1, 1]          # slot 0 is the given anchor
    assert valid[0, 1].tolist() == [0, 1, 0, 1]          # anchor 7: position 9 is masked out
    assert valid[0, 2].tolist() == [0, 1, 0, 0]          # anchor 10: 12, 13 past the end
    noise, positions = objective.block_inputs(input_ids, anchors, keep, BLOCK, mask_token_id=1)
    assert noise[0, :BLOCK].tolist() == [103, 1, 1, 1]
    assert positions[0, 12:16].tolist() == [3, 4, 5, 6]


def test_loss_weights_decay_and_normalisation():
    weights = objective.slot_weights(BLOCK, gamma=2.0)
    assert weights[0] == 0
    torch.testing.assert_close(weights[1:], torch.exp(-torch.tensor([0.0, 1.0, 2.0]) / 2.0))
    vocab = 5
    labels = torch.tensor([[[0, 1, 2, 3]]])
    valid = torch.tensor([[[0.0, 1.0, 1.0, 0.0]]])
    logits = torch.zeros(1, 1, BLOCK, vocab)
    logits[0, 0, 1, 1] = 10.0  # slot 1 right and confident; slot 2 uniform; slot 3 ignored
    logits[0, 0, 3] = torch.randn(vocab) * 100
    loss, stats = objective.dflash_loss(logits, labels, valid, gamma=2.0)
    ce = torch.nn.functional.cross_entropy(logits[0, 0], labels[0, 0], reduction="none")
    expected = (ce[1] * weights[1] + ce[2] * weights[2]) / (weights[1] + weights[2])
    torch.testing.assert_close(loss, expected)
    assert stats["slot_count"] == [1.0, 1.0, 0.0]
    assert stats["slot_correct"][0] == 1.0
    assert objective.acceptance_length(stats) == pytest.approx(2.0)  # slot 1 right, slot 2 wrong


def test_acceptance_length_counts_the_run_of_correct_slots():
    labels = torch.tensor([[[0, 1, 2, 3], [0, 1, 2, 3]]])
    valid = torch.tensor([[[0.0, 1, 1, 1], [0.0, 1, 1, 1]]])
    logits = torch.full((1, 2, BLOCK, 4), -5.0)
    for slot, token in enumerate([0, 1, 2, 3]):  # block 0 all right
        logits[0, 0, slot, token] = 5.0
    logits[0, 1, 1, 0] = 5.0  # block 1: slot 1 wrong, slots 2, 3 right (after a miss: no credit)
    logits[0, 1, 2, 2] = logits[0, 1, 3, 3] = 5.0
    _, stats = objective.dflash_loss(logits, labels, valid, gamma=7.0)
    assert objective.acceptance_length(stats) == pytest.approx((4 + 1) / 2)


def test_the_runs_the_decode_walk_reads_are_each_blocks_run_when_asked_for():
    labels = torch.tensor([[[0, 1, 2, 3], [0, 1, 2, 3]]])
    valid = torch.tensor([[[0.0, 1, 1, 1], [0.0, 1, 1, 1]]])
    logits = torch.full((1, 2, BLOCK, 4), -5.0)
    for slot, token in enumerate([0, 1, 2, 3]):
        logits[0, 0, slot, token] = 5.0
    logits[0, 1, 1, 1] = logits[0, 1, 2, 0] = 5.0  # block 1: slot 1 right, slot 2 wrong
    _, stats = objective.dflash_loss(logits, labels, valid, gamma=7.0, runs=True)
    assert stats["runs"] == [[3, 1]]
    assert "runs" not in objective.dflash_loss(logits, labels, valid, gamma=7.0)[1]


def test_every_anchor_takes_each_position_sample_anchors_could_draw_once_in_fixed_chunks():
    loss_mask = torch.zeros(3, 20)
    loss_mask[0, 5:15] = 1
    loss_mask[1, 2:4] = 1
    loss_mask[1, 9:20] = 1  # two answers; the last position anchors nothing
    chunks = objective.every_anchor(loss_mask, 4)
    assert len(chunks) == 3 and all(a.shape == k.shape == (3, 4) for a, k in chunks)
    taken = [[int(a) for chunk_a, chunk_k in chunks for a, k in zip(chunk_a[row], chunk_k[row],
                                                                     strict=True) if k]
             for row in range(3)]
    assert taken == [list(range(5, 15)), [2, 3, *range(9, 19)], []]
    assert all(int(a) == 0 for chunk_a, chunk_k in chunks for a in chunk_a[~chunk_k])


def test_decode_walk_steps_through_the_first_answer_as_dflash_generate_does():
    loss_mask = torch.zeros(2, 16)
    loss_mask[0, 3:11] = 1   # answer: positions 3 (from the prefill) .. 10 (the stop token)
    loss_mask[0, 13:16] = 1  # a later turn: not what eval_dflash.py decodes
    runs = torch.full((2, 16), -1)
    # anchored at 3: 2 drafts accepted + the target's token -> next at 6; at 6: none -> 7;
    # at 7: 3 accepted, but the answer ends at 10 -> 3 tokens, the walk is done
    runs[0, 3], runs[0, 6], runs[0, 7] = 2, 0, 3
    runs[0, 4] = runs[0, 5] = 7  # never anchors: skipped over
    assert objective.decode_walk(runs, loss_mask) == (3 + 1 + 3, 3)
    # a row with no answer adds nothing; an answer of one token takes no step
    loss_mask[1, 5] = 1
    assert objective.decode_walk(runs, loss_mask) == (7, 3)


def test_anchors_only_on_loss_positions_and_fixed_shape():
    loss_mask = torch.zeros(3, 20)
    loss_mask[0, 5:15] = 1
    loss_mask[1, 18:] = 1  # position 19 cannot be an anchor (no label after it)
    anchors, keep = objective.sample_anchors(loss_mask, 6, torch.Generator().manual_seed(0))
    assert anchors.shape == keep.shape == (3, 6)
    assert keep.sum(dim=1).tolist() == [6, 1, 0]
    assert all(loss_mask[0, a] == 1 for a in anchors[0].tolist())
    assert anchors[1][keep[1]].tolist() == [18]
    assert anchors[0].tolist() == sorted(anchors[0].tolist())


def test_wrong_target_hidden_shape_names_the_expected_shape():
    config = dm.create_drafter_config(5)  # the production default: 5 taps x 5120
    assert config.hidden_size == 5120 and len(config.dflash_config["target_layer_ids"]) == 5
    drafter = small_drafter()
    anchors, keep, target_hidden, noise, positions = random_inputs(drafter)
    mask = dm.dense_dflash_mask(anchors, keep, target_hidden.shape[1], BLOCK)
    four_d = target_hidden.view(2, target_hidden.shape[1], 2, 32)  # the incident's [B, T, 5, 5120]
    with pytest.raises(dm.DrafterShapeError, match=r"expected \[batch, seq, 64\]"):
        drafter(four_d, noise, positions, mask)
    with pytest.raises(dm.DrafterShapeError, match=r"\[2, 10, 2, 32\]"):
        drafter(four_d, noise, positions, mask)


def test_multimodal_config_is_unwrapped_to_text_config():
    from transformers import Qwen3_5Config

    text = dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=12,
                num_attention_heads=6, num_key_value_heads=2, head_dim=8)
    multimodal = Qwen3_5Config(text_config=text)
    config = dm.create_drafter_config(3, multimodal, block_size=8)
    assert (config.hidden_size, config.vocab_size, config.num_target_layers) == (48, 300, 12)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (6, 2, 8)
    assert config.dflash_config["target_layer_ids"] == dm.build_target_layer_ids(12, 3) == [1, 5, 9]
    assert config.num_hidden_layers == 3


def test_default_taps_match_qwen3_8b_layout():
    assert dm.build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]


def test_gradient_checkpointing_gives_the_same_gradients():
    grads = []
    for checkpointing in (False, True):
        drafter = small_drafter(gradient_checkpointing=checkpointing).train()
        anchors, keep, target_hidden, noise, positions = random_inputs(drafter)
        mask = dm.dense_dflash_mask(anchors, keep, target_hidden.shape[1], BLOCK)
        drafter(target_hidden, noise, positions, mask).square().mean().backward()
        grads.append([p.grad.clone() for p in drafter.parameters()])
    for plain, checkpointed in zip(*grads, strict=True):
        torch.testing.assert_close(plain, checkpointed)
