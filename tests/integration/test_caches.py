"""invoke clean-cache against the embedded host: frees, reports, refuses while a run holds the runs lock."""

import shlex

import pytest
import waiting
from deployed_box import box as make_box

from dflash_ops.errors import ExitStatus

pytestmark = pytest.mark.integration

FILL = ('set -e; mkdir -p /root/.cache/dflash/inductor/fx /root/.cache/dflash/triton; '
        'head -c 300000 /dev/zero > /root/.cache/dflash/inductor/fx/graph.bin; '
        'head -c 5000 /dev/zero > /root/.cache/dflash/triton/kernel.cubin')
# A stand-in for a live run as launch.py defines it: a process group whose wrapper (`sh <run>/run.sh`,
# flock's child: it inherits the lock's fd) holds <runs>/.lock; .current names it.
HOLD_LOCK = ('mkdir -p /root/runs/fake-run && echo fake-run > /root/runs/.current && '
             'echo "sleep 300" > /root/runs/fake-run/run.sh && '
             'setsid -f sh -c \'echo $$ > /root/runs/holder.pgid; '
             'exec flock /root/runs/.lock sh /root/runs/fake-run/run.sh\' </dev/null >/dev/null 2>&1')


@pytest.fixture(scope="module")
def box(sandbox_factory, tmp_path_factory):
    # clean-cache needs no venv: the cleaner runs on the system python
    return make_box(sandbox_factory, tmp_path_factory)


def lock_held(box) -> bool:
    return box.sh("flock -n /root/runs/.lock true", check=False).returncode != 0


def wait_for(what, predicate):
    return waiting.wait_for(what, predicate, timeout=30.0, every=0.1)


@pytest.fixture
def live_run(box):
    box.sh(HOLD_LOCK)
    wait_for("the runs lock to be held", lambda: lock_held(box))
    try:
        yield
    finally:
        pgid = box.container("cat", "/root/runs/holder.pgid").stdout.strip()
        box.container("kill", "-TERM", "--", f"-{pgid}")
        wait_for("the runs lock to be released", lambda: not lock_held(box))


def test_frees_each_cache_and_reports_bytes_then_finds_nothing(box):
    box.sh(FILL)
    r = box.invoke("clean-cache")
    assert r.returncode == ExitStatus.OK, r.stderr
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.strip()}
    assert "293.0 KiB" in lines["inductor"] and "1 files" in lines["inductor"]
    assert "4.9 KiB" in lines["triton"]
    assert "(was empty)" in lines["torch_extensions"]
    assert "freed 297.9 KiB (305000 bytes) in 2 files" in r.stdout
    assert box.sh("ls /root/.cache/dflash", check=False).stdout.split() == []
    again = box.invoke("clean-cache")
    assert again.returncode == ExitStatus.OK and "freed 0 B (0 bytes) in 0 files" in again.stdout


def test_refused_while_a_run_is_alive_and_force_overrides(box, live_run):
    box.sh(FILL)
    refused = box.invoke("clean-cache")
    assert refused.returncode == ExitStatus.RUN_STATE
    assert "error: run 'fake-run' is alive on pve1/200" in refused.stderr and "--force" in refused.stderr
    assert box.container("test", "-f", "/root/.cache/dflash/inductor/fx/graph.bin",
                         check=False).returncode == 0
    forced = box.invoke("clean-cache", "--force")
    assert forced.returncode == ExitStatus.OK, forced.stderr
    assert "freed 297.9 KiB (305000 bytes)" in forced.stdout
    assert box.container("test", "-e", "/root/.cache/dflash/inductor", check=False).returncode != 0


def test_dry_run_prints_one_line(box):
    r = box.invoke("clean-cache", "--dry-run")
    assert r.returncode == ExitStatus.OK
    (line,) = r.stdout.splitlines()
    argv = shlex.split(line)
    assert argv[:6] == ["env", "LC_ALL=C.UTF-8", str(box.sandbox.pct), "exec", "200", "--"]
    inner = argv[argv.index("dflash-session") + 1:]  # under the session wrapper: the container's command
    assert inner[:2] == ["env", "-i"] and "clean-caches" in inner, inner
