"""Connection sharing between invocations (dflash_ops.mux) against the embedded host: real sshd on
127.0.0.1, real pct isolation. The rest of the suite runs with sharing off (tests/conftest.py); these
tests turn it on, each with its own control directory."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from dflash_ops import errors, mux, transport
from dflash_ops.inventory import load_inventory

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def shared(sandbox, monkeypatch):
    """Sharing on (30 s), a private control dir of this test's own; every master left is stopped.
    The dir is short: a socket's path holds 107 bytes, and pytest's tmp_path can take most of them."""
    control = Path(tempfile.mkdtemp(prefix="cp-"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(control))
    monkeypatch.setenv(mux.ENV, "30")
    inv = load_inventory(sandbox.inventory)
    ct = inv.container(200)
    path = mux.socket_path(ct.host)
    yield inv, ct, path
    mux.stop(path)
    gone_by = time.monotonic() + 10
    while master_pids(path) and time.monotonic() < gone_by:
        time.sleep(0.1)
    for pid in master_pids(path):
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(control, ignore_errors=True)


def master_pids(path: Path) -> list[int]:
    """The masters of this test's control dir: found by the environment they inherit (their argv holds
    nothing of the host)."""
    found, control = [], f"XDG_RUNTIME_DIR={path.parent.parent}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if mux.MASTER_MODULE.encode() in cmdline and control in environ:
            found.append(int(pid))
    return found


def wait_for_master(path: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not mux.answers(path):
        assert time.monotonic() < deadline, f"no master answered at {path} within {timeout} s"
        time.sleep(0.05)


def in_container(s: transport.HostSession, ct, script: str) -> str:
    return s.exec(ct, ["sh", "-c", script], check=False).stdout


# Output that crosses the master's 64 KiB frames in the middle of a character, on both streams.
BIG = "head -c 300001 /dev/zero | tr '\\0' x; printf 'é%.0s' $(seq 70000); printf 'ü€' >&2; exit 7"


def test_the_next_session_runs_through_the_master_with_the_same_results(shared):
    inv, ct, path = shared
    first = transport.HostSession(ct.host)
    cases = [["sh", "-c", "echo out; echo err >&2; exit 3"], ["sh", "-c", BIG],
             ["sh", "-c", "printf '%s' \"$X\"; exit 0"]]
    own = [first.exec(ct, argv, env={"X": "a 'b' $(c)"}, check=False) for argv in cases]
    assert first.connections == 1
    wait_for_master(path)
    second = transport.HostSession(ct.host)
    through = [second.exec(ct, argv, env={"X": "a 'b' $(c)"}, check=False) for argv in cases]
    assert second.connections == 0 and second.round_trips == 4  # 3, and the check of pct's locale
    assert [(r.stdout, r.stderr, r.exited) for r in through] == [(r.stdout, r.stderr, r.exited) for r in own]
    assert through[1].stdout.endswith("é" * 70000) and through[1].stderr == "ü€" and through[1].exited == 7
    with pytest.raises(errors.RemoteCommandFailed) as err:
        second.exec(ct, ["sh", "-c", "echo 'the last line' >&2; exit 4"])
    assert err.value.exited == 4 and "the last line" in str(err.value)
    # A stopped container is still told apart from a command's failure.
    with pytest.raises(errors.ContainerStopped):
        second.exec(inv.container(201), ["true"])
    first.close()


def test_a_task_through_the_master_imports_no_paramiko(shared):
    inv, ct, path = shared
    env = {**os.environ, "DFLASH_OPS_STATS": "1"}
    argv = [str(REPO / ".venv/bin/invoke"), "status", "--json", "--inventory", str(inv.path), "--ct", "200"]
    first = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "pve1: 1 connection(s), 1 round trip(s)" in first.stderr
    wait_for_master(path)
    second = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert "pve1: 0 connection(s), 1 round trip(s)" in second.stderr
    # The same answer: the container's latest run, if another test left one (its ages and the free
    # disk space move on).
    stable = ("run", "state", "detail", "pid", "step", "checkpoint_step", "code_version")
    answers = [json.loads(r.stdout) for r in (first, second)]
    assert [answers[1].get(k) for k in stable] == [answers[0].get(k) for k in stable]
    # What a task through the master has imported: not paramiko, not fabric.
    code = ("import sys; from dflash_ops.inventory import load_inventory; from dflash_ops.transport import "
            "HostSession; ct = load_inventory(sys.argv[1]).container(200); HostSession(ct.host).exec(ct, "
            "['true']); print(sorted(m for m in ('paramiko', 'fabric') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, str(inv.path)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_command_that_closes_its_output_and_runs_on_is_waited_for_without_spinning(shared):
    inv, ct, path = shared
    transport.HostSession(ct.host).exec(ct, ["true"])
    wait_for_master(path)
    (master,) = master_pids(path)
    before = cpu_seconds(master)
    s = transport.HostSession(ct.host)
    r = s.run("echo early; exec >&- 2>&-; sleep 3; exit 5", check=False)  # on the host: sshd sees EOF
    assert (r.stdout, r.exited, s.connections) == ("early\n", 5, 0)
    # Three seconds with both streams closed: a master polling the ended channel in a loop would
    # burn most of them; one waiting on its client spends next to nothing.
    assert cpu_seconds(master) - before < 0.5


def test_a_timeout_through_the_master_ends_the_command_in_the_container(shared):
    inv, ct, path = shared
    own = transport.HostSession(ct.host)
    own.exec(ct, ["true"])
    wait_for_master(path)
    s = transport.HostSession(ct.host)
    with pytest.raises(errors.RemoteCommandFailed, match="timed out after 1 s"):
        s.exec(ct, ["sh", "-c", "exec sleep 4242"], timeout=1)
    assert s.connections == 0
    deadline = time.monotonic() + 15
    while "sleep 4242" in in_container(own, ct, "ps -eo args"):
        assert time.monotonic() < deadline, "the command outlived its timed-out session"
        time.sleep(0.2)
    own.close()


def test_a_client_killed_mid_command_ends_the_command_in_the_container(shared):
    inv, ct, path = shared
    own = transport.HostSession(ct.host)
    own.exec(ct, ["true"])
    wait_for_master(path)
    code = ("import sys; from dflash_ops.inventory import load_inventory; from dflash_ops.transport import "
            "HostSession; ct = load_inventory(sys.argv[1]).container(200); "
            "HostSession(ct.host).exec(ct, ['sh', '-c', 'echo started; exec sleep 4343'], stream=True)")
    client = subprocess.Popen([sys.executable, "-c", code, str(inv.path)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    assert client.stdout.readline() == "started\n"  # streamed through the master as it came
    assert "sleep 4343" in in_container(own, ct, "ps -eo args")
    client.send_signal(signal.SIGKILL)  # as a closed terminal: nothing in the client cleans up
    client.wait(timeout=30)
    deadline = time.monotonic() + 15
    while "sleep 4343" in in_container(own, ct, "ps -eo args"):
        assert time.monotonic() < deadline, "the command outlived its client"
        time.sleep(0.2)
    # The master goes on serving.
    assert transport.HostSession(ct.host).exec(ct, ["echo", "ok"]).stdout == "ok\n"
    own.close()


def test_an_idle_master_leaves_and_a_killed_one_is_replaced(shared, monkeypatch):
    inv, ct, path = shared
    monkeypatch.setenv(mux.ENV, "1")
    transport.HostSession(ct.host).exec(ct, ["true"])
    wait_for_master(path)
    deadline = time.monotonic() + 20
    while master_pids(path) or path.exists():
        assert time.monotonic() < deadline, "an idle master did not leave"
        time.sleep(0.2)
    monkeypatch.setenv(mux.ENV, "30")
    s = transport.HostSession(ct.host)
    s.exec(ct, ["true"])
    assert s.connections == 1  # nobody to share with: its own connection, and a master left behind
    wait_for_master(path)
    for pid in master_pids(path):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while mux.answers(path):  # its listening socket goes last as it exits
        assert time.monotonic() < deadline, "a killed master still answers"
        time.sleep(0.05)
    assert path.exists()  # what a killed master leaves
    s = transport.HostSession(ct.host)
    assert s.exec(ct, ["echo", "ok"]).stdout == "ok\n" and s.connections == 1
    wait_for_master(path)  # a new one
    assert mux.stop(path) and not path.exists()


def test_sharing_is_off_without_a_private_control_dir_or_with_zero(shared, monkeypatch, tmp_path):
    inv, ct, path = shared
    monkeypatch.setenv(mux.ENV, "0")
    s = transport.HostSession(ct.host)
    s.exec(ct, ["true"])
    assert s.connections == 1 and s.shared_path() is None
    time.sleep(0.5)
    assert not master_pids(path)
    opened = tmp_path / "open"
    opened.mkdir()
    opened.chmod(0o755)
    (opened / "dflash-ops").mkdir(mode=0o755)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(opened))
    monkeypatch.setenv(mux.ENV, "30")
    s = transport.HostSession(ct.host)
    s.exec(ct, ["true"])
    assert s.connections == 1 and s.shared_path() is None


def test_doctor_checks_a_connection_of_its_own(shared):
    inv, ct, path = shared
    transport.HostSession(ct.host).exec(ct, ["true"])
    wait_for_master(path)
    argv = [str(REPO / ".venv/bin/invoke"), "doctor", "--inventory", str(inv.path), "--ct", "200"]
    r = subprocess.run(argv, cwd=REPO, env={**os.environ, "DFLASH_OPS_STATS": "1"}, capture_output=True,
                       text=True, timeout=120)
    assert "pve1: 1 connection(s)" in r.stderr, r.stderr
    assert "host reachable" in r.stdout


def test_the_masters_argv_shows_nothing_of_the_host(shared):
    inv, ct, path = shared
    transport.HostSession(ct.host).exec(ct, ["true"])
    wait_for_master(path)
    (pid,) = master_pids(path)
    shown = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")  # what `ps` shows every user
    for private in (ct.host.address, ct.host.key, ct.host.known_hosts, f'"user": "{ct.host.user}"',
                    f'"port": {ct.host.port}', str(path)):
        assert private.encode() not in shown, (private, shown)
    assert shown.endswith(f"-m {mux.MASTER_MODULE} ".encode()), shown


def keygen(path: Path) -> tuple[str, str]:
    """A new ed25519 key at `path`: its type and base64 blob."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True,
                   stdin=subprocess.DEVNULL)
    kind, blob = Path(f"{path}.pub").read_text().split()[:2]
    return kind, blob


def own_known_hosts(inv, tmp_path) -> tuple[Path, Path]:
    """The inventory again, with a copy of its known_hosts file that the test may change."""
    known = tmp_path / "known_hosts"
    known.write_text(Path(inv.container(200).host.known_hosts).read_text())
    data = yaml.safe_load(Path(inv.path).read_text())
    for host in data["hosts"].values():
        host["known_hosts"] = str(known)
    variant = tmp_path / "inventory.yaml"
    variant.write_text(yaml.safe_dump(data))
    return variant, known


def test_disconnect_finds_the_master_after_a_re_pin(shared, tmp_path):
    inv, ct, path = shared
    variant, known = own_known_hosts(inv, tmp_path)
    host = load_inventory(variant).container(200).host
    transport.HostSession(host).exec(ct, ["true"])
    master = mux.socket_path(host)
    wait_for_master(master)
    # A re-pin rewrites known_hosts (trust-host); the host's own key stays pinned.
    kind, blob = keygen(tmp_path / "other")
    known.write_text(known.read_text() + f"other.example {kind} {blob}\n")
    r = subprocess.run([str(REPO / ".venv/bin/invoke"), "disconnect", "--host", host.name, "--inventory",
                        str(variant)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == f"{host.name}: closed\n", r.stdout + r.stderr
    deadline = time.monotonic() + 10
    while master_pids(master):
        assert time.monotonic() < deadline, "the master did not leave after disconnect"
        time.sleep(0.1)


def test_a_re_pinned_key_ends_the_master_at_its_next_command(shared, tmp_path):
    """known_hosts now pins another key for the host: the master refuses to serve on the connection it
    opened with the old one, and the task's own connection refuses the host (exit 4's error)."""
    inv, ct, path = shared
    variant, known = own_known_hosts(inv, tmp_path)
    host = load_inventory(variant).container(200).host
    transport.HostSession(host).exec(ct, ["true"])
    wait_for_master(mux.socket_path(host))
    kind, blob = keygen(tmp_path / "forged")
    known.write_text(f"{transport.known_hosts_name(host)} {kind} {blob}\n")
    with pytest.raises(errors.HostKeyChanged):
        transport.HostSession(host).exec(ct, ["true"])


def test_a_host_key_changed_while_a_master_lives_is_noticed(sandbox_factory, monkeypatch):
    """The host starts offering another key (reinstalled, or someone else answers at its address) while a
    master holds a connection opened with the old one: within HOST_KEY_RECHECK_S the master asks the host
    for its key again, refuses, and the task meets the changed key on its own connection."""
    box = sandbox_factory(containers=(200,))
    control = Path(tempfile.mkdtemp(prefix="cp-"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(control))
    monkeypatch.setenv(mux.ENV, "60")
    ct = load_inventory(box.inventory).container(200)
    path = mux.socket_path(ct.host)
    try:
        transport.HostSession(ct.host).exec(ct, ["true"])
        wait_for_master(path)
        through = transport.HostSession(ct.host)
        assert through.exec(ct, ["echo", "ok"]).stdout == "ok\n" and through.connections == 0
        hdir = box.host("pve1").dir
        for name in ("ssh_host_ed25519_key", "ssh_host_ed25519_key.pub"):
            (hdir / name).unlink()
        _, blob = keygen(hdir / "ssh_host_ed25519_key")
        os.kill(box.host("pve1").sshd_pid, signal.SIGHUP)  # sshd re-executes: new connections get the new key
        def offered():  # sshd closes its listening socket while it re-executes: refused meanwhile
            try:
                return transport.HostSession(ct.host).offered_host_key().get_base64()
            except OSError:
                return None

        deadline = time.monotonic() + 30
        while offered() != blob:
            assert time.monotonic() < deadline, "sshd did not take its new host key"
            time.sleep(0.1)
        time.sleep(mux.HOST_KEY_RECHECK_S)  # the interval the master may serve on its last check
        with pytest.raises(errors.HostKeyChanged, match="CHANGED"):
            transport.HostSession(ct.host).exec(ct, ["true"])
        assert not mux.answers(path)
    finally:
        mux.stop(path)
        for pid in master_pids(path):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(control, ignore_errors=True)
