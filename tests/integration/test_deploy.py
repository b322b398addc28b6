"""invoke deploy against the embedded host: fresh container, repeat, one-file change, interruption, dry-run."""

import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from deployed_box import deployed_box
from dflash_ops import deploy, facts
from dflash_ops.errors import RemoteCommandFailed

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
    assert {name[2:]: digest for digest, name in (ln.split() for ln in sums.splitlines())} == manifest["files"]
    assert box.container("test", "-f", "/dev/shm/tiny-qwen3/config.json", check=False).returncode == 0


def test_second_deploy_sends_nothing_and_changes_nothing(box):
    before = box.snapshot()
    r = box.invoke("deploy")
    assert r.returncode == 0, r.stderr
    numbers = deploy.parse_describe(r.stdout)
    assert numbers["files_sent"] == 0 and numbers["bytes_sent"] == 0 and numbers["round_trips"] == 1
    assert "code: up to date" in r.stdout and "venv: up to date" in r.stdout and "(up to date)" in r.stdout
    assert box.snapshot() == before


def test_one_changed_file_sends_one_file(box):
    edited = box.checkout / "remote_scripts" / "train_config.py"
    original = edited.read_text()
    edited.write_text(original + "\n# deployed by test_one_changed_file_sends_one_file\n")
    try:
        r = box.invoke("deploy")
    finally:
        edited.write_text(original)
    assert r.returncode == 0, r.stderr
    numbers = deploy.parse_describe(r.stdout)
    assert numbers["files_sent"] == 1 and 0 < numbers["bytes_sent"] < 20_000
    assert "1 changed, 0 deleted" in r.stdout and "venv: up to date" in r.stdout
    assert "# deployed by test_one" in box.container("cat", "/root/dflash/train_config.py").stdout
    back = box.invoke("deploy")
    assert back.returncode == 0 and deploy.parse_describe(back.stdout)["files_sent"] == 1
    assert box.container("cat", "/root/dflash/train_config.py").stdout == original


def test_interrupted_deploy_keeps_the_previous_release_whole_and_runnable(box, tree_copy):
    t = box.target()
    before = box.snapshot()
    live = box.sh("readlink /root/dflash").stdout
    big = tree_copy / "remote_scripts" / "data" / "train.jsonl"
    big.write_bytes(big.read_bytes() + b'{"note": "changed"}\n')
    (tree_copy / "remote_scripts" / "train_config.py").write_text("raise SystemExit('half-deployed')\n")
    local = deploy.local_tree(tree_copy)
    probe = facts.parse_json_line(t.session.run_in(t.container, facts.facts_line(t.container, ("code",))).stdout, "t")
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
    runnable = box.sh("cd /root/dflash && /root/venv/bin/python -c 'import train_config, dflash_model; print(1)'",
                      check=False)
    assert runnable.returncode == 0 and runnable.stdout.strip() == "1", runnable.stderr
    report = deploy.deploy(t, root=tree_copy, **QUIET)  # the next deploy completes
    assert set(report.changed) == {"data/train.jsonl", "train_config.py"}
    assert ".stage-" not in box.snapshot()
    assert "half-deployed" in box.container("cat", "/root/dflash/train_config.py").stdout
    assert deploy.deploy(t, root=box.checkout, **QUIET).files_sent == 2
    t.session.close()


def test_dry_run_prints_the_lines_and_connects_to_nothing(box, tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    data = yaml.safe_load(Path(box.inventory).read_text())
    for host in data["hosts"].values():
        host["port"] = listener.getsockname()[1]
    inventory = tmp_path / "unreachable.yaml"
    inventory.write_text(yaml.safe_dump(data))
    r = box.invoke("deploy", "--dry-run", inventory=str(inventory))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    pct = data["hosts"]["pve1"]["pct"]
    assert lines[0].startswith(f"{pct} exec 200 -- env -i -- ") and " facts " in lines[0]
    assert any(ln.startswith("# sftp put ") for ln in lines)
    assert any(ln.startswith(f"{pct} push 200 /tmp/dflash-deploy-200-") for ln in lines)
    assert any("pip install" in ln for ln in lines)
    assert any("make_tiny_target.py --out /dev/shm/tiny-qwen3" in ln for ln in lines)
    assert all(ln.startswith((pct, "# sftp")) for ln in lines)  # nothing but host lines, one per line
    with pytest.raises(BlockingIOError):
        listener.accept()  # no connection was even attempted
    listener.close()
