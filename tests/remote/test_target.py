"""The frozen target: loaded from a checkpoint directory, optionally split over several devices."""

from __future__ import annotations

import pytest
import torch
from target_model import (
    ShapeOnlyTarget,
    Target,
    TargetLoadError,
    decoder_layers,
    greedy_generate,
    load_causal_lm,
    use_grouped_attention,
)


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


def _padded(lengths, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 200, (len(lengths), width), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, n:] = 0
        mask[row, :n] = 1
    return ids, mask


def test_context_features_take_the_fast_path_on_right_padded_batches(tiny_target, monkeypatch):
    import fast_paths

    target = Target(tiny_target, ["cpu"], "float32", layer_ids=[0, 2])
    calls = []
    real = fast_paths.target_features
    monkeypatch.setattr(fast_paths, "target_features",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    ids, mask = _padded([12, 7], 12)
    got = target.context_features(ids, mask, "cpu")
    ref = target.reference_features(ids, mask, "cpu")
    assert calls == [1] and got.shape == ref.shape == (2, 12, 128)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1, :7], ref[1, :7], rtol=1e-4, atol=1e-5)
    assert target.compiled_layers == 0  # CPU: nothing compiled


def test_left_padded_batches_keep_the_reference_path(tiny_target):
    target = Target(tiny_target, ["cpu"], "float32", layer_ids=[1, 3])
    ids, mask = _padded([10, 6], 10, seed=1)
    ids, mask = ids.flip(1), mask.flip(1)  # real tokens last: the no-mask path would be wrong
    torch.testing.assert_close(target.context_features(ids, mask, "cpu"),
                               target.reference_features(ids, mask, "cpu"), rtol=0, atol=0)


def test_fast_path_switch_off_restores_the_reference(tiny_target):
    target = Target(tiny_target, ["cpu"], "float32", layer_ids=[1], fast_paths=False)
    ids, mask = _padded([8, 3], 8, seed=2)
    torch.testing.assert_close(target.context_features(ids, mask, "cpu"),
                               target.reference_features(ids, mask, "cpu"), rtol=0, atol=0)


def test_right_padded_and_layer_kinds():
    from types import SimpleNamespace

    from target_model import _one_layer_per_kind, right_padded

    assert right_padded(torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]]))
    assert not right_padded(torch.tensor([[1, 1, 0], [0, 1, 1]]))
    assert not right_padded(torch.tensor([[1, 0, 1]]))
    assert _one_layer_per_kind(SimpleNamespace()) == 1
    hybrid = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
    assert _one_layer_per_kind(SimpleNamespace(layer_types=hybrid)) == 4
    assert _one_layer_per_kind(SimpleNamespace(layer_types=["full_attention"] * 6)) == 1


def test_layer_warm_up_compiles_nothing_off_cuda(tiny_target):
    from target_model import warm_compiled_layers

    assert warm_compiled_layers(tiny_target, "float32", ["cpu"], 1, 16)["layers"] == 0


def test_compiled_layers_give_the_reference_features_with_one_graph(tiny_target, tmp_path,
                                                                      monkeypatch):
    """The CUDA-only layer compile, forced on CPU (inductor's C++ backend): same features on the
    real tokens, every layer call through compile_safety's lock, one graph shared by all layers."""
    import compile_safety
    import target_model

    monkeypatch.setattr(compile_safety, "_settings", compile_safety.CompileSettings())
    monkeypatch.setattr(compile_safety, "_stats", {})
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(target_model, "compile_layers_wanted", lambda devices: True)
    compile_safety.configure_compile(cache_dir=tmp_path / "inductor")
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    target = Target(tiny_target, ["cpu"], "float32", layer_ids=[0, 2, 3])
    target.compile_layers()  # training.apply_compile's first region; never implicit
    ids, mask = _padded([14, 9], 14, seed=3)
    got = target.context_features(ids, mask, "cpu")
    got_again = target.context_features(ids, mask, "cpu")
    plain = Target(tiny_target, ["cpu"], "float32", layer_ids=[0, 2, 3])  # never compiled
    ref = plain.reference_features(ids, mask, "cpu")
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1, :9], ref[1, :9], rtol=1e-4, atol=1e-5)
    assert torch.equal(got, got_again)
    assert target.compiled_layers == 4  # layers 0..3: up to the last tap
    assert compile_safety.stats()["by_name"]["target_layer"]["calls"] == 8  # 4 layers x 2 calls
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1
    torch._dynamo.reset()


def test_replicas_are_full_copies_on_their_devices_with_the_same_features(tiny_target):
    ids, mask = _padded([9, 5], 9, seed=4)
    one = Target(tiny_target, ["cpu"], "float32", layer_ids=[1, 3])
    replicated = Target(tiny_target, ["cpu", "cpu", "cpu"], "float32", layer_ids=[1, 3],
                        placement="replicate")
    assert len(replicated.replicas) == 3 and [replicated.replica_for(w) for w in range(4)] == [0, 1, 2, 0]
    first, second = (dict(m.named_parameters()) for m in replicated.replicas[:2])
    for name, tensor in first.items():  # copies, not views of one tensor
        assert torch.equal(tensor, second[name]) and tensor.data_ptr() != second[name].data_ptr()
        assert not second[name].requires_grad
    for replica in range(3):
        torch.testing.assert_close(replicated.context_features(ids, mask, "cpu", replica),
                                   one.context_features(ids, mask, "cpu"), rtol=0, atol=0)


def test_auto_placement_replicates_only_what_fits_and_says_why():
    from target_model import choose_placement

    gib = 2**30
    two = ["cuda:0", "cuda:1"]
    free = {"cuda:0": 130 * gib, "cuda:1": 130 * gib}
    placement, why = choose_placement("auto", two, 54 * gib, 1 * gib, free)
    assert placement == "replicate" and "fits each of the 2 target devices" in why
    placement, why = choose_placement("auto", two, 54 * gib, 1 * gib, dict(free, **{"cuda:1": 40 * gib}))
    assert placement == "split" and "cuda:1's free 40.0 GiB" in why
    # two copies on one device need twice the room
    assert choose_placement("auto", ["cuda:0", "cuda:0"], 70 * gib, gib, free)[0] == "split"
    assert choose_placement("auto", ["cuda:0", "cuda:0"], 20 * gib, gib, free)[0] == "replicate"
    assert choose_placement("auto", ["cpu", "cpu"], 1, 1, {})[0] == "split"
    assert choose_placement("auto", ["cuda:0"], 1, 1, free)[0] == "split"
    assert choose_placement("replicate", two, 500 * gib, gib, free) == (
        "replicate", "target.placement=replicate in the config")


def test_weights_are_counted_from_the_safetensors_headers(tiny_target):
    from target_model import checkpoint_weight_bytes, load_causal_lm

    params = sum(p.numel() for p in load_causal_lm(tiny_target, "float32").parameters())
    assert checkpoint_weight_bytes(tiny_target, "float32") == 4 * params
    assert checkpoint_weight_bytes(tiny_target, "bfloat16") == 2 * params


def test_feature_cache_gives_the_same_features_and_runs_the_target_once_per_conversation(
        tiny_target, monkeypatch):
    import fast_paths

    plain = Target(tiny_target, ["cpu"], "float32", layer_ids=[0, 2])
    cached = Target(tiny_target, ["cpu"], "float32", layer_ids=[0, 2], feature_cache_bytes=1 << 20)
    rows = []
    real = fast_paths.target_features
    monkeypatch.setattr(fast_paths, "target_features",
                        lambda model, ids, *a, **k: rows.append(tuple(ids.shape))
                        or real(model, ids, *a, **k))
    ids, mask = _padded([12, 7, 9], 16)
    first = cached.context_features(ids, mask, "cpu")
    assert rows == [(3, 12)]  # one forward, without the padding after the longest row
    expected = plain.context_features(ids, mask, "cpu")
    for row, n in enumerate([12, 7, 9]):
        # a shorter sequence (the padding is not computed) changes the matrix shapes: rounding only
        torch.testing.assert_close(first[row, :n], expected[row, :n], rtol=1e-5, atol=1e-5)
        assert not first[row, n:].any()  # pad positions: zeros (nothing reads them)
    rows.clear()
    # the same conversations in another batch, another order, another padding: read back
    again_ids, again_mask = _padded([9, 12], 14)
    again_ids[0, :9], again_ids[1, :12] = ids[2, :9], ids[0, :12]
    again = cached.context_features(again_ids, again_mask, "cpu")
    assert rows == [] and cached.feature_cache.hits == 2 and cached.feature_cache.misses == 3
    assert torch.equal(again[0, :9], first[2, :9]) and torch.equal(again[1, :12], first[0, :12])
    # a new conversation: only it goes through the target
    new_ids, new_mask = _padded([5, 12], 12, seed=1)
    new_ids[1] = ids[0, :12]
    cached.context_features(new_ids, new_mask, "cpu")
    assert rows == [(1, 5)]


def test_feature_cache_stops_storing_at_its_size(tiny_target):
    target = Target(tiny_target, ["cpu"], "float32", layer_ids=[0, 2], feature_cache_bytes=12 * 128 * 4)
    ids, mask = _padded([12, 7], 12)
    target.context_features(ids, mask, "cpu")
    assert target.feature_cache.bytes == 12 * 128 * 4  # the first row fits, the second does not
    target.context_features(ids, mask, "cpu")
    assert target.feature_cache.hits == 1 and target.feature_cache.misses == 3


def test_features_in_another_dtype_are_cast_before_they_move_and_cached_at_their_size(tiny_target):
    """Target(feature_dtype=...) (training.feature_dtype: bfloat16 under autocast): the fast path,
    the reference path and the feature cache give the float32 features rounded once, and the
    cache holds twice the rows in the same bytes."""
    plain = Target(tiny_target, ["cpu"], "float32", layer_ids=[0, 2])
    half = Target(tiny_target, ["cpu"], "float32", layer_ids=[0, 2], feature_dtype=torch.bfloat16,
                  feature_cache_bytes=2 * 12 * 128 * 2)
    ids, mask = _padded([12, 12, 7], 12)
    for made, expected in (
            (half.context_features(ids, mask, "cpu"),  # through the cache, on the fast path
             plain.context_features(ids, mask, "cpu").to(torch.bfloat16)),
            (half.reference_features(ids, mask, "cpu"),  # padding mask, every layer
             plain.reference_features(ids, mask, "cpu").to(torch.bfloat16))):
        assert made.dtype == torch.bfloat16
        for row, n in enumerate([12, 12, 7]):
            torch.testing.assert_close(made[row, :n], expected[row, :n], rtol=0, atol=0)
    # 12 tokens x 128 features x 2 bytes a row: both 12-token rows fit where float32 held one
    assert half.feature_cache.bytes == 2 * 12 * 128 * 2
    half.context_features(ids, mask, "cpu")
    assert half.feature_cache.hits == 2


def test_grouped_attention_decodes_what_sdpa_decodes_without_copying_key_value_heads(
        tiny_target, monkeypatch):
    """regenerate_data's attention (use_grouped_attention): the same greedy answers and logits as
    transformers' sdpa on left-padded prompts, with no key/value head repeated."""
    from transformers.integrations import sdpa_attention

    model = load_causal_lm(tiny_target, "float32")
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(8, 200, (n,), generator=generator).tolist() for n in (3, 9, 5, 7)]
    ids = torch.zeros(4, 9, dtype=torch.long)
    mask = torch.zeros(4, 9, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, 9 - len(prompt):], mask[row, 9 - len(prompt):] = torch.tensor(prompt), 1
    with torch.no_grad():
        answers, logits = greedy_generate(model, prompts, 12, []), model(ids, attention_mask=mask).logits

    def no_copies(*args):
        raise AssertionError("a key/value head was repeated")
    monkeypatch.setattr(sdpa_attention, "repeat_kv", no_copies)
    with pytest.raises(AssertionError, match="repeated"):  # transformers' sdpa copies them
        greedy_generate(model, prompts, 2, [])
    use_grouped_attention(model)
    with torch.no_grad():
        assert greedy_generate(model, prompts, 12, []) == answers
        grouped = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(grouped * mask[..., None], logits * mask[..., None],
                               rtol=1e-5, atol=1e-5)


def test_grouped_attention_takes_the_kernels_output_in_the_cuda_layout(tiny_target, monkeypatch):
    """CUDA's SDPA kernels return [B, H, L, D] laid out as [B, L, H, D] in memory (a GPU run of the
    first form of grouped_sdpa: "view size is not compatible with input tensor's size and
    stride"). The same values in that layout give the same answers."""
    import torch.nn.functional as F

    model = load_causal_lm(tiny_target, "float32")
    use_grouped_attention(model)
    prompts = [[5, 9, 17], [40, 41, 42, 43, 44, 45], [7] * 4]
    with torch.no_grad():
        answers = greedy_generate(model, prompts, 6, [])
    sdpa = F.scaled_dot_product_attention

    def cuda_layout(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)
    monkeypatch.setattr(F, "scaled_dot_product_attention", cuda_layout)
    with torch.no_grad():
        assert greedy_generate(model, prompts, 6, []) == answers
