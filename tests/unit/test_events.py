"""`invoke watch`: the events between two consecutive polls (pure)."""

import pytest

from dflash_ops.errors import UsageError
from dflash_ops.oncall import events
from dflash_ops.status import RunStatus

STALLED_FINDING = {"key": "stalled-run", "title": "no new log line or metric", "runbook":
                   "docs/runbooks/stalled-run.md", "line": ""}
OOM = {"key": "cuda-oom", "title": "CUDA out of memory", "runbook": "docs/runbooks/cuda-oom.md",
       "line": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}


def st(state, step=10, idle=1, findings=(), **kw):
    return RunStatus(run="r", state=state, step=step, loss=2.5, idle_s=idle, findings=list(findings), **kw)


def kinds(before, now, hang_after=1800):
    return [k for k, _, _ in events.changes(before, now, hang_after)]


def test_a_stall_resume_crash_sequence():
    seq = [st("running"), st("running", 11),
           st("stalled", 11, idle=40, findings=[STALLED_FINDING],
              detail="no new log line or metric for 40 s"),
           st("stalled", 11, idle=50, findings=[STALLED_FINDING]), st("running", 12),
           st("crashed", 12, idle=3, detail="killed by signal 9 (SIGKILL)")]
    got = [kinds(before, now) for before, now in zip([None, *seq], seq, strict=False)]
    assert got == [["watching"], [], ["stalled"], [], ["recovered"], ["crashed"]]
    crash = events.changes(seq[4], seq[5], 1800)[0]
    assert crash == ("crashed",
                     "crashed: killed by signal 9 (SIGKILL); read docs/runbooks/alerting.md; last step 12, "
                                "loss 2.5", "docs/runbooks/alerting.md")


def test_a_crash_with_a_signature_names_its_runbook_and_the_signature_is_an_event_once():
    running, oom = st("running"), st("running", findings=[OOM])
    assert events.changes(running, oom, 1800) == [
        ("signature", f"CUDA out of memory in the log: {OOM['line']}", "docs/runbooks/cuda-oom.md")]
    assert kinds(oom, oom) == []
    crashed = st("crashed", findings=[OOM], detail="exit 1")
    (kind, text, page), = events.changes(oom, crashed, 1800)
    assert ((kind, page) == ("crashed", "docs/runbooks/cuda-oom.md")
            and "read docs/runbooks/cuda-oom.md" in text)


def test_start_finish_hang_evaluations_and_a_missing_run():
    assert kinds(None, st("missing", step=None)) == ["waiting"]
    assert kinds(st("missing", step=None), st("running")) == ["started"]
    assert kinds(st("running"), st("finished", detail="exit 0")) == ["finished"]
    assert kinds(st("running"), st("stopped", detail="stopped with SIGTERM")) == ["stopped"]
    assert kinds(st("running"), st("missing")) == ["gone"]
    stalled = st("stalled", idle=700, findings=[STALLED_FINDING])
    assert kinds(st("running"), stalled, hang_after=600) == ["stalled", "hung"]
    assert kinds(stalled, st("stalled", idle=800, findings=[STALLED_FINDING]), hang_after=600) == []
    assert kinds(st("running", eval_step=0, eval_loss=3.0), st("running", eval_step=50, eval_loss=2.0)) == \
        ["evaluation"]
    last = {"step": 50, "acceptance_length": 2.5, "tokens_per_target_forward": 2.5, "speedup": 1.8,
            "lossless": True,
            "prompts": 4}
    (kind, text, _), = events.changes(st("running"), st("running", last_eval=last), 1800)
    assert kind == "evaluation" and text.startswith("invoke eval: acceptance 2.50")
    assert kinds(None, st("running", eval_step=50, last_eval=last)) == ["watching"]  # old news at the start


def test_bad_watch_flags_fail_at_once():
    events.check_watchable("r", 30, 600, 1800)
    for args, words in (((None, 30, 600, 1800), "--run NAME"), (("../x", 30, 600, 1800), "--run"),
                        (("r", 0, 600, 1800), "--every 0"), (("r", 30, 600, 60), "--hang-after 60")):
        with pytest.raises(UsageError, match=words):
            events.check_watchable(*args)


def test_an_automatic_restart_is_an_event_once():
    first = {"n": 1, "kind": "launch", "start": 100, "from_step": 0}
    again = {"n": 2, "kind": "restart", "start": 200, "from_step": 30, "restart": 1, "after": "signal 9"}
    before, now = st("running", segment=first), st("running", segment=again)
    assert events.changes(before, now, 1800) == [
        ("restarted", "restarted automatically (restart 1, segment 2) after the training process ended: "
                      "killed by signal 9 (SIGKILL); resuming from step 30", None)]
    assert kinds(now, st("running", 40, segment=again)) == []
    resumed = {"n": 3, "kind": "resume", "start": 300, "from_step": 40}  # a user's launch: `started`
    assert kinds(st("stopped", segment=again), st("running", segment=resumed)) == ["started"]
