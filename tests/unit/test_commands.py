"""Exact host command lines for hostile argv/env/cwd values, and their round trip through a real shell."""

import os
import shlex
import signal
import subprocess
import sys
import time
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_ops import commands
from dflash_ops.errors import UnsafeValue

PCT = "env LC_ALL=C.UTF-8 pct"  # pct under an explicit UTF-8 locale: it decodes its arguments with it
TIED = " -- sh -c " + shlex.quote(commands.SESSION_SCRIPT) + " dflash-session"  # ends with the SSH session

# (argv, env, cwd) -> the exact line the host's shell receives: PCT + " exec 200" + TIED + the rest.
CASES = [
    (["true"], None, None,
     " env -i -- true"),
    (["python3", "-c", "print(1)"], {"A": "x y"}, "/root/my dir",
     " env -i -C '/root/my dir' -- 'A=x y' python3 -c 'print(1)'"),
    (["echo", "it's"], {"Q": 'say "hi"'}, None,
     " env -i -- 'Q=say \"hi\"' echo 'it'\"'\"'s'"),
    (["echo", "$(id)", "`id`"], {"S": "$(reboot)"}, None,
     " env -i -- 'S=$(reboot)' echo '$(id)' '`id`'"),
    (["echo", "a;b", "c&&d", "e|f"], None, "/tmp/x;rm -rf /",
     " env -i -C '/tmp/x;rm -rf /' -- echo 'a;b' 'c&&d' 'e|f'"),
    (["printf", "%s", "line1\nline2"], {"N": "a\nb"}, None,
     " env -i -- 'N=a\nb' printf %s 'line1\nline2'"),
    (["echo", "héllo wörld", "日本"], {"U": "ünï"}, "/root/données",
     " env -i -C '/root/données' -- 'U=ünï' echo 'héllo wörld' '日本'"),
    (["echo", "", "-n", "--"], {"EMPTY": ""}, None,
     " env -i -- EMPTY= echo '' -n --"),
    (["echo", "*", "~", "{a,b}", "!x"], None, None,
     " env -i -- echo '*' '~' '{a,b}' '!x'"),
]


@pytest.mark.parametrize("argv,env,cwd,expected", CASES)
def test_exact_pct_exec_lines(argv, env, cwd, expected):
    assert commands.pct_exec(200, argv, env=env, cwd=cwd) == PCT + " exec 200" + TIED + expected


def test_pct_path_is_quoted_too():
    line = commands.pct_exec(201, ["true"], pct="/opt/my pct/pct")
    assert line == "env LC_ALL=C.UTF-8 '/opt/my pct/pct' exec 201" + TIED + " env -i -- true"


def test_become_sudo_runs_pct_through_sudo_without_a_prompt():
    line = commands.pct_transfer("push", 200, "/tmp/a", "/root/a",
                                 pct=commands.pct_argv("/usr/sbin/pct", "sudo"))
    assert line == "env LC_ALL=C.UTF-8 sudo -n /usr/sbin/pct push 200 /tmp/a /root/a"
    with pytest.raises(UnsafeValue):
        commands.pct_argv("pct", "su")


@pytest.mark.parametrize("bad", ["a\x00b", "bad\udcff"])
def test_unsafe_values_are_refused(bad):
    with pytest.raises(UnsafeValue):
        commands.pct_exec(200, ["echo", bad])
    with pytest.raises(UnsafeValue):
        commands.pct_exec(200, ["echo"], env={"X": bad})
    with pytest.raises(UnsafeValue):
        commands.pct_exec(200, ["echo"], cwd=bad)


@pytest.mark.parametrize("name", ["1X", "A-B", "A B", "A=B", "", "X;rm"])
def test_malformed_env_names_are_refused(name):
    with pytest.raises(UnsafeValue):
        commands.pct_exec(200, ["true"], env={name: "v"})


def test_program_name_with_equals_is_refused():
    # env(1) would take it as one more assignment and run the next word instead.
    with pytest.raises(UnsafeValue):
        commands.pct_exec(200, ["X=1", "rm"])


@pytest.mark.parametrize("ctid", ["200", True, 200.0, None])
def test_container_id_must_be_an_int(ctid):
    with pytest.raises(UnsafeValue):
        commands.pct_exec(ctid, ["true"])


def test_sh_script_passes_values_as_positional_arguments():
    argv = commands.sh_script('printf "%s" "$1" > "$2"', "$(id)", "/tmp/a b")
    assert argv == ["sh", "-c", 'printf "%s" "$1" > "$2"', "sh", "$(id)", "/tmp/a b"]


def test_mask_hides_raw_and_quoted_secrets():
    line = commands.pct_exec(200, ["run"], env={"HF_TOKEN": "hf_s3cr3t value"})
    shown = commands.mask(line, ["hf_s3cr3t value"])
    assert "s3cr3t" not in shown and commands.MASK in shown


HOSTILE = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                  max_size=40)


@settings(max_examples=60, deadline=None)
@given(args=st.lists(HOSTILE, min_size=1, max_size=4), value=HOSTILE, cwd=HOSTILE)
def test_a_real_shell_reads_back_exactly_what_was_built(args, value, cwd):
    """Property: the host's shell parses the line back into pct's argv, value for value."""
    line = commands.pct_exec(200, ["prog", *args], env={"V": value}, cwd="/" + cwd)
    # Replace `env LC_ALL=C.UTF-8 pct` by a program that prints its argv NUL-separated; run the
    # line in real bash.
    fake = "env() { shift; \"$@\"; }; pct() { printf '%s\\0' \"$@\"; }; "
    out = subprocess.run(["bash", "-c", fake + line],
                         capture_output=True, check=True).stdout
    got = out.decode("utf-8").split("\x00")[:-1]
    assert got == ["exec", "200", "--", "sh", "-c", commands.SESSION_SCRIPT, "dflash-session",
                   "env", "-i", "-C", "/" + cwd, "--", f"V={value}", "prog", *args]
    assert shlex.split(line)[:3] == ["env", "LC_ALL=C.UTF-8", "pct"]


# --- SESSION_SCRIPT through the real /bin/sh: the command ends with the session's stdin -------------

def tied(script: str, stdin=subprocess.PIPE, env: dict | None = None) -> subprocess.Popen:
    # The default dispositions sshd gives a session, even under a runner started without job control
    # (SIGINT ignored) or under nohup (SIGHUP ignored): a signal ignored on entry, a shell cannot trap.
    return subprocess.Popen(["sh", "-c", commands.SESSION_SCRIPT, "dflash-session", "sh", "-c", script],
                            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, preexec_fn=_default_signals)


def _default_signals():
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def watchers_marked(mark: str) -> list[int]:
    """Pids of dflash-watch processes whose environment holds DFLASH_TEST_MARK=mark: the watchers
    of this test's own command, not those of other tests or sessions on the machine."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:  # gone meanwhile, or not ours
            continue
        if b"dflash-watch" in argv and f"DFLASH_TEST_MARK={mark}".encode() in environ:
            found.append(int(pid))
    return found


def alive_with(marker: str) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    return [p for p in ps if marker in p and "dflash-session" not in p]


def until(predicate, what: str):
    for _ in range(2000):  # a bound on a hang (20 s), not a timing check
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(what)


def test_session_tied_passes_output_and_exit_code_through():
    p = tied("echo out; echo err >&2; exit 3")
    out, err = p.stdout.read(), p.stderr.read()  # stdin stays open: closing it would end the command
    assert (p.wait(timeout=60), out, err) == (3, "out\n", "err\n")
    p.stdin.close()


def test_session_end_kills_the_command_and_everything_it_started_but_a_detached_job():
    mark = f"{uuid.uuid4().int % 10**7 + 10**7}"
    p = tied(f"setsid -f sleep {mark}1 </dev/null >/dev/null 2>&1; "
             f"sleep {mark}2 & echo started; sleep {mark}3")
    assert p.stdout.readline() == "started\n"
    until(lambda: alive_with(f"sleep {mark}2") and alive_with(f"sleep {mark}3"), "the command never started")
    p.stdin.close()  # what sshd does when the SSH client goes away
    assert p.wait(timeout=60) == 128 + signal.SIGTERM
    until(lambda: not alive_with(mark)[1:], "something of the command outlived its session")
    assert [p.split()[-1] for p in alive_with(mark)] == [f"{mark}1"]  # the detached job (setsid -f) stays
    subprocess.run(["pkill", "-x", "-f", f"sleep {mark}1"])


def test_a_quick_command_leaves_no_watcher_behind():
    mark = uuid.uuid4().hex
    p = tied("exit 0", env={**os.environ, "DFLASH_TEST_MARK": mark})
    assert p.wait(timeout=60) == 0
    # With the session's stdin still open: a watcher left behind would wait on it for good. (The
    # session reaps the one it killed before it exits: test_when_the_session_ends_its_watcher_is_gone.)
    until(lambda: not watchers_marked(mark), "the watcher outlived its quick command")
    p.stdin.close()


# Runs the session script as the child of a subreaper (PR_SET_CHILD_SUBREAPER), so that whatever
# the script leaves behind when it exits, a process or a zombie no one reaped, becomes the
# subreaper's child, where it can be counted; then reaps it.
SUBREAPER = r"""
import ctypes, os, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
p = subprocess.Popen(["sh", "-c", sys.argv[1], "dflash-session", "sh", "-c", "exit 0"],
                     stdin=subprocess.PIPE)
code = p.wait()
left = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        continue
    if int(fields[1]) == os.getpid():  # PPid
        left.append(f"{pid} {fields[0]}")
print(code, len(left), *left)
p.stdin.close()
for _ in left:
    os.wait()
"""


def test_when_the_session_ends_its_watcher_is_gone_not_just_signalled():
    """The session script exits only once its watcher is reaped: on a busy machine a task's
    watcher, killed but not yet gone (or gone but not yet reaped by init), was still in the
    container's process list when the next command looked (test_jobs: two launches at once)."""
    out = subprocess.run([sys.executable, "-c", SUBREAPER, commands.SESSION_SCRIPT],
                         capture_output=True, text=True, timeout=60)
    code, count, *left = out.stdout.split()
    assert (code, count) == ("0", "0"), f"left behind (pid state): {left}; {out.stderr[-2000:]}"


def test_ctrl_c_and_a_hang_up_end_the_command():
    # Ctrl-C through a pty (SIGINT) ends it with SIGTERM and reads as 130, interrupted. Many times: a
    # signal that cut `wait` short while the command was ending gave 128+signal (129 for a hang-up)
    # instead of the command's own status, about one time in ten.
    for signum, code in [(signal.SIGINT, 130), (signal.SIGHUP, 3)] * 40:
        p = tied("trap 'exit 3' TERM; echo ready; while :; do sleep 0.1; done")
        assert p.stdout.readline() == "ready\n"
        p.send_signal(signum)
        assert p.wait(timeout=60) == code
        p.stdin.close()
