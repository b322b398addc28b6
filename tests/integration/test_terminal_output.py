"""Escape sequences and rich markup that a process in the container plants in the files the CLI reads
never reach the operator's terminal raw: driven through the real CLI against the embedded host, the
BYTES written to stdout and stderr hold no ESC (nor BEL), the markup shows literally, and nothing
crashes (a stray `[/]` was a MarkupError traceback).

No deploy: logs, status, doctor, metrics and fetch read these files with the container's system tools.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from training_runs import CT, REPO, Deployed

from dflash_ops.errors import ExitStatus

pytestmark = pytest.mark.integration

RUN = "shown"
ESCAPES = ("\x1b]0;TITLE\x07"                                    # window title
           "\x1b]52;c;cHduZWQ=\x07"                              # OSC 52: write the clipboard
           "\x1b[2J"                                             # clear the screen
           "\x1b]8;;file:///etc/passwd\x1b\\click\x1b]8;;\x1b\\")  # OSC 8 hyperlink
MARKUP = "[link=file:///etc/passwd]x[/link] [/] [bold red]alarm"
HOSTILE = ESCAPES + " " + MARKUP
# What the operator must see instead (terminal.visible's caret notation), and the markup as written.
SHOWN = ["^[]0;TITLE^G", "^[]52;c;cHduZWQ=^G", "^[[2J", "^[]8;;file:///etc/passwd^[\\click"]


@pytest.fixture(scope="module")
def box(sandbox):
    return Deployed(sandbox)


def in_container(box, script: str, *args: str, data: bytes | None = None) -> None:
    r = subprocess.run([str(box.sandbox.pct), "exec", CT, "--", "sh", "-c", script, "sh", *args],
                       input=data, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr


def write(box, path: str, text: str) -> None:
    in_container(box, 'mkdir -p "$(dirname "$1")" && cat > "$1"', path, data=text.encode())


def invoke_bytes(box, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="400")  # rich tables: one line per row, so the literal text stays whole
    return subprocess.run(box.invoke_argv(*args), cwd=REPO, capture_output=True, timeout=180, env=env)


def assert_shown_safely(r: subprocess.CompletedProcess, markup: bool = True) -> str:
    both = r.stdout + r.stderr
    assert b"\x1b" not in both and b"\x07" not in both, both[-2000:]
    text = both.decode()
    assert "Traceback" not in text and "MarkupError" not in text, text[-3000:]
    for part in SHOWN:
        assert part in text, (part, text[-3000:])
    if markup:
        assert MARKUP in text, text[-3000:]
    return text


@pytest.fixture(scope="module")
def planted(box):
    """A run whose files hold the escapes and markup, `.current` naming it."""
    runs = "/root/runs"
    in_container(box, f"rm -rf {runs} && mkdir -p {runs}/{RUN}")
    d = f"{runs}/{RUN}"
    write(box, f"{d}/train.log", "step 1 loss 2.0\n" + HOSTILE + "\n" + f"RuntimeError: {HOSTILE}\n")
    for name in ("code_version", "exit_code", "started", "ended"):
        write(box, f"{d}/{name}", HOSTILE + "\n")
    write(box, f"{d}/metrics.jsonl", '{"step": 1, "loss": 2.0, "lr": 0.001}\n')
    write(box, f"{runs}/.current", RUN + "\n")
    return d


def test_logs(box, planted):
    assert_shown_safely(invoke_bytes(box, "logs", "--run", RUN))
    assert_shown_safely(invoke_bytes(box, "logs"))  # the run named by .current


def test_logs_follow(box, planted):
    # No live run: the follower prints the tail, then says the run is not running (exit_code planted too).
    assert_shown_safely(invoke_bytes(box, "logs", "--follow", "--run", RUN))


def test_logs_raw_keeps_the_bytes(box, planted):
    r = invoke_bytes(box, "logs", "--raw", "--run", RUN)
    assert r.returncode == ExitStatus.OK and HOSTILE.encode() in r.stdout


def test_status(box, planted):
    r = invoke_bytes(box, "status", "--run", RUN)
    assert_shown_safely(r)


def test_current_names_a_hostile_run(box, planted):
    # `.current` is the container's: its text reaches logs/status as the run's name.
    name = "\x1b]0;TITLE\x07\x1b]52;c;cHduZWQ=\x07\x1b[2J[bold red]r"
    in_container(box, 'mkdir -p "/root/runs/$1" && printf "%s\\n" "$1" > /root/runs/.current', name)
    try:
        for args in (("logs",), ("status",), ("logs", "--follow"), ("metrics",)):
            r = invoke_bytes(box, *args)
            both = r.stdout + r.stderr
            assert b"\x1b" not in both and b"\x07" not in both, (args, both[-2000:])
            text = both.decode()
            # shown visibly: caret notation, or Python's repr in a refusal that quotes the value
            assert "Traceback" not in text, (args, text)
            assert "^[]0;TITLE^G" in text or "\\x1b]0;TITLE" in text, (args, text)
    finally:
        write(box, "/root/runs/.current", RUN + "\n")


def test_doctor_shows_the_models_config_values(box, planted):
    model = "/dev/shm/tiny-qwen3"
    in_container(box,
                 f"mkdir -p {model} && cp {model}/config.json {model}/config.json.keep 2>/dev/null; true")
    write(box, f"{model}/config.json", _json({"model_type": HOSTILE, "text_config": {"model_type": HOSTILE}}))
    try:
        r = invoke_bytes(box, "doctor")
        assert r.returncode in (ExitStatus.OK, ExitStatus.CHECK_FAILED), r.stderr[-2000:]
        assert_shown_safely(r)
    finally:
        in_container(box,
                     f"if [ -f {model}/config.json.keep ]; then mv {model}/config.json.keep "
                     f"{model}/config.json; "
                          f"else rm -f {model}/config.json; fi")


def test_fetch_error_quotes_latest_visibly(box, planted, tmp_path):
    write(box, f"{planted}/checkpoints/latest", HOSTILE + "\n")
    r = invoke_bytes(box, "fetch", "--run", RUN, "--to", str(tmp_path / "d"))
    assert r.returncode != ExitStatus.OK
    both = r.stdout + r.stderr
    assert b"\x1b" not in both and b"\x07" not in both and b"Traceback" not in both, both


def test_error_messages_from_remote_stderr(box, planted):
    # A run name that is the container's (via .current) in an error built from the remote's stderr.
    in_container(box, 'printf "%s\\n" "$1" > /root/runs/.current', "gone\x1b]0;TITLE\x07\x1b[2J[/]")
    try:
        r = invoke_bytes(box, "logs")
        assert r.returncode != ExitStatus.OK
        assert b"\x1b" not in r.stderr and b"\x07" not in r.stderr and b"Traceback" not in r.stderr, r.stderr
        # a name holding `/` is refused by the container, shown visibly (^[ for ESC, no raw byte)
        assert ("no run 'gone^[]0;TITLE^G^[[2J[/]' on pve1/200; runs: "
                in r.stderr.decode()), r.stderr
    finally:
        write(box, "/root/runs/.current", RUN + "\n")


def _json(value) -> str:
    import json

    return json.dumps(value)
