"""`status --check` verdicts and `status --prometheus` text from status facts (pure)."""

import dataclasses
import os

import pytest
from prometheus_client.parser import text_string_to_metric_families
from recorded_answers import status_answer

from dflash_ops.errors import UsageError
from dflash_ops.oncall import monitoring, prometheus
from dflash_ops.oncall.monitoring import CRITICAL, OK, UNKNOWN, WARNING, Thresholds
from dflash_ops.status import Gpu, RunStatus, parse_status

GIB = 1 << 30

# The status fact script's answer for a finished tiny run, with the facts added for monitoring.
FINISHED = """\
now 1795954010
name t1
free_runs 53687091200
free_shm 8589934592
exists 1
alive 0
pid 82
pgid 79
started 1795953931
ended 1795953966
exit_code 0
mtime_log 1795953966
free 53687091200
checkpoint step-30 1795953965
mtime_metrics 1795953965
metric {"kind": "train", "step": 30, "loss": 4.75, "slot_accuracy": [0.5, 0.25, 0.125], "acceptance_length": 1.5, "tokens_per_s": 4905.5, "lr": 0.005, "time": 1795953965.2}
metric {"kind": "eval", "step": 30, "loss": 4.5, "slot_accuracy": [0.14], "acceptance_length": 1.14, "time": 1795953965.5}
evaljson {"step": 30, "acceptance_length": 2.25, "speedup": 1.75, "lossless": true, "prompts": 4}
log dflash-ops: training process 82 ended: exit 0
gpu 0, 97, 70000, 81559, 64
gpu 1, 3, 1024, 81559, 41
end
"""  # noqa: E501


def test_status_facts_for_monitoring_are_parsed():
    st = parse_status(status_answer(FINISHED))
    assert (st.free_runs, st.free_shm) == (50 * GIB, 8 * GIB)
    assert (st.checkpoint_step, st.checkpoint_age_s) == (30, 45)
    assert (st.slot_accuracy, st.eval_step, st.eval_loss) == ([0.5, 0.25, 0.125], 30, 4.5)
    assert [(g.index, g.utilization, g.temperature_c) for g in st.gpus] == [(0, 97, 64), (1, 3, 41)]


def finished(**changes) -> RunStatus:
    """What parse_status makes of FINISHED (the verdicts and the exposition are tested on RunStatus)."""
    st = RunStatus(run="t1", state="finished", detail="exit 0", pid=82, uptime_s=35, idle_s=44, step=30,
                   loss=4.75,
                   acceptance_length=1.5, tokens_per_s=4905.5, lr=0.005, eval_loss=4.5, eval_step=30,
                   eval_decode_acceptance=1.25,
                   slot_accuracy=[0.5, 0.25, 0.125], checkpoint_step=30, checkpoint_age_s=45,
                   last_eval={"step": 30, "acceptance_length": 2.25, "speedup": 1.75, "lossless": True},
                   exit_code="0", free_runs=50 * GIB, free_shm=8 * GIB,
                   gpus=[Gpu(0, 97, 70000, 81559, 64), Gpu(1, 3, 1024, 81559, 41)])
    return dataclasses.replace(st, **changes)


def running(idle=5, stall_after=600, **changes) -> RunStatus:
    if idle > stall_after:
        return finished(state="stalled", idle_s=idle, exit_code=None,
                        detail=f"no new log line or metric for {idle} s (threshold {stall_after} s)",
                        findings=[{"key": "stalled-run", "title": "no new log line or metric",
                                   "runbook": "docs/runbooks/stalled-run.md", "line": ""}], **changes)
    return finished(state="running", detail="", idle_s=idle, exit_code=None, **changes)


def check(st, **th):
    return monitoring.verdict(st, "pve1/200", Thresholds(**th))


def test_each_state_gets_its_code_and_one_line():
    cases = {
        "running": (running(5), OK, "run t1 running, step 30, loss 4.75"),
        "stalled": (running(700), WARNING, "run t1 stalled: no new log line or metric for 700 s"),
        "hung": (running(4000), CRITICAL,
                 "run t1 hung: no new log line or metric for 4000 s (hang threshold 1800 s)"),
        "finished": (finished(), OK, "run t1 finished (exit 0)"),
        "crashed": (finished(state="crashed", detail="killed by signal 9 (SIGKILL)"), CRITICAL,
                    "run t1 crashed: killed by signal 9 (SIGKILL)"),
        "missing": (RunStatus(run="nope", state="missing"), UNKNOWN, "run nope does not exist"),
        "no run": (RunStatus(run=None, state="none"), OK, "no run yet"),
    }
    for name, (st, code, words) in cases.items():
        v = check(st)
        assert v.code == code, (name, v.line())
        assert v.line().startswith(f"{monitoring.NAMES[code]} - pve1/200: {words}"), (name, v.line())
        assert "\n" not in v.line()


@pytest.mark.parametrize("many", [False, True])
def test_what_a_run_file_holds_cannot_start_perfdata_or_a_plugin_line(many):
    """A crashed run whose last error line (the container's) holds `|` and every Unicode line break: the
    report stays one line per container with one `|`, the text shown visibly."""
    said = ("RuntimeError: x | step=999999 loss=0\u2028OK - pve1/200: run t1 running\x85OK - fake"
            "\u2029OK\x1cOK\r\nOK")
    crashed = finished(state="crashed", detail=f"exit 1: {said}")
    verdicts = [check(crashed)] + ([check(finished())] if many else [])
    code, text = monitoring.report(verdicts)
    lines = text.splitlines()  # as a monitoring system splits the plugin's output: every line break
    assert code == CRITICAL and len(lines) == 1 + 2 * many, lines
    assert text.count("|") == 1 and "step=999999" not in lines[0].split(" | ")[1]
    assert "x <U+007C> step=999999 loss=0 OK - pve1/200: run t1 running OK - fake OK OK OK" in text, text


def test_low_space_warns_and_a_failure_signature_is_critical():
    low = check(running(5, free_shm=100 << 20))
    assert (low.code == WARNING
            and "low space: 0.1 GiB free on the /dev/shm (threshold 0.5 GiB)" in low.summary)
    runs_low = check(running(5), min_free_runs=100 * GIB)
    assert runs_low.code == WARNING and "free on the runs dir" in runs_low.summary
    oom = running(5,
                  findings=[{"key": "cuda-oom", "title": "CUDA out of memory",
                             "runbook": "docs/runbooks/cuda-oom.md",
                                "line": "torch.OutOfMemoryError: CUDA out of memory"}])
    v = check(oom)
    assert v.code == CRITICAL and "CUDA out of memory in the log: read docs/runbooks/cuda-oom.md" in v.summary


def test_perfdata_and_the_group_report_puts_the_worst_first():
    ok, bad = check(running(5)), check(finished(state="crashed", detail="exit 1"))
    bad.label = "pve1/201"
    code, text = monitoring.report([ok])
    assert code == OK
    assert text.endswith("| step=30 loss=4.75 acceptance=1.5 tok_s=4905.5 idle=5s free_runs=53687091200B "
                         "free_shm=8589934592B")
    code, text = monitoring.report([ok, bad])
    lines = text.splitlines()
    assert code == CRITICAL and len(lines) == 3
    assert lines[0].startswith("CRITICAL - 2 containers (1 CRITICAL, 1 OK); worst pve1/201: run t1 "
                               "crashed: exit 1")
    assert "200_step=30" in lines[0] and "201_step=30" in lines[0]
    assert lines[1].startswith("CRITICAL - pve1/201") and lines[2].startswith("OK - pve1/200")
    unknown = monitoring.unknown("pve1/202", "cannot reach pve1.example:22 (connection refused)")
    code, text = monitoring.report([ok, unknown])
    assert code == UNKNOWN and "202_step=U" not in text  # no facts, no perfdata


def test_thresholds_and_sizes_are_checked():
    assert monitoring.parse_size("10G") == 10 * GIB and monitoring.parse_size("512M") == 512 << 20
    assert monitoring.parse_size("1.5GiB") == int(1.5 * GIB) and monitoring.parse_size("4096") == 4096
    for bad in ("banana", "-1G", "10X", ""):
        with pytest.raises(UsageError):
            monitoring.parse_size(bad)
    with pytest.raises(UsageError, match="--hang-after 10 must be at least --stall-after 600"):
        Thresholds(stall_after=600, hang_after=10)


def test_prometheus_text_of_a_finished_run_parses_with_names_types_and_values():
    text = prometheus.exposition(prometheus.samples("pve1", 200, finished()))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert all(f.type == "gauge" for f in families.values())
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values()
              for s in f.samples}
    run = (("ct", "200"), ("host", "pve1"), ("run", "t1"))

    def value(name, **extra):
        return values[(name, tuple(sorted(dict(run, **extra).items())))]

    assert (value("dflash_run_state", state="finished") == 1
            and value("dflash_run_state", state="running") == 0)
    assert value("dflash_run_step") == 30 and value("dflash_run_loss") == 4.75
    assert value("dflash_run_heldout_loss") == 4.5 and value("dflash_run_acceptance_length") == 1.5
    assert value("dflash_run_heldout_decode_acceptance_length") == 1.25
    assert [value("dflash_run_slot_accuracy", slot=str(i)) for i in (1, 2, 3)] == [0.5, 0.25, 0.125]
    assert value("dflash_run_tokens_per_second") == 4905.5
    assert value("dflash_run_checkpoint_step") == 30 and value("dflash_run_checkpoint_age_seconds") == 45
    assert value("dflash_eval_acceptance_length") == 2.25 and value("dflash_eval_speedup") == 1.75
    def host(name, **extra):
        return values[(name, tuple(sorted(dict(ct="200", host="pve1", **extra).items())))]

    assert host("dflash_up") == 1
    assert host("dflash_gpu_utilization_percent", gpu="0") == 97
    assert host("dflash_gpu_memory_used_bytes", gpu="1") == 1024 << 20
    assert host("dflash_gpu_temperature_celsius", gpu="0") == 64
    assert host("dflash_filesystem_free_bytes", fs="shm") == 8 * GIB
    assert text.count("# TYPE dflash_run_state gauge") == 1


def test_prometheus_label_values_from_the_container_are_escaped():
    st = finished(run='a"b\\c\nd}{x="1')  # what a hostile .current could name
    text = prometheus.exposition(prometheus.samples("pve1", 200, st) + prometheus.samples("pve2", 201, None))
    runs = {s.labels.get("run") for f in text_string_to_metric_families(text) for s in f.samples}
    assert 'a"b\\c\nd}{x="1' in runs
    down = [s for f in text_string_to_metric_families(text) for s in f.samples
            if s.labels.get("host") == "pve2"]
    assert [(s.name, s.value) for s in down] == [("dflash_up", 0)]


def test_prometheus_file_is_replaced_atomically(tmp_path):
    target = tmp_path / "dflash.prom"
    target.write_text("old\n")
    prometheus.write_atomic(str(target), "dflash_up 1\n")
    assert target.read_text() == "dflash_up 1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["dflash.prom"]  # no temp file left behind
    assert oct(target.stat().st_mode & 0o777) == "0o644"


def test_prometheus_temp_file_swapped_for_a_symlink_leaves_a_private_file_private(tmp_path, monkeypatch):
    """Another user of the textfile directory swaps the temp file for a symlink to a private file of
    root's between the write and the chmod: the private file stays 0600 and nothing is renamed."""
    victim = tmp_path / "root-only"
    victim.write_text("secret\n")
    victim.chmod(0o600)
    real_fsync = os.fsync

    def swap(fd):
        for temp in tmp_path.glob(".dflash.prom.*.tmp"):
            temp.unlink()
            temp.symlink_to(victim)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", swap)
    with pytest.raises(OSError, match="replaced by someone else"):
        prometheus.write_atomic(str(tmp_path / "dflash.prom"), "dflash_up 1\n")
    assert oct(victim.stat().st_mode & 0o777) == "0o600" and victim.read_text() == "secret\n"
    assert not (tmp_path / "dflash.prom").exists()
