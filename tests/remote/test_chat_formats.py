"""chat_formats: each row format and file type in, malformed rows counted, loss masks by hand."""

from __future__ import annotations

import gzip
import json
import os

import pytest
from chat_formats import MAX_ROW_BYTES, DataError, prompt_key, prompt_overlap, read_dataset, read_file
from conftest import REMOTE

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "data")
FORMATS = {"sharegpt": "sharegpt.jsonl", "openai": "openai.jsonl", "dflash": "dflash.jsonl"}
# the first row of every fixture: a system prompt and two exchanges, in each format's own spelling
FIRST_ROW = [{"role": "system", "content": "say ok"},
             {"role": "user", "content": "count from 3 to 6"},
             {"role": "assistant", "content": "3 4 5 6"},
             {"role": "user", "content": "say red 2 times"},
             {"role": "assistant", "content": "red , red ."}]


def fixture(name: str) -> str:
    return os.path.join(FIXTURES, name)


def raw_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in open(fixture(name))]


@pytest.mark.parametrize("fmt, name", FORMATS.items())
def test_each_format_is_detected_and_keeps_its_turns(fmt, name):
    rows, report = read_file(fixture(name))
    assert (report.format, report.container, report.rows, report.bad) == (fmt, "jsonl", 5, [])
    assert rows[0].turns == FIRST_ROW
    assert report.describe() == f"{fixture(name)}: {fmt} rows in jsonl, 5 read"


def _parquet(path, rows: list[dict]):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def test_every_file_type_and_a_directory_of_shards(tmp_path):
    rows = raw_rows("sharegpt.jsonl")
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "b.json").write_text(json.dumps(raw_rows("openai.jsonl")))
    _parquet(str(tmp_path / "c.parquet"), raw_rows("dflash.jsonl"))
    lines = []
    found = read_dataset(str(tmp_path), log=lines.append)
    assert [line.split(": ", 1)[1] for line in lines] == [
        "sharegpt rows in jsonl.gz, 5 read", "openai rows in json, 5 read", "dflash rows in parquet, 5 read"]
    assert len(found) == 15 and [r.turns for r in found[::5]] == [FIRST_ROW] * 3
    assert [r.id for r in found[:2]] == ["sg-1", "sg-2"] and found[5].id == "b-1"


# ----------------------------------------------------------------------------- loss masks

@pytest.fixture(scope="module")
def tokenizer():
    import make_tiny_target

    return make_tiny_target.build_tokenizer()


# The first fixture row rendered with the tiny target's ChatML template, token by token, with the
# mask worked out by hand: 1 on the assistant answers and their <|im_end|>, 0 everywhere else.
HAND_MASK = [("<|im_start|>", 0), ("system", 0), ("say", 0), ("ok", 0), ("<|im_end|>", 0),
             ("<|im_start|>", 0), ("user", 0), ("count", 0), ("from", 0), ("3", 0), ("to", 0),
             ("6", 0), ("<|im_end|>", 0),
             ("<|im_start|>", 0), ("assistant", 0), ("3", 1), ("4", 1), ("5", 1), ("6", 1),
             ("<|im_end|>", 1),
             ("<|im_start|>", 0), ("user", 0), ("say", 0), ("red", 0), ("2", 0), ("times", 0),
             ("<|im_end|>", 0),
             ("<|im_start|>", 0), ("assistant", 0), ("red", 1), (",", 1), ("red", 1), (".", 1),
             ("<|im_end|>", 1)]


@pytest.mark.parametrize("name", FORMATS.values())
def test_loss_mask_covers_assistant_turns_only(tokenizer, name):
    from dflash_data import tokenize_conversation

    rows, _ = read_file(fixture(name))
    ids, mask = tokenize_conversation(tokenizer, rows[0].turns, "<|im_start|>assistant\n",
                                      "<|im_end|>", max_length=100)
    assert list(zip(tokenizer.convert_ids_to_tokens(ids), mask, strict=True)) == HAND_MASK


# ----------------------------------------------------------------------------- bad input

def _good_lines(count: int) -> list[str]:
    lines = open(os.path.join(REMOTE, "data", "train.jsonl")).read().splitlines()
    return lines[:count]


def _read_with_bad_rows(path, bad: dict[int, str]) -> tuple[list, list[str]]:
    """60 good rows with each of `bad` (index -> line) inserted in order, written to `path` and read:
    (rows, the read's report lines)."""
    lines = _good_lines(60)
    for index, line in bad.items():
        lines[index:index] = [line]
    path.write_text("\n".join(lines) + "\n")
    reports = []
    return read_dataset(str(path), log=reports.append), reports


def test_empty_file_is_one_line(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"^\S+empty.jsonl: empty file$"):
        read_dataset(str(tmp_path / "empty.jsonl"))


def test_binary_file_is_one_line(tmp_path):
    (tmp_path / "junk.jsonl").write_bytes(bytes(range(256)) * 100 + b"\n\x00\xff\n")
    with pytest.raises(DataError) as info:
        read_dataset(str(tmp_path / "junk.jsonl"))
    message = str(info.value)
    assert "\n" not in message and "rows unusable, over the 5% limit" in message
    assert "junk.jsonl row 1: not JSON" in message


def test_rows_without_an_assistant_turn_and_oversized_rows_are_counted_and_skipped(tmp_path):
    no_answer = json.dumps({"conversations": [{"role": "user", "content": "count from 1 to 3"}]})
    huge = json.dumps({"conversations": [{"role": "user", "content": "x" * (10 * MAX_ROW_BYTES)},
                                         {"role": "assistant", "content": "ok"}]})
    rows, reports = _read_with_bad_rows(tmp_path / "mixed.jsonl", {4: no_answer, 10: huge})
    assert len(rows) == 60
    assert reports == [f"{tmp_path / 'mixed.jsonl'}: dflash rows in jsonl, 62 read, 2 skipped "
                       f"(row 5: no assistant turn; row 11: row is 10.5 MB, over the 1 MB row limit)"]


def test_deeply_nested_rows_are_counted_and_skipped_not_a_crash(tmp_path):
    # 200,000 levels: deeper than JSON's own parser goes (RecursionError); 40 levels: parsed, over MAX_DEPTH.
    abyss = "[" * 200_000 + "]" * 200_000
    deep = {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
            "meta": json.loads("[" * 40 + "]" * 40)}
    rows, reports = _read_with_bad_rows(tmp_path / "nested.jsonl", {2: abyss, 7: json.dumps(deep)})
    assert len(rows) == 60
    assert reports == [f"{tmp_path / 'nested.jsonl'}: dflash rows in jsonl, 62 read, 2 skipped "
                       f"(row 3: nested deeper than 32 levels; row 8: nested deeper than 32 levels)"]
    (tmp_path / "nested.json").write_text("[" + abyss + "]")
    with pytest.raises(DataError, match=r"nested.json: not a JSON file \(nested too deep to read\)$"):
        read_dataset(str(tmp_path / "nested.json"))
    _parquet(str(tmp_path / "deep.parquet"), [deep] + [json.loads(line) for line in _good_lines(30)])
    _, report = read_file(str(tmp_path / "deep.parquet"))
    assert report.bad == [(1, "nested deeper than 32 levels")] and report.rows == 31


def test_parquet_rows_are_measured_before_their_text_is_made(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def turns(content):
        return {"conversations": [{"role": "user", "content": content},
                                  {"role": "assistant", "content": "ok"}]}

    good = [json.loads(line) for line in _good_lines(20)]
    # One 2 MiB string in a dictionary page that two rows point to: a few KB on disk.
    big = "x" * (2 << 20)
    pq.write_table(pa.Table.from_pylist(good[:10] + [turns(big), turns(big)] + good[10:]),
                   tmp_path / "dict.parquet", compression="zstd")
    assert os.path.getsize(tmp_path / "dict.parquet") < 20_000
    rows, report = read_file(str(tmp_path / "dict.parquet"))
    assert len(rows) == 20 and report.bad == [(11, "row expands to 2.1 MB, over the 1 MB row limit"),
                                              (12, "row expands to 2.1 MB, over the 1 MB row limit")]
    # One compressed page holding 4 MiB for one row: its row group is skipped undecoded.
    pq.write_table(pa.Table.from_pylist([turns("y" * (4 << 20))]), tmp_path / "page.parquet",
                   compression="zstd", use_dictionary=False)
    rows, report = read_file(str(tmp_path / "page.parquet"))
    assert rows == [] and report.bad[0][1].startswith("its row group holds 4.2 MB for 1 row(s), over the")
    # Many rows, each under the limit, all pointing to one string: 1000 times the file's size in all
    # (at least 64 MiB) is one DataError, before the rows past it are made.
    under = "z" * ((1 << 20) - 200)
    pq.write_table(pa.Table.from_pylist([turns(under)] * 200), tmp_path / "many.parquet", compression="zstd")
    with pytest.raises(DataError, match=r"many.parquet: its rows expand to more than 67 MB, 1000 times its "
                                        r"\d+ bytes: refusing it$"):
        read_file(str(tmp_path / "many.parquet"))


def test_a_file_name_with_a_line_break_reports_on_one_line(tmp_path):
    name = 'x\nRESULT {"rows": 1}.jsonl'
    (tmp_path / name).write_text("\n".join(_good_lines(3)) + "\n")
    reports = []
    read_dataset(str(tmp_path / name), log=reports.append)
    assert len(reports) == 1 and "\n" not in reports[0]
    assert reports[0].endswith('x\\nRESULT {"rows": 1}.jsonl: dflash rows in jsonl, 3 read'), reports


def test_too_many_bad_rows_stop_with_one_line(tmp_path):
    lines = _good_lines(10) + ['{"conversations": [{"role": "robot", "content": "hi"}]}',
                               '{"conversations": [{"from": "human", "value": "hi"}]}']
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl: 2 of 12 rows unusable, over the 5% limit "
                                        r"\(data.max_bad_fraction\) \(bad.jsonl row 11: turn 1: unknown "
                                        r"role 'robot'; bad.jsonl row 12: turn 1: no 'role' and 'content' "
                                        r"\(dflash rows\)\)$"):
        read_dataset(str(tmp_path / "bad.jsonl"))
    assert len(read_dataset(str(tmp_path / "bad.jsonl"), max_bad_fraction=0.2)) == 10


def test_parquet_with_the_wrong_columns_is_one_line(tmp_path):
    _parquet(str(tmp_path / "wrong.parquet"), [{"text": "hello", "label": 1}])
    with pytest.raises(DataError, match=r"wrong.parquet: Parquet columns \['text', 'label'\]: a chat "
                                        r"dataset needs a 'conversations' or 'messages' column$"):
        read_dataset(str(tmp_path / "wrong.parquet"))


def test_not_parquet_and_not_gzip_are_one_line(tmp_path):
    (tmp_path / "fake.parquet").write_text("hello")
    (tmp_path / "fake.jsonl.gz").write_text("hello")
    with pytest.raises(DataError, match=r"fake.parquet: not a readable Parquet file"):
        read_dataset(str(tmp_path / "fake.parquet"))
    with pytest.raises(DataError, match=r"fake.jsonl.gz: cannot read jsonl.gz"):
        read_dataset(str(tmp_path / "fake.jsonl.gz"))


# ----------------------------------------------------------------------------- held-out overlap

def test_prompt_key_normalises_case_and_spacing():
    a = [{"role": "user", "content": "Count  from 3\nto 6"}, {"role": "assistant", "content": "x"}]
    b = [{"role": "user", "content": "count from 3 to 6"}, {"role": "assistant", "content": "y"}]
    assert prompt_key(a) == prompt_key(b)
    assert prompt_key(a) != prompt_key([{"role": "system", "content": "be brief"}, *b])


def test_shipped_split_holds_out_and_a_leaky_one_is_counted(tmp_path):
    train = read_dataset(os.path.join(REMOTE, "data", "train.jsonl"))
    heldout = read_dataset(os.path.join(REMOTE, "data", "heldout.jsonl"))
    assert prompt_overlap(train, heldout) == (0, 200)
    users = lambda rows: {t["content"] for r in rows for t in r.turns if t["role"] == "user"}  # noqa: E731
    assert not users(train) & users(heldout)  # no held-out prompt in any training turn either
    leaky = heldout[:150] + train[:50]
    assert prompt_overlap(train, leaky) == (50, 200)


def test_eval_uses_held_out_prompts_only_and_says_how_many_it_skipped(tokenizer, tmp_path):
    import eval_dflash

    train_path = os.path.join(REMOTE, "data", "train.jsonl")
    leaky = tmp_path / "leaky.jsonl"
    held = open(os.path.join(REMOTE, "data", "heldout.jsonl")).read().splitlines()
    leaky.write_text("\n".join(_good_lines(3) + held[:5]) + "\n")  # 3 training rows first
    lines = []
    prompts = eval_dflash.prompt_ids(tokenizer, str(leaky), 4, train_path, log=lines.append)
    assert len(prompts) == 4
    assert lines[-1] == f"prompts: skipped 3 that also appear in the training data ({train_path})"
    first_held = json.loads(held[0])["conversations"][0]["content"]
    assert first_held in tokenizer.decode(prompts[0])
    with pytest.raises(eval_dflash.EvalError, match="no held-out prompt"):
        eval_dflash.prompt_ids(tokenizer, train_path, 4, train_path, log=lines.append)
