"""Config validation, the chat data pipeline, and checkpoint atomicity (no training)."""

from __future__ import annotations

import json
import os
import time

import checkpoints
import dflash_data
import pytest
import yaml
from conftest import REMOTE, TINY_CONFIG
from dflash_data import Sampler, load_examples, read_conversations, tokenize_conversation
from train_config import ConfigError, load_config

PRODUCTION = os.path.join(REMOTE, "configs", "production-27b.yaml")


def test_shipped_configs_load():
    tiny, production = load_config(TINY_CONFIG), load_config(PRODUCTION)
    assert tiny.model.attention == "dense" and tiny.devices.drafter == "cpu"
    assert (production.model.num_draft_layers, production.model.block_size) == (5, 16)
    assert production.model.attention == "flex" and production.compile.enabled
    assert production.devices.drafter == "cuda:5,cuda:6,cuda:7"


@pytest.mark.parametrize("assignment, message", [
    ("train.bogus=1", r"tiny-cpu.yaml: train.bogus: unknown key"),
    ("nonsense.x=1", r"nonsense: unknown section"),
    ("model.attention=sdpa", r"model.attention: must be flex or dense"),
    ("train.batch_size=0", r"train.batch_size: must be >= 1"),
    ("train.lr=fast", r"train.lr: expected a number"),
    ("compile.enabled=maybe", r"compile.enabled: expected true/false"),
    ("train.batch_size=1.5", r"train.batch_size: expected an integer"),
])
def test_bad_values_are_refused_with_file_key_and_reason(assignment, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY_CONFIG, [assignment])


def test_overrides_and_cli_flags_apply():
    config = load_config(TINY_CONFIG, ["train.lr=5e-4", "model.target_layer_ids=[1, 3]"],
                         {"devices.drafter": "cpu,cpu,cpu", "devices.target": None})
    assert config.train.lr == 5e-4 and config.model.target_layer_ids == [1, 3]
    assert config.devices.drafter == "cpu,cpu,cpu" and config.devices.target == "cpu"


def test_unknown_key_in_file(tmp_path):
    tree = yaml.safe_load(open(TINY_CONFIG))
    tree["data"]["shuffle_buffer"] = 10
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError, match=r"bad.yaml: data.shuffle_buffer: unknown key"):
        load_config(str(path))


def test_loss_mask_covers_exactly_the_assistant_turns(tiny_target):
    from target_model import load_tokenizer

    tokenizer = load_tokenizer(tiny_target)
    turns = [{"role": "user", "content": "count from 3 to 6"},
             {"role": "assistant", "content": "3 4 5 6"},
             {"role": "user", "content": "say red 2 times"},
             {"role": "assistant", "content": "red , red ."}]
    ids, mask = tokenize_conversation(tokenizer, turns, "<|im_start|>assistant\n", "<|im_end|>",
                                      max_length=100)
    masked = tokenizer.convert_ids_to_tokens([i for i, m in zip(ids, mask, strict=True) if m])
    assert masked == ["3", "4", "5", "6", "<|im_end|>", "red", ",", "red", ".", "<|im_end|>"]


def test_shipped_data_renders_and_heldout_is_disjoint(tiny_target):
    from target_model import load_tokenizer

    train_path = os.path.join(REMOTE, "data", "train.jsonl")
    heldout_path = os.path.join(REMOTE, "data", "heldout.jsonl")
    held = {json.dumps(c) for c in read_conversations(heldout_path)}
    assert not held & {json.dumps(c) for c in read_conversations(train_path)}
    examples = load_examples(heldout_path, load_tokenizer(tiny_target), "<|im_start|>assistant\n",
                             "<|im_end|>", 64)
    assert len(examples) == len(held)
    assert all(sum(e.loss_mask) >= 2 and len(e.input_ids) <= 64 for e in examples)


def test_synthetic_generator_is_deterministic(tmp_path):
    import subprocess
    import sys

    script = os.path.join(REMOTE, "data", "make_synthetic.py")
    subprocess.run([sys.executable, script, "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (tmp_path / name).read_text() == open(os.path.join(REMOTE, "data", name)).read()


def test_sampler_resumes_where_it_stopped():
    straight = Sampler(10, seed=3)
    expected = straight.take(7) + straight.take(9)
    first = Sampler(10, seed=3)
    got = first.take(7)
    resumed = Sampler(10, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert got + resumed.take(9) == expected
    assert sorted(expected[:10]) == list(range(10))  # an epoch is a permutation


def test_checkpoint_write_is_atomic_and_latest_points_at_complete_ones(tmp_path):
    run = str(tmp_path)

    def writer(step):
        return lambda d: checkpoints.save_state(d, {"step": step})

    for step in (1, 2, 3):
        checkpoints.save_checkpoint(run, step, writer(step), keep_last=2)
    root = checkpoints.checkpoint_root(run)
    assert sorted(os.listdir(root)) == ["latest", "step-2", "step-3"]
    assert checkpoints.latest_checkpoint(run).endswith("step-3")

    def crash(directory):
        checkpoints.save_state(directory, {"step": 4})
        raise OSError("disk full")

    with pytest.raises(OSError):
        checkpoints.save_checkpoint(run, 4, crash, keep_last=2)
    assert checkpoints.latest_checkpoint(run).endswith("step-3")  # the half-written one is hidden
    assert not os.path.exists(os.path.join(root, "step-4"))
    os.remove(os.path.join(root, "latest"))  # a lost pointer falls back to the highest step
    assert checkpoints.latest_checkpoint(run).endswith("step-3")


# --- the tokenized-data cache (data.cache_dir) and the warm-up's first batch ------------------------

HEADER, END = "<|im_start|>assistant\n", "<|im_end|>"


def _load(path, tokenizer, cache_dir, **kw):
    lines = []
    examples = load_examples(str(path), tokenizer, HEADER, END, 64, log=lines.append,
                             cache_dir=str(cache_dir), **kw)
    return examples, lines


def _entries(cache_dir):
    return sorted(p.name for p in cache_dir.glob(f"*{dflash_data.CACHE_SUFFIX}"))


@pytest.fixture()
def heldout_copy(tmp_path):
    path = tmp_path / "heldout.jsonl"
    path.write_bytes(open(os.path.join(REMOTE, "data", "heldout.jsonl"), "rb").read())
    return path


def test_tokenized_data_is_read_back_from_the_cache_with_its_report(tiny_target, tmp_path, heldout_copy,
                                                                     monkeypatch):
    from target_model import load_tokenizer

    tokenizer, cache = load_tokenizer(tiny_target), tmp_path / "cache"
    first, first_lines = _load(heldout_copy, tokenizer, cache)
    assert len(_entries(cache)) == 1 and first_lines
    uncached = load_examples(str(heldout_copy), tokenizer, HEADER, END, 64)
    assert first == uncached

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized although the cache holds this data")

    monkeypatch.setattr(dflash_data, "tokenize_conversation", no_tokenizing)
    again, lines = _load(heldout_copy, tokenizer, cache)
    assert again == first
    assert lines[:-1] == first_lines  # the read's report, as it was
    assert lines[-1].startswith(f"{len(first)} tokenized conversations from the cache")


@pytest.mark.parametrize("change", ["data", "chat_template", "max_length"])
def test_what_the_tokens_depend_on_changing_is_a_new_entry(tiny_target, tmp_path, heldout_copy, change):
    from target_model import load_tokenizer

    tokenizer, cache = load_tokenizer(tiny_target), tmp_path / "cache"
    first, _ = _load(heldout_copy, tokenizer, cache)
    max_length = 64
    if change == "data":
        rows = heldout_copy.read_text().splitlines()
        heldout_copy.write_text("\n".join(rows[1:]) + "\n")
    elif change == "chat_template":
        content = "+ message['content']"  # each turn rendered with a word before it
        assert content in tokenizer.chat_template
        tokenizer.chat_template = tokenizer.chat_template.replace(content, "+ 'ok ' " + content)
    else:
        max_length = 32
    lines = []
    second = load_examples(str(heldout_copy), tokenizer, HEADER, END, max_length, log=lines.append,
                           cache_dir=str(cache))
    assert len(_entries(cache)) == 2
    assert not any("from the cache" in line for line in lines)
    assert second == load_examples(str(heldout_copy), tokenizer, HEADER, END, max_length) != first


def test_a_damaged_or_unwritable_cache_is_a_log_line_and_the_data_still_loads(tiny_target, tmp_path,
                                                                               heldout_copy):
    from target_model import load_tokenizer

    tokenizer, cache = load_tokenizer(tiny_target), tmp_path / "cache"
    first, _ = _load(heldout_copy, tokenizer, cache)
    [entry] = _entries(cache)
    (cache / entry).write_bytes(b"not a torch file")
    again, lines = _load(heldout_copy, tokenizer, cache)
    assert again == first and any("unreadable" in line for line in lines)
    assert _load(heldout_copy, tokenizer, cache)[1][-1].startswith(f"{len(first)} tokenized")  # replaced
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    examples, lines = _load(heldout_copy, tokenizer, blocked / "cache")
    assert examples == first and "not written" in lines[-1]


def test_the_cache_keeps_its_newest_entries(tiny_target, tmp_path, heldout_copy):
    from target_model import load_tokenizer

    tokenizer, cache = load_tokenizer(tiny_target), tmp_path / "cache"
    rows = heldout_copy.read_text().splitlines()
    for n in range(dflash_data.CACHE_KEEP + 2):
        heldout_copy.write_text("\n".join(rows[n:]) + "\n")
        _load(heldout_copy, tokenizer, cache)
    assert len(_entries(cache)) == dflash_data.CACHE_KEEP
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]
    # What a write killed a day ago left goes with the next write; one in progress stays.
    killed, writing = (cache / f".tmp-{name}{dflash_data.CACHE_SUFFIX}" for name in ("killed", "now"))
    for path in (killed, writing):
        path.write_bytes(b"partial")
    os.utime(killed, (time.time() - 2 * 86400,) * 2)
    heldout_copy.write_text("\n".join(rows) + "\n")
    _load(heldout_copy, tokenizer, cache)
    assert not killed.exists() and writing.exists()


def test_the_first_batch_tokenizes_only_that_batch(tiny_target, heldout_copy, monkeypatch):
    from target_model import load_tokenizer

    tokenizer = load_tokenizer(tiny_target)
    full = load_examples(str(heldout_copy), tokenizer, HEADER, END, 64)
    calls = []
    real = dflash_data.tokenize_conversation
    monkeypatch.setattr(dflash_data, "tokenize_conversation", lambda *a: calls.append(1) or real(*a))
    first = load_examples(str(heldout_copy), tokenizer, HEADER, END, 64, limit=4)
    assert first == full[:4] and len(calls) == 4 < len(full)
