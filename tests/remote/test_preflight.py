"""preflight.py: one JSON line, exit 0 or 2, each failure names its check and a fix; creates nothing."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import preflight
import pytest
from conftest import REMOTE, TINY_CONFIG

SHIPPED_TRAIN = os.path.join(REMOTE, "data", "train.jsonl")


@pytest.fixture
def target(tmp_path) -> str:
    """A target directory as preflight sees one: config.json and a weights file (no torch)."""
    path = tmp_path / "target"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 6}))
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    return str(path)


def args(target: str, run_dir: str, *extra: str) -> list[str]:
    return ["--config", TINY_CONFIG, "--run-dir", run_dir, "--set", f"target.path={target}", *extra]


def check(argv: list[str], capsys) -> tuple[int, dict]:
    code = preflight.main(argv)
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out  # exactly one line
    return code, json.loads(out)


def test_healthy_launch_is_ok_and_creates_nothing(target, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "r1"
    code, result = check(args(target, str(run_dir)), capsys)
    assert code == 0 and result["ok"] is True, result
    assert result["data"]["train"]["format"] == "dflash"
    assert result["run"] == {**result["run"], "resume_step": None, "stop_step": 500}
    assert not (tmp_path / "runs").exists()


def test_no_torch_import():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import preflight; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code, REMOTE]).returncode == 0


def test_missing_target_names_the_fix(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "r1"
    code, result = check(args(str(tmp_path / "gone"), str(run_dir)), capsys)
    assert code == 2 and result["check"] == "target"
    assert result["error"] == f"target checkpoint directory not found: {tmp_path / 'gone'}"
    assert "invoke deploy" in result["fix"] and "docs/runbooks/preflight.md" in result["fix"]
    assert not run_dir.parent.exists()


def test_target_without_config_or_weights(target, tmp_path, capsys):
    os.remove(os.path.join(target, "model.safetensors"))
    error = check(args(target, str(tmp_path / "r")), capsys)[1]["error"]
    assert error.endswith("has no weights (*.safetensors)")
    os.remove(os.path.join(target, "config.json"))
    assert "target config unreadable" in check(args(target, str(tmp_path / "r")), capsys)[1]["error"]


def _parquet(path, columns: dict):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


@pytest.mark.parametrize("name, write, message", [
    ("missing.jsonl", None, "data file not found"),
    ("empty.jsonl", lambda p: open(p, "w").close(), "empty file"),
    ("binary.jsonl", lambda p: open(p, "wb").write(bytes(range(256)) * 40), "no usable chat row"),
    ("rows.csv", lambda p: open(p, "w").write("a,b\n"), "unknown file type"),
    ("broken.jsonl.gz", lambda p: open(p, "wb").write(b"not gzip at all"), "cannot read jsonl.gz"),
    ("wrong.parquet", lambda p: _parquet(p, {"text": ["hello"], "label": [1]}),
     "Parquet columns ['text', 'label']: a chat dataset needs a 'conversations' or 'messages' column"),
])
def test_bad_data_files(target, tmp_path, capsys, name, write, message):
    path = tmp_path / name
    if write:
        write(str(path))
    code, result = check(args(target, str(tmp_path / "r"), "--set", f"data.train={path}"), capsys)
    assert code == 2 and result["check"] == "data", result
    assert message in result["error"] and result["error"].startswith("data.train: ")
    assert "\n" not in result["error"] and "invoke regenerate" in result["fix"]


def test_gzip_and_directory_of_shards_are_accepted(target, tmp_path, capsys):
    shards = tmp_path / "shards"
    shards.mkdir()
    lines = open(SHIPPED_TRAIN, "rb").read().splitlines(keepends=True)
    with gzip.open(shards / "part-0.jsonl.gz", "wb") as f:
        f.writelines(lines[:10])
    code, result = check(args(target, str(tmp_path / "r"), "--set", f"data.train={shards}"), capsys)
    assert code == 0, result
    assert result["data"]["train"] == {"path": str(shards), "files": 1, "format": "dflash",
                                       "container": "jsonl.gz"}


@pytest.mark.parametrize("flag, value, failed, message", [
    # the spelling of a device list is checked by the config (DevicesConfig), what is visible here
    ("--drafter-devices", "gpu0", "config", "devices.drafter: 'gpu0' is not a device"),
    ("--target-devices", "cuda:x", "config", "devices.target: 'cuda:x' is not a device"),
    ("--target-devices", "cpu,cuda:3", "devices",
     "devices.target: cuda:3 is not visible: this container sees 2 GPU(s)"),
])
def test_devices(target, tmp_path, capsys, monkeypatch, flag, value, failed, message):
    monkeypatch.setattr(preflight, "visible_gpus", lambda: (2, "test"))
    code, result = check(args(target, str(tmp_path / "r"), flag, value), capsys)
    assert code == 2 and result["check"] == failed and message in result["error"], result


def test_cuda_visible_devices_limits_what_is_seen(monkeypatch):
    monkeypatch.setattr(preflight.os.path, "isdir",
                        lambda p: p == "/proc/driver/nvidia/gpus" or os.path.isdir(p))
    monkeypatch.setattr(preflight.os, "listdir", lambda p: ["0000:01:00.0", "0000:02:00.0", "0000:03:00.0"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert preflight.visible_gpus()[0] == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert preflight.visible_gpus()[0] == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert preflight.visible_gpus() == (3, "/proc/driver/nvidia/gpus")


def test_bad_set_and_bad_arguments(target, tmp_path, capsys):
    code, result = check(args(target, str(tmp_path / "r"), "--set", "train.batch_size=0"), capsys)
    assert (code, result["check"]) == (2, "config") and "train.batch_size: must be >= 1" in result["error"]
    code, result = check(args(target, str(tmp_path / "r"), "--max-steps", "many"), capsys)
    assert (code, result["check"]) == (2, "arguments") and "--max-steps" in result["error"]


def _finished_run(run_dir, step: int):
    checkpoint = run_dir / "checkpoints" / f"step-{step}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "training_state.pt").write_bytes(b"x" * 100)
    (run_dir / "checkpoints" / "latest").write_text(f"step-{step}\n")


def test_finished_run_is_refused_until_more_steps_are_asked(target, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "quick"
    _finished_run(run_dir, 500)
    code, result = check(args(target, str(run_dir)), capsys)
    assert (code, result["check"]) == (2, "finished")
    assert result["error"] == ("run quick finished at step 500/500: give --max-steps N to continue, "
                               "or a new --run name")
    # --max-steps alone continues it (train.max_steps used to cap it: the same refusal again)
    code, result = check(args(target, str(run_dir), "--max-steps", "600"), capsys)
    assert code == 0 and result["run"]["resume_step"] == 500 and result["run"]["stop_step"] == 600


def test_max_steps_past_the_schedule_lengthens_it_and_shorter_keeps_it():
    from train_config import cli_parser, config_from_args, stop_step

    def config(*argv):
        parsed = cli_parser("t").parse_args(["--config", TINY_CONFIG, *argv])
        return config_from_args(parsed), parsed.max_steps

    longer, max_steps = config("--max-steps", "700")
    assert (longer.train.max_steps, stop_step(longer, max_steps)) == (700, 700)
    shorter, max_steps = config("--max-steps", "3")
    assert (shorter.train.max_steps, stop_step(shorter, max_steps)) == (500, 3)
    default, max_steps = config()
    assert (default.train.max_steps, stop_step(default, max_steps)) == (500, 500)


def test_a_run_with_checkpoints_resumed_on_other_data_or_target_needs_allow_change(target, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "r1"
    _finished_run(run_dir, 5)
    other = tmp_path / "other.jsonl"
    other.write_text(open(SHIPPED_TRAIN).read())
    (run_dir / "config.yaml").write_text(f"target:\n  path: {target}\ndata:\n  train: data/train.jsonl\n"
                                        "  heldout: data/heldout.jsonl\n")
    same = args(target, str(run_dir), "--max-steps", "9")
    code, result = check(same, capsys)
    assert code == 0, result  # the same data and target (paths compared resolved)
    code, result = check([*same, "--set", f"data.train={other}"], capsys)
    assert (code, result["check"]) == (2, "changed")
    assert result["error"] == (f"run r1 has checkpoints trained on other data or another target (data.train "
                               f"data/train.jsonl -> {other}): resuming it on these makes a different run")
    assert "--confirm-change" in result["fix"]
    second = tmp_path / "second-target"  # another target: its tokenizer too
    second.mkdir()
    for name in ("config.json", "model.safetensors"):
        (second / name).write_bytes(open(os.path.join(target, name), "rb").read())
    code, result = check([*same, "--set", f"target.path={second}"], capsys)
    assert (code, result["check"]) == (2, "changed")
    assert f"target.path {target} -> {second}" in result["error"]
    code, result = check([*same, "--set", f"data.train={other}", "--allow-change"], capsys)
    assert code == 0, result
    (run_dir / "config.yaml").unlink()  # nothing recorded: nothing to compare
    assert check([*same, "--set", f"data.train={other}"], capsys)[0] == 0


def test_too_little_free_space(target, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(preflight, "MIN_FREE_BYTES", 1 << 60)
    code, result = check(args(target, str(tmp_path / "r")), capsys)
    assert (code, result["check"]) == (2, "disk") and "GiB free for the run directory" in result["error"]


def test_require_target_answers_is_checked_before_launch(target, tmp_path, capsys):
    import provenance

    code, result = check(args(target, str(tmp_path / "r"), "--set", "data.require_target_answers=true"),
                         capsys)
    assert (code, result["check"]) == (2, "data")
    assert result["error"] == ("data.train: acceptance in training metrics is teacher-forced on data not "
                               "produced by this target (train.jsonl: no provenance record, not from "
                               "`invoke regenerate`) and data.require_target_answers is set")
    for name in ("train", "heldout"):
        data = tmp_path / f"{name}.jsonl"
        data.write_text(open(os.path.join(REMOTE, "data", f"{name}.jsonl")).read())
        provenance.write_record(str(data), target, "src", {}, {})
    code, result = check(args(target, str(tmp_path / "r"), "--set", "data.require_target_answers=true",
                              "--set", f"data.train={tmp_path / 'train.jsonl'}",
                              "--set", f"data.heldout={tmp_path / 'heldout.jsonl'}"), capsys)
    assert code == 0, result
