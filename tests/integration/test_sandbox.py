"""The embedded Proxmox host behaves like one: real sshd, real pct messages and exit codes, real isolation."""

import glob
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import paramiko
import pytest
import waiting
import yaml

from dflash_ops import commands, errors, transport
from dflash_ops import sandbox as sandbox_mod
from dflash_ops.inventory import load_inventory

pytestmark = pytest.mark.integration

LXC_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # lxc-attach --clear-env's
MISSING = "Configuration file 'nodes/{node}/lxc/{vmid}.conf' does not exist"


def ssh(sb, command, host="pve1", stdin=None):
    """Run a host command over OpenSSH with the pinned host key; returns (exit code, stdout, stderr)."""
    p = subprocess.run(sb.ssh_argv(command, host), input=stdin, capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


def paramiko_client(sb, known_hosts=None, host="pve1"):
    client = paramiko.SSHClient()
    client.load_host_keys(str(known_hosts or sb.known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect("127.0.0.1", port=sb.host(host).port, username="root", key_filename=str(sb.key),
                   look_for_keys=False, allow_agent=False, timeout=10)
    return client


def unique_sleep():
    """A `sleep N` whose command line no other process on this machine has."""
    return f"sleep {random.randint(10**6, 10**7)}"


def host_pids_running(cmdline):
    return [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p) == cmdline]


def wait_for(condition):
    """Poll (up to 20 s) for something another process is about to do."""
    return waiting.wait_for("a process to do what it was started for", condition, timeout=20.0, every=0.01)


def _cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


# --- the shared session sandbox (200 running, 201 stopped): nothing here changes its state ---------

def test_second_up_changes_nothing(sandbox):
    # Other tests of the session may have restarted this sandbox's sshd: compare with now, not with setup.
    now = sandbox_mod.up(sandbox.state_dir, containers=(200,), stopped=(201,),
                         inventory_path=sandbox.inventory)
    before = Path(sandbox.inventory).read_text()
    again = sandbox_mod.up(sandbox.state_dir, containers=(200,), stopped=(201,),
                           inventory_path=sandbox.inventory)
    assert again.changed == ()
    assert again.host("pve1").sshd_pid == now.host("pve1").sshd_pid
    assert again.port == now.port
    assert Path(sandbox.inventory).read_text() == before


def test_inventory_points_at_the_sandbox(sandbox):
    inv = load_inventory(sandbox.inventory)
    host = inv.hosts["pve1"]
    assert (host.address, host.port, host.user) == ("127.0.0.1", sandbox.port, "root")
    assert host.pct == str(sandbox.pct) and os.access(host.pct, os.X_OK)
    assert sorted(inv.containers) == [200, 201] and inv.default_container == 200
    raw = yaml.safe_load(Path(sandbox.inventory).read_text())["containers"][200]
    assert raw["roles"] == {"target": ["cpu"], "drafter": ["cpu", "cpu", "cpu"]}
    assert raw["tiny_target"] is True and raw["env"]["OMP_NUM_THREADS"] == "1"
    assert raw["pip_env"]["PIP_CACHE_DIR"] == sandbox_mod.PIP_CACHE_MOUNT
    known = Path(sandbox.known_hosts).read_text()
    assert known.startswith(f"[127.0.0.1]:{sandbox.port} ssh-ed25519 ")


def test_pct_is_on_the_session_path_and_status_reports(sandbox):
    code, out, _ = ssh(sandbox, "command -v pct; pct status 200; pct status 201; pct list")
    lines = out.splitlines()
    assert code == 0
    assert lines[:3] == [str(sandbox.pct), "status: running", "status: stopped"]
    assert lines[3].split() == ["VMID", "Status", "Lock", "Name"]
    assert [line.split() for line in lines[4:]] == [["200", "running", "ct200"], ["201", "stopped", "ct201"]]


def test_a_command_runs_without_this_machines_bashrc(sandbox):
    # Debian's bash reads ~/.bashrc for a command from sshd while SHLVL is unset (SSH_SOURCE_BASHRC):
    # root's .bashrc here is the test machine's, not a Proxmox host's. sshd sets SHLVL=1, bash makes
    # it 2, and at 2 it reads nothing; the session's PATH is the host's own.
    code, out, _ = ssh(sandbox, 'echo "$SHLVL"; echo "$PATH"')
    assert code == 0
    system = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert out.splitlines() == ["2", f"{sandbox.pct.parent}:{system}"]


def test_unknown_host_key_is_refused(sandbox, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        paramiko_client(sandbox, known_hosts=empty)


def test_exec_keeps_the_session_env_forces_path_and_starts_in_the_callers_cwd(sandbox):
    # pve-container 6.x: --keep-env defaults to 1, PVE's CLI forces PATH, lxc-attach adds container=lxc
    # and keeps the caller's cwd when the container has it (an SSH session starts in root's home).
    client = paramiko_client(sandbox)
    try:
        def run(line):
            _, stdout, stderr = client.exec_command(line)
            out = stdout.read().decode()
            assert stdout.channel.recv_exit_status() == 0, stderr.read()
            return out
        env = dict(line.split("=", 1)
                   for line in run("FROM_HOST='a b' pct exec 200 -- /usr/bin/env").splitlines())
        cleared = run("FROM_HOST=x pct exec 200 --keep-env 0 -- /usr/bin/env").split()
        where = run("pct exec 200 -- sh -c 'hostname; pwd; cat /proc/1/comm'").split()
        elsewhere = run("cd /usr/share && pct exec 200 -- pwd; cd /etc/ssh && pct exec 200 -- pwd; "
                        f"cd {sandbox.state_dir} && pct exec 200 -- pwd").split()
    finally:
        client.close()
    assert ((env["FROM_HOST"], env["USER"], env["PATH"], env["container"])
            == ("a b", "root", "/sbin:/bin:/usr/sbin:/usr/bin", "lxc"))
    assert "SSH_CONNECTION" in env
    # --keep-env 0 is lxc-attach --clear-env: LXC's own PATH
    assert sorted(cleared) == [f"PATH={LXC_PATH}", "container=lxc"]
    # own hostname, root's home, own pid namespace (LXC's init.lxc is pid 1)
    assert where == ["ct200", "/root", "init.lxc.static"]
    assert elsewhere == ["/usr/share", "/etc/ssh", "/"]  # the state dir is not in the container: /


def test_each_container_has_its_own_root_tmp_and_shm(sandbox):
    token = f"iso-{random.randint(0, 10**9)}"
    script = (f"for d in /root /tmp /dev/shm /var/tmp; do echo {token} > $d/{token}; done; df -k "
              "/dev/shm | tail -1")
    code, out, err = ssh(sandbox, f"pct exec 200 -- sh -c '{script}'")
    assert code == 0, err
    assert int(out.split()[1]) == 1024 * 1024  # the default 1g /dev/shm of the container config
    for host_dir in ("/tmp", "/dev/shm", "/var/tmp", "/root"):
        assert not os.path.exists(f"{host_dir}/{token}")
    ct_root = Path(sandbox.state_dir) / "pve1" / "ct" / "200" / "root"
    assert (ct_root / token).read_text() == f"{token}\n"  # /root is the container's dir on disk


def test_host_filesystem_is_read_only_and_private_dirs_hidden(sandbox):
    code, out, _ = ssh(sandbox,
                       "pct exec 200 -- sh -c 'touch /usr/x 2>&1; ls /work 2>&1; test -x /usr/bin/python3 && "
                                "test -d /opt && echo ok'")
    assert "Read-only file system" in out
    assert "No such file or directory" in out
    assert out.strip().endswith("ok")


def test_missing_and_stopped_containers_are_told_apart(sandbox):
    # A missing config file is a die with errno ENOENT still set: exit 2 (inferred from pct's source).
    code, _, err = ssh(sandbox, "pct exec 999 -- true")
    assert (code, err.strip()) == (2, MISSING.format(node="pve1", vmid=999))
    code, _, err = ssh(sandbox, "pct exec 201 -- true")
    assert (code, err.strip()) == (255, "container '201' not running!")
    code, _, err = ssh(sandbox, "pct exec 200")
    assert (code, err.strip()) == (255, "missing command at /usr/share/perl5/PVE/CLI/pct.pm line 246.")
    code, _, err = ssh(sandbox, "pct status 999")
    assert (code, err.strip()) == (2, MISSING.format(node="pve1", vmid=999))
    # push and pull ask whether it runs before they read the config: one message for stopped and missing.
    for ct in (201, 999):
        code, _, err = ssh(sandbox, f"pct push {ct} /etc/hostname /root/x")
        assert (code, err.strip()) == (255, "can only push files to a running CT")
        code, _, err = ssh(sandbox, f"pct pull {ct} /etc/hostname /tmp/x")
        assert (code, err.strip()) == (255,
                                       "can only pull files from a running VM at "
                                       "/usr/share/perl5/PVE/CLI/pct.pm "
                                            "line 664.")


@pytest.mark.parametrize("script, expected", [
    ("exit 0", 0),
    ("exit 3", 3),
    ("exit 255", 255),
    ("kill -TERM $$", 128 + 15),
    ("kill -KILL $$", 128 + 9),
])
def test_exit_codes_pass_through(sandbox, script, expected):
    code, _, _ = ssh(sandbox, f"pct exec 200 -- sh -c '{script}'")
    assert code == expected


def test_stdin_stdout_stderr_pass_through(sandbox):
    data = "line one\nüñï $(no) `expansion`\n"
    code, out, err = ssh(sandbox, "pct exec 200 -- sh -c 'cat; echo to-stderr >&2'", stdin=data)
    assert (code, out, err) == (0, data, "to-stderr\n")


@pytest.mark.parametrize("session_env, expected", [
    # No locale (no PAM): C, each non-ASCII byte is U+FFFD.
    ([], "\ufffd\ufffdn\ufffd\ufffd \ufffd\ufffd\ufffd"),
    (["-o", "SetEnv=LANG=C"], "\ufffd\ufffdn\ufffd\ufffd \ufffd\ufffd\ufffd"),
    (["-o", "SetEnv=LANG=C.UTF-8"], "ünï €"),
    (["-o", "SetEnv=LANG=C LC_CTYPE=C.UTF-8"], "ünï €"),
    (["-o", "SetEnv=LANG=C.UTF-8 LC_ALL=C"], "\ufffd\ufffdn\ufffd\ufffd \ufffd\ufffd\ufffd"),
])
def test_arguments_are_decoded_with_the_session_locale(sandbox, session_env, expected):
    argv = sandbox.ssh_argv("pct exec 200 -- printf %s 'ünï €'")
    p = subprocess.run([argv[0], *session_env, *argv[1:]], capture_output=True, timeout=60)
    assert (p.returncode, p.stdout.decode()) == (0, expected)
    assert b"perl: warning" not in p.stderr  # every locale here is installed


def test_a_session_locale_that_is_not_installed_is_c_with_perls_warning(sandbox):
    argv = sandbox.ssh_argv("pct exec 200 -- printf %s 'ü'")
    p = subprocess.run([argv[0], "-o", "SetEnv=LANG=xx_YY.UTF-8", *argv[1:]], capture_output=True, text=True,
                       timeout=60)
    assert (p.returncode, p.stdout) == (0, "\ufffd\ufffd")
    assert p.stderr.startswith("perl: warning: Setting locale failed.\n")
    assert '\tLANG = "xx_YY.UTF-8"\n' in p.stderr


def test_push_and_pull_one_file(sandbox, tmp_path):
    src = tmp_path / "in file"
    src.write_bytes(bytes(range(256)) * 64)
    dst = tmp_path / "back"
    code, out, err = ssh(sandbox, f"pct push 200 '{src}' '/dev/shm/a b' --perms 0600 && "
                                  "pct exec 200 -- stat -c %a '/dev/shm/a b' && pct pull 200 "
                                  f"'/dev/shm/a b' '{dst}'")
    assert (code, out.strip()) == (0, "600"), err
    assert dst.read_bytes() == src.read_bytes()


def test_a_new_file_gets_0666_less_the_umask(sandbox, tmp_path):
    src = tmp_path / "f"
    src.write_text("x")
    code, out, err = ssh(sandbox,
                         f"umask 022; pct push 200 {src} /tmp/m022 && umask 077 && pct push 200 {src} "
                         "/tmp/m077 && "
                                  f"pct pull 200 /tmp/m077 {tmp_path}/back && pct exec 200 -- stat -c %a "
                                  "/tmp/m022 /tmp/m077")
    assert (code, out.split(), err) == (0, ["644", "600"], "")
    assert oct((tmp_path / "back").stat().st_mode & 0o777) == "0o600"


def test_failed_push_and_pull_print_why_and_exit_0(sandbox, tmp_path):
    """pct's worker prints its error and pct exits 0 (pct.pm: fork_worker in the CLI)."""
    stale = tmp_path / "stale"
    stale.write_text("the previous content")
    code, out, err = ssh(sandbox, f"pct push 200 {tmp_path}/nothing /tmp/x; echo $?; "
                                  f"pct push 200 /etc/hostname /no/such/dir/x; echo $?; "
                                  f"pct pull 200 /no/such/file {stale}; echo $?")
    assert (code, out.split()) == (0, ["0", "0", "0"])
    assert err.splitlines() == [f"failed to open {tmp_path}/nothing for reading",
                                "failed to create file: /no/such/dir/x: No such file or directory",
                                "failed to open /no/such/file: No such file or directory"]
    assert stale.read_bytes() == b""  # pull truncates its destination before it opens the source


def test_a_push_onto_a_full_disk_is_short_and_silent(sandbox, tmp_path):
    big = tmp_path / "big"
    big.write_bytes(os.urandom(200_000))
    code, out, err = ssh(sandbox,
                         "pct exec 200 -- sh -c 'mkdir -p /root/small && mount -t tmpfs -o size=64k tmpfs "
                         "/root/small' && "
                                  f"pct push 200 {big} /root/small/big; echo $?; pct exec 200 -- stat -c %s "
                                  "/root/small/big; pct exec 200 -- umount /root/small")
    assert (code, out.split(), err) == (0, ["0", "65536"], "")


def test_pct_refuses_anyone_but_root(sandbox, tmp_path):
    # nobody cannot read the session's state dir: pct and its host.json go to a world-readable copy.
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        (Path(tmp) / "bin").mkdir()
        for name in ("pct", f"{sandbox_mod.PCT_MODULE}.py"):
            shutil.copy(Path(sandbox.pct).with_name(name), Path(tmp) / "bin" / name)
        shutil.copy(Path(sandbox.pct).parents[1] / "host.json", Path(tmp) / "host.json")
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", f"{tmp}/bin/pct",
                     "status", "200"]
        p = subprocess.run(as_nobody, capture_output=True, text=True, cwd=tmp)
    assert (p.returncode, p.stdout, p.stderr) == (255, "", "please run as root\n")


# --- a private sandbox for what changes state: stop, start, down ----------------------------------

@pytest.fixture(scope="module")
def private(sandbox_factory):
    return sandbox_factory(containers=(300, 301))


def test_a_command_killed_by_a_slow_stop_is_told_as_the_container_stopped(private):
    # pct status says "running" for a moment after pct stop killed the container's processes (here
    # for 1.5 s): the command's exit 137 is still the container stopped, not a failure of its own.
    inv = load_inventory(private.inventory)
    ct = inv.container(300)
    s = transport.HostSession(ct.host)
    s.exec(ct, ["true"])
    stopped = []
    stopper = threading.Timer(1.0, lambda: stopped.append(subprocess.run(
        [str(private.pct), "stop", "300"], env={**os.environ, "DFLASH_PCT_STOP_LAG": "1.5"},
        capture_output=True, text=True)))
    stopper.start()
    try:
        with pytest.raises(errors.ContainerStopped, match="stopped while the command ran"):
            s.exec(ct, ["sleep", "300"])
    finally:
        stopper.join()
        subprocess.run([str(private.pct), "start", "300"], check=True)
        s.close()
    assert stopped[0].returncode == 0, stopped[0].stderr


def test_list_names_a_container_without_hostname_ct_and_its_id(private):
    conf = Path(private.state_dir) / "pve1" / "nodes" / "pve1" / "lxc" / "399.conf"
    conf.write_text("arch: amd64\nostype: debian\n")
    try:
        code, out, err = ssh(private, "pct list")
    finally:
        conf.unlink()
    assert code == 0, err
    assert out.splitlines()[-1] == f"{'399':<10} {'stopped':<10} {'':<12} {'CT399':<20}"


def test_containers_do_not_see_each_others_files(private):
    code, out, err = ssh(private, "pct exec 300 -- sh -c 'echo 300 > /tmp/mine; echo 300 > /root/mine' && "
                                  "pct exec 301 -- sh -c 'cat /tmp/mine /root/mine 2>&1; hostname'")
    assert code == 0, err
    assert out.count("No such file or directory") == 2
    assert out.strip().endswith("ct301")


def test_detached_job_survives_the_ssh_session(private):
    sleep = unique_sleep()
    client = paramiko_client(private)
    try:
        _, stdout, _ = client.exec_command(f"pct exec 300 -- setsid -f {sleep} </dev/null >/dev/null 2>&1")
        assert stdout.channel.recv_exit_status() == 0
    finally:
        client.close()
    wait_for(lambda: host_pids_running(sleep))  # setsid -f returns before its child has exec'd
    code, out, _ = ssh(private, "pct exec 300 -- ps -eo args")
    assert sleep in out.splitlines()
    assert len(host_pids_running(sleep)) == 1


def test_stop_kills_every_process_and_start_gives_fresh_tmp(private):
    sleeps = [unique_sleep() for _ in range(2)]
    code, _, err = ssh(private, f"pct exec 300 -- setsid -f {sleeps[0]} </dev/null >/dev/null 2>&1; "
                                f"pct exec 300 -- setsid -f sh -c '{sleeps[1]}; true' </dev/null "
                                ">/dev/null 2>&1; pct exec 300 -- sh -c 'echo t > /tmp/t; echo s > "
                                "/dev/shm/s; echo r > /root/r'")
    assert code == 0, err
    wait_for(lambda: all(host_pids_running(s) for s in sleeps))
    code, out, err = ssh(private, "pct stop 300 && pct status 300")
    assert (code, out.strip()) == (0, "status: stopped"), err
    assert not any(host_pids_running(s) for s in sleeps)
    code, out, err = ssh(private, "pct start 300 && pct exec 300 -- sh -c 'ls -A /tmp /dev/shm; cat /root/r'")
    assert (code, out.split()) == (0, ["/dev/shm:", "/tmp:", "r"]), err  # both empty


def pct_of(sleep):
    """Host pids of `pct exec 300 -- SLEEP`: pct has exec'd lxc-attach, as pve-container's does."""
    return [int(p) for p in os.listdir("/proc")
            if p.isdigit() and _cmdline(p).startswith("/usr/bin/lxc-attach -P ")
            and _cmdline(p).endswith(f" -n 300 --keep-env -- {sleep}")]


def sshd_process_above(pid):
    while not _cmdline(pid).startswith("sshd:"):
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return pid


def test_ctrl_c_on_a_pty_ends_the_command(private):
    client = paramiko_client(private)
    try:
        sleep = unique_sleep()
        channel = client.get_transport().open_session()
        channel.get_pty()
        channel.exec_command(f"pct exec 300 -- {sleep}")
        wait_for(lambda: host_pids_running(sleep))
        channel.send(b"\x03")
        assert channel.recv_exit_status() == 128 + 2
    finally:
        client.close()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_pct_without_a_tty_leaves_the_command_running(private, signum):
    """lxc-attach dies of SIGTERM/SIGHUP and the command goes on in the container (pct-real.md)."""
    client = paramiko_client(private)
    sleep = unique_sleep()
    try:
        channel = client.get_transport().open_session()
        channel.exec_command(f"pct exec 300 -- {sleep}")
        wait_for(lambda: host_pids_running(sleep) and pct_of(sleep))
        os.kill(pct_of(sleep)[0], signum)  # as a host-side supervisor would
        wait_for(lambda: not pct_of(sleep))
        assert host_pids_running(sleep)
        assert not channel.exit_status_ready()  # sshd waits for the command, which holds the session's pipes
        ssh(private, f"pct exec 300 -- pkill -f -x '{sleep}'")
        assert channel.recv_exit_status() == -1  # and then has no exit status to give: pct's is lost
    finally:
        client.close()
    assert not host_pids_running(sleep)


def test_a_signal_to_pct_with_a_tty_hangs_the_command_up(private):
    client = paramiko_client(private)
    sleep = unique_sleep()
    try:
        channel = client.get_transport().open_session()
        channel.get_pty()
        channel.exec_command(f"pct exec 300 -- {sleep}")
        wait_for(lambda: host_pids_running(sleep) and pct_of(sleep))
        os.kill(pct_of(sleep)[0], signal.SIGTERM)
        wait_for(lambda: not host_pids_running(sleep))  # its pty hung up: SIGHUP
        channel.recv_exit_status()
    finally:
        client.close()


def test_a_killed_ssh_client_leaves_the_command_running_without_a_tty(private):
    """sshd closes the session's pipes and signals nobody: a quiet command goes on in the container."""
    sleep = unique_sleep()
    client = subprocess.Popen(private.ssh_argv(f"pct exec 300 -- {sleep}"), stdin=subprocess.PIPE)
    try:
        wait_for(lambda: host_pids_running(sleep) and pct_of(sleep))
        session = sshd_process_above(pct_of(sleep)[0])
        client.kill()
        client.wait()
        wait_for(lambda: not os.path.exists(f"/proc/{session}"))  # sshd ended the session
        code, out, _ = ssh(private, "pct exec 300 -- ps -eo args")
        assert sleep in out.splitlines()
    finally:
        ssh(private, f"pct exec 300 -- pkill -f -x '{sleep}'")
    # pkill returns once the signal is sent; the sleep ends when it next runs (a loaded 2-core
    # machine ran this check first once)
    wait_for(lambda: not host_pids_running(sleep))


def test_a_killed_ssh_session_leaves_pct_execs_command_running_but_not_a_session_tied_one(private):
    """lxc-attach semantics: sshd closes a dropped session's pipes and signals nobody, so a bare
    `pct exec` command goes on in the container (as the container's root, in its cgroup), while the
    tool's session script (commands.SESSION_SCRIPT) sees its stdin end and ends its own command."""
    bare, tied = unique_sleep(), unique_sleep()
    lines = [f"pct exec 300 -- {bare}", commands.pct_exec(300, tied.split())]
    clients = [subprocess.Popen(private.ssh_argv(line), stdin=subprocess.PIPE) for line in lines]
    try:
        wait_for(lambda: host_pids_running(bare) and host_pids_running(tied) and pct_of(bare))
        for client in clients:
            client.kill()
            client.wait()
        wait_for(lambda: not host_pids_running(tied))
        [pid] = host_pids_running(bare)
        assert os.stat(f"/proc/{pid}").st_uid == sandbox_mod.CONTAINER_ROOT_UID  # the container's root
        cgroup = f"dflash-{sandbox_mod.lxcpath(private.host('pve1').dir).name}-300"
        assert cgroup in Path(f"/proc/{pid}/cgroup").read_text()
        code, out, _ = ssh(private, "pct exec 300 -- ps -eo args")
        assert bare in out.splitlines()
    finally:
        ssh(private, f"pct exec 300 -- pkill -f -x '{bare}'")
    wait_for(lambda: not host_pids_running(bare))  # pkill does not wait for it to end


def test_dev_shm_is_the_containers_own_and_emptied_by_stop_and_by_shutdown(private):
    state = Path(private.state_dir)
    for stop in ("pct stop 301", "pct shutdown 301 --timeout 10"):
        token, sleep = f"shm-{random.randint(0, 10**9)}", unique_sleep()
        code, _, err = ssh(private, f"pct exec 301 -- sh -c 'echo {token} > /dev/shm/{token}'; "
                                    f"pct exec 301 -- setsid -f {sleep} </dev/null >/dev/null 2>&1")
        assert code == 0, err
        wait_for(lambda sleep=sleep: host_pids_running(sleep))
        [inside] = host_pids_running(sleep)  # a process of the container: its /dev/shm is a tmpfs of its own
        assert Path(f"/proc/{inside}/root/dev/shm/{token}").read_text() == f"{token}\n"
        assert not os.path.exists(f"/dev/shm/{token}") and not list(state.rglob(token))
        code, out, err = ssh(private, f"{stop} && pct status 301 && pct start 301 && "
                                      "pct exec 301 -- ls -A /dev/shm")
        assert (code, out.split()) == (0, ["status:", "stopped"]), err


def test_the_container_cannot_remount_the_hosts_dirs_or_write_outside_its_own_dir(private):
    """Unprivileged: the host's dirs are bound read-only before the container's user namespace
    exists (the pre-start hook), so the kernel locks them read-only; whatever the container can
    write lands in its own dir (its rootfs), in its tmpfs mounts, or in the shared pip cache."""
    token = f"escape-{random.randint(0, 10**9)}"
    dirs = ("/", "/root", "/tmp", "/var/tmp", "/home", "/run", "/dev/shm", "/usr", "/opt", "/etc", "/sys",
            sandbox_mod.PIP_CACHE_MOUNT)
    script = ('for d in /usr /opt /etc /sys; do mount -o remount,bind,rw "$d" 2>/dev/null && '
              'echo "remounted $d"; done; t=$1; shift; '
              'for d in "$@"; do echo x 2>/dev/null > "$d/$t" && echo "wrote $d"; done; true')
    code, out, err = ssh(private, f"pct exec 300 -- sh -c {shlex.quote(script)} sh {token} {' '.join(dirs)}")
    assert code == 0, err
    assert "remounted" not in out
    assert {line.split()[1] for line in out.splitlines()} == {
        "/", "/root", "/tmp", "/var/tmp", "/home", "/run", "/dev/shm", sandbox_mod.PIP_CACHE_MOUNT}
    for host_dir in dirs:
        assert not os.path.exists(os.path.join(host_dir, token)), host_dir
    state = Path(private.state_dir)
    ct = state / "pve1" / "ct" / "300"
    assert sorted(state.rglob(token)) == sorted([ct / token, ct / "root" / token, ct / "tmp" / token,
                                                  ct / "var" / "tmp" / token, ct / "home" / token,
                                                  state / "pip-cache" / token])
    for path in state.rglob(token):
        path.unlink()


def lxc_leftovers(sb) -> list[str]:
    """What LXC could leave of a sandbox host: monitors and attaches (ps), cgroup dirs, mounts, its
    lxcpath."""
    run = str(sandbox_mod.lxcpath(sb.host("pve1").dir))
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if str(sb.state_dir) in line or run in line]
    return ([p for p in ps if run in p] + container_cgroups(sb) + mounts
            + ([run] if os.path.exists(run) else []))


def test_down_leaves_no_process_behind(private):
    state = str(private.state_dir)
    sshd_pid = private.host("pve1").sshd_pid
    on_host, in_container = unique_sleep(), unique_sleep()
    code, _, err = ssh(private, f"setsid -f {on_host} </dev/null >/dev/null 2>&1; "
                                f"pct exec 301 -- setsid -f {in_container} </dev/null >/dev/null 2>&1")
    assert code == 0, err
    wait_for(lambda: host_pids_running(on_host) and host_pids_running(in_container))
    client = paramiko_client(private)  # an open session must not survive down() either
    sandbox_mod.down(state)
    client.close()
    assert not host_pids_running(on_host) and not host_pids_running(in_container)
    ps = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
    assert state not in ps
    assert not os.path.exists(f"/proc/{sshd_pid}")
    marker = f"{sandbox_mod.MARKER}={state}".encode()
    assert not [p for p in os.listdir("/proc") if p.isdigit() and marker in _environ(p)]
    after = sandbox_mod.status(state)
    assert after.host("pve1").sshd_pid is None
    assert set(after.host("pve1").containers.values()) == {"stopped"}
    assert lxc_leftovers(private) == []
    assert sandbox_mod.down(state).changed == ()  # a second down has nothing left to do


def test_a_session_killed_before_teardown_still_takes_its_sandbox_down(tmp_path):
    state = str(tmp_path / "state")
    session = ("import os, time; from dflash_ops import sandbox; "
               f"sb = sandbox.up({state!r}, inventory_path=None); sandbox.watch(sb.state_dir, os.getpid()); "
               "print(sb.host('pve1').sshd_pid, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", session], stdout=subprocess.PIPE, text=True,
                            cwd=Path(sandbox_mod.__file__).parents[1])
    sshd_pid = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    for _ in range(3000):  # the watcher notices within about a second, then runs down()
        if not [p for p in os.listdir("/proc") if p.isdigit() and state in _cmdline(p)]:
            break
        time.sleep(0.01)
    assert not sandbox_mod._alive(sshd_pid)  # gone, or a zombie its new parent has yet to reap
    after = sandbox_mod.status(state)
    assert after.host("pve1").sshd_pid is None
    assert after.host("pve1").containers == {200: "stopped"}
    assert state not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert lxc_leftovers(after) == []


def test_a_container_whose_monitor_was_killed_is_still_taken_down(sandbox_factory):
    """A SIGKILLed LXC monitor takes its container's init, and so every process of the container,
    with it (LXC gives init a parent-death signal) and leaves the container's cgroups behind, without
    a command socket (pct says stopped): down() still removes them."""
    sb = sandbox_factory(containers=(320,))
    sleep = unique_sleep()
    code, _, err = ssh(sb, f"pct exec 320 -- setsid -f {sleep} </dev/null >/dev/null 2>&1")
    assert code == 0, err
    wait_for(lambda: host_pids_running(sleep))
    init = sandbox_mod.init_pid(sb.host("pve1"), 320)
    run = str(sandbox_mod.lxcpath(sb.host("pve1").dir))
    [monitor] = [int(p) for p in os.listdir("/proc")
                 if p.isdigit() and _cmdline(p) == f"[lxc monitor] {run} 320"]
    os.kill(monitor, signal.SIGKILL)
    # init's parent-death signal comes with the monitor's exit, its own exit a moment later
    wait_for(lambda: not sandbox_mod._alive(monitor) and not sandbox_mod._alive(init))
    assert sandbox_mod.status(sb.state_dir).host("pve1").containers == {320: "stopped"}
    assert container_cgroups(sb, 320)
    sandbox_mod.down(sb.state_dir)
    assert not host_pids_running(sleep)
    assert lxc_leftovers(sb) == []


def test_up_refuses_to_run_without_root(tmp_path):
    # nobody may not read the checkout or its .venv (a clone in a 0700 home): it runs the venv's base
    # interpreter on copies of our package and of PyYAML in a world-readable directory of its own.
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        for package in (Path(sandbox_mod.__file__).parent, Path(yaml.__file__).parent):
            shutil.copytree(package, Path(tmp, package.name), ignore=shutil.ignore_patterns("__pycache__"))
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                     os.path.realpath(sys.executable),
                     "-c",
                     f"from dflash_ops import sandbox; sandbox.up({str(tmp_path)!r}, inventory_path=None)"]
        p = subprocess.run(as_nobody, capture_output=True, text=True, cwd=tmp)
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip().splitlines()[-1] == (
        "dflash_ops.sandbox.SandboxError: the embedded host needs root (sshd, LXC containers): "
        "run it as root")


def _environ(pid):
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


# --- several hosts: each its own sshd, port, host key and node name -------------------------------

@pytest.fixture(scope="module")
def two_hosts(sandbox_factory):
    return sandbox_factory(containers=(200,), hosts=2)


def test_two_hosts_each_run_their_own_sshd_and_containers(two_hosts):
    pve1, pve2 = two_hosts.host("pve1"), two_hosts.host("pve2")
    assert pve1.port != pve2.port and pve1.sshd_pid != pve2.sshd_pid
    assert (pve1.containers, pve2.containers) == ({200: "running"}, {201: "running"})
    inv = load_inventory(two_hosts.inventory)
    assert {n: (h.port, h.node) for n, h in inv.hosts.items()} == {"pve1": (pve1.port, "pve1"),
                                                                   "pve2": (pve2.port, "pve2")}
    assert {i: c.host.name for i, c in inv.containers.items()} == {200: "pve1", 201: "pve2"}
    again = sandbox_mod.up(two_hosts.state_dir, containers=(200,), hosts=2,
                           inventory_path=two_hosts.inventory)
    assert again.changed == ()


def test_each_host_knows_only_its_own_containers(two_hosts):
    code, out, err = ssh(two_hosts, "pct exec 201 -- hostname; pct exec 200 -- true", host="pve2")
    assert (code, out.strip(), err.strip()) == (2, "ct201", MISSING.format(node="pve2", vmid=200))
    code, _, err = ssh(two_hosts, "pct status 201", host="pve1")
    assert (code, err.strip()) == (2, MISSING.format(node="pve1", vmid=201))


def test_a_host_key_pinned_for_another_port_is_refused(two_hosts, tmp_path):
    pve1, pve2 = two_hosts.host("pve1"), two_hosts.host("pve2")
    wrong = tmp_path / "known_hosts"  # pve1's key written down for pve2's address: a changed key
    wrong.write_text(Path(two_hosts.known_hosts).read_text().replace(f"[127.0.0.1]:{pve1.port} ",
                                                                     f"[127.0.0.1]:{pve2.port} ", 1)
                     .splitlines(keepends=True)[0])
    with pytest.raises(paramiko.BadHostKeyException):
        paramiko_client(two_hosts, known_hosts=wrong, host="pve2")


def test_containers_on_two_hosts_reach_each_other_on_loopback(two_hosts):
    with socket.socket() as s:  # a free loopback port; the containers share the host's network
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = (f"import socket; s = socket.create_server(('127.0.0.1', {port})); c, _ = s.accept(); "
              "c.sendall(socket.gethostname().encode())")
    client = ("import socket, time\nfor _ in range(500):\n    try:\n"
              f"        print(socket.create_connection(('127.0.0.1', {port})).recv(64).decode()); break\n"
              "    except ConnectionRefusedError:\n        time.sleep(0.02)")
    code, _, err = ssh(two_hosts,
                       f"pct exec 200 -- setsid -f python3 -c {shlex.quote(server)} </dev/null "
                       ">/dev/null 2>&1")
    assert code == 0, err
    code, out, err = ssh(two_hosts, "pct exec 201 -- python3 -", host="pve2", stdin=client)
    assert (code, out.strip()) == (0, "ct200"), err


def test_down_stops_every_host(two_hosts):
    pids = [h.sshd_pid for h in two_hosts.hosts]
    after = sandbox_mod.down(two_hosts.state_dir)
    assert [h.sshd_pid for h in after.hosts] == [None, None]
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]
    assert [set(h.containers.values()) for h in after.hosts] == [{"stopped"}, {"stopped"}]


def container_cgroups(sb, vmid=None, host="pve1"):
    """The cgroup dirs LXC made for this sandbox host's containers (or container `vmid`), in every
    hierarchy: dflash-<host>-<vmid>, .monitor and .pivot, under the cgroup of whoever started it."""
    name = f"dflash-{sandbox_mod.lxcpath(sb.host(host).dir).name}-{vmid if vmid else ''}"
    return [d for d in glob.glob("/sys/fs/cgroup/**/" + name + "*", recursive=True) if os.path.isdir(d)]


def test_a_containers_processes_share_its_cgroup_with_the_configs_limits(sandbox_factory):
    """Proxmox's cpuunits and memory as LXC cgroup limits (v2 keys, or v1 where the machine has v1):
    what `pct exec` starts is in the container's cgroup, detached or not (lxc-attach puts it there);
    the cgroups go with `pct stop`, LXC's pivot dir included."""
    sb = sandbox_factory(containers=(310,), cpuunits=30)
    v2 = os.path.isfile("/sys/fs/cgroup/cgroup.controllers")
    own = [line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
           if line.split(":")[1] == ("" if v2 else "cpu")][0]
    root = "/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/cpu"
    name = f"dflash-{sandbox_mod.lxcpath(sb.host('pve1').dir).name}-310"
    cgroup = os.path.join(root, own.lstrip("/"), name)
    weight = Path(cgroup, "cpu.weight" if v2 else "cpu.shares").read_text().strip()
    assert weight == ("30" if v2 else str(30 * 1024 // 100))
    sleep = unique_sleep()
    limit = "/sys/fs/cgroup/memory.max" if v2 else "/sys/fs/cgroup/memory/memory.limit_in_bytes"
    code, out, err = ssh(sb, f"pct exec 310 -- setsid -f {sleep} </dev/null >/dev/null 2>&1; "
                             f"pct exec 310 -- cat {limit}")
    assert (code, out.strip()) == (0, str(4096 << 20)), err  # the config's memory: 4096, seen from inside
    wait_for(lambda: host_pids_running(sleep))
    assert host_pids_running(sleep)[0] in Path(cgroup, "cgroup.procs").read_text().split()
    code, _, err = ssh(sb, "pct stop 310")
    assert code == 0, err
    assert container_cgroups(sb, 310) == []


def test_a_privileged_container_maps_no_user(sandbox_factory):
    """`unprivileged: 0` (Proxmox's default without the key): the container's root is the host's."""
    sb = sandbox_factory(containers=(330,))
    conf = Path(sb.state_dir) / "pve1" / "nodes" / "pve1" / "lxc" / "330.conf"
    conf.write_text(conf.read_text().replace("unprivileged: 1\n", "unprivileged: 0\n"))
    sleep = unique_sleep()
    code, out, err = ssh(sb, f"pct stop 330 && pct start 330 && pct exec 330 -- cat /proc/self/uid_map && "
                             f"pct exec 330 -- setsid -f {sleep} </dev/null >/dev/null 2>&1")
    assert (code, out.split()) == (0, ["0", "0", "4294967295"]), err
    wait_for(lambda: host_pids_running(sleep))
    assert os.stat(f"/proc/{host_pids_running(sleep)[0]}").st_uid == 0
    code, out, err = ssh(sb, f"pct exec 330 -- pkill -f -x '{sleep}'; pct stop 330")
    assert code == 0, err


def test_a_container_that_cannot_start_is_named_with_lxcs_errors_and_leaves_nothing(sandbox_factory):
    """lxc-start says little (and exits 0 when init dies at once): pct start reads LXC's log."""
    sb = sandbox_factory(containers=(340,), stopped=(341,))
    conf = Path(sb.state_dir) / "pve1" / "nodes" / "pve1" / "lxc" / "341.conf"
    conf.write_text(conf.read_text() + "lxc.mount.entry: /no/such/dir mnt none bind 0 0\n")
    code, out, err = ssh(sb, "pct start 341; echo $?; pct status 341")
    assert out.split() == ["255", "status:", "stopped"], err
    assert err.startswith("startup for container '341' failed: ") and "/no/such/dir" in err, err
    assert container_cgroups(sb, 341) == []
