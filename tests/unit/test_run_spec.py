"""A run's spec (its launch.json): what `train --run NAME` resumes with, and what it shows first."""

import json

import pytest

from dflash_ops import launch
from dflash_ops.errors import RemoteCommandFailed, UsageError
from dflash_ops.inventory import parse_inventory
from dflash_ops.remote import prelude
from dflash_ops.remote import runs as container_runs

INVENTORY = {
    "hosts": {"pve1": {"address": "pve1.example", "pct": "/usr/sbin/pct"}},
    "containers": {200: {"host": "pve1", "paths": {"code": "/root/dflash", "venv": "/root/venv",
                                                   "runs": "/root/runs", "model": "/dev/shm/m"}}},
}


@pytest.fixture
def ct():
    return parse_inventory(INVENTORY).container(200)


@pytest.fixture
def saved(ct):
    """The launch record of `train --run r1 --config configs/tiny-cpu.yaml --set data.train=...
    --set train.max_steps=3000 --max-steps 3000`."""
    argv, _ = launch.launch_argv(ct, "r1", "configs/tiny-cpu.yaml",
                               ["data.train=/root/data/train.jsonl", "train.max_steps=3000"], 3000)
    record = json.loads(json.loads(argv[-1])["launch"])
    record["code_version"] = "tree abc123"  # the container adds it
    return record


def test_a_new_run_is_what_was_given(ct):
    spec = launch.merge_spec(ct, None, None, ["train.lr=1"], None)
    assert (spec.config, spec.sets, spec.max_steps) == (None, ["train.lr=1"], None)
    assert (spec.changes, spec.saved) == ([], False)


def test_the_name_alone_resumes_with_the_saved_spec(ct, saved):
    spec = launch.merge_spec(ct, saved, None, [], None, "tree abc123")
    assert spec.saved and spec.changes == []
    assert spec.config == "/root/dflash/configs/tiny-cpu.yaml"
    assert spec.sets == ["data.train=/root/data/train.jsonl", "train.max_steps=3000"]
    assert spec.max_steps == 3000
    shown = launch.describe_spec("r1", spec)
    assert shown.splitlines() == [
        "run r1: resuming with its saved spec: --config /root/dflash/configs/tiny-cpu.yaml "
        "--set data.train=/root/data/train.jsonl --set train.max_steps=3000 --max-steps 3000",
        "  (nothing changed)"]


def test_new_values_apply_on_top_and_are_shown(ct, saved):
    spec = launch.merge_spec(ct, saved, None, ["train.max_steps=4000", "train.lr=1e-4",
                                             "data.train=/root/data/train.jsonl"], 4000, "tree def456")
    assert spec.sets == ["data.train=/root/data/train.jsonl", "train.max_steps=4000", "train.lr=1e-4"]
    assert spec.max_steps == 4000
    assert spec.changes == ["--set train.max_steps: 3000 -> 4000",
                            "--set train.lr: (the config file) -> 1e-4",
                            "--max-steps: 3000 -> 4000", 'code: "tree abc123" -> "tree def456"']


def test_max_steps_alone_changes_only_the_stop(ct, saved):
    spec = launch.merge_spec(ct, saved, None, [], 5000)
    assert (spec.sets, spec.max_steps, spec.changes) == (saved["sets"], 5000, ["--max-steps: 3000 -> 5000"])


def test_what_the_inventory_changed_is_shown(ct, saved):
    saved = dict(saved, devices={"target": "cuda:0", "drafter": "cuda:1"},
                 inventory_sets=['target.path="/dev/shm/old"'])
    changes = launch.merge_spec(ct, saved, "configs/other.yaml", [], None).changes
    assert changes == ["--config: /root/dflash/configs/tiny-cpu.yaml -> /root/dflash/configs/other.yaml",
                       'devices: {"target": "cuda:0", "drafter": "cuda:1"} -> '
                       '{"target": null, "drafter": null}',
                       'inventory --set: ["target.path=\\"/dev/shm/old\\""] -> '
                       '["target.path=\\"/dev/shm/m\\"", '
                       '"compile.cache_dir=\\"/root/.cache/dflash/inductor\\""]']


@pytest.mark.parametrize("bad", [{"sets": ["no-equals-sign"]}, {"sets": ["$(id)=1"]},
                                 {"config": "-rf"}, {"config": "a\nb"}])
def test_a_tampered_spec_is_one_line(ct, saved, bad):
    with pytest.raises(RemoteCommandFailed) as info:
        launch.merge_spec(ct, dict(saved, **bad), None, [], None)
    assert "\n" not in str(info.value) and "saved spec (launch.json) is not usable" in str(info.value)


def test_the_shown_spec_has_no_control_characters(ct, saved):
    spec = launch.merge_spec(ct, dict(saved, sets=["data.train=/x\x1b[2J\ny"]), None, [], None)
    shown = launch.describe_spec("r1", spec)
    assert "\x1b" not in shown and shown.count("\n") == 1 and "^[[2J^Jy" in shown


def test_the_spec_verb_reads_launch_json_as_data(tmp_path):
    runs = tmp_path / "runs"
    (runs / "r1").mkdir(parents=True)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"tree": "abc123"}))

    def ask(name):
        return container_runs.spec({"runs": str(runs), "name": name, "manifest": str(manifest)})

    assert ask("r1") == {"exists": True, "spec": None, "code_version": "tree abc123"}
    assert ask("none")["exists"] is False
    (runs / "r1" / "launch.json").write_text(json.dumps({"sets": ["a.b=1"], "max_steps": 3}))
    assert ask("r1")["spec"] == {"sets": ["a.b=1"], "max_steps": 3}
    for junk in ("[1, 2]", "{cut", "x" * (prelude.SPEC_CAP + 10)):
        (runs / "r1" / "launch.json").write_text(junk)
        assert ask("r1")["spec"] is None


def test_max_restarts_is_saved_kept_by_a_resume_and_changed_by_a_new_value(ct):
    argv, _ = launch.launch_argv(ct, "r1", None, [], None, max_restarts=2)
    payload = json.loads(argv[-1])
    record = json.loads(payload["launch"])
    assert record["max_restarts"] == 2
    hook = payload["hook"]  # what the wrapper runs when the training process ends
    assert hook[:3] == [ct.python, "-S", "-c"] and hook[5] == "ended"
    assert hook[4] == ""  # the helper travels once, as the launch verb's own text (runs._hook)
    restart = json.loads(hook[6])["restart"]
    assert restart["max"] == 2 and restart["signals"] == [9, 11, 7]
    assert any("NCCL" in p for p in restart["patterns"])
    kept = launch.merge_spec(ct, record, None, [], None)
    assert (kept.max_restarts, kept.changes) == (2, [])
    assert "--max-restarts 2" in launch.describe_spec("r1", kept)
    changed = launch.merge_spec(ct, record, None, [], None, max_restarts=0)
    assert (changed.max_restarts, changed.changes) == (0, ["--max-restarts: 2 -> 0"])
    with pytest.raises(UsageError, match="--max-restarts -1: give 0..100"):
        launch.Spec(None, [], None, max_restarts=launch.check_max_restarts(-1))


def test_a_multi_node_run_refuses_max_restarts():
    import tasks

    with pytest.raises(UsageError, match="--max-restarts is for a run in one container, not a multi-node"):
        tasks._train_nodes([], run="r1", max_restarts=2)
