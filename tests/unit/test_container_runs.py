"""remote/runs.py's verbs on temporary run directories, in this process (no SSH, no container):
the answers the local parsers read, forged facts that stay data, and `stop`'s proof of a process group."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from waiting import wait_for

from dflash_ops import status
from dflash_ops.remote import prelude, ship
from dflash_ops.remote import runs as container_runs
from dflash_ops.remote.prelude import Refused


def call(verb, **payload):
    """One verb as the container runs it: its answer, or its refusal's answer."""
    try:
        return container_runs.VERBS[verb](payload)
    except Refused as refused:
        return refused.answer


def answer_text(verb, **payload):
    """The verb's reply as the container prints it (prelude.serve): {"ok": ...} or the refusal."""
    try:
        return json.dumps({"ok": container_runs.VERBS[verb](payload)}) + "\n"
    except Refused as refused:
        return json.dumps(refused.answer) + "\n"


@pytest.fixture
def runs(tmp_path):
    (tmp_path / "runs").mkdir()
    return tmp_path / "runs"


def make_run(runs, name, files=None, log="", metrics="", current=True):
    run = runs / name
    run.mkdir()
    for key, value in (files or {}).items():
        (run / key).write_text(value)
    if log:
        (run / "train.log").write_bytes(log.encode() if isinstance(log, str) else log)
    if metrics:
        (run / "metrics.jsonl").write_text(metrics)
    if current:
        (runs / ".current").write_text(name + "\n")
    return run


class HeldLock:
    """What a live run's processes hold: the runs lock, exclusively, on their own open file."""

    def __init__(self, runs):
        self.f = open(runs / ".lock", "w")
        fcntl.flock(self.f, fcntl.LOCK_EX)

    def release(self):
        self.f.close()


class Wrapper:
    """A live run as its processes are: its wrapper (`sh <run>/run.sh`, flock's child: it inherits the
    lock's fd) holds the runs lock, which makes the run alive (prelude.lock_holder_run)."""

    def __init__(self, runs, name):
        (runs / name / "run.sh").write_text("sleep 60\n")
        self.p = subprocess.Popen(["flock", str(runs / ".lock"), "sh", str(runs / name / "run.sh")],
                                  start_new_session=True)
        wait_for("the wrapper to hold the lock", lambda: prelude.alive_run(str(runs)) == name, timeout=30,
                 every=0.05)

    def release(self):
        os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait()


KILLED = {"pid": "487\n", "pgid": "484\n", "started": "1795954052\n", "ended": "1795954068\n",
          "exit_code": "signal 9\n", "code_version": "tree c3f5d18a\n"}


# --- status: facts are data ---------------------------------------------------------------------------

def test_a_log_line_with_carriage_returns_cannot_forge_facts(runs):
    """A progress bar's `\\r` used to split a log line into fact lines: a SIGKILLed run showed `running`."""
    forged = "Killed\ralive 1\rexit_code 0\rcode_version tree f0f0\rstopped term 1\r\n"
    make_run(runs, "t3", KILLED, log="12:00:00 INFO step 1/9 | loss 2.0\n" + forged)
    st = status.parse_status(answer_text("status", runs=str(runs), name=None))
    assert (st.state, st.exit_code, st.detail) == ("crashed", "signal 9", "killed by signal 9 (SIGKILL)")
    assert st.code_version == "tree c3f5d18a"
    assert st.last_error.startswith("Killed\r")  # the line itself, shown through terminal.markup


def test_eval_json_with_backslashes_and_newlines_is_read_whole(runs):
    """`echo` used to turn `\\n` inside eval.json into new fact lines: a finished run showed `running`."""
    record = {"step": 3, "acceptance_length": 2.5, "lossless": True, "prompts": 4,
              "note": "a\nalive 1\nexit_code 1\nend\n", "path": "C:\\x\\n"}
    make_run(runs, "t1", {**KILLED, "exit_code": "0\n"})
    (runs / "t1" / "eval.json").write_text(json.dumps(record, indent=1))
    st = status.parse_status(answer_text("status", runs=str(runs), name="t1"))
    assert (st.state, st.detail) == ("finished", "exit 0")
    assert st.last_eval["acceptance_length"] == 2.5 and st.last_eval["prompts"] == 4


def test_status_of_a_live_run_and_of_none(runs, tmp_path):
    assert status.parse_status(answer_text("status", runs=str(runs), name=None)).state == "none"
    assert status.parse_status(answer_text("status", runs=str(runs), name="nope")).state == "missing"
    assert launch(runs, tmp_path, name="live")["outcome"] == "started"
    (runs / "live" / "metrics.jsonl").write_text('{"kind": "train", "step": 7, "loss": 1.5}\n'
                                                 '{"kind": "train", "ste')
    make_run(runs, "other", {"pid": "5", "exit_code": "1\n"})  # .current names it: still not the alive run
    try:
        st = status.parse_status(answer_text("status", runs=str(runs), name=None))
        assert status.parse_status(answer_text("status", runs=str(runs), name="other")).state == "crashed"
    finally:
        assert call("stop", runs=str(runs), name="live", grace=5)["outcome"] == "term"
    assert (st.run, st.state, st.step, st.loss) == ("live", "running", 7, 1.5)
    assert status.parse_status(answer_text("status", runs=str(runs), name="live")).state == "stopped"
    # A process holding the lock that is no run's wrapper makes no run alive, whatever .current says.
    lock = HeldLock(runs)
    try:
        assert status.parse_status(answer_text("status", runs=str(runs), name="other")).state == "crashed"
        assert prelude.alive_run(str(runs)) == "?"
    finally:
        lock.release()


def test_huge_files_are_read_from_their_end_within_the_caps(runs):
    line = b"x" * 5000
    log = b"\n".join([line] * 2000) + b"\n12:00:00 INFO last line\n"  # 10 MB
    make_run(runs, "big", {"exit_code": "1\n", "pid": "3"}, log=log,
             metrics='{"kind": "train", "step": 1, "loss": ' + "9" * 100_000 + "}\n"
                     '{"kind": "train", "step": 2, "loss": 0.5}\n')
    answer = call("status", runs=str(runs), name="big")
    assert len(json.dumps(answer)) < 200_000
    assert answer["log"][-1] == "12:00:00 INFO last line"
    assert all(len(x) <= prelude.LINE_CAP for x in answer["log"])
    st = status.parse_status(json.dumps({'ok': answer}))
    assert (st.step, st.loss, st.last_error) == (2, 0.5, None)  # an INFO line is no error
    tail = call("logs-tail", runs=str(runs), name="big", lines=2)
    assert tail["lines"] == [line.decode()[:prelude.LINE_CAP], "12:00:00 INFO last line"]


# A run stopped at step 700 after a full disk, resumed from its step-500 checkpoint: the first
# segment's lines and metrics are still in its files, before the second launch line.
T1, T2 = 1795950000, 1795960000  # the two launches (container clock)
FIRST = ("dflash-ops: launch 2026-11-29T10:00:00Z of run r1\n12:00:00 INFO step 700/3000 | loss 0.2100\n"
         "Traceback (most recent call last):\nOSError: [Errno 28] No space left on device\n"
         "dflash-ops: training process 5 ended: exit 1\n")
SECOND = ("dflash-ops: launch 2026-11-29T12:46:40Z of run r1\n"
          "12:47:00 INFO resumed from /root/runs/r1/checkpoints/step-500 at step 500\n"
          "12:47:10 INFO step 510/3000 | loss 0.3000\n12:47:20 INFO step 525/3000 | loss 0.2900\n")


def _train(step, loss, time, **extra):
    return json.dumps({"kind": "train", "step": step, "loss": loss, "tokens_per_s": 100.0, "lr": 1e-3,
                       "time": time, **extra}) + "\n"


RESUMED_METRICS = "".join([
    json.dumps({"kind": "eval", "step": 0, "loss": 9.0, "time": T1 + 1}) + "\n",
    _train(500, 0.35, T1 + 500),
    json.dumps({"kind": "checkpoint", "step": 500, "replica_max_abs_diff": 0.0}) + "\n",
    json.dumps({"kind": "eval", "step": 500, "loss": 0.4, "time": T1 + 501}) + "\n",
    json.dumps({"kind": "eval", "step": 600, "loss": 0.3, "time": T1 + 601}) + "\n",
    _train(700, 0.21, T1 + 700),
    _train(510, 0.30, T2 + 10, stop_step=3000),
    _train(525, 0.29, T2 + 40, stop_step=3000),  # 15 steps in 30 s
])


def resumed_run(runs, stopped=True):
    files = {"pid": "9\n", "pgid": "8\n", "started": f"{T2}\n", "code_version": "tree c3\n"}
    if stopped:
        files.update(ended=f"{T2 + 50}\n", exit_code="0\n", stopped=f"term {T2 + 50}\n")
    run = make_run(runs, "r1", files, log=FIRST + SECOND, metrics=RESUMED_METRICS)
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest").write_text("step-500\n")
    return run


def test_status_of_a_resumed_run_is_of_its_current_segment_only(runs):
    """Issue 32: step 700 with the loss of step 525, an old held-out loss, an old disk-full line paging."""
    from dflash_ops.oncall import monitoring

    resumed_run(runs)
    answer = call("status", runs=str(runs), name="r1")
    assert answer["log"] == SECOND.splitlines()  # the log's lines since the last launch line
    assert answer["segment_offset"] == len(FIRST)
    st = status.parse_status(json.dumps({"ok": answer}))
    assert (st.state, st.step, st.total_steps, st.percent, st.loss) == ("stopped", 525, 3000, 17.5, 0.29)
    assert (st.eval_step, st.eval_loss) == (500, 0.4)  # not step 600 of the redone steps, nor step 0
    assert (st.checkpoint_step, st.duration_s, st.uptime_s, st.eta_s) == (500, 50, None, None)
    assert st.findings == [] and st.last_error is None
    verdict = monitoring.verdict(st, "pve1/200", monitoring.Thresholds(min_free_runs=0, min_free_shm=0))
    assert verdict.code == monitoring.OK, verdict.line()
    assert "step 525" in verdict.line() and "loss 0.29" in verdict.line()


def test_a_resumed_run_alive_has_an_eta_from_this_segments_rate(runs):
    resumed_run(runs, stopped=False)
    lock = Wrapper(runs, "r1")
    try:
        answer = call("status", runs=str(runs), name="r1")
    finally:
        lock.release()
    st = status.parse_status(json.dumps({"ok": answer}))
    assert (st.state, st.step, st.steps_per_s) == (answer["state"], 525, 0.5)
    assert st.state in ("running", "stalled") and st.eta_s == (3000 - 525) * 2
    from rich.console import Console

    console = Console(record=True, width=200)
    status.render(st, "pve1/200", console)
    text = console.export_text()
    for row in ("525 of 3000 (17.5%)", "0.29 (step 525)", "0.4 (step 500)", "step-500, written",
                "1h22m30s (0.5 steps/s", "uptime"):
        assert row in text, text


def test_a_crashed_segment_names_only_its_own_error_lines(runs):
    resumed_run(runs)
    (runs / "r1" / "stopped").unlink()
    (runs / "r1" / "exit_code").write_text("1\n")
    with open(runs / "r1" / "train.log", "a") as f:
        f.write("12:47:30 INFO data: 0 rows not found in the cache\n12:47:31 ERROR loader failed\n"
                "dflash-ops: training process 9 ended: exit 1\n")
    st = status.parse_status(json.dumps({"ok": call("status", runs=str(runs), name="r1")}))
    assert (st.state, st.last_error, st.findings) == ("crashed", "12:47:31 ERROR loader failed", [])


@pytest.mark.parametrize("window", [7, 16, 19, 20, 64, 1 << 20])
def test_segment_start_is_the_last_launch_line_wherever_the_read_windows_fall(tmp_path, monkeypatch, window):
    monkeypatch.setattr(prelude, "TAIL_WINDOW", window)
    log = tmp_path / "train.log"
    assert prelude.segment_start(str(log)) == 0  # no log
    log.write_text("dflash-ops: launch a of run x\nline\n")
    assert prelude.segment_start(str(log)) == 0
    body = ("dflash-ops: launch a of run x\n" + "y" * 50 + "\ndflash-ops: launch b of run x\nz\n"
            + "w" * 40 + "\n")
    log.write_text(body)
    assert prelude.segment_start(str(log)) == body.index("dflash-ops: launch b")
    log.write_text("no launch line here\n" * 5)
    assert prelude.segment_start(str(log)) == 0


def test_metrics_sends_the_newest_lines_within_its_cap(runs):
    def rows(steps):
        return "".join(json.dumps({"kind": "train", "step": i, "loss": 1.0}) + "\n" for i in steps)

    make_run(runs, "m", metrics=rows(range(1000)) + "{" + "x" * 70000 + "}\n" + rows(range(1000, 1100)))
    answer = call("metrics", runs=str(runs), name="m", cap=100_000)
    assert answer["metrics_left_out"] > 0 and answer["metrics_dropped"] == 1  # the 70 kB line is not sent
    assert len(json.dumps(answer)) < 100_000
    steps = [json.loads(x)["step"] for x in answer["metrics"]]
    assert steps[-1] == 1099 and steps == list(range(steps[0], 1000)) + list(range(1000, 1100))
    assert call("metrics", runs=str(runs), name="zz")["error"] == "no-run"


def test_warm_up_holds_the_lock_shared_and_clean_caches_waits_for_nobody(runs, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "f").write_bytes(b"12")
    assert prelude.alive_run(str(runs)) is None
    answer = call("clean-caches", runs=str(runs), caches={"inductor": str(cache)})
    assert answer["freed"]["inductor"]["bytes"] == 2 and not cache.exists()


# --- launch, wait, stop on a real wrapper ---------------------------------------------------------------

def launch_payload(runs, tmp_path, name="r1", code="import time; time.sleep(60)", **extra):
    config = tmp_path / "config.yaml"
    config.write_text("train: {}\n")
    payload = dict(runs=str(runs), name=name, config=str(config), argv=[sys.executable, "-c", code],
                   required=[sys.executable], preflight=None, manifest=str(tmp_path / "none.json"),
                   settle=0.3, launch="{}", env="A=1", cwd=str(tmp_path))
    payload.update(extra)
    return payload


def launch(runs, tmp_path, name="r1", code="import time; time.sleep(60)", **extra):
    return call("launch", **launch_payload(runs, tmp_path, name, code, **extra))


def test_launch_records_the_run_and_stop_ends_its_group(runs, tmp_path):
    started = launch(runs, tmp_path)
    assert started["outcome"] == "started", started
    run = runs / "r1"
    assert {"run.sh", "pgid", "pid", "launch.json", "env", "config.given.yaml",
            "code_version"} <= set(os.listdir(run))
    assert prelude.alive_run(str(runs)) == "r1"
    again = launch(runs, tmp_path, name="r2", lock_wait=0)
    assert (again["error"], again["run"]) == ("busy", "r1") and not (runs / "r2").exists()
    stopped = call("stop", runs=str(runs), name=None, grace=5)
    assert (stopped["outcome"], stopped["run"]) == ("term", "r1")
    assert prelude.alive_run(str(runs)) is None
    assert (run / "stopped").read_text().startswith("term ")
    assert call("stop", runs=str(runs), name="r1")["outcome"] == "notalive"


def test_a_launch_waits_out_another_under_way_and_names_the_run_it_started(runs, tmp_path, monkeypatch):
    """Two launches at once: the first holds the lock through its preflight, before any wrapper can
    be named; the second waits that out and names the run the first started, never `?`."""
    assert ship.LOADER.encode().startswith(prelude.LOADER_START)  # how the first is told a launch
    go = tmp_path / "go"
    check = tmp_path / "preflight.py"  # the first launch's preflight: done once `go` exists (60 s at most)
    check.write_text(f"import json, os, time\ndeadline = time.time() + 60\n"
                     f"while not os.path.exists({str(go)!r}) and time.time() < deadline:\n"
                     f"    time.sleep(0.05)\nprint(json.dumps({{'ok': True}}))\n")
    payload = launch_payload(runs, tmp_path, "first", preflight=[sys.executable, str(check)], settle=15)
    first = subprocess.Popen([sys.executable, "-S", "-c", ship.LOADER, ship.packed("runs"), "launch",
                              json.dumps(payload)], stdout=subprocess.PIPE, text=True)
    try:
        wait_for("the first launch to take the lock", lambda: prelude.lock_held(str(runs)) == "exclusive",
                 timeout=30, every=0.05)
        assert prelude.alive_run(str(runs)) == "?"  # its preflight: no run to name yet
        assert prelude.launch_under_way(str(runs))
        real = prelude.launch_under_way

        def under_way(path):  # the first preflight ends once the second launch is waiting on it
            seen = real(path)
            go.touch()
            return seen

        monkeypatch.setattr(container_runs, "launch_under_way", under_way, raising=False)
        second = launch(runs, tmp_path, name="second", lock_wait=0)
        assert (second["error"], second["run"]) == ("busy", "first"), second
        assert not (runs / "second").exists()
        # the first launch keeps its copy of the lock until its answer (its settle, 15 s): from the
        # lock's first taking until the wrapper can be named, a launch under way always has it
        under_way, answered = real(str(runs)), first.poll() is not None
        assert not answered and under_way
    finally:
        go.touch()
        out = first.communicate(timeout=60)[0]
    assert json.loads(out.splitlines()[-1])["ok"]["outcome"] == "started", out
    assert call("stop", runs=str(runs), name="first", grace=5)["outcome"] == "term"
    assert not prelude.launch_under_way(str(runs))


def test_launch_that_dies_at_once_says_so_with_its_log(runs, tmp_path):
    died = launch(runs, tmp_path,
                  code="import sys; print('train_dflash: error: boom', file=sys.stderr); sys.exit(2)",
                  settle=1)
    assert (died["outcome"], died["exit_code"]) == ("died", "2")
    assert "train_dflash: error: boom" in died["log"]


def test_a_failed_preflight_creates_nothing(runs, tmp_path):
    check = tmp_path / "preflight.py"
    check.write_text('import json, sys\nprint(json.dumps({"ok": False, "check": "target", '
                     '"error": "target checkpoint directory not found: /dev/shm/m", "fix": "run `invoke '
                     'deploy`"}))\nsys.exit(2)\n')
    refused = launch(runs, tmp_path, preflight=[sys.executable, str(check), "--run-dir=x"])
    assert (refused["error"], refused["check"]) == ("preflight", "target")
    assert "not found: /dev/shm/m" in refused["message"] and refused["fix"] == "run `invoke deploy`"
    assert os.listdir(runs) == [".lock"]
    assert prelude.alive_run(str(runs)) is None


def test_wait_streams_new_lines_until_the_first_step(runs, tmp_path, capsys):
    run = make_run(runs, "w", log="old 12:00:00 INFO step 9/9 | from the last launch\n")
    offset = (run / "train.log").stat().st_size
    with open(run / "train.log", "a") as f:
        f.write("dflash-ops: launch now\n12:00:01 INFO data: 3 rows\n12:00:02 INFO step 1/5 | loss "
                "3.0\nmore\n")
    verdict = container_runs.wait({"runs": str(runs), "name": "w", "offset": offset, "timeout": 5})
    lines = [json.loads(x)["line"] for x in capsys.readouterr().out.splitlines()]
    assert verdict == {"outcome": "step", "line": "12:00:02 INFO step 1/5 | loss 3.0"}
    assert lines == ["dflash-ops: launch now", "12:00:01 INFO data: 3 rows",
                     "12:00:02 INFO step 1/5 | loss 3.0"]
    offset = (run / "train.log").stat().st_size
    (run / "exit_code").write_text("2\n")
    with open(run / "train.log", "a") as f:
        f.write("train_dflash: error: target checkpoint directory not found\n")
    crashed = container_runs.wait({"runs": str(runs), "name": "w", "offset": offset, "timeout": 5})
    assert crashed == {"outcome": "crashed", "exit_code": "2"}
    assert json.loads(capsys.readouterr().out)["line"].startswith("train_dflash: error: ")


# --- stop signals only a group it has proven to be this run's ---------------------------------------------

@pytest.mark.parametrize("pgid", ["0", "1", "own", "other", "-5", "", "12 34"])
def test_stop_refuses_a_group_it_cannot_prove(runs, tmp_path, pgid):
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a live group that is not the run's
    launch(runs, tmp_path, name="victim")  # alive: its wrapper holds the lock; its pgid file then lies
    real = (runs / "victim" / "pgid").read_text()
    try:
        value = {"own": str(os.getpgrp()), "other": str(other.pid)}.get(pgid, pgid)
        (runs / "victim" / "pgid").write_text(value + "\n")
        answer = call("stop", runs=str(runs), name="victim", grace=0)
        assert (answer["error"], answer["run"]) == ("unproven", "victim"), answer
        assert "\n" not in answer["message"]
        assert other.poll() is None  # the other group survived
        assert not (runs / "victim" / "stopped").exists()
    finally:
        other.kill()
        other.wait()
        (runs / "victim" / "pgid").write_text(real)
        assert call("stop", runs=str(runs), name="victim", grace=5)["outcome"] == "term"


def test_stop_signals_no_wrapper_of_another_run(runs, tmp_path):
    launch(runs, tmp_path, name="real")
    try:
        pgid = (runs / "real" / "pgid").read_text()
        make_run(runs, "impostor", {"pgid": pgid})  # .current now names it; the lock is real's
        answer = call("stop", runs=str(runs), name="impostor", grace=0)
        assert (answer["outcome"], answer["run"]) == ("notalive", "impostor"), answer
        assert container_runs.group_alive(int(pgid))
        assert call("stop", runs=str(runs), name=None, grace=5)["outcome"] == "term"  # the alive one: real
    finally:
        call("stop", runs=str(runs), name="real", grace=5)


def test_serve_answers_one_json_line_even_for_bad_input(capsys):
    container_runs.serve(container_runs.VERBS, ["x", "status", "{}"])  # no "runs": a KeyError in the verb
    answer = json.loads(capsys.readouterr().out)
    assert answer["error"] == "bad-input" and "KeyError" in answer["message"]


def log_at(clock: list[tuple[str, str]]) -> str:
    return "".join(f"{hms} INFO {text}\n" if hms else f"{text}\n" for hms, text in clock)


def test_logs_grep_keeps_the_last_n_matching_lines(runs):
    make_run(runs, "g", log=log_at([("12:00:00", f"step {i}/100 | loss {i}") for i in range(100)]
                                  + [("12:00:01", "ERROR disk full"), ("12:00:02", "step 100/100 | loss 0")]))
    got = call("logs-tail", runs=str(runs), name="g", lines=3, grep=r"ERROR|step 9\d/")
    assert got["lines"] == ["12:00:00 INFO step 98/100 | loss 98", "12:00:00 INFO step 99/100 | loss 99",
                            "12:00:01 INFO ERROR disk full"]
    assert got["matched"] == 11 and got["searched"] == got["size"]
    assert call("logs-tail", runs=str(runs), name="g", lines=3, grep="(")["error"] == "bad-input"


def test_logs_since_counts_back_from_the_logs_time_across_midnight(runs):
    run = make_run(runs, "s", log=log_at([("23:50:00", "old"), ("23:58:00", "before midnight"),
                                          ("", "Traceback: a line without a time"), ("00:05:00", "after")]))
    end = time.mktime((2026, 3, 2, 0, 6, 0, 0, 0, -1))  # the log was last written at 00:06 on March 2
    os.utime(run / "train.log", (end, end))
    got = call("logs-tail", runs=str(runs), name="s", lines=50, since={"at": end - 10 * 60})
    assert got["lines"] == ["23:58:00 INFO before midnight", "Traceback: a line without a time",
                            "00:05:00 INFO after"]
    got = call("logs-tail", runs=str(runs), name="s", lines=50, since={"at": end - 60}, grep="a")
    assert got["lines"] == ["00:05:00 INFO after"]
    assert call("logs-tail", runs=str(runs), name="s", lines=50, since={"at": end})["lines"] == []


def test_a_pattern_that_backtracks_for_ever_is_stopped_by_the_deadline():
    try:
        pattern = container_runs.Pattern(r"(a+)+$")
        answer = container_runs.within(0.3, "searching the log", pattern.regex.search, "a" * 40 + "b")
    except Refused as refused:
        answer = refused.answer
    assert answer["error"] == "timeout" and "simpler --grep" in answer["message"]  # the match: days
