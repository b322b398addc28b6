"""invoke deploy against the embedded host: fresh container, repeat, one-file change,
interruption, dry-run."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from deployed_box import deployed_box
from waiting import wait_for

from dflash_ops import deploy
from dflash_ops.errors import ExitStatus, RemoteCommandFailed, TimedOut
from dflash_ops.remote import facts as container_facts
from dflash_ops.remote import readings, ship

pytestmark = pytest.mark.integration
QUIET = {"echo": lambda msg: None}


@pytest.fixture(scope="module")
def box(sandbox_factory, tmp_path_factory):
    return deployed_box(sandbox_factory, tmp_path_factory)


@pytest.fixture
def tree_copy(box, tmp_path):
    """Another git checkout holding a copy of the box's payload, for library-level deploys."""
    root = tmp_path / "checkout"
    for name in deploy.payload_files(box.checkout):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(box.checkout / name, root / name)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def test_fresh_container_gets_code_venv_torch_and_tiny_target(box):
    out = box.deployed.stdout
    numbers = deploy.parse_describe(out)
    manifest = json.loads(box.container("cat", f"/root/dflash/{deploy.MANIFEST}").stdout)
    assert numbers["files_sent"] == len(manifest["files"]) > 10 and numbers["bytes_sent"] > 0
    assert "venv: creating /root/venv" in out and "Successfully installed" in out  # pip's output streamed
    assert "0 GPUs visible, as the CPU-only roles expect" in out
    assert "model: creating the tiny target in /dev/shm/tiny-qwen3" in out
    assert box.sh("readlink /root/dflash").stdout.strip() == f"/root/dflash.releases/{manifest['tree'][:16]}"
    sums = box.sh('cd /root/dflash && find . -type f ! -name "*.pyc" ! -name .dflash-manifest.json '
                  '-exec sha256sum {} +').stdout
    assert {name[2:]: digest
            for digest, name in (ln.split() for ln in sums.splitlines())} == manifest["files"]
    assert box.container("test", "-f", "/dev/shm/tiny-qwen3/config.json", check=False).returncode == 0


RECORD = f"/root/venv/{container_facts.TORCH_RECORD}"


@pytest.fixture
def counted(box):
    """The box with the venv interpreter's starts counted (see Box.count_venv_starts)."""
    box.count_venv_starts()
    yield box
    box.stop_counting_venv_starts()


def record(box) -> tuple[dict, str]:
    """The venv's recorded torch check and its file's modification time (ns)."""
    return json.loads(box.container("cat", RECORD).stdout), box.container("stat", "-c", "%y", RECORD).stdout


def test_second_deploy_sends_nothing_changes_nothing_and_imports_no_torch(counted):
    box = counted
    before, recorded = box.snapshot(), record(box)
    r = box.invoke("deploy", env={"DFLASH_OPS_STATS": "1"})
    assert r.returncode == ExitStatus.OK, r.stderr
    numbers = deploy.parse_describe(r.stdout)
    assert numbers["files_sent"] == 0 and numbers["bytes_sent"] == 0 and numbers["round_trips"] == 1
    assert "ssh stats: pve1: 1 connection(s), 1 round trip(s)" in r.stderr
    assert "code: up to date" in r.stdout and "venv: up to date" in r.stdout and "(up to date)" in r.stdout
    assert "recorded check" in r.stdout and "0 GPUs visible, as the CPU-only roles expect" in r.stdout
    assert box.venv_starts() == 0  # the venv's interpreter never started: no torch import
    assert record(box) == recorded  # the recorded check was read, not rewritten
    assert box.snapshot() == before


def test_the_torch_check_runs_again_for_check_new_gpus_or_new_requirements(counted, tmp_path):
    box = counted
    forced = box.invoke("deploy", "--check")
    assert forced.returncode == ExitStatus.OK, forced.stderr
    assert "recorded check" not in forced.stdout and "checked)" in forced.stdout
    assert box.venv_starts() == 1
    # Another GPU set (the visibility variable the container's processes get): checked again, once.
    data = yaml.safe_load(Path(box.inventory).read_text())
    data["containers"][200]["env"]["CUDA_VISIBLE_DEVICES"] = "0"
    other_gpus = tmp_path / "other-gpus.yaml"
    other_gpus.write_text(yaml.safe_dump(data))
    for starts in (2, 2):
        r = box.invoke("deploy", inventory=str(other_gpus))
        assert r.returncode == ExitStatus.OK, r.stderr
        assert box.venv_starts() == starts
    assert record(box)[0]["key"]["gpus"]["visible"] == {"CUDA_VISIBLE_DEVICES": "0"}
    back = box.invoke("deploy")
    assert back.returncode == ExitStatus.OK and "checked)" in back.stdout and box.venv_starts() == 3
    # The venv built from other requirements: pip refreshes it, then torch is checked again.
    stamp = f"/root/venv/{container_facts.REQUIREMENTS_STAMP}"
    want = box.container("cat", stamp).stdout.strip()
    box.sh(f"echo other > {stamp}")
    r = box.invoke("deploy")
    assert r.returncode == ExitStatus.OK, r.stderr
    assert "venv: refreshing /root/venv" in r.stdout and "checked)" in r.stdout
    assert record(box)[0]["key"]["requirements"] == want


# What a process in the container can make pip and the tiny-target build print: a `.pth` file in the
# venv runs at every start of its interpreter. Written as Python escapes, so the file itself is ASCII.
HOSTILE_PTH = ("import sys; [s.write('\\x1b]52;c;cHduZWQ=\\x07\\x1b]0;TITLE\\x07\\x1b[2J\\n') "
               "or s.flush() for s in (sys.stdout, sys.stderr)]\n")


def test_pip_and_the_tiny_target_build_stream_through_the_terminal_filter(box):
    """deploy streams pip's output on a venv refresh and make_tiny_target.py's: what the container makes
    them print (OSC 52 clipboard write, a title, a screen clear) shows in caret notation, never raw."""
    stamp = f"/root/venv/{container_facts.REQUIREMENTS_STAMP}"
    box.sh('for d in /root/venv/lib/python3*/site-packages; do printf "%s" "$1" > "$d/zz-hostile.pth"; done; '
           'rm -f "$2"; mv /dev/shm/tiny-qwen3 /dev/shm/tiny-qwen3.keep', HOSTILE_PTH, stamp)
    try:
        r = box.invoke("deploy")
    finally:
        box.sh("rm -f /root/venv/lib/python3*/site-packages/zz-hostile.pth; "
               "if [ -d /dev/shm/tiny-qwen3.keep ]; then rm -rf /dev/shm/tiny-qwen3; "
               "mv /dev/shm/tiny-qwen3.keep /dev/shm/tiny-qwen3; fi")
    assert r.returncode == ExitStatus.OK, r.stdout + r.stderr
    assert "venv: refreshing /root/venv" in r.stdout and "model: creating the tiny target" in r.stdout
    both = r.stdout + r.stderr
    assert "\x1b" not in both and "\x07" not in both, both[-3000:]
    # shown, not dropped: from pip (its stdout and stderr) and from the build
    assert both.count("^[]52;c;cHduZWQ=^G^[]0;TITLE^G^[[2J") >= 3, both[-3000:]


# A pip that never finishes: the venv's interpreter sleeps when it starts as `python -m pip install ...`
# (a `.pth` file runs at every start; sys.argv is ['-m', 'install', ...] by then), and only then.
HANGING_PIP_PTH = "import sys, time; sys.argv[:2] == ['-m', 'install'] and time.sleep(600)\n"


def test_a_pip_that_hangs_is_ended_at_its_deadline_and_deploy_fails_in_one_line(box, monkeypatch):
    """The venv verb's deadline (deploy.PIP_TIMEOUT_S, 5 s here) ends pip with its process group in the
    container; deploy fails with one line, exit 13 (TIMED_OUT, as every task past its deadline), and the
    venv stays marked stale."""
    monkeypatch.setattr(deploy, "PIP_TIMEOUT_S", 5.0)
    stamp = f"/root/venv/{container_facts.REQUIREMENTS_STAMP}"
    want = box.container("cat", stamp).stdout
    box.sh('for d in /root/venv/lib/python3*/site-packages; do printf "%s" "$1" > "$d/zz-hang.pth"; done; '
           'rm -f "$2"', HANGING_PIP_PTH, stamp)
    t = box.target()
    try:
        with pytest.raises(TimedOut) as failed:
            deploy.deploy(t, root=box.checkout, **QUIET)
        left = [p for p in box.sh("ps -eo args").stdout.splitlines() if "pip install" in p]
        stale = box.container("test", "-e", stamp, check=False).returncode != 0
    finally:
        t.session.close()
        box.sh('rm -f /root/venv/lib/python3*/site-packages/zz-hang.pth; printf "%s" "$1" > "$2"',
               want, stamp)
    assert str(failed.value) == (
        "pve1/200: venv: pip install -r /root/dflash/requirements.txt did not finish within 5 s: ended with "
        "its process group (SIGTERM, then SIGKILL); re-run deploy; the venv stays marked stale")
    assert failed.value.exit_status == ExitStatus.TIMED_OUT
    assert left == [] and stale


def test_one_changed_file_sends_one_file(box):
    edited = box.checkout / "remote_scripts" / "train_config.py"
    original = edited.read_text()
    edited.write_text(original + "\n# deployed by test_one_changed_file_sends_one_file\n")
    try:
        r = box.invoke("deploy")
    finally:
        edited.write_text(original)
    assert r.returncode == ExitStatus.OK, r.stderr
    numbers = deploy.parse_describe(r.stdout)
    assert numbers["files_sent"] == 1 and 0 < numbers["bytes_sent"] < 20_000
    assert "1 changed, 0 deleted" in r.stdout and "venv: up to date" in r.stdout
    assert "# deployed by test_one" in box.container("cat", "/root/dflash/train_config.py").stdout
    back = box.invoke("deploy")
    assert back.returncode == ExitStatus.OK and deploy.parse_describe(back.stdout)["files_sent"] == 1
    assert box.container("cat", "/root/dflash/train_config.py").stdout == original


# A real `pct push` prints its error and exits 0, and writes short without a word when the disk fills
# (pct-real.md); the stand-in does the same. The container's /tmp, where the tarball lands, is made
# read-only or tiny by a tmpfs mounted over it in the container's mount namespace.
@pytest.mark.parametrize("tmp_mount, said", [
    ("ro",
     "failed: failed to create file: /tmp/dflash-deploy-200-{}.tar.gz.dflash-part: Read-only file system; "),
    ("size=4k", "wrote 4096 of {} bytes and said nothing (a full disk in the container?); "),
])
def test_a_failed_or_short_push_is_one_line_and_changes_nothing(box, tmp_mount, said):
    ballast = box.checkout / "remote_scripts" / "ballast.bin"
    ballast.write_bytes(os.urandom(65536))  # incompressible: the tarball is bigger than the tiny /tmp
    before, host_tmps = box.snapshot(), set(Path("/tmp").glob("dflash-deploy-200-*"))
    box.container("mount", "-t", "tmpfs", "-o", tmp_mount, "tmpfs", "/tmp")
    try:
        r = box.invoke("deploy")
        left_in_tmp = box.container("ls", "-A", "/tmp").stdout.split()
    finally:
        box.container("umount", "/tmp", check=False)
        ballast.unlink()
    lines = r.stderr.strip().splitlines()
    assert r.returncode == ExitStatus.REMOTE_FAILED and len(lines) == 1, (r.returncode, r.stderr)
    m = re.fullmatch(r"error: pve1/200: pct push of the release tarball \(([0-9]+) bytes\) (.*)nothing "
                     r"changed in "
                     r"the container", lines[0])
    assert m, lines
    stem = re.search(r"dflash-deploy-200-([0-9a-f]+)\.tar", lines[0])
    assert m.group(2) == said.format(stem.group(1) if stem else m.group(1)), lines
    assert box.snapshot() == before and left_in_tmp == []
    # The host's copy is removed too. The host's /tmp is this machine's, shared with the other
    # workers' sandboxes: the copy of a deploy running there comes and goes; one left by ours stays.
    wait_for("no host copy but those there before",
             lambda: not set(Path("/tmp").glob("dflash-deploy-200-*")) - host_tmps, timeout=60)


def test_interrupted_deploy_keeps_the_previous_release_whole_and_runnable(box, tree_copy):
    t = box.target()
    before = box.snapshot()
    live = box.sh("readlink /root/dflash").stdout
    big = tree_copy / "remote_scripts" / "data" / "train.jsonl"
    big.write_bytes(big.read_bytes() + b'{"note": "changed"}\n')
    (tree_copy / "remote_scripts" / "train_config.py").write_text("raise SystemExit('half-deployed')\n")
    local = deploy.local_tree(tree_copy)
    probe = ship.facts(t, ("code",))
    plan = deploy.make_plan({r: f.sha256 for r, f in local.items()}, probe["code"])
    assert set(plan.changed) == {"data/train.jsonl", "train_config.py"}
    data = deploy.pack(local, plan.changed, deploy.manifest_bytes(local, plan.tree))
    host_tmp = f"/tmp/dflash-deploy-test-{tree_copy.parent.name}.tar.gz"
    with pytest.raises(RemoteCommandFailed):
        deploy.ship(t, plan, data[: len(data) // 2], host_tmp)  # the upload cut half-way
    assert not Path(host_tmp).exists()  # the host's temp copy is removed even so
    assert box.sh("readlink /root/dflash").stdout == live
    after = box.snapshot().splitlines()
    assert any(".stage-" in ln for ln in after)  # the unfinished stage, beside the releases, never linked
    assert [ln for ln in after if ".stage-" not in ln] == before.splitlines()
    runnable = box.sh("cd /root/dflash && /root/venv/bin/python -c 'import train_config, "
                      "dflash_model; print(1)'",
                      check=False)
    assert runnable.returncode == 0 and runnable.stdout.strip() == "1", runnable.stderr
    report = deploy.deploy(t, root=tree_copy, **QUIET)  # the next deploy completes
    assert set(report.changed) == {"data/train.jsonl", "train_config.py"}
    assert ".stage-" not in box.snapshot()
    assert "half-deployed" in box.container("cat", "/root/dflash/train_config.py").stdout
    assert deploy.deploy(t, root=box.checkout, **QUIET).files_sent == 2
    t.session.close()


def test_dry_run_reads_the_container_and_prints_the_plan_changing_nothing(box):
    """The plan, from the container's state read in one round trip: which files would be sent and
    their sizes, the venv kept or refreshed and why, torch, the model, the steps; -v: the exact lines,
    without the packed helper code. No full deploy is claimed and nothing changes."""
    link = box.sh("readlink /root/dflash").stdout
    edited = box.checkout / "remote_scripts" / "train_config.py"
    requirements = box.checkout / "remote_scripts" / "requirements.txt"
    original, pinned = edited.read_text(), requirements.read_text()
    edited.write_text(original + "\n# changed for the dry run\n")
    try:
        one = box.invoke("deploy", "--dry-run")
        verbose = box.invoke("deploy", "--dry-run", "-v")
        requirements.write_text(pinned + "\n# a new pin\n")
        refresh = box.invoke("deploy", "--dry-run")
    finally:
        edited.write_text(original)
        requirements.write_text(pinned)
    assert one.returncode == verbose.returncode == refresh.returncode == ExitStatus.OK, one.stderr
    out = one.stdout
    size = readings.human_bytes(edited.stat().st_size + len("\n# changed for the dry run\n"))
    assert re.search(r"code: 1 of \d+ files would be sent, 0 deleted, as release ", out), out
    assert f"  {size:>8}  train_config.py" in out
    assert "venv: keep /root/venv: built from the same requirements" in out
    assert "torch: the venv's recorded check is reused" in out
    assert "model: /dev/shm/tiny-qwen3 has a config.json: left as it is" in out
    assert "pip install" not in out and "files_sent" not in out and "base64" not in out
    assert "venv: refresh /root/venv: built from requirements " in refresh.stdout
    assert "refresh the venv with pip" in refresh.stdout and "requirements.txt" in refresh.stdout
    pct = "env LC_ALL=C.UTF-8 " + box.sandbox.host("pve1").pct.as_posix()
    assert f"{pct} push 200 /tmp/dflash-deploy-200-XXXXXXXXXXXX.tar.gz " in verbose.stdout
    assert "base64 characters>" in verbose.stdout and len(verbose.stdout) < 10_000  # the helpers: elided
    assert box.sh("readlink /root/dflash").stdout == link  # nothing changed
    assert "# changed for the dry run" not in box.container("cat", "/root/dflash/train_config.py").stdout
    assert "code: up to date" in box.invoke("deploy", "--dry-run").stdout
