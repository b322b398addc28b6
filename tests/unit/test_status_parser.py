"""The status parser on outputs recorded from the status fact script in the embedded host's container.

Recorded with `sh -c STATUS_SCRIPT sh /root/runs NAME` (log lines trimmed). H200_BUSY was recorded
on an NVIDIA H200 machine (driver 580.159.04) while torch held 8 GB on it and a `flock` held the
runs lock; GPUS and the out-of-memory log are written in nvidia-smi's and torch's formats.
"""

import json

import pytest
from recorded_answers import status_answer

from dflash_ops import cli
from dflash_ops.remote.prelude import describe_exit
from dflash_ops.status import RunStatus, parse_status, render

FINISHED = """\
now 1795954010
name t1
exists 1
alive 0
pid 82
pgid 79
started 1795953931
ended 1795953966
exit_code 0
code_version tree c3f5d18a75f3f24e18bbbab62d6a9f0978680da873db2a44a5ce5850ae9e1418
mtime_log 1795953966
mtime_metrics 1795953965
metric {"kind": "train", "step": 25, "loss": 8.3215, "acceptance_length": 1.07, "tokens_per_s": 2716.2, "lr": 0.005, "memory_gib": 0.56, "time": 1795953963.1}
metric {"kind": "train", "step": 30, "loss": 4.777572218577067, "slot_accuracy": [0.13, 0.14], "acceptance_length": 1.1301128349788434, "tokens_per_s": 4905.897291164022, "lr": 0.004999212664740431, "memory_gib": 0.56, "time": 1795953965.2}
metric {"kind": "eval", "step": 30, "loss": 4.614003479480743, "slot_accuracy": [0.14], "acceptance_length": 1.14, "decode_acceptance": 1.09, "time": 1795953965.5}
metric {"kind": "checkpoint", "step": 30, "path": "/root/runs/t1/checkpoints/step-30", "replica_max_abs_diff": 0.0}
log 12:06:05 INFO checkpoint /root/runs/t1/checkpoints/step-30 (replicas differ by at most 0)
log dflash-ops: training process 82 ended: exit 0
end
"""  # noqa: E501

RUNNING = """\
now 1795954068
name t3
exists 1
alive 1
pid 487
pgid 484
started 1795954052
code_version tree c3f5d18a75f3f24e18bbbab62d6a9f0978680da873db2a44a5ce5850ae9e1418
mtime_log 1795954060
log dflash-ops: launch 2026-11-29T12:07:32Z of run t3
log 12:07:40 INFO drafter: 2 layers, 0.1M parameters, taps [1, 3], block 8, mask token 3; dense reference attention (no compile)
end
"""  # noqa: E501

KILLED = """\
now 1795954070
name t3
exists 1
alive 0
pid 487
pgid 484
started 1795954052
ended 1795954068
exit_code signal 9
code_version tree c3f5d18a75f3f24e18bbbab62d6a9f0978680da873db2a44a5ce5850ae9e1418
mtime_log 1795954068
log Killed
log dflash-ops: training process 487 ended: exit signal 9
end
"""

STOPPED = """\
now 1795954051
name t2
exists 1
alive 0
pid 280
pgid 277
started 1795953974
ended 1795954004
exit_code 0
stopped term 1795954004
mtime_log 1795954004
mtime_metrics 1795954001
metric {"kind": "eval", "step": 0, "loss": 16.455127716064453, "slot_accuracy": [0.0], "acceptance_length": 1.0, "time": 1795954001.2993648}
metric {"kind": "checkpoint", "step": 0, "path": "/root/runs/t2/checkpoints/step-0", "replica_max_abs_diff": 0.0}
log 12:06:41 INFO stopped by SIGTERM at step 0
log dflash-ops: training process 280 ended: exit 0
end
"""  # noqa: E501

H200_BUSY = """\
now 1795955514
name r1
exists 1
alive 1
started 1795955506
gpu 0, 3, 8251, 143771
end
"""

MISSING = "now 1795954070\nname nope\nexists 0\nend\n"
NO_RUN_YET = "now 1795954070\nname \nend\n"

GPUS = """\
gpu 0, 97, 70211, 143771
gpu 1, 0, 1, 143771
gpu 2, [N/A], [N/A], 143771
"""

OOM = """\
log   File "/root/dflash/training.py", line 201, in forward_backward
log torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 5 has a total capacity of 139.72 GiB of which 1.12 GiB is free.
log dflash-ops: training process 912 ended: exit 1
"""  # noqa: E501


def test_finished_run_reports_last_train_metrics_and_duration():
    st = parse_status(status_answer(FINISHED))
    assert (st.run, st.state, st.detail, st.pid) == ("t1", "finished", "exit 0", 82)
    assert st.step == 30
    assert st.loss == pytest.approx(4.777572218577067)
    assert st.acceptance_length == pytest.approx(1.1301128349788434)
    assert st.tokens_per_s == pytest.approx(4905.897291164022)
    assert st.lr == pytest.approx(0.004999212664740431)
    assert st.eval_loss == pytest.approx(4.614003479480743)
    assert st.eval_decode_acceptance == pytest.approx(1.09)
    assert (st.duration_s, st.uptime_s) == (1795953966 - 1795953931, None)  # ended: no uptime
    assert st.code_version.startswith("tree c3f5d18a")
    assert st.findings == [] and st.gpus == []


def test_running_run_is_running_until_quiet_longer_than_the_threshold():
    st = parse_status(status_answer(RUNNING, stall_after=600))
    assert (st.state, st.pid, st.uptime_s, st.idle_s) == ("running", 487, 16, 8)
    assert st.step is None and st.loss is None  # no metric yet: shown as '-', not as zero
    stalled = parse_status(status_answer(RUNNING, stall_after=5))
    assert stalled.state == "stalled"
    assert "8 s" in stalled.detail
    assert [f["runbook"] for f in stalled.findings] == ["docs/runbooks/stalled-run.md"]


def test_sigkilled_run_is_crashed_with_the_signal():
    st = parse_status(status_answer(KILLED))
    assert st.state == "crashed"
    assert st.exit_code == "signal 9"
    assert st.detail == "killed by signal 9 (SIGKILL)"
    assert st.duration_s == 16


def with_memory(answer: str, limit, kills) -> str:
    """The status verb's answer with the container's memory fact (remote.prelude.container_memory)."""
    facts = json.loads(answer)
    facts["ok"]["memory"] = {"limit": limit, "oom_kills": kills}
    return json.dumps(facts)


def test_a_sigkilled_run_in_a_container_whose_oom_killer_ran_names_the_likely_oom():
    st = parse_status(with_memory(status_answer(KILLED), 256 << 20, 1))
    assert (st.state, st.memory_limit, st.oom_kills) == ("crashed", 256 << 20, 1)
    assert st.detail == ("killed by signal 9 (SIGKILL), likely out of memory: the container's OOM killer ran "
                         "(256 MiB)")
    assert [f["runbook"] for f in st.findings] == ["docs/runbooks/container-oom.md"]
    from rich.console import Console

    console = Console(record=True, width=200)
    render(st, "pve1/200", console)
    assert "killed by the container's memory limit (OOM killer): read docs/runbooks/container-oom.md" in (
        console.export_text())


@pytest.mark.parametrize("kills, code", [(0, "signal 9"), (None, "signal 9"), (3, "1"), (3, "signal 15")])
def test_no_oom_is_named_without_the_oom_killer_or_without_sigkill(kills, code):
    killed = KILLED.replace("exit_code signal 9", f"exit_code {code}")
    st = parse_status(with_memory(status_answer(killed), 256 << 20, kills))
    assert "out of memory" not in st.detail
    assert not [f for f in st.findings if f["key"] == "container-oom"]


def test_stopped_run_says_how():
    st = parse_status(status_answer(STOPPED))
    assert st.state == "stopped"
    assert st.detail == "stopped with SIGTERM, exit 0"
    assert st.step == 0 and st.loss is None and st.eval_loss == pytest.approx(16.455127716064453)


def test_a_live_run_is_running_even_when_a_stop_was_requested():
    alive = STOPPED.replace("alive 0", "alive 1")
    assert parse_status(status_answer(alive)).state == "running"


def test_missing_and_no_run_yet():
    assert (parse_status(status_answer(MISSING)).state,
            parse_status(status_answer(MISSING)).run) == ("missing", "nope")
    assert (parse_status(status_answer(NO_RUN_YET)).state,
            parse_status(status_answer(NO_RUN_YET)).run) == ("none", None)


def test_run_whose_wrapper_died_too_is_crashed_without_exit_code():
    text = KILLED.replace("exit_code signal 9\n", "").replace("ended 1795954068\n", "")
    st = parse_status(status_answer(text))
    assert st.state == "crashed"
    assert "no exit code recorded" in st.detail
    never = "now 5\nname x\nexists 1\nalive 0\nstarted 1 \nend\n"
    assert parse_status(status_answer(never)).detail == "the training process never started"


def test_gpu_lines_and_nvidia_smi_errors():
    smi_failed = "gpu NVIDIA-SMI has failed because it couldn't communicate\n"
    st = parse_status(status_answer(RUNNING.replace("end\n", GPUS + smi_failed + "end\n")))
    assert [(g.index, g.utilization, g.memory_used_mib, g.memory_total_mib) for g in st.gpus] == [
        (0, 97, 70211, 143771), (1, 0, 1, 143771), (2, None, None, 143771)]
    assert "couldn't communicate" in st.gpu_error


def test_recorded_h200():
    st = parse_status(status_answer(H200_BUSY))
    assert (st.state, st.uptime_s, st.idle_s) == ("running", 8, 8)
    assert ([(g.index, g.utilization, g.memory_used_mib, g.memory_total_mib) for g in st.gpus]
            == [(0, 3, 8251, 143771)])
    assert st.gpu_error is None


def test_known_failure_in_the_last_log_lines_names_the_runbook():
    killed = KILLED.replace("exit_code signal 9", "exit_code 1").replace("end\n", OOM + "end\n")
    st = parse_status(status_answer(killed))
    assert st.state == "crashed" and st.detail == "exit 1"
    assert [(f["key"], f["runbook"]) for f in st.findings] == [("cuda-oom", "docs/runbooks/cuda-oom.md")]
    assert "Tried to allocate" in st.findings[0]["line"]


def test_a_metric_line_cut_mid_write_is_skipped():
    text = FINISHED.replace("end\n", 'metric {"kind": "train", "step": 31, "lo\nend\n')
    st = parse_status(status_answer(text))
    assert st.step == 30


def test_truncated_output_is_an_error_not_a_healthy_run():
    with pytest.raises(ValueError, match="no complete answer"):
        parse_status(status_answer(RUNNING.replace("end\n", "")))


def test_pty_line_endings_are_tolerated():
    assert parse_status(status_answer(FINISHED.replace("\n", "\r\n"))).state == "finished"


def test_describe_exit():
    assert describe_exit("signal 15") == "killed by signal 15 (SIGTERM)"
    assert describe_exit("2") == "exit 2"
    assert describe_exit("signal 99") == "killed by signal 99 (?)"


def test_json_and_table_render_every_fact():
    from rich.console import Console

    st = parse_status(status_answer(FINISHED.replace("end\n", GPUS + "end\n")))
    data = json.loads(cli.as_json_text(st.facts()))
    assert data["state"] == "finished" and data["step"] == 30 and data["gpus"][0]["memory_used_mib"] == 70211
    assert set(data) == set(RunStatus.__dataclass_fields__)
    console = Console(record=True, width=120)
    render(st, "pve1/200", console)
    text = console.export_text()
    for expected in ("finished", "4.778", "1.130", "4,906", "70211", "143771", "pve1/200: run t1"):
        assert expected in text


def test_data_warnings_from_training_are_shown():
    from rich.console import Console

    warning = ("acceptance in training metrics is teacher-forced on data not produced by this target "
               "(train.jsonl: no provenance record, not from `invoke regenerate`)")
    data = json.dumps({"target_answers": False, "warnings": [warning, "\x1b[31m[bold]x", 5],
                       "heldout_overlap": {"in_train": 0, "heldout": 200}})
    st = parse_status(status_answer(FINISHED.replace("end\n", f"datajson {data}\nend\n")))
    assert st.data_warnings == [warning, "\x1b[31m[bold]x"]
    console = Console(record=True, width=400)
    render(st, "pve1/200", console)
    text = console.export_text()
    assert "data warning" in text and warning in text and "teacher-forced acceptance" in text
    assert "\x1b" not in text and "^[[31m[bold]x" in text
    assert parse_status(status_answer(FINISHED.replace("end\n", "datajson {cut\nend\n"))).data_warnings == []


def test_replicas_that_differ_at_the_last_checkpoint_are_shown():
    from rich.console import Console

    differ = ('metric {"kind": "checkpoint", "step": 35, "path": "/root/runs/t1/checkpoints/step-35", '
              '"replica_max_abs_diff": 0.053}\n')
    st = parse_status(status_answer(FINISHED.replace("end\n", differ + "end\n")))
    assert st.replicas_differ == pytest.approx(0.053)
    assert json.loads(cli.as_json_text(st.facts()))["replicas_differ"] == pytest.approx(0.053)
    console = Console(record=True, width=120)
    render(st, "pve1/200", console)
    text = console.export_text()
    assert "replicas differ" in text and "by up to 0.053" in text
    assert parse_status(status_answer(FINISHED)).replicas_differ is None  # identical: no row
    healed = FINISHED.replace("end\n", differ + differ.replace("35", "40").replace("0.053", "0.0") + "end\n")
    assert parse_status(status_answer(healed)).replicas_differ is None  # the last checkpoint counts


def test_the_runs_spec_is_in_the_json_and_only_of_its_types():
    reply = json.loads(status_answer(FINISHED))
    answer = reply["ok"]
    answer["spec"] = {"config": "/root/dflash/configs/tiny-cpu.yaml", "max_steps": 3000,
                      "sets": ["data.train=/root/data/train.jsonl", 5, "train.max_steps=3000"],
                      "devices": {"target": "cuda:0", "drafter": ["x"]}, "code_version": "tree abc",
                      "argv": ["not", "kept"]}
    st = parse_status(json.dumps(reply) + "\n")
    assert json.loads(cli.as_json_text(st.facts()))["spec"] == {
        "config": "/root/dflash/configs/tiny-cpu.yaml", "max_steps": 3000, "max_restarts": None,
        "sets": ["data.train=/root/data/train.jsonl", "train.max_steps=3000"],
        "devices": {"target": "cuda:0", "drafter": None}, "inventory_sets": [], "code_version": "tree abc",
        "launched_at": None, "launched_by": None}
    answer["spec"] = "junk"
    assert parse_status(json.dumps(reply) + "\n").spec is None
