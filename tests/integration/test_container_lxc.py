"""Training in a real LXC container (the embedded host): a run killed by the container's memory
limit (a cgroup limit from the Proxmox config) is reported as such (`status`: crashed by SIGKILL,
likely out of memory; `doctor`: the limit), and a running training is a process of LXC."""

import os
import re
import subprocess
from pathlib import Path

import pytest
from training_runs import CT, LONG, QUICK, deploy

from dflash_ops import sandbox as sandbox_mod
from dflash_ops.errors import ExitStatus

pytestmark = pytest.mark.integration

CONTAINER_ROOT = sandbox_mod.CONTAINER_ROOT_UID
MEMORY_MIB = 768  # torch and the tiny run fit; three drafters of the size below do not
TOO_BIG = ["--set", "model.drafter_overrides.intermediate_size=150000"]  # about 230 MB of weights each


@pytest.fixture(scope="module")
def small(sandbox_factory, template):
    """Container 200 of a sandbox of its own, with `memory: 768` in its Proxmox config, deployed."""
    sb = sandbox_factory(containers=(int(CT),))
    conf = Path(sb.state_dir) / "pve1" / "nodes" / "pve1" / "lxc" / f"{CT}.conf"
    conf.write_text(re.sub(r"(?m)^memory: \d+$", f"memory: {MEMORY_MIB}", conf.read_text()))
    for verb in ("stop", "start"):  # pct start writes the limit into the LXC config
        subprocess.run([str(sb.pct), verb, CT], check=True)
    d = deploy(sb, template)
    yield d
    d.stop_any()


def test_a_run_over_the_containers_memory_limit_is_reported_as_killed_by_it(small):
    r = small.invoke("train", "--run", "big", *QUICK, *TOO_BIG, check=False)
    assert r.returncode != ExitStatus.OK and "crashed" in r.stderr, r
    st = small.status("big")
    assert (st["state"], st["exit_code"]) == ("crashed", "signal 9"), st
    assert st["detail"] == ("killed by signal 9 (SIGKILL), likely out of memory: the container's OOM killer "
                            f"ran ({MEMORY_MIB} MiB)")
    assert (st["memory_limit"], st["oom_kills"] >= 1) == (MEMORY_MIB << 20, True)
    assert [f["runbook"] for f in st["findings"] if f["key"] == "container-oom"] == [
        "docs/runbooks/container-oom.md"]
    doctor = small.invoke("doctor", check=False).stdout
    assert re.search(rf"container memory.*WARNING: {MEMORY_MIB} MiB limit", doctor), doctor



def ancestry(pid: int) -> list[str]:
    """Command lines from `pid` up to the host's init."""
    lines = []
    while pid > 1:
        lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip())
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return lines


def test_a_running_training_is_a_process_of_lxc_and_followed_through_lxc_attach(small):
    """The detached training hangs under the container's init.lxc and the LXC monitor; `invoke logs
    --follow` reads it through pct exec, which is lxc-attach."""
    small.train("tree", *LONG)
    run = str(sandbox_mod.lxcpath(small.sandbox.host("pve1").dir))
    [training] = [int(p) for p in os.listdir("/proc") if p.isdigit() and "train_dflash.py" in _cmdline(p)
                  and _cmdline(p).startswith("/root/venv/bin/python ") and "/root/runs/tree" in _cmdline(p)
                  and os.stat(f"/proc/{p}").st_uid == CONTAINER_ROOT]
    up = ancestry(training)
    assert up[-2:] == ["init", f"[lxc monitor] {run} {CT}"], up
    follow = small.popen("logs", "--follow", "--run", "tree", "-n", "1")
    try:
        small.wait_for("an lxc-attach of logs --follow", lambda: [
            p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).startswith(
                f"/usr/bin/lxc-attach -P {run} -n {CT} --keep-env -- ")
            and " follow {" in _cmdline(p)], timeout=60, every=0.2)
    finally:
        follow.kill()
        follow.wait()


def _cmdline(pid) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
