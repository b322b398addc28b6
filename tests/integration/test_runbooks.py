"""Every runbook's fix, followed as written on the embedded host: each test provokes the page's
failure for real, checks that `status --check` sees it, runs the page's fix commands read from the
page itself (runbooks.py: a command the test cannot run, or a page whose commands changed, fails
here), and checks that the run is healthy again (`status --check` OK).

Not here: pages whose fix is not a command to paste (pct-host.md: sudoers), or whose failure needs
GPUs (nccl.md, cuda-oom.md) or a real compile (compile-race.md, slow-compile.md), and venv-torch.md
(a rebuilt venv is minutes of pip).
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from runbooks import Runbook, fix_blocks
from signals import sigint_default
from training_runs import CT, LONG, REPO, deployed  # noqa: F401 (deployed: the module's container)

from dflash_ops import transport
from dflash_ops.inventory import load_inventory

pytestmark = pytest.mark.integration

# Alive and silent after its first step: no step line, metric or checkpoint for 100000 steps.
SILENT = ["--set", "train.log_every=100000", "--set", "train.save_every=100000"]
MODEL, STORE = "/dev/shm/tiny-qwen3", "/root/models/tiny-qwen3"


def stop(deployed, run):
    deployed.invoke("stop", "--run", run, "--grace", "0", check=False)


def follow_until_a_step(book: Runbook, line: str) -> None:
    """`invoke logs --follow` of a run that goes on: read up to its first step line, then Ctrl-C (it
    stops following only)."""
    follower = subprocess.Popen(book.argv(line), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, preexec_fn=sigint_default)
    try:
        seen = []
        for out in follower.stdout:
            seen.append(out)
            if " INFO step " in out:
                break
        assert any(" INFO step " in s for s in seen), "".join(seen)
        follower.send_signal(signal.SIGINT)
        follower.communicate(timeout=60)
    finally:
        follower.kill()
        follower.wait()


def test_stalled_run(deployed):
    page = "stalled-run.md"
    [fix] = fix_blocks(page)
    assert fix == ["invoke stop --run NAME --grace 120", "invoke status --run NAME",
                   "invoke train --run NAME", "invoke logs --follow --run NAME"]
    book = Runbook(deployed, page, NAME="quiet")
    deployed.train("quiet", *LONG, *SILENT)
    try:
        stalled = deployed.wait_for(
            "the silent run to be stalled",
            lambda: (r := book.check("quiet", "--stall-after", "2")).returncode == 1 and r, every=2.0)
        assert "run quiet stalled" in stalled.stdout and "read docs/runbooks/stalled-run.md" in stalled.stdout

        stopped, status, resumed = book.follow(fix[:3])
        assert "run quiet on pve1/200 stopped (SIGTERM" in stopped.stdout, stopped.stdout
        assert "stopped (stopped with SIGTERM" in status.stdout, status.stdout
        assert "run quiet started" in resumed.stdout, resumed.stdout
        follow_until_a_step(book, fix[3])
        ok = book.check("quiet")
        assert ok.returncode == 0 and ok.stdout.startswith("OK - pve1/200: run quiet running"), ok.stdout
        assert "resumed from /root/runs/quiet/checkpoints/step-" in deployed.run_file("quiet", "train.log")
    finally:
        stop(deployed, "quiet")


@pytest.fixture(scope="module")
def with_store(deployed, tmp_path_factory):
    """The inventory with paths.model_store: a persistent copy of the tiny target in the container,
    recorded once (`invoke stage --record`, as stage-target.md says)."""
    inv = yaml.safe_load(Path(deployed.inventory).read_text())
    inv["containers"][int(CT)]["paths"]["model_store"] = STORE
    path = tmp_path_factory.mktemp("store") / "inventory.yaml"
    path.write_text(yaml.safe_dump(inv))
    deployed.sh('mkdir -p /root/models && rm -rf "$2" && cp -a "$1" "$2"', MODEL, STORE)
    r = deployed.invoke("stage", "--record", inventory=str(path), check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    return str(path)


@pytest.mark.parametrize("page, block", [("stage-target.md", 1), ("preflight.md", 0)])
def test_target_gone_from_dev_shm(deployed, with_store, page, block):
    """What a container restart does to /dev/shm, without the restart: the target is gone, the resume
    is refused by the preflight; the page's fix stages it back and resumes."""
    fix = fix_blocks(page)[block]
    assert fix[0] == "invoke stage" and fix[-1] == "invoke train --run NAME", fix
    run = "shm-" + page.split(".")[0]
    book = Runbook(deployed, page, inventory=with_store, NAME=run)
    deployed.train(run, *LONG)
    try:
        stop(deployed, run)
        deployed.container("rm", "-rf", MODEL)
        refused = book.run(f"invoke train --run {run}")
        assert refused.returncode == 12 and "target checkpoint directory not found" in refused.stderr, refused
        book.follow(fix, expect={})
        ok = book.check(run)
        assert ok.returncode == 0 and ok.stdout.startswith(f"OK - pve1/200: run {run} running"), ok.stdout
    finally:
        stop(deployed, run)


def test_container_stopped(deployed, with_store):
    page = "container.md"
    fix = fix_blocks(page)[0]
    assert fix == ["ssh root@HOST pct start 200", "invoke doctor", "invoke stage", "invoke status --run NAME",
                   "invoke train --run NAME"], fix
    book = Runbook(deployed, page, inventory=with_store, NAME="restarted")
    deployed.train("restarted", *LONG)
    try:
        subprocess.run([str(deployed.sandbox.pct), "stop", CT], check=True, timeout=120)
        down = book.check("restarted")
        assert down.returncode == 2 and "is stopped" in down.stdout and "container.md" in down.stdout, down
        # doctor fails on the model /dev/shm lost with the restart, as the page says; the rest works
        _, doctor, _, status, resumed = book.follow(fix, expect={"invoke doctor": 1})
        assert "model" in doctor.stderr + doctor.stdout
        assert "crashed (no exit code recorded" in status.stdout, status.stdout
        assert "run restarted started" in resumed.stdout
        ok = book.check("restarted")
        assert ok.returncode == 0 and ok.stdout.startswith("OK - pve1/200: run restarted running"), ok.stdout
    finally:
        stop(deployed, "restarted")


def test_disk_full(deployed):
    """The runs directory fills up (an old run's files) while a run checkpoints: it crashes with the
    disk-full line; the page's commands free it and the run resumes, and the old line pages nothing."""
    page = "disk-full.md"
    fix = fix_blocks(page)[0]
    assert fix[0] == "ssh root@HOST pct exec 200 -- rm -rf /root/runs/OLD_RUN", fix
    assert fix[-1] == "invoke train --run NAME --set train.keep_last=2", fix
    book = Runbook(deployed, page, NAME="filled", OLD_RUN="old")
    deployed.container("sh", "-c", "mkdir -p /root/runs && mount -t tmpfs -o size=1100m tmpfs /root/runs")
    try:
        deployed.train("filled", *LONG)  # a checkpoint every step
        deployed.sh('mkdir -p /root/runs/old && avail=$(df -k --output=avail /root/runs | tail -n 1) && '
                    'dd if=/dev/zero of=/root/runs/old/fill bs=1k count=$((avail - 64)) 2>/dev/null; true')
        crashed = deployed.wait_for("the run to die of the full disk",
                                    lambda: (s := deployed.status("filled"))["state"] != "running" and s,
                                    timeout=300, every=2.0)
        assert crashed["state"] == "crashed", crashed
        full = book.check("filled")
        assert full.returncode == 2 and "read docs/runbooks/disk-full.md" in full.stdout, full.stdout

        book.follow(fix)
        ok = book.check("filled")
        assert ok.returncode == 0 and ok.stdout.startswith("OK - pve1/200: run filled running"), ok.stdout
        spec = json.loads(deployed.run_file("filled", "launch.json"))
        assert "train.keep_last=2" in spec["sets"], spec
    finally:
        stop(deployed, "filled")
        deployed.container("umount", "/root/runs", check=False)


def test_changed_host_key(deployed, tmp_path):
    """The host was reinstalled (its key is not the pinned one): every task refuses it; the page's fix
    pins the key the host's console shows, and the next check reads the run again."""
    page = "ssh-host-key.md"
    [fix] = fix_blocks(page)
    assert fix == ["invoke trust-host --host pve1 --fingerprint SHA256:...", "invoke disconnect --host pve1",
                   "invoke status"], fix
    inv = yaml.safe_load(Path(deployed.inventory).read_text())
    old = tmp_path / "old_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(old)], check=True)
    known = tmp_path / "known_hosts"  # what this machine pinned before the reinstall
    name = transport.known_hosts_name(load_inventory(deployed.inventory).container(int(CT)).host)
    known.write_text(f"{name} {' '.join(Path(f'{old}.pub').read_text().split()[:2])}\n")
    inv["hosts"]["pve1"]["known_hosts"] = str(known)
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump(inv))
    # the host's console: `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` (the embedded host's key)
    console = subprocess.run(["ssh-keygen", "-lf", str(Path(deployed.sandbox.state_dir) / "pve1" /
                                                       "ssh_host_ed25519_key.pub")],
                             capture_output=True, text=True, check=True).stdout.split()[1]
    book = Runbook(deployed, page, inventory=str(inventory), **{"SHA256:...": console})
    deployed.train("pinned", "--max-steps", "1")
    deployed.invoke("logs", "--follow", "--run", "pinned", "-n", "0", timeout=600)
    refused = book.check("pinned")
    assert refused.returncode == 3 and "CHANGED" in refused.stdout, refused.stdout

    _, _, status = book.follow(fix)
    assert "run pinned" in status.stdout and "finished" in status.stdout, status.stdout
    ok = book.check("pinned")
    assert ok.returncode == 0 and ok.stdout.startswith("OK - pve1/200: run pinned finished"), ok.stdout
    offered = (Path(deployed.sandbox.state_dir) / "pve1" / "ssh_host_ed25519_key.pub").read_text().split()[1]
    pinned = known.read_text()
    assert offered in pinned and Path(f"{old}.pub").read_text().split()[1] not in pinned, pinned


def cgroup_value(deployed, name: str) -> int:
    """A value of the container's memory cgroup, as the container sees it (v2 or v1)."""
    out = deployed.sh('for f in /sys/fs/cgroup/"$1" /sys/fs/cgroup/memory/"$1"; do '
                      '[ -f "$f" ] && { cat "$f"; exit 0; }; done; exit 1', name)
    return int(out.split()[0])


HOG = """import os, sys, time
held = []
while os.path.exists("/proc/" + sys.argv[1]) and len(held) < 4096:  # 1 MiB at a time, pages touched
    held.append(bytes(range(256)) * 4096)
time.sleep(600)
"""


def test_container_out_of_memory(deployed):
    """The container reaches its memory limit while a run trains (the limit lowered to about what is
    in use, then a process takes more until the training is gone; the training is made the OOM
    killer's first choice, as the largest process is): the page's fix raises the limit at once, and
    the run resumes from its last checkpoint."""
    page = "container-oom.md"
    [fix] = fix_blocks(page)
    assert fix == ["ssh root@HOST pct set 200 --memory 65536", "invoke train --run NAME"], fix
    book = Runbook(deployed, page, NAME="grown")
    pct = str(deployed.sandbox.pct)
    before = subprocess.run([pct, "config", CT], capture_output=True, text=True, check=True).stdout
    memory = next(line.split(":")[1].strip() for line in before.splitlines() if line.startswith("memory:"))
    v2 = deployed.container("test", "-f", "/sys/fs/cgroup/memory.max", check=False).returncode == 0
    deployed.train("grown", *LONG)  # a checkpoint every step
    try:
        deployed.wait_for_file("grown", "checkpoints/latest")
        pid = deployed.status("grown")["pid"]
        deployed.sh('echo 1000 > /proc/"$1"/oom_score_adj', str(pid))
        for margin in range(100, 400, 50):  # v1 refuses a limit under what it cannot reclaim: a bit more
            used = cgroup_value(deployed, "memory.current" if v2 else "memory.usage_in_bytes")
            if subprocess.run([pct, "set", CT, "--memory", str((used >> 20) + margin)]).returncode == 0:
                break
        deployed.sh('python3 -c "$1" "$2" > /dev/null 2>&1 & echo $! > /tmp/hog.pid', HOG, str(pid))
        crashed = deployed.wait_for("the OOM killer to kill the training",
                                    lambda: (s := deployed.status("grown"))["state"] != "running" and s,
                                    timeout=120, every=2.0)
        deployed.sh('kill -9 "$(cat /tmp/hog.pid)" 2>/dev/null; true')
        assert (crashed["state"], crashed["exit_code"]) == ("crashed", "signal 9"), crashed
        assert "likely out of memory" in crashed["detail"], crashed
        killed = book.check("grown")
        assert killed.returncode == 2 and "container-oom.md" in killed.stdout, killed.stdout

        _, resumed = book.follow(fix)
        assert cgroup_value(deployed, "memory.max" if v2 else "memory.limit_in_bytes") == 65536 << 20
        assert "resumed from /root/runs/grown/checkpoints/step-" in resumed.stdout, resumed.stdout
        ok = book.check("grown")
        assert ok.returncode == 0 and ok.stdout.startswith("OK - pve1/200: run grown running"), ok.stdout
    finally:
        stop(deployed, "grown")
        deployed.sh('kill -9 "$(cat /tmp/hog.pid)" 2>/dev/null; true')
        subprocess.run([pct, "set", CT, "--memory", memory], check=True)
