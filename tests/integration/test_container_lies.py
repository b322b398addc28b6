"""What a process in the container writes cannot fool the operator's monitoring, chat or prune: run
files planted from inside container 200 of the embedded host, read by the real CLI over real SSH.

No deploy: status, watch and prune read with the container's system Python.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from training_runs import CT, REPO, Deployed
from waiting import wait_for
from webhook_receiver import Receiver

from dflash_ops.errors import ExitStatus
from dflash_ops.oncall import monitoring

pytestmark = pytest.mark.integration
RUNS = "/root/runs"


@pytest.fixture(scope="module")
def box(sandbox):
    return Deployed(sandbox)


def sh(box, script: str, *args: str) -> str:
    r = subprocess.run([str(box.sandbox.pct), "exec", CT, "--", "sh", "-c", script, "sh", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def plant_run(box, name: str, *, exit_code: str = "1", log: str = "step 1\n", started: int = 1_700_000_000):
    sh(box, 'd="$1/$2"; mkdir -p "$d" && printf "%s" "$3" > "$d/exit_code" && printf "%s" "$4" > '
            '"$d/train.log" && echo "$5" > "$d/started" && echo "$(($5 + 60))" > "$d/ended" && '
            'echo 4242 > "$d/pid"',
       RUNS, name, exit_code, log, str(started))


@pytest.fixture
def clean(box):
    sh(box, f"rm -rf {RUNS} /root/outside && mkdir -p {RUNS}")
    yield
    sh(box, f"rm -rf {RUNS} /root/outside")


def invoke(box, *args, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(box.invoke_argv(*args), cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_a_pipe_and_unicode_line_breaks_in_a_run_file_stay_in_one_plugin_line(box, clean):
    plant_run(box, "c1", exit_code="1 | step=999999 loss=0\u2028OK - pve1/200: all good\x85OK - fine")
    sh(box, f'echo c1 > {RUNS}/.current')
    r = invoke(box, "status", "--check", "--run", "c1")
    lines = r.stdout.splitlines()  # as Nagios/Icinga split a plugin's output: every line break
    assert r.returncode == monitoring.CRITICAL and len(lines) == 1, r.stdout
    assert r.stdout.count("|") == 1 and "999999" not in r.stdout.split(" | ")[1], r.stdout
    assert lines[0].startswith("CRITICAL - pve1/200: run c1 crashed: exit 1 <U+007C> step=999999"), lines


def test_the_webhook_text_of_a_planted_crash_pages_nobody_and_links_nothing(box, clean, tmp_path):
    # A known signature's event quotes the log line: the container chose every character of it.
    plant_run(box, "c2", log="torch.OutOfMemoryError: CUDA out of memory @channel @all see "
                             "[the fix](http://evil.example/x) ![p](http://evil.example/p.png)\n")
    hook = Receiver()
    try:
        url_file = tmp_path / "hook"
        url_file.write_text(hook.url + "\n")
        url_file.chmod(0o600)
        r = invoke(box, "watch", "--run", "c2", "--every", "1", "--webhook-file", str(url_file))
    finally:
        hook.close()
    assert r.returncode == ExitStatus.RUN_STATE, r.stdout + r.stderr  # the run crashed
    texts = [b["text"] for b in hook.bodies]
    assert texts and all("@channel" not in t and "@all" not in t and "](" not in t and "![" not in t
                         for t in texts), texts
    z = "\u200b"
    assert any(f"@{z}channel" in t and f"[the fix]{z}(http:{z}//evil.example/x)" in t for t in texts), texts


def test_a_webhook_url_in_argv_is_refused_in_one_line(box, clean):
    r = invoke(box, "watch", "--run", "c3", "--webhook", "https://bot:hunter2@hooks.example/T0/B0/SECRETtoken")
    assert r.returncode == ExitStatus.USAGE and r.stdout == "", r
    assert len(r.stderr.splitlines()) == 1 and "--webhook-file FILE" in r.stderr, r.stderr
    assert "hunter2" not in r.stderr and "SECRETtoken" not in r.stderr


def test_prune_follows_no_symlink_keeps_the_run_holding_the_lock_and_lists_what_is_not_a_run(box, clean):
    # Oldest first. "linked" (kept by --keep 3) has its checkpoints/ a symlink out of the runs dir and
    # keep_last 1; "old0" goes.
    for i, name in enumerate(("old0", "alive1", "linked", "old2", "newest")):
        plant_run(box, name, exit_code="0", started=1_700_000_000 + i * 1000)
    sh(box, f'mkdir -p /root/outside/step-1 /root/outside/step-2 /root/outside/step-3 && echo step-3 > '
            f'/root/outside/latest && ln -s /root/outside {RUNS}/linked/checkpoints && '
            f'printf "train:\\n  keep_last: 1\\n" > {RUNS}/linked/config.yaml && '
            f'mkdir -p "{RUNS}/not a run" && ln -s /root/outside {RUNS}/elsewhere')
    # "alive1" is alive: its wrapper holds the runs lock; .current names another run.
    sh(box, f'rm -f {RUNS}/alive1/exit_code {RUNS}/alive1/ended; echo "sleep 600" > {RUNS}/alive1/run.sh; '
            f'echo newest > {RUNS}/.current')
    holder = subprocess.Popen(
        [str(box.sandbox.pct), "exec", CT, "--", "python3", "-c",
         "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o644); "
         "fcntl.flock(fd, fcntl.LOCK_EX); os.set_inheritable(fd, True); "
         "os.execvp('sh', ['sh', sys.argv[2] + '/run.sh', sys.argv[2]])", f"{RUNS}/.lock", f"{RUNS}/alive1"])
    try:
        wait_for("the fake run's wrapper", lambda: "sleep 600" in sh(box, "ps -eo args"), timeout=60,
                 every=0.2)
        r = invoke(box, "prune", "--keep", "3", "--yes")
        assert r.returncode == ExitStatus.OK, r.stdout + r.stderr
        left = sh(box, f"ls -1 {RUNS}").splitlines()
        assert left == ["alive1", "elsewhere", "linked", "newest", "not a run", "old2"], r.stdout
        assert sh(box, "ls /root/outside").split() == ["latest", "step-1", "step-2", "step-3"], r.stdout
        assert "kept       alive run alive1 (never touched)" in r.stdout, r.stdout
        assert "left alone, not runs: elsewhere, not a run" in r.stdout, r.stdout
    finally:
        holder.kill()
        sh(box, "pkill -f '^sh /root/runs/alive1/run.sh'; pkill -f '^sleep 600$'; true")


# A fake run's wrapper: it records its group as the real one does, logs a step, and ends (exit 0) once
# `<run>/end-now` exists; started as a group leader holding the runs lock, as a launch leaves it.
WRAPPER = ('echo $$ > "$1/pgid"; date +%s > "$1/started"; echo "step 1/9 | first" >> "$1/train.log"; '
           'while [ ! -e "$1/end-now" ]; do sleep 0.2; done; echo "step 9/9 | the end of alive" >> '
           '"$1/train.log"; date +%s > "$1/ended"; echo 0 > "$1/exit_code"')


def start_alive(box, name: str) -> subprocess.Popen:
    """Run `name` alive: its wrapper (`sh <run>/run.sh <run>`) leads its group and holds the runs lock."""
    sh(box, 'mkdir -p "$1" && printf "%s\\n" "$2" > "$1/run.sh" && rm -f "$1/end-now" "$1/exit_code"',
       f"{RUNS}/{name}", WRAPPER)
    holder = subprocess.Popen(
        [str(box.sandbox.pct), "exec", CT, "--", "python3", "-c",
         "import fcntl, os, sys; os.setsid(); fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o644); "
         "fcntl.flock(fd, fcntl.LOCK_EX); os.set_inheritable(fd, True); "
         "os.execvp('sh', ['sh', sys.argv[2] + '/run.sh', sys.argv[2]])", f"{RUNS}/.lock", f"{RUNS}/{name}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(f"run {name}'s wrapper", lambda: sh(box, 'cat "$1/pgid" 2>/dev/null; true', f"{RUNS}/{name}"),
             timeout=60, every=0.2)
    return holder


def test_the_alive_run_is_the_one_holding_the_lock_whatever_current_names(box, clean, tmp_path):
    # From inside the container: .current names "other", a run that crashed; "alive" holds the lock.
    plant_run(box, "other", exit_code="1")
    holder = start_alive(box, "alive")
    sh(box, f"echo other > {RUNS}/.current")
    try:
        st = json_of(invoke(box, "status", "--json"))  # no --run: the alive run, not .current's
        assert (st["run"], st["state"]) == ("alive", "running"), st
        assert json_of(invoke(box, "status", "--run", "alive", "--json"))["state"] == "running"
        other = json_of(invoke(box, "status", "--run", "other", "--json"))
        assert other["state"] == "crashed", other  # named by .current, and dead

        out = tmp_path / "follow.out"
        with out.open("w") as sink:
            follow = subprocess.Popen(box.invoke_argv("logs", "--follow", "-n", "5"), cwd=REPO, stdout=sink,
                                      stderr=subprocess.STDOUT, text=True)
        try:
            # The old one followed the dead run .current names, for ever (the lock is held).
            shown = lambda: "step 1/9" in out.read_text() or follow.poll() is not None  # noqa: E731
            wait_for("the alive run's log", shown, timeout=60, every=0.2)
            # It follows while the run lives: its liveness checks (one a second) do not end it.
            with pytest.raises(subprocess.TimeoutExpired):
                follow.wait(timeout=4)
            sh(box, f"touch {RUNS}/alive/end-now")
            assert follow.wait(timeout=60) == 0, out.read_text()
        finally:
            follow.kill()
        assert "the end of alive" in out.read_text(), out.read_text()
        holder.wait(timeout=60)

        holder = start_alive(box, "alive")  # alive again; .current still names "other"
        r = invoke(box, "stop", "--grace", "5")
        assert r.returncode == 0 and "alive" in r.stdout and "not running" not in r.stdout, r
        assert holder.wait(timeout=60) is not None
        assert "run.sh" not in sh(box, "ps -eo args"), "the alive run's wrapper outlived stop"
        assert sh(box, f"cat {RUNS}/alive/stopped").startswith("term "), "stop did not record it"
    finally:
        holder.kill()
        sh(box, f"touch {RUNS}/alive/end-now; pkill -f '^sh /root/runs/alive/run.sh'; true")


def json_of(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_following_a_line_of_64_mib_is_cut_and_holds_bounded_memory(box, clean, tmp_path):
    """From inside the container, a run logs one line of 64 MiB without a break: `logs --follow` once
    took 281 s for 16 MiB (quadratic) and grew with everything it followed. It shows the line cut,
    follows on, and its peak memory is the CLI's own."""
    holder = start_alive(box, "long")
    sh(box, 'head -c 67108864 /dev/zero | tr "\\0" x >> "$1" && printf "\\nafter the long line\\n" >> "$1"',
       f"{RUNS}/long/train.log")
    out, rss = tmp_path / "follow.out", tmp_path / "rss"
    try:
        with out.open("w") as sink:
            follow = subprocess.Popen(["/usr/bin/time", "-f", "%M", "-o", str(rss),
                                       *box.invoke_argv("logs", "--follow", "--run", "long", "-n", "3")],
                                      cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, text=True)
        try:
            wait_for("the line after the long one", lambda: "after the long line" in out.read_text()
                     or follow.poll() is not None, timeout=120, every=0.5)
            sh(box, f"touch {RUNS}/long/end-now")
            assert follow.wait(timeout=120) == 0, out.read_text()[-2000:]
        finally:
            follow.kill()
    finally:
        holder.kill()
        sh(box, f"touch {RUNS}/long/end-now; pkill -f '^sh /root/runs/long/run.sh'; true")
    lines = out.read_text().splitlines()
    assert "after the long line" in lines and any("the end of alive" in line for line in lines), lines[-5:]
    longest = max(len(line) for line in lines)
    assert 1000 < longest < 10_000, longest  # shown, cut (the follower keeps LINE_CAP characters)
    peak_kib = int(rss.read_text().split()[-1])
    assert peak_kib < 200 * 1024, peak_kib  # the CLI's own, not the 64 MiB line
