"""One CLI: the same flag means the same thing in every task, usage errors exit 2, and the help shows
no broken option."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from signals import sigint_default

import tasks
from dflash_ops import cli, doctor, fanout, launch
from dflash_ops.errors import ExitStatus
from dflash_ops.inventory import parse_inventory
from dflash_ops.target import Target

REPO = Path(__file__).resolve().parents[2]


def every_task():
    for name in tasks.ns.task_names:
        yield name, tasks.ns[name]


def flags(task):
    return {arg.attr_name or arg.name: [n for n in arg.names] for arg in task.get_arguments()}


@pytest.mark.parametrize("name, task", list(every_task()), ids=[n for n, _ in every_task()])
def test_no_task_has_a_dash_for_a_short_flag_and_n_is_always_a_count(name, task):
    for param, names in flags(task).items():
        assert "-" not in names and "" not in names, (name, param, names)  # `--=STRING` in the help
        if "n" in names:
            assert param == "n", f"{name}: -n is {param}, elsewhere a count"


def test_a_shared_option_has_one_letter_everywhere():
    for option, letter in cli.SHORT_FLAGS.items():
        for name, task in every_task():
            names = flags(task).get(option)
            if names is not None:
                assert letter in names, (name, option, names)


def test_a_shared_options_letter_means_only_that_option():
    """`-t` is --target wherever it exists, never --to (fetch), --interval (status) or --tensorboard."""
    meaning = {letter: option for option, letter in cli.SHORT_FLAGS.items()}
    for name, task in every_task():
        for param, names in flags(task).items():
            for letter in set(names) & set(meaning):
                assert meaning[letter] == param, (name, param, letter)


def invoke(*args):
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def test_the_status_help_shows_no_broken_option():
    r = invoke("--help", "status")
    assert r.returncode == ExitStatus.OK
    assert "--=STRING" not in r.stdout and "--min-free-shm=STRING" in r.stdout


@pytest.mark.parametrize("args, said", [
    (["logs", "--bogus"], "error: No idea what '--bogus' is!"),
    (["no-such-task"], "error: No idea what 'no-such-task' is!"),
    (["logs", "-n"], "needed value and was not given"),
])
def test_invokes_usage_errors_exit_2_like_every_other_usage_error(args, said):
    r = invoke(*args)
    assert r.returncode == ExitStatus.USAGE and said in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_a_forgotten_inventory_says_the_example_was_used():
    env = {k: v for k, v in os.environ.items() if k != "INVOKE_DFLASH_INVENTORY"}
    argv = [sys.executable, "-m", "invoke", "logs", "--ct", "999"]
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == ExitStatus.USAGE and r.stderr.count("\n") == 1, r.stderr
    assert "container 999 is not in the inventory" in r.stderr
    assert ("the inventory was the example inventory/production.yaml (no --inventory given and "
            "INVOKE_DFLASH_INVENTORY not set)") in r.stderr
    given = subprocess.run([*argv, "--inventory", "inventory/production.yaml"], cwd=REPO, capture_output=True,
                           text=True, timeout=60, env=env)
    assert given.returncode == ExitStatus.USAGE and "the inventory was the example" not in given.stderr


@pytest.mark.parametrize("path, said", [
    ("/nonexistent/x.png", "the directory /nonexistent does not exist"),
    ("/tmp", "is a directory"),
    ("/tmp/plot.txt", "ending in .png"),
])
def test_a_bad_plot_path_is_one_line_before_any_round_trip(path, said):
    r = invoke("metrics", "--plot", path, "--dry-run", "--inventory", "inventory/production.yaml")
    assert r.returncode == ExitStatus.USAGE, r.stderr
    assert r.stderr.startswith("error: --plot ") and said in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stdout == ""  # nothing sent, not even in the dry run


@pytest.mark.parametrize("to", ["/dev/null/x/drafter", "/etc/hostname/drafter"])
def test_a_fetch_destination_that_cannot_be_made_is_one_line_before_any_round_trip(to):
    r = invoke("fetch", "--run", "r1", "--to", to, "--dry-run", "--inventory", "inventory/production.yaml")
    assert r.returncode == 2 and r.stderr.startswith(f"error: --to {to}: ") and r.stderr.count("\n") == 1, \
        r.stderr
    assert "is not a writable directory" in r.stderr and r.stdout == ""


def test_a_refused_warmup_prints_no_raw_json():
    """The container's refusal is one JSON line before it would become the warm-up: the task turns it
    into its one error line (`run X is alive ...`); it is not shown as it came."""
    out = io.StringIO()
    progress = launch.WarmupProgress(devices=["cpu"], out=out)
    progress.write('{"error": "busy", "run": "r1"}\r\n')
    progress.close()
    assert out.getvalue() == "" and launch.refusal(progress.lines) == {"error": "busy", "run": "r1"}
    progress.write("compile warm-up: starting\r\n")  # what the warm-up itself writes is shown
    assert out.getvalue() == "compile warm-up: starting\n"


def test_a_fan_out_rows_fix_names_its_container():
    inv = parse_inventory({"hosts": {"h": {"address": "h.example"}},
                           "containers": {200: {"host": "h"}, 201: {"host": "h"}}})
    failed = fanout.Outcome(Target(inv, inv.container(201), None, False), error=doctor.DoctorFailed(
        "1 of 11 checks failed: deployed code: 2 file(s) differ -> run `invoke deploy`"))
    assert failed.detail.endswith("-> run `invoke deploy --ct 201`")
    assert fanout.name_container("`invoke logs --run r -n 200`, `invoke stop --ct 200`, `invoke sandbox.up`",
                                 201) == "`invoke logs --run r -n 200 --ct 201`, `invoke stop --ct 200`, " \
                                         "`invoke sandbox.up`"


def invoke_into_a_closed_pipe(*args):
    """`invoke ARGS | head -1` once head has gone: stdout is a pipe whose reader is closed."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args", [["--help", "status"], ["--list"]])
def test_output_into_a_closed_pipe_stops_quietly(args):
    # (a bare `invoke --help` is Invoke's own, printed before it imports tasks.py)
    r = invoke_into_a_closed_pipe(*args)
    assert r.returncode == 141 and r.stderr == "", r.stderr  # no BrokenPipeError traceback


def test_a_task_into_a_closed_pipe_stops_quietly():
    # a task's own output (here a dry run's command lines, printed without a host)
    r = invoke_into_a_closed_pipe("status", "--dry-run", "--inventory", "inventory/production.yaml")
    assert r.returncode == 141 and "Traceback" not in r.stderr, r.stderr
    assert "Exception ignored" not in r.stderr, r.stderr


def test_ctrl_c_while_a_task_waits_for_its_host_is_one_line(tmp_path):
    """SIGINT (what Ctrl-C sends) once the task is connecting to a loopback port that never answers."""
    import signal
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        inventory = tmp_path / "inv.yaml"
        inventory.write_text(f"""default_container: 200
hosts:
  h: {{address: 127.0.0.1, port: {silent.getsockname()[1]}, user: root, key: {tmp_path}/key,
      known_hosts: {tmp_path}/known_hosts}}
containers:
  200: {{host: h}}
""")
        p = subprocess.Popen([sys.executable, "-m", "invoke", "status", "--inventory", str(inventory)],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=sigint_default)
        silent.settimeout(60)
        connection, _ = silent.accept()  # the task is working: it waits for the host's banner
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        connection.close()
    assert p.returncode == 130 and err == "interrupted\n", err


# Tasks that report something a script could want have --json; these do not: they stream (a log, a
# shell, a warm-up's progress, watch's events) or manage the local test host and connections.
NO_JSON = {"shell", "exec", "logs", "warmup", "watch", "disconnect", "sandbox.up", "sandbox.down",
           "sandbox.status"}


@pytest.mark.parametrize("name, task", list(every_task()), ids=[n for n, _ in every_task()])
def test_every_task_that_reports_has_json(name, task):
    assert ("json" in flags(task)) == (name not in NO_JSON), name


class Reported:
    def __init__(self, facts, error=None):
        self._facts, self.error = facts, error

    def describe(self):
        return "for a person"

    def facts(self):
        return self._facts

    def row(self):
        return "a row"


def test_json_is_the_results_facts_on_stdout_and_the_error_still_counts(capsys):
    cli.show(Reported({"run": "r\x1b[2J", "n": 1}), as_json=True)
    out = capsys.readouterr().out
    assert json.loads(out) == {"run": "r\x1b[2J", "n": 1} and "\x1b" not in out  # an escape, not the byte
    with pytest.raises(doctor.DoctorFailed):
        cli.show(Reported({"ok": False}, error=doctor.DoctorFailed("1 check failed")), as_json=True)
    assert json.loads(capsys.readouterr().out) == {"ok": False}  # printed before the error


def test_json_over_several_containers_is_one_object_and_the_rows_go_to_stderr(capsys):
    inv = parse_inventory({"hosts": {"h": {"address": "h.example"}},
                           "containers": {200: {"host": "h"}, 201: {"host": "h"}}})
    targets = [Target(inv, inv.container(n), None, False) for n in (201, 200)]
    rows = fanout.Rows("doctor", [fanout.Outcome(targets[0], error=doctor.DoctorFailed("venv: missing")),
                                  fanout.Outcome(targets[1], Reported({"ok": True}))])
    with pytest.raises(Exception, match="1 of 2 containers failed"):
        cli.show(rows, as_json=True)
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {targets[1].container.label: {"ok": True},
                                        targets[0].container.label: {"error": "venv: missing"}}
    assert "container" in captured.err  # the table, for the person watching


def test_a_tasks_progress_goes_to_stderr_under_json(capsys):
    with cli.working_output(True):
        print("pip: installing ...")
        with cli.working_output(True):  # status: the task's body shows through on_targets
            print("more progress")
            cli.show(Reported({"ok": True}), as_json=True)
    with cli.working_output(False):
        print("shown")
    captured = capsys.readouterr()
    assert captured.err == "pip: installing ...\nmore progress\n"
    assert captured.out == '{\n  "ok": true\n}\nshown\n'


@pytest.mark.parametrize("args, said", [
    (["--grep", "("], "error: --grep '(': not a regular expression: missing ), unterminated subpattern"),
    (["--since", "yesterday"], "error: --since 'yesterday': expected an age such as 10m"),
    (["--grep", "x" * 1001], "error: --grep: 1001 characters; at most 1000"),
])
def test_a_bad_grep_or_since_is_one_line_before_any_round_trip(args, said):
    r = invoke("logs", *args, "--dry-run", "--inventory", "inventory/production.yaml")
    assert r.returncode == 2 and r.stderr.startswith(said) and r.stderr.count("\n") == 1, r.stderr
    assert r.stdout == ""


def test_since_is_an_age_on_the_containers_clock_or_a_time():
    from dflash_ops import logs

    assert logs.parse_since("10m") == {"ago": 600} and logs.parse_since("2h") == {"ago": 7200}
    assert logs.parse_since("2026-01-01T00:00:00Z") == {"at": 1767225600.0}
    assert logs.parse_since("2026-01-01T01:00:00+01:00") == {"at": 1767225600.0}
