"""Faults against the embedded host (real sshd, real pct, real processes), one deployed container 200.

Each test breaks something for real (SIGKILL, a killed sshd, `pct stop`, a full tmpfs mounted in the
container's namespace) and checks what the tool says and what is left: the previous release, the
last complete checkpoint, a parseable metrics file, nothing running. Covered elsewhere, not repeated
here: unreachable host, silent host, wrong key, unknown/changed host key (test_transport.py); two
launches at the same moment (test_jobs.py); SIGKILL -> `status` crashed with the signal and a stalled
run (test_status.py); a dropped `logs --follow` connection (test_logs.py).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from ct_template import seed
from training_runs import CT, REPO, deploy

from dflash_ops import sandbox as sandbox_mod
from dflash_ops.errors import ExitStatus

pytestmark = pytest.mark.integration

LOST_CONNECTION = "error: connection to pve1 lost"
STOPPED_UNDER = (f"error: container {CT} on host pve1 stopped while the command ran; start it with "
                 f"`pct start {CT}` on the host, then check `invoke status`")
# Runs in the container with the deployed code. Checks every checkpoint directory under RUN_DIR with
# the real loaders; with ROUNDS > 0 it first forks ROUNDS children that each resume from `latest`
# (real restore()) and save back to back (real save path), SIGKILLing each at a random moment and
# checking what is left after every kill. Prints one JSON line.
CHECKPOINT_DRIVER = r'''
import json, os, random, signal, sys, time
from types import SimpleNamespace
sys.path.insert(0, "/root/dflash")
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config
import checkpoints, dflash_model as dm
from dflash_data import Sampler

run_dir, rounds, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
root = checkpoints.checkpoint_root(run_dir)

def build():
    target = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    drafter = dm.DFlashDrafter(dm.create_drafter_config(2, target, block_size=4, mask_token_id=511))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return SimpleNamespace(drafter=drafter, optimizer=optimizer, scheduler=scheduler), Sampler(100, 0)

def save_back_to_back(progress_fd, saves=None):
    worker, sampler = build()
    resumed = checkpoints.latest_checkpoint(run_dir)
    step = start = checkpoints.restore(resumed, [worker], sampler) if resumed else 0
    config = SimpleNamespace(to_dict=lambda: {"fault": "test"}, train=SimpleNamespace(keep_last=3))
    while True:
        step += 1
        for p in worker.drafter.parameters():
            p.grad = torch.randn_like(p)
        worker.optimizer.step()
        worker.scheduler.step()
        sampler.take(2)
        checkpoints.save_training(run_dir, step, [worker], sampler.state_dict(), config)
        os.write(progress_fd, b".")
        if saves is not None and step - start >= saves:
            return

def check(official):
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    good, bad = [], {}
    for name in (n for n in names if n.startswith("step-")):
        path = os.path.join(root, name)
        try:
            json.load(open(os.path.join(path, "config.json")))
            load_file(os.path.join(path, "model.safetensors"))
            checkpoints.load_state(path)
            if official:
                from dflash.model import DFlashDraftModel
                DFlashDraftModel.from_pretrained(path)
            good.append(name)
        except Exception as exc:
            bad[name] = f"{type(exc).__name__}: {exc}"[:200]
    pointer = os.path.join(root, "latest")
    latest = open(pointer).read().strip() if os.path.exists(pointer) else None
    return {"entries": names, "good": good, "bad": bad, "latest": latest}

rng, results = random.Random(seed), []
for _ in range(rounds):
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            save_back_to_back(write_fd)
        finally:
            os._exit(3)
    os.close(write_fd)
    os.read(read_fd, 1)  # the child resumed and finished one save
    time.sleep(rng.uniform(0, 0.6))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    saved = 1 + len(os.read(read_fd, 1 << 16))
    os.close(read_fd)
    results.append({"saved": saved, **check(False)})
if rounds:  # a kill between a save and its prune leaves keep_last + 1: the next save prunes them
    save_back_to_back(os.open(os.devnull, os.O_WRONLY), saves=1)
print(json.dumps({"seed": seed, "rounds": results, "final": check(True)}), flush=True)
'''


@pytest.fixture(scope="module")
def deployed(sandbox, template):
    d = deploy(sandbox, template)
    (ct_root(d) / "fault_checkpoints.py").write_text(CHECKPOINT_DRIVER)
    yield d
    # Leave what the next module expects: container running, no run, the (tmpfs) model recreated.
    if "status: stopped" in subprocess.run([str(sandbox.pct), "status", CT], capture_output=True,
                                           text=True).stdout:
        subprocess.run([str(sandbox.pct), "start", CT], check=True)
    d.stop_any()
    seed(template, sandbox)  # the model again, as the template has it (a deploy would make the same)
    d.invoke("deploy", timeout=600)


def ct_root(d) -> Path:
    """Container 200's /root as the host sees it (not its tmpfs mounts: those live in its namespace)."""
    return Path(d.sandbox.state_dir) / "pve1" / "ct" / CT / "root"


def container_pids(d, program: str, *needles: str) -> list[int]:
    """Host pids of container 200's processes (its pid namespace) running `program` (argv[0]) whose
    command line holds every needle; other sandboxes' containers (other sessions, xdist workers) not."""
    init = sandbox_mod.init_pid(d.sandbox.host("pve1"), CT)
    namespace = os.readlink(f"/proc/{init}/ns/pid")
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
            ours = os.readlink(f"/proc/{entry}/ns/pid") == namespace
        except OSError:
            continue
        if ours and argv[0] == program and all(any(n in a for a in argv) for n in needles):
            found.append(int(entry))
    return found


def checkpoints_in(d, run_dir: str, rounds: int = 0, seed: int = 0) -> dict:
    """What the driver found: {"final": {entries, good, bad, latest}, "rounds": [...]}
    (see CHECKPOINT_DRIVER)."""
    r = d.container("env", "OMP_NUM_THREADS=1", "/root/venv/bin/python", "/root/fault_checkpoints.py",
                    run_dir, str(rounds), str(seed))
    return json.loads(r.stdout.strip().splitlines()[-1])


def metric_records(d, run: str) -> list[dict]:
    """Every line of metrics.jsonl must parse: a kill or a full disk must not leave a torn line."""
    return [json.loads(line) for line in d.run_file(run, "metrics.jsonl").splitlines()]


def variant_inventory(d, tmp_path, **paths) -> str:
    """The sandbox inventory with container 200's paths changed."""
    inv = yaml.safe_load(Path(d.inventory).read_text())
    inv["containers"][int(CT)]["paths"].update(paths)
    out = tmp_path / "variant.yaml"
    out.write_text(yaml.safe_dump(inv))
    return str(out)


def mount_tmpfs(d, where: str, size: str, fill_kib: int = 0) -> None:
    """A small tmpfs inside the container's mount namespace, optionally nearly filled."""
    d.container("sh", "-c", f'mkdir -p "$1" && mount -t tmpfs -o size={size} tmpfs "$1"', "sh", where)
    if fill_kib:
        d.container("sh", "-c", f'dd if=/dev/zero of="$1/fill" bs=1k count={fill_kib} 2>/dev/null; true',
                    "sh", where)


def shrink_and_fill(d, where: str, size: str, leave_kib: int) -> None:
    """Shrink a tmpfs that let the launch past the preflight's free-space check, then fill it but
    `leave_kib`: a disk that fills up after the launch."""
    d.container("sh", "-c", f'mount -o remount,size={size} tmpfs "$1" && '
                'avail=$(df -k --output=avail "$1" | tail -n 1) && '
                f'dd if=/dev/zero of="$1/fill" bs=1k count=$((avail - {leave_kib})) 2>/dev/null; true',
                "sh", where)


def unmount(d, where: str) -> None:
    d.container("umount", where, check=False)


# --- the training process killed ------------------------------------------------------------------

def test_sigkill_mid_checkpoint_then_train_resumes_losing_at_most_one_interval(deployed):
    deployed.train("killed", "--max-steps", "400")  # a checkpoint every step
    checkpoints = ct_root(deployed) / "runs" / "killed" / "checkpoints"
    deployed.wait_for("a first checkpoint", lambda: (checkpoints / "latest").exists(), timeout=300)
    [pid] = container_pids(deployed, "/root/venv/bin/python", "train_dflash.py",
                           "--run-dir=/root/runs/killed")
    deployed.wait_for("a checkpoint being written",
                      lambda: any(n.startswith(".tmp-step-") for n in os.listdir(checkpoints)), every=0.002)
    os.kill(pid, signal.SIGKILL)

    crashed = deployed.wait_for("the wrapper to record the kill",
                                lambda: (s := deployed.status("killed"))["state"] != "running" and s,
                                every=2.0)
    assert (crashed["state"], crashed["detail"]) == ("crashed", "killed by signal 9 (SIGKILL)")
    done = max(r["step"] for r in metric_records(deployed, "killed") if r["kind"] == "train")
    found = checkpoints_in(deployed, "/root/runs/killed")["final"]
    assert found["bad"] == {} and found["latest"] in found["good"], found
    kept = int(found["latest"].removeprefix("step-"))
    assert done - kept <= 1, (done, found)  # train.save_every=1: at most one interval is redone

    deployed.train("killed", "--max-steps", str(kept + 2))
    log = deployed.invoke("logs", "--follow", "--run", "killed", "-n", "1000", timeout=300).stdout
    assert f"resumed from /root/runs/killed/checkpoints/step-{kept} at step {kept}" in log
    final = deployed.status("killed")
    assert (final["state"], final["step"]) == ("finished", kept + 2)
    assert metric_records(deployed, "killed")[-1]["kind"] == "checkpoint"


def test_repeated_sigkill_during_checkpoint_writes_never_leaves_a_half_written_one(deployed):
    seed = random.randrange(1 << 30)
    found = checkpoints_in(deployed, "/root/fault-ckpt", rounds=10, seed=seed)
    latest_steps = []
    for r in found["rounds"]:
        assert r["bad"] == {} and r["latest"] in r["good"], (seed, r)
        latest_steps.append(int(r["latest"].removeprefix("step-")))
    assert latest_steps == sorted(latest_steps) and latest_steps[-1] >= 10, (seed, latest_steps)  # it resumed
    in_flight = [r["entries"] for r in found["rounds"]
                 if any(n.startswith((".tmp-step-", ".del-", "latest.tmp-")) for n in r["entries"])]
    assert in_flight, f"seed {seed}: no kill landed inside a save; the test did not test"
    final = found["final"]  # after one more save (the driver's): what prune keeps
    assert final["bad"] == {} and len(final["good"]) == 3 and final["latest"] in final["good"], (seed, final)


# --- full disks --------------------------------------------------------------------------------------

def test_checkpoint_on_a_full_runs_filesystem_is_a_clear_crash_with_the_last_checkpoint_whole(deployed):
    mount_tmpfs(deployed, "/root/runs/full/checkpoints", "2m")  # room for one tiny checkpoint, not two
    try:
        deployed.train("full", "--max-steps", "40")
        out = deployed.invoke("logs", "--follow", "--run", "full", "-n", "300", timeout=300).stdout
        assert "OSError: [Errno 28] No space left on device: checkpoint step-" in out
        assert ">>> disk full: read docs/runbooks/disk-full.md" in out
        st = deployed.status("full")
        assert (st["state"], st["exit_code"]) == ("crashed", "1")
        assert [f["runbook"] for f in st["findings"]] == ["docs/runbooks/disk-full.md"]
        found = checkpoints_in(deployed, "/root/runs/full")["final"]
        assert found["bad"] == {} and found["latest"] in found["good"], found
        assert found["entries"] == ["latest", found["latest"]]  # the failed save removed its temp dir
        assert metric_records(deployed, "full")
    finally:
        unmount(deployed, "/root/runs/full/checkpoints")


def test_run_directory_filling_up_mid_run_is_named_and_the_torn_metrics_line_is_cut_on_restart(deployed):
    # Room for the launch and the warm-up, then a few steps: the log, the metrics and the wrapper's
    # exit code all hit the full disk, so no error line can be written anywhere.
    # The preflight refuses a launch with under 1 GiB free (a tmpfs size is a limit, not memory used).
    mount_tmpfs(deployed, "/root/runs/tear", "1100m")
    try:
        deployed.train("tear", "--max-steps", "1000", "--set", "train.save_every=1000")
        shrink_and_fill(deployed, "/root/runs/tear", "4m", leave_kib=76)
        st = deployed.wait_for("the run to die of the full disk",
                               lambda: (s := deployed.status("tear"))["state"] != "running" and s,
                               timeout=300, every=2.0)
        assert st["state"] == "crashed" and st["step"], st
        # From a log line when one got through, else from the free space status reads.
        assert [f["runbook"] for f in st["findings"]] == ["docs/runbooks/disk-full.md"], st
        torn = deployed.run_file("tear", "metrics.jsonl")
        assert not torn.endswith("\n")  # what a full disk leaves

        deployed.container("rm", "/root/runs/tear/fill")  # and room again for the preflight
        deployed.container("mount", "-o", "remount,size=1100m", "tmpfs", "/root/runs/tear")
        deployed.train("tear", "--max-steps", "2", "--set", "train.save_every=1000")
        deployed.invoke("logs", "--follow", "--run", "tear", "-n", "0", timeout=300)
        assert deployed.status("tear")["state"] == "finished"
        records = metric_records(deployed, "tear")  # every line parses: the torn one was cut
        assert [r["step"] for r in records if r["kind"] == "train"][-2:] == [1, 2]  # the restart, from step 0
    finally:
        unmount(deployed, "/root/runs/tear")


def test_full_runs_directory_refuses_the_launch_in_one_line_and_doctor_says_why(deployed, tmp_path):
    mount_tmpfs(deployed, "/root/fullruns", "1m", fill_kib=1024)
    try:
        inventory = variant_inventory(deployed, tmp_path, runs="/root/fullruns")
        r = deployed.invoke("train", "--run", "r1", "--max-steps", "3", inventory=inventory, check=False)
        # the preflight's free-space check, before anything is created
        assert r.returncode == ExitStatus.PREFLIGHT, r
        assert r.stderr.strip() == (f"error: pve1/{CT}: preflight disk: 0.00 GiB free for the run "
                                    "directory /root/fullruns/r1 (/root/fullruns), fewer than the 1.00 GiB "
                                    "a run needs; "
                                    "free space there (`invoke prune`, old checkpoints); see "
                                    "docs/runbooks/disk-full.md; nothing was launched")
        assert not [p for p in deployed.processes() if "train_dflash" in p]
        assert "r1" not in deployed.container("ls", "-A", "/root/fullruns").stdout.split()
        doctor = deployed.invoke("doctor", inventory=inventory, check=False)
        assert doctor.returncode == ExitStatus.CHECK_FAILED and "free runs dir" in doctor.stderr
        assert any("FAIL" in line and "free runs dir" in line for line in doctor.stdout.splitlines())
    finally:
        unmount(deployed, "/root/fullruns")


def test_full_dev_shm_fails_deploy_clearly_and_leaves_no_half_written_model(deployed):
    mount_tmpfs(deployed, "/dev/shm", "4m", fill_kib=3900)  # hides the model: deploy must recreate it
    try:
        r = deployed.invoke("deploy", check=False, timeout=600)
        # The tiny target's own output streams first; the task's error is the last line.
        assert r.returncode == ExitStatus.REMOTE_FAILED, r
        last = r.stderr.strip().splitlines()[-1]
        # the tiny-target verb's refusal: what failed, how, and the build's last line
        assert last.startswith(f"error: pve1/{CT}: tiny-target: ") and "failed (exit 1)" in last, r.stderr
        assert "No space left on device" in last, r.stderr
        assert deployed.container("ls", "-A", "/dev/shm").stdout.split() == ["fill"]  # no partial model
        doctor = deployed.invoke("doctor", check=False)
        assert any("FAIL" in line and "free /dev/shm" in line for line in doctor.stdout.splitlines())

        deployed.container("rm", "/dev/shm/fill")
        again = deployed.invoke("deploy", timeout=600)
        assert "model: creating the tiny target in /dev/shm/tiny-qwen3" in again.stdout
        rows = deployed.invoke("doctor", check=False).stdout.splitlines()
        assert any(line.lstrip("│ ").startswith("ok") and "tiny-qwen3: qwen3" in line for line in rows), rows
    finally:
        unmount(deployed, "/dev/shm")


# --- sshd killed in the middle of a deploy ---------------------------------------------------------------

@pytest.fixture(scope="module")
def other_payload(tmp_path_factory):
    """A checkout whose payload differs by 400 incompressible files: a deploy with time to interrupt."""
    root = tmp_path_factory.mktemp("checkout")
    for name in ("tasks.py", "invoke.yaml", "dflash_ops", "remote_scripts"):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, root / name)
    ballast = root / "remote_scripts" / "ballast"
    ballast.mkdir()
    for i in range(400):
        (ballast / f"f{i:04d}.bin").write_bytes(os.urandom(16384))
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "dflash_ops", "remote_scripts", "tasks.py"], check=True)
    return root


def kill_sshd(listener: int) -> None:
    """SIGKILL the sandbox host's sshd and everything under it: sessions, their pct, the command."""
    for pid in sandbox_mod._descendants(listener) + [listener]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


TARBALL = re.compile(r"/tmp/dflash-deploy-200-[0-9a-f]+\.tar\.gz")


def our_tarball(listener: int, moment: str) -> str | None:
    """The host path of the tar our deploy is sending (held open by our sshd: SFTP) or staging
    (named on the command line our sshd runs); other sandboxes' deploys do not count."""
    for pid in sandbox_mod._descendants(listener):
        try:
            if moment == "sending":
                seen = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            else:
                seen = [Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
        except OSError:
            continue
        for text in seen:
            if m := TARBALL.search(text):
                return m.group(0)
    return None


def release_whole(d, runs: bool = False) -> str:
    """The release `paths.code` points at, after checking every file against its manifest (and, with
    `runs`, that the training script starts)."""
    check = ("import hashlib, json, os; m = json.load(open('.dflash-manifest.json')); "
             "print([r for r, h in m['files'].items() if hashlib.sha256(open(r, "
             "'rb').read()).hexdigest() != h])")
    assert d.container("env", "-C", "/root/dflash", "/usr/bin/python3", "-c", check).stdout.strip() == "[]"
    if runs:
        assert "--max-steps" in d.container("/root/venv/bin/python", "/root/dflash/train_dflash.py",
                                            "--help").stdout
    return os.readlink(ct_root(d) / "dflash")


@pytest.mark.parametrize("moment", ["sending", "staging"])
def test_sshd_killed_mid_deploy_keeps_the_previous_release_and_the_next_deploy_completes(
        deployed, other_payload, moment):
    # a new release each time
    (other_payload / "remote_scripts" / "ballast" / "moment.txt").write_text(moment)
    subprocess.run(["git", "-C", str(other_payload), "add", "remote_scripts"], check=True)
    before = release_whole(deployed)
    state = sandbox_mod.status(deployed.sandbox.state_dir)
    releases = ct_root(deployed) / "dflash.releases"
    stages = set(releases.glob(".stage-*"))

    def in_flight():
        if moment == "staging" and not set(releases.glob(".stage-*")) - stages:
            return None
        return our_tarball(state.hosts[0].sshd_pid, moment)

    argv = deployed.invoke_argv("deploy")
    p = subprocess.Popen(argv, cwd=other_payload, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        tarball = deployed.wait_for(f"the deploy to be {moment}", in_flight, timeout=120, every=0.002)
    finally:
        kill_sshd(state.hosts[0].sshd_pid)
    out = p.communicate(timeout=60)[0]
    assert p.returncode == ExitStatus.UNREACHABLE, out
    assert len(out.strip().splitlines()) == 1 and out.startswith(LOST_CONNECTION), out
    for leftover in (Path(tarball), ct_root(deployed).parent / "tmp" / Path(tarball).name):
        leftover.unlink(missing_ok=True)  # the interrupted tar's copies (a known leftover, see the report)

    restarted = sandbox_mod.up(deployed.sandbox.state_dir, inventory_path=deployed.inventory,
                               containers=(int(CT),), stopped=(201,))
    assert restarted.port == state.port  # the inventory and every later test still point at it
    assert release_whole(deployed, runs=True) == before

    again = subprocess.run(argv, cwd=other_payload, capture_output=True, text=True, timeout=600)
    assert again.returncode == ExitStatus.OK and "files_sent=401" in again.stdout.splitlines()[-1], again
    assert release_whole(deployed) != before and not list(releases.glob(".stage-*"))  # stage cleared
    deployed.invoke("deploy", timeout=600)  # back to this checkout's payload
    assert release_whole(deployed) == before


# --- the container stopped under a task --------------------------------------------------------------------

def test_container_stopped_under_warmup_and_logs_follow_is_one_clear_line(deployed, tmp_path):
    # The model on a disk that survives the restart, so the second half needs no deploy.
    deployed.container("cp", "-r", "/dev/shm/tiny-qwen3", "/root/fault-model")
    inventory = variant_inventory(deployed, tmp_path, model="/root/fault-model")
    pct = str(deployed.sandbox.pct)

    def stopped_under(*task):
        p = subprocess.Popen(deployed.invoke_argv(*task, inventory=inventory), cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert p.stdout.readline()  # the task is running in the container
        subprocess.run([pct, "stop", CT], check=True)
        out = p.communicate(timeout=60)[0]
        subprocess.run([pct, "start", CT], check=True)
        assert p.returncode == ExitStatus.CONTAINER, out
        assert out.rstrip().splitlines()[-1] == STOPPED_UNDER, out

    stopped_under("warmup")
    assert deployed.processes() == []
    deployed.invoke("train", "--run", "ct-stop", "--set", "data.heldout=null", "--max-steps", "400",
                    inventory=inventory)
    stopped_under("logs", "--follow", "--run", "ct-stop", "-n", "5")
    st = deployed.status("ct-stop")
    assert st["state"] == "crashed" and st["detail"].startswith("no exit code recorded"), st
    assert deployed.processes() == []
