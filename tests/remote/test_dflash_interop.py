"""Our checkpoints load in the official `dflash` package, and both models compute the same thing."""

from __future__ import annotations

import checkpoints
import dflash_model as dm
import objective
import torch
from dflash.model import DFlashDraftModel
from transformers import Qwen3Config

BLOCK = 4


def saved_drafter(tmp_path):
    target = Qwen3Config(vocab_size=101, hidden_size=32, intermediate_size=80, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    config = dm.create_drafter_config(2, target, block_size=BLOCK, mask_token_id=100)
    torch.manual_seed(0)
    ours = dm.DFlashDrafter(config).eval()
    with torch.no_grad():  # non-trivial norms, so a swapped norm would show
        for name, param in ours.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    checkpoints.save_drafter(ours, str(tmp_path))
    return ours


def relative_error(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_from_pretrained_loads_our_checkpoint_with_no_missing_or_unexpected_keys(tmp_path):
    ours = saved_drafter(tmp_path)
    official, info = DFlashDraftModel.from_pretrained(str(tmp_path), output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    assert official.target_layer_ids == ours.target_layer_ids
    assert official.block_size == BLOCK and official.mask_token_id == 100
    ours_state = ours.state_dict()
    for name, tensor in official.state_dict().items():
        assert torch.equal(tensor.float(), ours_state[name]), name


def test_hidden_states_match_official_model_with_the_training_mask(tmp_path):
    ours = saved_drafter(tmp_path)
    official = DFlashDraftModel.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(3)
    batch, context, num_anchors = 2, 12, 3
    loss_mask = torch.ones(batch, context)
    loss_mask[1, :9] = 0  # a padding block in row 1
    anchors, keep = objective.sample_anchors(loss_mask, num_anchors, generator)
    _, positions = objective.block_inputs(torch.zeros(batch, context, dtype=torch.long), anchors, keep,
                                   BLOCK, 100)
    target_hidden = torch.randn(batch, context, 2 * 32, generator=generator)
    noise = torch.randn(batch, num_anchors * BLOCK, 32, generator=generator)
    mask = dm.dense_dflash_mask(anchors, keep, context, BLOCK)
    with torch.no_grad():
        expected = official(position_ids=positions, attention_mask=mask, noise_embedding=noise,
                            target_hidden=target_hidden)
        got = ours(target_hidden, noise, positions, mask)
    assert relative_error(got, expected) < 1e-5


def test_hidden_states_match_official_model_in_the_inference_layout(tmp_path):
    """dflash_generate's call: one block right after the context, no mask (all visible)."""
    ours = saved_drafter(tmp_path)
    official = DFlashDraftModel.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(4)
    context = 9
    target_hidden = torch.randn(1, context, 64, generator=generator)
    noise = torch.randn(1, BLOCK, 32, generator=generator)
    positions = torch.arange(context + BLOCK).view(1, -1)
    anchors, keep = torch.tensor([[context]]), torch.tensor([[True]])
    mask = dm.dense_dflash_mask(anchors, keep, context, BLOCK)
    assert mask.all()  # our training rule, applied at inference, sees everything
    with torch.no_grad():
        expected = official(position_ids=positions, noise_embedding=noise,
                            target_hidden=target_hidden)
        got = ours(target_hidden, noise, positions, mask)
    assert relative_error(got, expected) < 1e-5
