"""The trained drafter in the official `dflash` inference code, on CPU with a tiny target.

One real pipeline per module, as the toolkit runs it: a tiny target fitted to the synthetic data
(so that its greedy answers have structure), the data regenerated with those answers
(regenerate_data.py), a short training run (train_dflash.py), then eval_dflash.py on its checkpoint
and on an untrained drafter. Loading and hidden-state parity with `dflash` are covered by
test_dflash_interop.py; here: lossless `dflash_generate`, acceptance, and the regeneration itself.
"""

from __future__ import annotations

import json
import os

import eval_dflash
import pytest
import regenerate_data as rd
import target_model
import torch
from conftest import REMOTE, run_script, tiny_args

pytestmark = pytest.mark.slow  # one real fit + regeneration + training run for the module (minutes)

TRAIN_ROWS, HELDOUT_ROWS, STEPS = 480, 200, 80  # held-out: the whole shipped split


def results_of(completed) -> list[dict]:
    lines = [ln for ln in completed.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, completed.stdout[-2000:] + completed.stderr[-2000:]
    return [json.loads(line[len("RESULT "):]) for line in lines]


def result_of(completed) -> dict:
    return results_of(completed)[-1]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """In-process decoding of a tiny model: one thread (2-core machine, shared with other runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-pipeline")
    target = str(root / "target")
    done = run_script("make_tiny_target.py", "--out", target, "--fit-steps", "50")
    assert done.returncode == 0, done.stderr[-3000:]

    # both splits in one call (one model load); --limit keeps the run short
    data = {split: str(root / f"{split}.jsonl") for split in ("train", "heldout")}
    done = run_script("regenerate_data.py", "--target", target, "--limit", str(TRAIN_ROWS),
                      "--max-new-tokens", "48",
                      "--in", os.path.join(REMOTE, "data", "train.jsonl"), "--out", data["train"],
                      "--in", os.path.join(REMOTE, "data", "heldout.jsonl"), "--out", data["heldout"])
    assert done.returncode == 0, done.stderr[-3000:]
    data["train_stats"], data["heldout_stats"] = results_of(done)

    run = str(root / "run")
    done = run_script("train_dflash.py", *tiny_args(
        target, run, f"data.train={data['train']}", f"data.heldout={data['heldout']}",
        f"train.max_steps={STEPS}", "train.eval_every=1000", "train.eval_batches=1"))
    assert done.returncode == 0, done.stderr[-3000:]

    with open(os.path.join(run, "checkpoints", "latest")) as f:
        trained = os.path.join(run, "checkpoints", f.read().strip())
    return {"target": target, "run": run, "trained": trained, **data}


def evaluate(pipeline, *args):
    return run_script("eval_dflash.py", "--run-dir", pipeline["run"], "--num-prompts", "8",
                      "--max-new-tokens", "32", *args)


@pytest.fixture(scope="module")
def trained_eval(pipeline):
    """`eval_dflash.py --run-dir RUN` once: the latest checkpoint, eval.json written."""
    done = evaluate(pipeline)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return result_of(done)


def test_eval_is_lossless_and_the_trained_drafter_accepts_more_than_one_token(pipeline, trained_eval):
    record = trained_eval
    print(f"trained drafter: acceptance {record['acceptance_length']:.2f}, "
          f"{record['tokens_per_target_forward']:.2f} tokens/forward, speedup {record['speedup']:.2f}x")
    assert record["lossless"] is True and record["mismatched_prompts"] == []
    assert record["checkpoint"] == pipeline["trained"] and record["step"] == STEPS
    assert record["acceptance_length"] > 1.2
    assert record["tokens_per_target_forward"] > 1.0
    # every verification step is accounted for: the histogram covers them all
    assert sum(record["acceptance_histogram"]) == record["verify_steps"]
    # and each prompt's share: its new tokens and its steps, summing to the totals
    assert len(record["per_prompt"]) == record["prompts"]
    assert sum(t for t, _ in record["per_prompt"]) == record["new_tokens"]
    assert sum(s for _, s in record["per_prompt"]) == record["verify_steps"]
    assert record["target_forwards"]["spec"] < record["target_forwards"]["plain"]
    with open(os.path.join(pipeline["run"], "eval.json")) as f:
        assert json.load(f) == record
    with open(os.path.join(pipeline["run"], "evals.jsonl")) as f:
        assert json.loads(f.readlines()[-1]) == record


def test_trained_drafter_beats_an_untrained_one(pipeline, trained_eval):
    """`--checkpoint init`: the drafter the run's config initialises, before any step, kept as
    RUN/untrained (written once) in the dflash layout."""
    done = evaluate(pipeline, "--checkpoint", "init", "--no-write")
    assert done.returncode == 0, done.stderr[-2000:]
    untrained = result_of(done)
    kept = os.path.join(pipeline["run"], "untrained")
    assert untrained["checkpoint"] == kept and untrained["step"] == 0
    from safetensors.torch import load_file
    init = load_file(os.path.join(kept, "model.safetensors"))
    trained = load_file(os.path.join(pipeline["trained"], "model.safetensors"))
    assert init.keys() == trained.keys()
    assert any(not torch.equal(init[k], trained[k]) for k in init)
    # the run's seeded initialisation: the drafter training builds first
    import training
    from train_config import load_config
    config = load_config(os.path.join(pipeline["run"], "config.yaml"))
    target_config = target_model.load_target_config(pipeline["target"])
    with open(os.path.join(pipeline["trained"], "config.json")) as f:
        mask_token_id = json.load(f)["dflash_config"]["mask_token_id"]
    template = training.build_drafter_template(config, target_config, mask_token_id,
                                               training.target_layer_ids(config, target_config))
    assert all(torch.equal(init[k], v.detach()) for k, v in template.state_dict().items())
    print(f"acceptance: untrained {untrained['acceptance_length']:.2f}, "
          f"trained {trained_eval['acceptance_length']:.2f}")
    assert untrained["lossless"] is True  # a bad drafter costs speed, never correctness
    assert untrained["acceptance_length"] < 1.1
    assert trained_eval["acceptance_length"] > untrained["acceptance_length"] + 0.2
    with open(os.path.join(pipeline["run"], "eval.json")) as f:  # --no-write wrote nothing
        assert json.load(f) == trained_eval


def test_the_trainings_decode_walk_is_what_the_official_decoding_measures(pipeline, tmp_path):
    """A run's held-out evaluation walks greedy decoding over its first batch's answers (16
    conversations here, eval_batches=1): dflash_generate on the same 16 prompts takes exactly those
    steps and yields exactly those tokens. The answers are whole: each ended with the target's
    own end of turn (not cut at the regeneration's 48 tokens) and fits data.max_length."""
    from conftest import read_metrics, tiny_args
    tokenizer = target_model.load_tokenizer(pipeline["target"])
    whole = []
    with open(pipeline["heldout"]) as f:
        for line in f:
            row = json.loads(line)
            turns = row["conversations"][:2]
            text = tokenizer.apply_chat_template(turns, tokenize=False)
            answer = tokenizer(turns[1]["content"], add_special_tokens=False)["input_ids"]
            if 0 < len(answer) < 40 and len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= 60:
                whole.append(json.dumps({**row, "conversations": turns}))
    heldout = tmp_path / "whole.jsonl"
    heldout.write_text("\n".join(whole[:16]) + "\n")
    assert len(whole) >= 16
    run = str(tmp_path / "run")
    done = run_script("train_dflash.py", *tiny_args(
        pipeline["target"], run, f"data.train={pipeline['train']}", f"data.heldout={heldout}",
        f"train.max_steps={STEPS}", "train.eval_every=1000", "train.eval_batches=1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = read_metrics(run, "eval")[-1]
    done = run_script("eval_dflash.py", "--run-dir", run, "--num-prompts", "16",
                      "--max-new-tokens", "48", "--no-write")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    official = result_of(done)
    assert official["lossless"] is True and official["prompts"] == 16 and last["step"] == STEPS
    print(f"decode walk {last['decode_acceptance']:.4f}, official {official['acceptance_length']:.4f}, "
          f"teacher-forced {last['acceptance_length']:.4f}")
    assert last["decode_acceptance"] == pytest.approx(official["acceptance_length"], rel=1e-12)


def test_dtype_evaluates_a_run_in_another_precision_than_its_config(pipeline, trained_eval, tmp_path):
    """--dtype float32 on a run whose config says bfloat16 (its features made by a bfloat16 target):
    the target and the drafter in float32, so the figures are, exactly, those of the run's twin
    whose config says float32 (the precision is all that differs between the two)."""
    import yaml

    run = tmp_path / "bf16-run"
    run.mkdir()
    with open(os.path.join(pipeline["run"], "config.yaml")) as f:
        config = yaml.safe_load(f)
    assert config["target"]["dtype"] == "float32"
    config["target"]["dtype"] = "bfloat16"
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    done = run_script("eval_dflash.py", "--run-dir", str(run), "--checkpoint", pipeline["trained"],
                      "--num-prompts", "8", "--max-new-tokens", "32", "--dtype", "float32", "--no-write")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    record = result_of(done)
    assert record["dtype"] == "float32" and "(float32)" in done.stdout
    same = ("lossless", "acceptance_histogram", "new_tokens", "target_forwards", "verify_steps")
    assert {k: record[k] for k in same} == {k: trained_eval[k] for k in same}


def test_untrained_drafter_of_two_evaluations_at_once(pipeline, monkeypatch):
    """Two `--checkpoint init` evaluations of one run (shards of the prompts, say): the one that
    finds RUN/untrained taken by the other after writing its own copy keeps the other's."""
    run, target = pipeline["run"], pipeline["target"]
    config = eval_dflash.run_config(run)
    tokenizer = target_model.load_tokenizer(target)
    kept = eval_dflash.initial_checkpoint(run, config, tokenizer, target)
    written = os.stat(os.path.join(kept, "model.safetensors")).st_mtime_ns
    real_isfile, checked = os.path.isfile, []

    def not_yet_there(path):  # the second evaluation looked before the first had renamed its copy
        checked.append(path)
        return False if len(checked) == 1 else real_isfile(path)

    monkeypatch.setattr(eval_dflash.os.path, "isfile", not_yet_there)
    assert eval_dflash.initial_checkpoint(run, config, tokenizer, target) == kept
    assert os.stat(os.path.join(kept, "model.safetensors")).st_mtime_ns == written
    assert [n for n in os.listdir(run) if n.startswith("untrained.tmp")] == []


def test_acceptance_counting_equals_dflash_own_stats(pipeline, monkeypatch):
    """Our count (from the target's KV cache) against dflash's return_stats acceptance_lengths.

    return_stats times with torch.cuda.synchronize(), which fails on CPU: only that clock call is
    replaced, the decoding itself is dflash's.
    """
    from dflash.model import dflash_generate

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    tokenizer, target = rd.load_target(pipeline["target"], "cpu", "float32")
    drafter = eval_dflash.load_drafter(pipeline["trained"], "cpu", torch.float32)
    stops = rd.stop_token_ids(tokenizer, target)
    for prompt in eval_dflash.prompt_ids(tokenizer, pipeline["heldout"], 4):
        counter = eval_dflash.ForwardCounter(target)
        stats = dflash_generate(drafter, target, torch.tensor([prompt]), 40, stops,
                                return_stats=True)
        counter.close()
        ours = eval_dflash.step_lengths(counter.cache_lengths, len(prompt), stats.num_output_tokens)
        assert ours == stats.acceptance_lengths
        assert counter.calls == 1 + len(stats.acceptance_lengths)


def test_step_lengths_when_only_the_prefill_ran():
    """A prompt answered by the prefill alone (its first token a stop) has no verification step."""
    assert eval_dflash.step_lengths([0], 7, 1) == []
    assert eval_dflash.step_lengths([0, 7, 9], 7, 5) == [2, 2]


def test_regeneration_writes_the_targets_own_greedy_answers(pipeline):
    stats = pipeline["heldout_stats"]
    assert pipeline["train_stats"]["rows"] == TRAIN_ROWS
    assert stats["rows"] == HELDOUT_ROWS and stats["changed"] > 0
    tokenizer, target = rd.load_target(pipeline["target"], "cpu", "float32")
    stops = rd.stop_token_ids(tokenizer, target)
    original = rd.read_rows(os.path.join(REMOTE, "data", "heldout.jsonl"), HELDOUT_ROWS)
    regenerated = rd.read_rows(pipeline["heldout"])
    assert [r["id"] for r in regenerated] == [r["id"] for r in original]
    # each turn re-decoded: keep it short
    for before, after in list(zip(original, regenerated, strict=True))[:12]:
        turns = after["conversations"]
        assert [t["role"] for t in turns] == [t["role"] for t in before["conversations"]]
        for index, turn in enumerate(turns):
            if turn["role"] != "assistant":
                assert turn == before["conversations"][index]  # prompts are kept
                continue
            # each answer continues the conversation as regenerated so far
            answer = rd.greedy_generate(target, [rd.chat_prompt_ids(tokenizer, turns[:index])],
                                        48, stops)[0]
            answer = answer[:-1] if answer and answer[-1] in stops else answer
            assert turn["content"] == tokenizer.decode(answer, skip_special_tokens=True).strip()


def test_regenerating_regenerated_data_changes_nothing(pipeline, tmp_path):
    again = str(tmp_path / "again.jsonl")
    done = run_script("regenerate_data.py", "--target", pipeline["target"], "--in",
                      pipeline["heldout"], "--out", again, "--max-new-tokens", "48", "--limit", "24")
    assert done.returncode == 0, done.stderr[-2000:]
    stats = result_of(done)
    untruncated = stats["turns"] - stats["truncated"]
    assert untruncated > 0 and stats["changed"] <= stats["truncated"]
    assert rd.read_rows(again)[0] == rd.read_rows(pipeline["heldout"])[0]


def test_samples_are_more_rows_of_the_targets_own_answers_drawn_reproducibly(pipeline, tmp_path):
    """--samples K: the first pair's rows, then K sampled copies of each (ids <id>~sK), seeded;
    the greedy rows are what a greedy-only run writes; the second pair stays greedy only."""
    source = os.path.join(REMOTE, "data", "heldout.jsonl")

    def regenerate(name, *extra):
        out = {split: str(tmp_path / f"{name}-{split}.jsonl") for split in ("first", "second")}
        done = run_script("regenerate_data.py", "--target", pipeline["target"], "--limit", "6",
                          "--max-new-tokens", "12", *extra, "--in", source, "--out", out["first"],
                          "--in", source, "--out", out["second"])
        assert done.returncode == 0, done.stderr[-3000:]
        return {split: rd.read_rows(path) for split, path in out.items()}, results_of(done)

    greedy, _ = regenerate("greedy")
    sampled, stats = regenerate("sampled", "--samples", "2", "--temperature", "1.5", "--seed", "3")
    again, _ = regenerate("again", "--samples", "2", "--temperature", "1.5", "--seed", "3")
    ids = [r["id"] for r in greedy["first"]]
    assert [r["id"] for r in sampled["first"]] == ids + [f"{i}~s{k}" for k in (1, 2) for i in ids]
    assert sampled["first"][:6] == greedy["first"] and sampled["second"] == greedy["second"]
    assert again["first"] == sampled["first"]  # the seed fixes the draws

    def answers(rows):
        return [t["content"] for r in rows for t in r["conversations"] if t["role"] == "assistant"]
    assert answers(sampled["first"][6:12]) != answers(greedy["first"])
    assert answers(sampled["first"][6:12]) != answers(sampled["first"][12:])
    assert stats[0]["rows"] == 18 and stats[1]["rows"] == 6
    with open(str(tmp_path / "sampled-first.jsonl") + ".provenance.json") as f:
        settings = json.load(f)["settings"]
    assert settings["samples"] == 2 and settings["decoding"] == "greedy + sampled"


def test_batched_greedy_equals_one_prompt_at_a_time(pipeline):
    tokenizer, target = rd.load_target(pipeline["target"], "cpu", "float32")
    stops = rd.stop_token_ids(tokenizer, target)
    prompts = eval_dflash.prompt_ids(tokenizer, pipeline["heldout"], 6)
    assert len({len(p) for p in prompts}) > 1  # different lengths: left padding is exercised
    batched = rd.greedy_generate(target, prompts, 30, stops)
    assert batched == [rd.greedy_generate(target, [p], 30, stops)[0] for p in prompts]
    reference = target.generate(torch.tensor([prompts[0]]), max_new_tokens=30, do_sample=False,
                                eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
    assert batched[0] == reference[0, len(prompts[0]):].tolist()


def test_finished_answers_leave_the_batch(pipeline):
    """An answer that reached its stop token is no longer decoded: later forwards are smaller."""
    tokenizer, target = rd.load_target(pipeline["target"], "cpu", "float32")
    prompts = eval_dflash.prompt_ids(tokenizer, pipeline["heldout"], 4)
    free = rd.greedy_generate(target, prompts, 12, [])  # no stop token: 12 tokens each
    at = next(i for i in range(1, 12) if free[0][i] not in free[0][:i])
    stop = free[0][at]  # the first answer ends there, whatever the others do
    sizes = []
    hook = target.register_forward_pre_hook(lambda m, args: sizes.append(args[0].shape[0]))
    try:
        answers = rd.greedy_generate(target, prompts, 12, [stop])
    finally:
        hook.remove()
    assert answers[0] == free[0][: at + 1]
    assert answers == [rd.greedy_generate(target, [p], 12, [stop])[0] for p in prompts]
    assert sizes[0] == 4 and sizes[-1] < 4 and sizes == sorted(sizes, reverse=True)


def test_bad_run_dir_and_checkpoint_exit_2_with_one_line(pipeline, tmp_path):
    done = run_script("eval_dflash.py", "--run-dir", str(tmp_path))
    assert done.returncode == 2 and "no config.yaml" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    done = evaluate(pipeline, "--checkpoint", "step-999999")
    assert done.returncode == 2 and "step-999999" in done.stderr


def test_reserved_cache_decodes_the_same_answers_in_place(pipeline):
    """greedy_generate(reserve=True), regenerate_data's decoding: the same answers as the default
    (concatenating) cache, one key buffer per layer written in place from the first forward to the
    last, and finished answers dropped only once a quarter of the batch has finished."""
    from transformers.cache_utils import DynamicLayer

    tokenizer, target = rd.load_target(pipeline["target"], "cpu", "float32")
    prompts = eval_dflash.prompt_ids(tokenizer, pipeline["heldout"], 8)
    free = rd.greedy_generate(target, prompts, 12, [])
    stop = free[0][next(i for i in range(1, 12) if free[0][i] not in free[0][:i])]
    plain = rd.greedy_generate(target, prompts, 12, [stop])
    sizes, buffers = [], set()

    def record(module, args, kwargs):
        sizes.append(args[0].shape[0] if args else kwargs["input_ids"].shape[0])
        layer = kwargs["past_key_values"].layers[0]
        assert type(layer) is not DynamicLayer
        if layer.is_initialized:
            buffers.add(layer.key_buffer.data_ptr())
    hook = target.register_forward_pre_hook(record, with_kwargs=True)
    try:
        reserved = rd.greedy_generate(target, prompts, 12, [stop], reserve=True)
    finally:
        hook.remove()
    assert reserved == plain
    finishing = sorted(len(a) for a in plain if a[-1] == stop)
    assert finishing and len(sizes) == max(len(a) for a in plain)
    drops = [i for i in range(1, len(sizes)) if sizes[i] < sizes[i - 1]]
    assert all(sizes[i] <= sizes[i - 1] * 3 // 4 for i in drops)
    assert len(buffers) == len(drops) + 1  # a new buffer only where the batch shrank
