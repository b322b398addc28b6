"""fast_paths computes what the plain path computes: loss, gradient and statistics."""

from __future__ import annotations

import fast_paths
import objective
import pytest
import torch


def _case(seed, batch=2, blocks=5, bs=4, hidden=24, vocab=97, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, blocks * bs, hidden, generator=g, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype) / hidden ** 0.5
    labels = torch.randint(0, vocab, (batch, blocks, bs), generator=g)
    valid = (torch.rand(batch, blocks, bs, generator=g) > 0.3).float()
    valid[:, :, 0] = 0
    valid[0, 1] = 0  # a padding block
    return h, w, labels, valid


@pytest.mark.parametrize("seed,chunk", [(0, 7), (1, 40), (2, 1), (3, None)])
def test_lm_head_loss_matches_plain_path(seed, chunk):
    h, w, labels, valid = _case(seed)
    batch, blocks, bs = labels.shape
    h_ref = h.clone().requires_grad_(True)
    logits = objective.draft_logits(h_ref, w, blocks, bs)
    ref_loss, ref_stats = objective.dflash_loss(logits, labels, valid, 3.0)
    ref_loss.backward()
    h_fast = h.clone().requires_grad_(True)
    loss, stats = fast_paths.lm_head_loss(h_fast, w, labels, valid, 3.0, chunk=chunk)
    (loss * 2.5).backward()  # a scaled upstream gradient must scale the result
    assert torch.allclose(loss.double(), ref_loss.double(), rtol=1e-6, atol=1e-9)
    # both paths take the softmax in float32 (dflash_loss casts the logits with .float())
    scale = h_ref.grad.abs().max().item()
    assert torch.allclose(h_fast.grad, 2.5 * h_ref.grad, rtol=1e-5, atol=1e-6 * scale)
    assert h_fast.grad.abs().sum() > 0
    assert stats == ref_stats


def test_lm_head_loss_without_grad_and_frozen_head_required():
    h, w, labels, valid = _case(4)
    with torch.no_grad():
        loss, stats = fast_paths.lm_head_loss(h, w, labels, valid, 7.0, chunk=8)
        logits = objective.draft_logits(h, w, *labels.shape[1:])
        ref, ref_stats = objective.dflash_loss(logits, labels, valid, 7.0)
    assert torch.allclose(loss.double(), ref.double(), rtol=1e-6) and stats == ref_stats
    with torch.no_grad():  # the held-out decode walk's runs: the same from both paths
        _, stats = fast_paths.lm_head_loss(h, w, labels, valid, 7.0, chunk=8, runs=True)
        _, ref_stats = objective.dflash_loss(logits, labels, valid, 7.0, runs=True)
    assert stats == ref_stats and len(stats["runs"]) == labels.shape[0]
    with pytest.raises(ValueError, match="frozen"):
        fast_paths.lm_head_loss(h, w.clone().requires_grad_(True), labels, valid, 7.0)


def test_adamw_stays_unfused_on_cpu():
    p = torch.nn.Parameter(torch.ones(3))
    opt = fast_paths.adamw([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    assert opt.defaults.get("fused") in (None, False) and torch.all(p < 1)


@pytest.mark.parametrize("taps", [[0, 2], [1, 3, 5]])
def test_target_features_match_the_project_path_on_real_tokens(tiny_target, taps):
    from target_model import Target

    target = Target(tiny_target, ["cpu"], "float32", layer_ids=taps)
    g = torch.Generator().manual_seed(len(taps))
    ids = torch.randint(5, 200, (3, 24), generator=g)
    lengths = [24, 17, 9]  # right-padded, as dflash_data.collate pads
    attention = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, n:] = 0
        attention[row, :n] = 1
    ref = target.reference_features(ids, attention, "cpu")
    got = fast_paths.target_features(target.model, ids, taps, "cpu")
    assert got.shape == ref.shape
    for row, n in enumerate(lengths):  # pad positions differ; nothing reads them
        assert torch.allclose(got[row, :n], ref[row, :n], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got[2, 9:], ref[2, 9:])  # the comparison can fail
