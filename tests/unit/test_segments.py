"""A run's segments (each launch, resume or automatic restart) on a real wrapper in temporary run
directories: what the launch and the wrapper's `ended` call write, what `runs --history` shows, and
`--max-restarts`: a transient crash is relaunched, a stop, a clean end or another failure never is."""

import json
import sys

import pytest
from waiting import wait_for

from dflash_ops import history, status
from dflash_ops import runs as runs_mod
from dflash_ops.remote import history as container_history
from dflash_ops.remote import prelude, ship
from dflash_ops.remote import runs as container_runs
from dflash_ops.remote.prelude import Refused


def call(verb, **payload):
    try:
        return container_runs.VERBS[verb](payload)
    except Refused as refused:
        return refused.answer


@pytest.fixture
def runs(tmp_path):
    (tmp_path / "runs").mkdir()
    return tmp_path / "runs"


# The training process: SIGKILLs itself on its first `kills` starts (counted in a file beside the
# runs), then logs a train metric of step `from + 1` and exits `code`.
CHILD = """
import json, os, signal, sys
count = os.path.join(sys.argv[1], "starts")
n = int(open(count).read()) if os.path.exists(count) else 0
open(count, "w").write(str(n + 1))
with open(os.path.join(sys.argv[2], "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"kind": "train", "step": 10 * (n + 1), "loss": 1.0}) + "\\n")
if n < int(sys.argv[3]):
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[5] == "sleep":  # until a stop's SIGTERM, which it answers by dying of SIGKILL
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGKILL))
    import time; time.sleep(60)
sys.exit(int(sys.argv[4]))
"""


def launch_code(runs, tmp_path, name, argv, max_restarts, settle=0.3):
    """The launch verb of training argv `argv` with the wrapper's `ended` hook (ship.argv's shape),
    restarts after 0.05 s."""
    config = tmp_path / "config.yaml"
    config.write_text("train: {}\n")
    policy = dict(runs_mod.restart_policy(max_restarts), backoff_s=0.05)
    hook = [sys.executable, "-S", "-c", ship.LOADER, ship.packed("runs"), "ended",
            json.dumps({"runs": str(runs), "name": name, "restart": policy})]
    return call("launch", runs=str(runs), name=name, config=str(config), argv=argv, required=[sys.executable],
                preflight=None, manifest=str(tmp_path / "none.json"), settle=settle, launch="{}", env="A=1",
                cwd=str(tmp_path), hook=hook)


def launch(runs, tmp_path, name="r1", kills=1, code=0, max_restarts=2, then="exit"):
    argv = [sys.executable, "-c", CHILD, str(tmp_path), str(runs / name), str(kills), str(code), then]
    return launch_code(runs, tmp_path, name, argv, max_restarts)


def ended(runs, name="r1"):
    """Once the run has ended: `runs --history`'s answer, checked as the local side does."""
    wait_for("the run to end", lambda: prelude.alive_run(str(runs)) is None, timeout=60)
    return history.checked_segments(container_history.segments({"runs": str(runs), "run": name}), "test")


def test_a_sigkilled_training_process_is_restarted_once_and_both_segments_are_recorded(runs, tmp_path):
    assert launch(runs, tmp_path, kills=1)["outcome"] in ("started", "died")
    answer = ended(runs)
    rows = [(s["n"], s["kind"], s["exit"], s["restart"], s["from_step"], s["last_step"])
            for s in answer["segments"]]
    assert rows == [(1, "launch", "signal 9", None, 0, 10), (2, "restart", "0", 1, 0, 20)], rows
    assert answer["state"] == "finished"
    log = (runs / "r1" / "train.log").read_text()
    assert "dflash-ops: the training process was killed by signal 9 (SIGKILL): restart 1 of 2 in 0.05 s" \
        in log
    restart_at = answer["segments"][1]["log_offset"]
    assert log.encode()[restart_at:].startswith(b"dflash-ops: restart ")
    shown = history.describe_segments(answer, "pve1/200")
    assert "signal KILL" in shown and "restart 1" in shown and shown.splitlines()[-1].startswith(
        "total elapsed: ") and "in 2 segment(s)" in shown


def test_the_launchs_wait_goes_on_through_a_restart_to_the_first_step(runs, tmp_path, capsys):
    # killed before its first step: `train` waits for the restarted process's step, not `crashed`
    child = ("import os, signal, sys\nif not os.path.exists('again'):\n    open('again', 'w').close()\n"
             "    os.kill(os.getpid(), signal.SIGKILL)\n"
             "open(sys.argv[1], 'a').write('12:00:00 INFO step 1/5 | loss 3.0\\n')\n")
    argv = [sys.executable, "-c", child, str(runs / "w" / "train.log")]
    started = launch_code(runs, tmp_path, "w", argv, 1, settle=0)
    verdict = container_runs.wait({"runs": str(runs), "name": "w", "offset": started["log_offset"],
                                   "timeout": 60})
    assert (verdict["outcome"], verdict.get("line")) == ("step", "12:00:00 INFO step 1/5 | loss 3.0"), verdict
    lines = [json.loads(x)["line"] for x in capsys.readouterr().out.splitlines()]
    assert any(line.startswith("dflash-ops: restart ") for line in lines), lines
    ended(runs, "w")


def test_restarts_stop_at_max_restarts_in_a_row(runs, tmp_path):
    launch(runs, tmp_path, kills=5, max_restarts=2)
    answer = ended(runs)
    assert [(s["kind"], s["exit"]) for s in answer["segments"]] == [
        ("launch", "signal 9"), ("restart", "signal 9"), ("restart", "signal 9")]
    log = (runs / "r1" / "train.log").read_text()
    assert "its 2 automatic restart(s) of --max-restarts 2 are used" in log
    assert answer["state"] == "crashed"


@pytest.mark.parametrize("code", [2, 1])
def test_an_error_exit_is_never_restarted(runs, tmp_path, code):
    launch(runs, tmp_path, kills=0, code=code)
    answer = ended(runs)
    assert [(s["kind"], s["exit"]) for s in answer["segments"]] == [("launch", str(code))]


def test_a_transient_error_in_the_segments_log_is_restarted(runs, tmp_path):
    # exit 1 with an NCCL error in this segment's log: transient; the same line before it is not read
    (runs / "r1").mkdir()
    (runs / "r1" / "train.log").write_text("12:00:00 ERROR NCCL error: unhandled system error\n")
    child = ("import os, sys\nfirst = not os.path.exists('again')\nopen('again', 'w').close()\n"
             "print('12:00:01 ERROR NCCL error: remote process exited', file=sys.stderr) if first else None\n"
             "sys.exit(1 if first else 0)\n")
    launch_code(runs, tmp_path, "r1", [sys.executable, "-c", child], 1)
    answer = ended(runs)
    assert [(s["kind"], s["exit"]) for s in answer["segments"]] == [("launch", "1"), ("restart", "0")]
    # status judges the restart's segment: the NCCL error that caused it is not among its lines
    facts = call("status", runs=str(runs), name="r1")
    assert facts["segment"]["kind"] == "restart"
    assert facts["segment_offset"] == facts["segment"]["log_offset"]
    assert facts["log"][0].startswith("dflash-ops: restart ") and not [x for x in facts["log"] if "NCCL" in x]
    st = status.parse_status(json.dumps({"ok": facts}) + "\n")
    assert (st.state, st.findings, st.segment["n"], st.segment_started) == (
        "finished", [], 2, facts["segment"]["start"])
    # the next launch of that run is a resume; with no NCCL line of its own, exit 1 ends it
    launch_code(runs, tmp_path, "r1", [sys.executable, "-c", "import sys; sys.exit(1)"], 1)
    answer = ended(runs)
    assert [(s["kind"], s["exit"]) for s in answer["segments"]][2:] == [("resume", "1")]


def test_a_stopped_run_is_never_restarted(runs, tmp_path):
    assert launch(runs, tmp_path, kills=0, then="sleep")["outcome"] == "started"
    stopped = call("stop", runs=str(runs), name="r1", grace=5)
    assert stopped["outcome"] == "term", stopped
    answer = ended(runs)
    # killed by SIGKILL, a transient signal, but a stop was requested: never restarted
    segments = [(s["kind"], s["exit"], s["stopped"]) for s in answer["segments"]]
    assert segments == [("launch", "signal 9", True)]
    assert history._exit(answer["segments"][0]) == "signal KILL (stopped)"


def test_the_current_segment_and_a_segment_its_wrapper_could_not_close(runs, tmp_path):
    run = runs / "r1"
    run.mkdir()
    assert prelude.current_segment(str(run)) is None  # a run from before segments.jsonl
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 3}) + "\n")
    container_runs.open_segment(str(run), "launch", "r1")
    (run / "metrics.jsonl").open("a").write(json.dumps({"kind": "train", "step": 7}) + "\n")
    current = prelude.current_segment(str(run))
    assert (current["n"], current["kind"], current["log_offset"], current["end"]) == (1, "launch", 0, None)
    # its wrapper was SIGKILLed with it by a stop: the stop's record closes it
    (run / "stopped").write_text("kill 1700000000\n")
    closed = container_runs.close_segment(str(run), prelude.run_files(str(run)))
    assert (closed["exit"], closed["stopped"], closed["last_step"]) == ("signal 9", True, 7)
    assert prelude.read_segments(str(run))[0]["end"] == closed["end"]
    assert container_runs.close_segment(str(run), {})["exit"] == "signal 9"  # written once
    assert len((run / "segments.jsonl").read_text().splitlines()) == 2


def test_segments_read_from_the_container_are_data(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    lines = ['{"n": 1, "kind": "launch", "start": 5, "log_offset": 0}', "{cut", "[]", '"x"',
             '{"n": true, "kind": "launch"}', '{"n": 2, "kind": "evil", "start": 6}',
             '{"n": 1, "end": 9, "exit": "' + "9" * 100 + '", "last_step": -4}',
             '{"n": 3, "kind": "resume", "start": "7", "from_step": 1e999}']
    (run / "segments.jsonl").write_text("\n".join(lines) + "\n")
    found = prelude.read_segments(str(run))
    assert [(s["n"], s["kind"], s["start"], s["end"], len(s["exit"] or ""), s["last_step"], s["from_step"])
            for s in found] == [(1, "launch", 5, 9, 40, None, 0), (3, "resume", None, None, 0, None, 0)]
    answer = history.checked_segments({"segments": found + ["junk", {"n": 4, "kind": "restart",
                                                                     "start": 2**70}],
                                       "now": 10, "alive": True, "run": "r", "state": "bogus"}, "t")
    assert [s["n"] for s in answer["segments"]] == [1, 3, 4] and answer["state"] == "?"
    assert answer["segments"][-1]["start"] is None and answer["total_elapsed_s"] == 4
    with pytest.raises(ship.BadAnswer, match="'segments' is not a list"):
        history.checked_segments({"segments": "x"}, "t")


def test_history_rows_say_what_each_segment_was():
    answer = history.checked_segments({"run": "r1", "now": 1000, "alive": True, "state": "running",
                                       "segments": [
        {"n": 1, "kind": "launch", "start": 100, "end": 400, "exit": "signal 9", "from_step": 0,
         "last_step": 30},
        {"n": 2, "kind": "restart", "restart": 1, "start": 410, "end": 500, "exit": "0", "stopped": True,
         "from_step": 30, "last_step": 40},
        {"n": 3, "kind": "resume", "start": 600, "from_step": 40, "last_step": None}]}, "t")
    rows = history.segment_rows(answer)
    assert [r[1] for r in rows] == ["launch", "restart 1", "resume"]
    assert [r[5] for r in rows] == ["signal KILL", "0 (stopped)", "running"]
    assert [r[6] for r in rows] == ["1-30", "31-40", "from 40 (none logged)"]
    assert [r[4] for r in rows] == ["5m00s", "1m30s", "6m40s"]
    assert answer["total_elapsed_s"] == 300 + 90 + 400
    assert history.describe_segments(answer, "pve1/200").splitlines()[-1] == (
        "total elapsed: 13m10s in 3 segment(s)")


def test_the_wrappers_restart_notes_are_never_a_runs_last_error():
    lines = ["12:00:00 ERROR NCCL error: unhandled system error",
             "dflash-ops: training process 12 ended: exit 1",
             "dflash-ops: a transient error in its log (12:00:00 ERROR NCCL error): restart 1 of 1 in 5 s, "
             "from the latest checkpoint",
             "dflash-ops: restart 2026-12-03T20:07:15Z of run r1",
             "dflash-ops: not restarting run r1: the training process was killed by signal 9 (SIGKILL); "
             "its 1 automatic restart(s) of --max-restarts 1 are used"]
    assert runs_mod.last_error_line(lines) == lines[0]
