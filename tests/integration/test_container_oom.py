"""A run killed by its container's memory limit, against the embedded host's real LXC cgroup limits:
`status` says it crashed by SIGKILL and names the likely OOM, `doctor` shows the limit."""

import re
import subprocess
from pathlib import Path

import pytest
from training_runs import CT, QUICK, deploy

pytestmark = pytest.mark.integration

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
    assert r.returncode != 0 and "crashed" in r.stderr, r
    st = small.status("big")
    assert (st["state"], st["exit_code"]) == ("crashed", "signal 9"), st
    assert st["detail"] == ("killed by signal 9 (SIGKILL), likely out of memory: the container's OOM killer "
                            f"ran ({MEMORY_MIB} MiB)")
    assert (st["memory_limit"], st["oom_kills"] >= 1) == (MEMORY_MIB << 20, True)
    assert [f["runbook"] for f in st["findings"] if f["key"] == "container-oom"] == [
        "docs/runbooks/container-oom.md"]
    doctor = small.invoke("doctor", check=False).stdout
    assert re.search(rf"container memory.*WARNING: {MEMORY_MIB} MiB limit", doctor), doctor
