"""Every config field, given a wrong type and a wrong value through `--set`, is refused by the
training script with one line naming the key and exit 2 (design.md: bad config is exit 2, never a
traceback). Validation lives in each section's __post_init__, so preflight.py gets it too."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import train_dflash
from conftest import TINY_CONFIG, run_script, tiny_args
from train_config import SECTIONS

# key | a value of the wrong type | a wrong value of the right type ("-" where every value of the
# type is valid). Values are YAML, as `--set` reads them.
TABLE = """
model.num_draft_layers       | two     | 0
model.block_size             | [8]     | 1
model.target_layer_ids       | 3       | [1, 1]
model.mask_token_id          | abc     | -1
model.attention              | [flex]  | sdpa
model.gradient_checkpointing | maybe   | -
model.loss_gamma             | abc     | 0
model.drafter_overrides      | [1]     | {1: 2}
target.path                  | [a]     | ""
target.dtype                 | 16      | int8
target.placement             | [split] | pipeline
target.feature_cache_gib     | lots    | -1
data.train                   | {a: 1}  | ""
data.heldout                 | 5       | ""
data.max_length              | long    | 3
data.num_anchors             | 1.5     | 0
data.assistant_header        | 1       | ""
data.end_of_turn             | [x]     | ""
data.max_bad_fraction        | some    | 1
data.require_target_answers  | maybe   | -
data.cache_dir               | 5       | ""
train.run_dir                | 7       | ""
train.seed                   | abc     | -1
train.batch_size             | 1.5     | 0
train.max_steps              | many    | 0
train.lr                     | fast    | 0
train.min_lr_ratio           | low     | 1.5
train.warmup_ratio           | [0]     | 1
train.weight_decay           | heavy   | -0.1
train.grad_clip              | true    | 0
train.autocast               | 16      | int8
train.log_every              | often   | 0
train.eval_every             | {}      | 0
train.eval_batches           | all     | 0
train.save_every             | 2.5     | 0
train.keep_last              | .nan    | 0
train.prefetch_target        | maybe   | -
train.fast_paths             | maybe   | -
train.init_from              | [a]     | -
compile.enabled              | maybe   | -
compile.cache_dir            | [a]     | ""
compile.recompile_limit      | lots    | 0
devices.target               | 0       | gpu
devices.drafter              | [cpu]   | cuda:
speed.compile_layers         | maybe   | -
speed.param_dtype            | 16      | float16
speed.fp8_lm_head            | yes_no  | -
"""
BAD = {key: (wrong_type, None if wrong_value == "-" else wrong_value)
       for key, wrong_type, wrong_value in (map(str.strip, line.split("|"))
                                            for line in TABLE.strip().splitlines())}
CASES = [(key, value) for key, values in BAD.items() for value in values if value is not None]


def test_the_table_covers_every_field():
    fields = {f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert set(BAD) == fields


@pytest.mark.parametrize("key, value", CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_bad_value_is_one_line_and_exit_2(key, value, tmp_path, monkeypatch, capsys):
    # run_dir first, so that a wrongly accepted value cannot write into the payload tree
    argv = ["train_dflash.py", "--config", TINY_CONFIG, "--set", f"train.run_dir={tmp_path}",
            "--set", f"{key}={value}"]
    monkeypatch.setattr(sys, "argv", argv)
    code = train_dflash.main()
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and err.startswith(f"train_dflash: error: {TINY_CONFIG}: {key}: "), err


def test_recompile_limit_zero_through_the_script(tiny_target, tmp_path):
    # Was a traceback (rc 1) from the compile settings, after the target had been loaded.
    p = run_script("train_dflash.py", *tiny_args(tiny_target, str(tmp_path), "compile.recompile_limit=0"))
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1].endswith("compile.recompile_limit: must be >= 1"), p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("raw", ["\x07", "\udcff\udcfe"])  # a control byte; non-UTF-8 argv bytes
def test_a_set_value_yaml_cannot_read_is_one_config_error(raw):
    # yaml's ReaderError has no .problem, unlike the parse errors: it was an AttributeError.
    from train_config import ConfigError, apply_override

    with pytest.raises(ConfigError, match=r"^--set data\.assistant_header: value is not valid YAML") as info:
        apply_override({}, f"data.assistant_header={raw}")
    assert "\n" not in str(info.value)
