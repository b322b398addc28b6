"""invoke logs against the embedded host: last lines, --follow to the end across a truncated log,
Ctrl-C and a dropped connection leave nothing in the container, known failures are highlighted."""

import os
import signal

import pytest
from training_runs import LONG, deployed  # noqa: F401 (deployed: the module's container)

from dflash_ops import sandbox as sandbox_mod
from dflash_ops.errors import ExitStatus

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def live_run(deployed):
    deployed.train("followed", *LONG)
    return "followed"


def follower_processes(deployed):
    return [p for p in deployed.processes() if p.startswith("tail ") or " follow {" in p]


def start_following(deployed, run):
    p = deployed.popen("logs", "--follow", "--run", run, "-n", "5")
    assert p.stdout.readline().strip() == f"==> dflash-ops: run {run}"
    assert p.stdout.readline()  # a log line came through
    deployed.wait_for("the follower in the container", lambda: follower_processes(deployed))
    return p


def test_ctrl_c_stops_following_and_leaves_no_tail(deployed, live_run):
    p = start_following(deployed, live_run)
    p.send_signal(signal.SIGINT)  # what Ctrl-C in a terminal sends
    out = p.communicate(timeout=60)[0]
    assert p.returncode == ExitStatus.OK, out
    assert "stopped following; the run goes on" in out
    deployed.wait_for("the follower to be gone", lambda: not follower_processes(deployed), timeout=30)
    assert deployed.status(live_run)["state"] == "running"


def test_dropped_connection_exits_with_a_message_and_leaves_no_tail(deployed, live_run):
    p = start_following(deployed, live_run)
    session = sshd_session_of(deployed)
    os.kill(session, signal.SIGKILL)  # the SSH connection drops
    out = p.communicate(timeout=60)[0]
    assert p.returncode == ExitStatus.UNREACHABLE, out
    assert "the connection was lost" in out and "invoke logs --follow" in out
    deployed.wait_for("the follower to be gone", lambda: not follower_processes(deployed), timeout=30)
    assert deployed.status(live_run)["state"] == "running"


def test_follow_keeps_up_when_the_run_is_stopped_and_restarted(deployed, live_run):
    p = start_following(deployed, live_run)
    deployed.invoke("stop", "--run", live_run, "--grace", "0")
    stopped_at = deployed.container("date", "-u", "+%Y-%m-%dT%H:%M:%SZ").stdout.strip()
    deployed.train(live_run, *LONG)  # the same name: it resumes in the same directory

    def relaunched(line):  # `dflash-ops: launch <UTC time> of run NAME`, written by the new launch
        words = line.split()
        return words[:2] == ["dflash-ops:", "launch"] and words[2] >= stopped_at and words[-1] == live_run

    seen = []
    while not any(relaunched(line) for line in seen):
        line = p.stdout.readline()
        assert line, "the follower ended instead of following the restarted run: " + "".join(seen[-5:])
        seen.append(line)
    p.send_signal(signal.SIGINT)
    assert p.communicate(timeout=60)[1] is None and p.returncode == ExitStatus.OK
    deployed.wait_for("the follower to be gone", lambda: not follower_processes(deployed), timeout=30)


def test_grep_and_since_choose_the_lines_and_follow_keeps_the_grep(deployed, live_run):
    header = f"==> dflash-ops: run {live_run}"
    steps = deployed.invoke("logs", "--run", live_run, "--grep", r"INFO step \d+/", "-n", "3").stdout
    assert steps.splitlines()[0] == header and len(steps.splitlines()) == 4, steps
    assert all(" INFO step " in line for line in steps.splitlines()[1:]), steps
    recent = deployed.invoke("logs", "--run", live_run, "--since", "1h", "-n", "2").stdout.splitlines()
    assert recent[0] == header and len(recent) == 3  # the run logs every step: lines of the last hour
    for since in ("2999-01-01T00:00:00Z", "0s"):  # nothing is written after the future, or after now
        assert deployed.invoke("logs", "--run", live_run, "--since", since).stdout.splitlines() == [header]

    p = deployed.popen("logs", "--follow", "--run", live_run, "--grep", r"INFO step \d+/", "-n", "1")
    assert p.stdout.readline().strip() == header
    seen = [p.stdout.readline() for _ in range(3)]  # the last step line, then new ones as they come
    p.send_signal(signal.SIGINT)
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 0 and all(" INFO step " in line for line in seen), seen
    assert [line for line in out.splitlines()[:-1] if " INFO step " not in line] == [], out
    deployed.wait_for("the follower to be gone", lambda: not follower_processes(deployed), timeout=30)


def test_follow_keeps_up_across_truncation_and_ends_with_the_run(deployed, live_run):
    p = start_following(deployed, live_run)
    deployed.container("sh", "-c",
                       f"cp /root/runs/{live_run}/train.log /tmp/rotated && : > "
                       f"/root/runs/{live_run}/train.log")
    pid = deployed.run_file(live_run, "pid").strip()
    deployed.container("kill", "-KILL", pid)  # the run ends; its wrapper logs that and frees the lock
    out = p.communicate(timeout=120)[0]
    assert p.returncode == ExitStatus.OK, out
    after = out[out.index("file truncated"):]
    assert "dflash-ops: training process" in after and " ended: exit " in after
    assert after.rstrip().splitlines()[-1].startswith(f"==> dflash-ops: run {live_run} is not running "
                                                      "(exit code: ")
    assert not follower_processes(deployed)


def test_last_lines_and_known_failures_highlighted(deployed, live_run):
    r = deployed.invoke("logs", "--run", live_run, "-n", "2")
    lines = r.stdout.splitlines()
    assert lines[0] == f"==> dflash-ops: run {live_run}" and len(lines) == 3
    # A CUDA out-of-memory line as torch prints it, appended to the finished run's log.
    oom = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 5 has a total "
           "capacity of 139.72 GiB")
    deployed.container("sh", "-c", 'printf "%s\\n" "$1" >> "$2"', "sh", oom,
                       f"/root/runs/{live_run}/train.log")
    r = deployed.invoke("logs", "-n", "3")  # the latest run
    assert oom in r.stdout
    assert ">>> CUDA out of memory: read docs/runbooks/cuda-oom.md" in r.stdout
    assert r.stdout.rstrip().endswith("CUDA out of memory: read docs/runbooks/cuda-oom.md")


def sshd_sessions_of_followers(deployed):
    """The sandbox's sshd processes serving an SSH connection that runs a log follower."""
    def parent(p):
        return int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])

    def cmdline(p):
        return open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")

    lxc = sandbox_mod.lxcpath(deployed.sandbox.host("pve1").dir)
    sessions = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = cmdline(int(entry))
            # pct exec becomes `lxc-attach -P <lxcpath> ... -- <the container's argv>` (pct execs it,
            # as pve-container): the host process whose argv runs the runs helper's follow verb, under
            # an sshd session. Of this sandbox only (its lxcpath): a follower of another sandbox on the
            # machine (an xdist worker's, another checkout's) is not ours to kill; it once was, and
            # that follow ended with `exit -1` in test_jobs and test_launch.
            if " follow {" in cmd and (cmd.startswith(f"/usr/bin/lxc-attach -P {lxc} -n 200 ")
                                       or f"{deployed.sandbox.pct} exec 200 " in cmd):
                p = int(entry)
                while p > 1:
                    if cmdline(p).startswith("sshd: root@"):
                        sessions.add(p)
                        break
                    p = parent(p)
        except OSError:  # the process ended meanwhile
            continue
    return sessions


def sshd_session_of(deployed):
    """The sshd process serving the SSH connection of the one log follower now running.

    The container's side of an earlier test's follower is gone (that test waited for it), but its
    host side (lxc-attach under its sshd session) can still be exiting: under load it was found first
    once, and killing that stale session left this test's follower running. So: wait until exactly
    one session serves a follower."""
    def one():
        sessions = sshd_sessions_of_followers(deployed)
        return sessions if len(sessions) == 1 else None

    return deployed.wait_for("one sshd session serving a follower", one, timeout=60).pop()
