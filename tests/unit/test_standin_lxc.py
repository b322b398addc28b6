"""The stand-in pct's pure parts over LXC: the LXC config it writes from a Proxmox config (limits
as cgroup v2 or v1 keys, the user mapping of an unprivileged container), its running test, and its
reads of /proc racing a process that is reaped."""
import builtins
import importlib.machinery
import importlib.util
import io
import json
import shutil
from pathlib import Path

import pytest

import dflash_ops

PCT = Path(dflash_ops.__file__).parent / "sandbox" / "pct"
CONF = {"arch": "amd64", "cores": "1", "cpuunits": "25", "hostname": "ct200", "memory": "768", "swap": "0",
        "unprivileged": "1", "lxc.mount.entry": "tmpfs dev/shm tmpfs size=1g,nosuid,nodev,create=dir 0 0"}


def _standin(tmp_path):
    """The stand-in loaded as a module, as it lies in a host's bin/ (it reads ../host.json)."""
    (tmp_path / "bin").mkdir()
    script = shutil.copy(PCT, tmp_path / "bin" / "pct")
    (tmp_path / "host.json").write_text(json.dumps({"node": "pve1", "lxcpath": "/run/dflash-sandbox/abc"}))
    loader = importlib.machinery.SourceFileLoader("standin_pct", str(script))
    spec = importlib.util.spec_from_loader("standin_pct", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _config(pct, monkeypatch, v2, conf=CONF):
    monkeypatch.setattr(pct, "cgroup_v2", lambda: v2)
    monkeypatch.setattr(pct.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    return pct.lxc_config("200", conf, "/run/dflash-sandbox/abc/200/lxc.log").splitlines()


def test_the_limits_are_cgroup_v2_keys_where_the_machine_has_v2(tmp_path, monkeypatch):
    lines = _config(_standin(tmp_path), monkeypatch, v2=True)
    assert {"lxc.cgroup2.memory.max = 805306368", "lxc.cgroup2.memory.swap.max = 0",
            "lxc.cgroup2.cpu.weight = 25", "lxc.cgroup2.cpuset.cpus = 0"} <= set(lines)
    assert not [line for line in lines if line.startswith("lxc.cgroup.memory")]


def test_the_limits_are_cgroup_v1_keys_on_a_v1_machine(tmp_path, monkeypatch):
    pct = _standin(tmp_path)
    monkeypatch.setattr(pct.os.path, "exists", lambda path: path.endswith("memory.memsw.limit_in_bytes"))
    lines = _config(pct, monkeypatch, v2=False, conf={**CONF, "cpulimit": "1.5"})
    assert {"lxc.cgroup.memory.limit_in_bytes = 805306368",
            "lxc.cgroup.memory.memsw.limit_in_bytes = 805306368", "lxc.cgroup.cpu.shares = 256",
            "lxc.cgroup.cpu.cfs_quota_us = 150000",
            "lxc.cgroup.cpu.cfs_period_us = 100000", "lxc.cgroup.cpuset.cpus = 0"} <= set(lines)
    assert not [line for line in lines if line.startswith("lxc.cgroup2.")]


def test_an_unprivileged_container_maps_root_to_100000_and_keeps_the_configs_lxc_lines(tmp_path, monkeypatch):
    pct = _standin(tmp_path)
    lines = _config(pct, monkeypatch, v2=True)
    assert {"lxc.idmap = u 0 100000 65536", "lxc.idmap = g 0 100000 65536",
            "lxc.include = /usr/share/lxc/config/userns.conf", "lxc.net.0.type = none",
            "lxc.cgroup.relative = 1", "lxc.cgroup.dir.container = dflash-abc-200",
            "lxc.init.cmd = /usr/sbin/init.lxc.static -n 200 -- /usr/bin/sleep infinity",
            "lxc.mount.entry = tmpfs dev/shm tmpfs size=1g,nosuid,nodev,create=dir 0 0"} <= set(lines)
    privileged = _config(pct, monkeypatch, v2=True, conf={**CONF, "unprivileged": "0"})
    assert not [line for line in privileged if "idmap" in line or "userns" in line]


@pytest.mark.parametrize("key, value", [("memory", "lots"), ("memory", "0"), ("cpuunits", "20000"),
                                        ("cpulimit", "-1")])
def test_a_bad_limit_is_pcts_parameter_error(tmp_path, monkeypatch, key, value):
    pct = _standin(tmp_path)
    with pytest.raises(pct.PctError, match=rf"^400 Parameter verification failed.\n{key}: value must be "):
        _config(pct, monkeypatch, v2=True, conf={**CONF, key: value})


def test_running_is_the_abstract_command_socket_in_proc_net_unix(tmp_path):
    pct = _standin(tmp_path)
    sockets = {"@/run/dflash-sandbox/abc/200/command", "@/run/dflash-sandbox/other/201/command"}
    assert pct.running("200", sockets) and not pct.running("201", sockets)
    assert isinstance(pct.active_sockets(), set)  # this machine's own listing parses


def test_a_process_reaped_while_pct_reads_its_proc_file_reads_as_nothing(monkeypatch, tmp_path):
    """Between open() and read() of /proc/PID/stat the process can be reaped: the read fails with
    ESRCH (ProcessLookupError), which once broke `pct stop` with a traceback in CI."""
    pct = _standin(tmp_path)
    real_open = builtins.open

    class Reaped(io.StringIO):
        def read(self, *args):
            raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: Reaped() if str(path).startswith("/proc/1234")
                        else real_open(path, *a, **k))
    assert pct.read_text("/proc/12345/stat") == ""


@pytest.mark.parametrize("v2, grow, order", [
    (False, True, ["memory.memsw.limit_in_bytes", "memory.limit_in_bytes"]),  # memsw may never be below
    (False, False, ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]),
    (True, True, ["memory.swap.max", "memory.max"]),
])
def test_pct_set_writes_the_config_and_hot_applies_memory_in_an_order_v1_accepts(tmp_path, monkeypatch,
                                                                                 v2, grow, order):
    pct = _standin(tmp_path)
    conf_dir = tmp_path / "nodes" / "pve1" / "lxc"
    conf_dir.mkdir(parents=True)
    (conf_dir / "200.conf").write_text("".join(f"{k}: {v}\n" for k, v in CONF.items()))
    monkeypatch.setattr(pct, "HOST_DIR", str(tmp_path))
    monkeypatch.setattr(pct, "cgroup_v2", lambda: v2)
    exists = pct.os.path.exists
    monkeypatch.setattr(pct.os.path, "exists",  # v1 swap accounting on
                        lambda path: path.endswith("memory.memsw.limit_in_bytes") or exists(path))
    monkeypatch.setattr(pct, "running", lambda vmid: True)
    calls = []
    monkeypatch.setattr(pct.subprocess, "run", lambda argv, **kw: calls.append(argv[-2:]) or
                        type("R", (), {"returncode": 0, "stderr": ""})())
    assert pct.cmd_set("200", "--memory", "4096" if grow else "256") == 0
    assert [key for key, _ in calls] == order
    assert dict(calls)[order[-1 if grow else 0]] == str((4096 if grow else 256) << 20)
    text = (conf_dir / "200.conf").read_text()
    assert ("memory: 4096" if grow else "memory: 256") in text and "memory: 768" not in text
    assert "hostname: ct200" in text and "swap: 0" in text
    with pytest.raises(pct.PctError, match="property is not defined in schema"):
        pct.cmd_set("200", "--cores", "2")
    with pytest.raises(pct.PctError, match="memory: value must be"):
        pct.cmd_set("200", "--memory", "lots")
