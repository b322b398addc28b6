"""Training runs that exercise the data side: readiness, provenance, held-out overlap, formats."""

from __future__ import annotations

import gzip
import json
import os
import random

import provenance
import pytest
from conftest import REMOTE, run_script, tiny_args

QUICK = ("train.batch_size=4", "train.log_every=1", "train.eval_every=1000",
         "train.eval_batches=1", "train.save_every=1000")
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "data")
NOT_THIS_TARGET = ("WARNING DATA WARNING: acceptance in training metrics is teacher-forced on data "
                   "not produced by this target")


def train(target, run_dir, *sets, max_steps=1):
    result = run_script("train_dflash.py", *tiny_args(target, str(run_dir), *QUICK, *sets),
                        "--max-steps", str(max_steps))
    log = open(os.path.join(run_dir, "train.log")).read() if os.path.exists(
        os.path.join(run_dir, "train.log")) else ""
    return result, log


def test_original_data_with_a_random_target_warns_and_the_run_is_ready_before_step_1(
        tiny_target, tmp_path):
    run = tmp_path / "run"
    result, log = train(tiny_target, run)
    assert result.returncode == 0, result.stderr[-3000:]
    # the misleading run: the shipped answers were not written by this (random) target
    warning = next(line for line in log.splitlines() if "DATA WARNING" in line)
    assert NOT_THIS_TARGET in warning and "train.jsonl: no provenance record" in warning
    facts = json.loads((run / "data.json").read_text())
    assert facts["target_answers"] is False and facts["warnings"][0].startswith(
        "acceptance in training metrics is teacher-forced on data not produced by this target")
    assert facts["heldout_overlap"] == {"in_train": 0, "heldout": 200}
    assert "held-out prompts also in train: 0/200" in log
    # readiness: the marker and the `ready:` line, before the first step's line
    assert json.loads((run / "ready").read_text())["step"] == 0
    lines = log.splitlines()
    ready = next(i for i, line in enumerate(lines) if " ready: " in line)
    assert ready < next(i for i, line in enumerate(lines) if " step 1/1 " in line)


def test_require_target_answers_makes_it_an_error(tiny_target, tmp_path):
    result, _ = train(tiny_target, tmp_path / "run", "data.require_target_answers=true")
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("train_dflash: error: acceptance in training metrics is teacher-forced on "
                           "data not produced by this target (train.jsonl: no provenance record")
    assert line.endswith("data.require_target_answers is set: regenerate the data with this target "
                         "(`invoke regenerate`)")


def test_regenerated_data_carries_its_target_and_a_leaky_heldout_is_reported(tiny_target, tmp_path):
    data = tmp_path / "data"
    result = run_script("regenerate_data.py", "--target", tiny_target, "--limit", "8",
                        "--max-new-tokens", "6", "--in", os.path.join(FIXTURES, "sharegpt.jsonl"),
                        "--out", str(data / "train.jsonl"),
                        "--in", os.path.join(REMOTE, "data", "heldout.jsonl"),
                        "--out", str(data / "heldout.jsonl"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sharegpt.jsonl: sharegpt rows in jsonl, 5 read" in result.stdout
    record = json.load(open(data / "train.jsonl.provenance.json"))
    assert record["target"] == {"path": tiny_target, **provenance.fingerprint(tiny_target)}
    assert record["counts"]["rows"] == 5 and record["settings"]["max_new_tokens"] == 6
    # a leaky held-out file: two of its rows are training rows
    train_rows = open(data / "train.jsonl").read().splitlines()
    held_rows = open(data / "heldout.jsonl").read().splitlines()
    (data / "heldout.jsonl").write_text("\n".join(held_rows[:6] + train_rows[:2]) + "\n")
    run = tmp_path / "run"
    result, log = train(tiny_target, run, f"data.train={data / 'train.jsonl'}",
                        f"data.heldout={data / 'heldout.jsonl'}", "data.require_target_answers=true")
    assert result.returncode == 0, result.stderr[-3000:]
    facts = json.loads((run / "data.json").read_text())
    assert facts["target_answers"] is True and "teacher-forced on data not produced" not in log
    assert facts["heldout_overlap"] == {"in_train": 2, "heldout": 8}
    assert ("DATA WARNING: 2 of 8 held-out prompts (25%) also appear in data.train: held-out metrics "
            "flatter the drafter") in log


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def _rows(name):
    return [json.loads(line) for line in open(os.path.join(FIXTURES, name))]


def test_every_format_trains_a_few_steps(tiny_target, tmp_path):
    """ShareGPT JSONL + an OpenAI .json array; then a directory of shards (OpenAI rows gzipped,
    ShareGPT in Parquet) + our rows in Parquet."""
    (tmp_path / "openai.json").write_text(json.dumps(_rows("openai.jsonl")))
    shards = tmp_path / "shards"
    shards.mkdir()
    with gzip.open(shards / "part-0.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in _rows("openai.jsonl"))
    _parquet(str(shards / "part-1.parquet"), _rows("sharegpt.jsonl"))
    _parquet(str(tmp_path / "ours.parquet"), _rows("dflash.jsonl"))
    for name, train_path, heldout_path, formats in [
            ("a", os.path.join(FIXTURES, "sharegpt.jsonl"), tmp_path / "openai.json",
             ["sharegpt rows in jsonl, 5 read", "openai rows in json, 5 read"]),
            ("b", shards, tmp_path / "ours.parquet",
             ["openai rows in jsonl.gz, 5 read", "sharegpt rows in parquet, 5 read",
              "dflash rows in parquet, 5 read"])]:
        result, log = train(tiny_target, tmp_path / name, f"data.train={train_path}",
                            f"data.heldout={heldout_path}", "data.max_length=48", max_steps=2)
        assert result.returncode == 0, result.stderr[-3000:]
        assert [line.split(": ")[-1] for line in log.splitlines() if " rows in " in line] == formats
        assert " step 2/2 " in log


def _empty(path):
    open(path, "w").close()


def _wrong_columns(path):
    _parquet(path, [{"text": "hello", "label": 1}])


@pytest.mark.parametrize("name, write, message", [
    ("empty.jsonl", _empty, "empty.jsonl: empty file"),
    ("wrong.parquet", _wrong_columns, "a chat dataset needs a 'conversations' or 'messages' column"),
])
def test_bad_data_through_training_is_one_line(tiny_target, tmp_path, name, write, message):
    write(str(tmp_path / name))
    result, _ = train(tiny_target, tmp_path / "run", f"data.train={tmp_path / name}")
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("train_dflash: error: ") and message in line


# ----------------------------------------------------------------------------- regenerate --src

TEN_MB_ROW = json.dumps({"conversations": [{"from": "human", "value": "x " * (5 << 20)},
                                           {"from": "gpt", "value": "ok"}]})
# Bytes that are not text; the first row starts with one that UTF-8 never has (random bytes could
# start with blank lines, which are skipped: then the first bad row would not be row 1).
BINARY = b"\xff" + random.Random(0).randbytes(1 << 16) + bytes(range(256)) * 64
NO_ANSWER_ROW = json.dumps({"conversations": [{"from": "human", "value": "count from 1 to 3"}]})


def _write(text):
    return lambda path: open(path, "w").write(text)


@pytest.mark.parametrize("name, write, message", [
    ("empty.jsonl", _empty, "empty.jsonl: empty file"),
    ("binary.jsonl", lambda p: open(p, "wb").write(BINARY),
     "binary.jsonl row 1: not JSON"),
    ("no-answer.jsonl", _write(NO_ANSWER_ROW + "\n"),
     "1 of 1 rows unusable, over the 5% limit (data.max_bad_fraction) "
     "(no-answer.jsonl row 1: no assistant turn)"),
    ("huge.jsonl", _write(TEN_MB_ROW + "\n"), "(huge.jsonl row 1: row is 10.5 MB, over the 1 MB row limit)"),
    ("wrong.parquet", _wrong_columns, "wrong.parquet: Parquet columns ['text', 'label']: a chat dataset "
                                      "needs a 'conversations' or 'messages' column"),
])
def test_bad_input_to_regenerate_is_one_line(tiny_target, tmp_path, name, write, message):
    """What `invoke regenerate --src FILE` runs in the container: one line on stderr, exit 2,
    no traceback, nothing written."""
    write(str(tmp_path / name))
    result = run_script("regenerate_data.py", "--target", tiny_target, "--in", str(tmp_path / name),
                        "--out", str(tmp_path / "out" / "x.jsonl"))
    assert result.returncode == 2, result.stderr[-3000:]
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("regenerate_data: error: ") and message in line
    assert not (tmp_path / "out").exists()


def test_regenerate_counts_and_skips_a_row_without_an_answer_and_a_10_mb_row(tiny_target, tmp_path):
    lines = open(os.path.join(FIXTURES, "sharegpt.jsonl")).read().splitlines()
    lines[1:1] = [NO_ANSWER_ROW]
    lines[3:3] = [TEN_MB_ROW]
    (tmp_path / "mixed.jsonl").write_text("\n".join(lines) + "\n")
    result = run_script("regenerate_data.py", "--target", tiny_target, "--max-new-tokens", "2",
                        "--max-bad-fraction", "0.5", "--in", str(tmp_path / "mixed.jsonl"),
                        "--out", str(tmp_path / "out.jsonl"))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert (f"read {tmp_path / 'mixed.jsonl'}: sharegpt rows in jsonl, 7 read, 2 skipped (row 2: no "
            f"assistant turn; row 4: row is 10.5 MB, over the 1 MB row limit)") in result.stdout.splitlines()
    written = [json.loads(line)["id"] for line in open(tmp_path / "out.jsonl")]
    assert written == ["sg-1", "sg-2", "sg-3", "sg-4", "sg-5"]
