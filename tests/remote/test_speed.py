"""The speed switches (remote_scripts/speed.py) on CPU: FP8 LM head (emulated products), bf16
parameters with fp32 master weights, the config section, and a worker with the switches on."""

from __future__ import annotations

import dataclasses
import os

import dflash_model as dm
import fast_paths
import objective
import pytest
import speed
import torch
import training
from conftest import REMOTE
from train_config import ConfigError, dump_yaml, load_config

TINY = os.path.join(REMOTE, "configs", "tiny-cpu.yaml")


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_quantize_rows_keeps_each_row_within_e4m3_precision():
    x = torch.randn(64, 300) * torch.logspace(-3, 2, 64)[:, None]  # rows of very different size
    q, scale = speed.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    # row-major also from a transposed view: cuBLASLt's FP8 product takes no other layout (the
    # H200 refused Fp8Head's W^T copy when it kept the view's strides)
    assert speed.quantize_rows(x.t())[0].is_contiguous()
    back = q.float() * scale
    assert q.float().abs().amax(dim=1).allclose(torch.full((64,), speed.FP8_MAX))
    rel = ((back - x).norm(dim=1) / x.norm(dim=1)).max().item()
    assert 1e-3 < rel < 0.04  # e4m3 has 3 mantissa bits: ~2-3% per element, never exact


def test_fp8_head_logits_match_the_bf16_head():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(500, 64, generator=g) * 0.05
    h = torch.randn(32, 64, generator=g)
    head = speed.Fp8Head(w)
    assert 1e-3 < _rel(head.logits(h).float(), h @ w.t()) < 0.05


def _lm_head_case(seed, vocab=400, hidden=64):
    g = torch.Generator().manual_seed(seed)
    batch, blocks, bs = 2, 6, 4
    h = torch.randn(batch, blocks * bs, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) / hidden ** 0.5 * 3
    labels = torch.randint(0, vocab, (batch, blocks, bs), generator=g)
    valid = torch.ones(batch, blocks, bs)
    valid[:, :, 0] = 0
    return h, w, labels, valid


@pytest.mark.parametrize("seed,chunk", [(0, 7), (1, None)])
def test_lm_head_loss_in_fp8_is_within_a_percent_of_bf16(seed, chunk):
    h, w, labels, valid = _lm_head_case(seed)
    h_ref = h.clone().requires_grad_(True)
    ref, ref_stats = fast_paths.lm_head_loss(h_ref, w, labels, valid, 3.0, chunk=chunk)
    ref.backward()
    h_fp8 = h.clone().requires_grad_(True)
    loss, stats = fast_paths.lm_head_loss(h_fp8, w, labels, valid, 3.0, chunk=chunk,
                                          fp8=speed.Fp8Head(w))
    (loss * 2.0).backward()
    assert abs(loss.item() - ref.item()) / ref.item() < 0.01
    assert loss.item() != ref.item()  # the FP8 product did run
    assert _rel(h_fp8.grad, 2.0 * h_ref.grad) < 0.08
    assert stats["slot_count"] == ref_stats["slot_count"]


@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_head_input_gradient_uses_the_unquantized_head(seed):
    """speed.fp8_lm_head quantizes the logits' product only: d loss / d hidden is the softmax
    gradient of the FP8 logits times the head W itself (bf16 product). The gradient through an
    e4m3 copy of W (2.7% error per element, the same every step) biased the tiny run's training
    loss low by 1-3% over 300 steps; the gradient product through W moves it no more than a
    change of rounding does (bench/RESULTS.md, bench_numerics.py)."""
    h, w, labels, valid = _lm_head_case(seed, vocab=2000)
    head = speed.Fp8Head(w)
    h_fp8 = h.clone().requires_grad_(True)
    loss, _ = fast_paths.lm_head_loss(h_fp8, w, labels, valid, 3.0, chunk=5, fp8=head)
    loss.backward()
    # reference: the same FP8 logits, the loss by autograd in fp32, its gradient through W
    logits = head.logits(h.reshape(-1, h.shape[-1])).float().requires_grad_(True)
    ref, _ = objective.dflash_loss(logits.view(*labels.shape, -1), labels, valid, 3.0)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5 * ref.item()
    expected = (logits.grad.to(torch.bfloat16).to(w.dtype) @ w).view_as(h)  # bf16 like the logits
    assert _rel(h_fp8.grad, expected) < 1e-3
    quantized_w = speed.quantize_rows(w.t())  # what an FP8 gradient product would use
    through_fp8 = (logits.grad @ (quantized_w[0].float() * quantized_w[1]).t()).view_as(h)
    assert _rel(through_fp8, expected) > 1e-2  # the check above tells the two apart


def test_master_adamw_is_fp32_adamw_on_the_masters():
    g = torch.Generator().manual_seed(1)
    init = [torch.randn(5, 7, generator=g), torch.randn(3, generator=g)]
    model = [torch.nn.Parameter(t.to(torch.bfloat16)) for t in init]
    ref = [torch.nn.Parameter(t.to(torch.bfloat16).float()) for t in init]
    opt = speed.MasterAdamW(model, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        grads = [torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in init]
        for p, r, gr in zip(model, ref, grads, strict=True):
            p.grad, r.grad = gr.clone(), gr.float()
        torch.nn.utils.clip_grad_norm_(speed.grad_params(opt, model), 0.5)
        torch.nn.utils.clip_grad_norm_(ref, 0.5)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    for p, m, r in zip(model, opt.masters, ref, strict=True):
        assert m.dtype == torch.float32 and p.dtype == torch.bfloat16
        assert torch.equal(m, r.detach())            # the fp32 update, bit for bit
        assert torch.equal(p.detach(), m.to(torch.bfloat16))
        assert p.grad is None
    assert not torch.equal(opt.masters[0].to(torch.bfloat16).float(), opt.masters[0])


def test_master_adamw_state_dict_restores_the_fp32_masters():
    model = [torch.nn.Parameter(torch.randn(4, 4).to(torch.bfloat16))]
    opt = speed.MasterAdamW(model, lr=1e-2)
    model[0].grad = torch.randn(4, 4).to(torch.bfloat16)
    opt.step()
    state = opt.state_dict()
    other = [torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))]
    restored = speed.MasterAdamW(other, lr=1e-2)
    restored.load_state_dict(state)
    assert torch.equal(restored.masters[0], opt.masters[0])
    assert torch.equal(other[0].detach(), model[0].detach())
    assert restored.state_dict()["state"][0]["exp_avg"].equal(state["state"][0]["exp_avg"])


def test_speed_section_is_validated_and_recorded():
    with pytest.raises(ConfigError, match="speed.param_dtype: bfloat16 parameters need train.autocast"):
        load_config(TINY, ["train.autocast=null", "speed.param_dtype=bfloat16"])
    config = load_config(TINY, ["train.autocast=bfloat16", "speed.param_dtype=bfloat16",
                                "speed.fp8_lm_head=true", "speed.compile_layers=true"])
    text = dump_yaml(config)  # what the run writes as config.yaml
    assert "speed:\n  compile_layers: true\n  param_dtype: bfloat16\n  fp8_lm_head: true" in text
    assert load_config(TINY).speed.param_dtype == "float32"  # every switch off by default


SMALL = ["model.attention=dense", "data.max_length=32", "data.num_anchors=4", "model.block_size=4"]


def _small_drafter(config):
    """A drafter template over a 6-layer, 32-wide Qwen3 shape, a frozen embedding and head for
    it, and the generator that drew them (it draws the batch next: _block_batch)."""
    from transformers import Qwen3Config

    target = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8)
    template = training.build_drafter_template(config, target, 127,
                                               training.target_layer_ids(config, target))
    g = torch.Generator().manual_seed(0)
    embed, head = torch.randn(128, 32, generator=g) * 0.1, torch.randn(128, 32, generator=g) * 0.1
    return template, embed, head, g


def _block_batch(template, g, rows: int) -> training.Batch:
    """`rows` random 32-token rows, 4 blocks of 4 slots each, random float32 features."""
    input_ids = torch.randint(0, 127, (rows, 32), generator=g)
    loss_mask = torch.ones(rows, 32)
    anchors, keep = objective.sample_anchors(loss_mask, 4, g)
    noise, positions = objective.block_inputs(input_ids, anchors, keep, 4, 127)
    labels, valid = objective.block_labels(input_ids, loss_mask, anchors, keep, 4)
    taps = len(template.target_layer_ids)
    return training.Batch(torch.randn(rows, 32, taps * 32, generator=g), noise, positions,
                          dm.dense_dflash_mask(anchors, keep, 32, 4), labels, valid, 4, 32)


def test_a_worker_with_every_switch_on_trains_on_cpu():
    config = load_config(TINY, ["train.autocast=bfloat16", "speed.param_dtype=bfloat16",
                                "speed.fp8_lm_head=true", "speed.compile_layers=true", *SMALL])
    template, embed, head, g = _small_drafter(config)
    worker = training.DrafterWorker(0, "cpu", template, config, embed, head, dm.dense_attention)
    assert not speed.compile_layers_wanted(config, "cpu")  # CUDA only: eager layers here
    assert speed.compile_layers([worker], None) == 0 and worker.attention is dm.dense_attention
    assert worker.fp8_head is not None and isinstance(worker.optimizer, speed.MasterAdamW)
    for name, p in worker.drafter.named_parameters():  # linear weights bf16, norms fp32
        assert p.dtype == (torch.float32 if "norm" in name else torch.bfloat16), name
    assert worker.drafter.rotary_emb.inv_freq.dtype == torch.float32
    batch = _block_batch(template, g, 1)
    before = [m.clone() for m in worker.optimizer.masters]
    # the masters start from the template's fp32 values, not from their bf16 rounding (masters
    # on the bf16 grid would not move the model's weights through a warm-up's small updates)
    linear = [m for m, p in zip(before, worker.params, strict=True) if p.dtype == torch.bfloat16]
    assert all(torch.equal(m, t.detach()) for m, t in
               zip(before, template.parameters(), strict=True))
    assert not any(torch.equal(m, m.to(torch.bfloat16).float()) for m in linear)
    losses = []
    for _ in range(3):
        loss, _ = worker.forward_backward(batch)
        worker.update()
        losses.append(loss)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(a, b) for a, b in zip(before, worker.optimizer.masters, strict=True))
    for p, m in zip(worker.params, worker.optimizer.masters, strict=True):
        assert torch.equal(p.detach(), m.to(p.dtype))


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_features_in_the_autocast_dtype_change_no_bit_of_a_step(param_dtype):
    """training.feature_dtype: under autocast the drafter's first layer (fc) casts the target's
    float32 features to bfloat16 itself, so features made in bfloat16 give the same loss and the
    same gradients, bit for bit, at half the memory."""
    config = load_config(TINY, ["train.autocast=bfloat16", f"speed.param_dtype={param_dtype}",
                                *SMALL])
    assert training.feature_dtype(config) == torch.bfloat16
    assert training.feature_dtype(load_config(TINY, ["train.autocast=null"])) is None
    template, embed, head, g = _small_drafter(config)
    batch = _block_batch(template, g, 2)
    features = batch.target_hidden
    results = []
    for made in (features, fast_paths.moved(features, "cpu", training.feature_dtype(config))):
        worker = training.DrafterWorker(0, "cpu", template, config, embed, head, dm.dense_attention)
        loss, _ = worker.forward_backward(dataclasses.replace(batch, target_hidden=made))
        results.append((loss, [p.grad.clone() for p in worker.params], made.element_size()))
    (loss32, grads32, size32), (loss16, grads16, size16) = results
    assert loss16 == loss32 and (size32, size16) == (4, 2)
    assert all(torch.equal(a, b) for a, b in zip(grads32, grads16, strict=True))
