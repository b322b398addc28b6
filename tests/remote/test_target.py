"""The frozen target: loaded from a checkpoint directory, optionally split over several devices."""

from __future__ import annotations

import pytest
import torch

from target_model import ShapeOnlyTarget, Target, TargetLoadError, decoder_layers


def test_context_features_are_the_tapped_hidden_states_concatenated(tiny_target):
    target = Target(tiny_target, ["cpu"], "float32")
    target.layer_ids = [1, 3]
    ids = torch.randint(8, 200, (2, 11))
    mask = torch.ones_like(ids)
    features = target.context_features(ids, mask, "cpu")
    hidden = target.model(ids, output_hidden_states=True).hidden_states
    assert features.shape == (2, 11, 2 * 64)
    assert torch.equal(features, torch.cat([hidden[2], hidden[4]], dim=-1))
    assert not any(p.requires_grad for p in target.model.parameters())


def test_split_over_several_devices_gives_the_same_features(tiny_target):
    ids = torch.randint(8, 200, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    one = Target(tiny_target, ["cpu"], "float32")
    split = Target(tiny_target, ["cpu", "cpu", "cpu"], "float32")
    for target in (one, split):
        target.layer_ids = [1, 3, 4]
    layers = decoder_layers(split.model)
    assert len(layers) == 6 and all(layer._forward_pre_hooks for layer in layers)
    torch.testing.assert_close(split.context_features(ids, mask, "cpu"),
                               one.context_features(ids, mask, "cpu"), rtol=0, atol=0)


def test_shape_only_target_has_the_real_widths(tiny_target):
    stand_in = ShapeOnlyTarget(tiny_target, "bfloat16", layer_ids=[1, 3])
    assert stand_in.embed_weight.shape == (256, 64) and stand_in.embed_weight.dtype == torch.bfloat16
    features = stand_in.context_features(torch.zeros(2, 5, dtype=torch.long), None, "cpu")
    assert features.shape == (2, 5, 128)


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(TargetLoadError, match="not found"):
        Target(str(tmp_path / "absent"), ["cpu"], "float32")


def test_directory_without_a_checkpoint_is_a_one_line_error(tmp_path):
    from target_model import load_tokenizer

    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(TargetLoadError, match=r"^cannot load the target tokenizer from .*") as info:
        load_tokenizer(str(tmp_path))
    assert "\n" not in str(info.value)
    with pytest.raises(TargetLoadError, match=r"^cannot load the target model from "):
        Target(str(tmp_path), ["cpu"], "float32")
