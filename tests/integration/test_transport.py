"""The transport against the embedded host: real sshd on 127.0.0.1, real pct isolation, real bash."""

import dataclasses
import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest
import yaml

from dflash_ops import transport
from dflash_ops.errors import (AuthFailed, ContainerMissing, ContainerStopped, HostKeyChanged, HostKeyUnknown,
                               HostUnreachable, RemoteCommandFailed)
from dflash_ops.inventory import load_inventory

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def inv(sandbox):
    return load_inventory(sandbox.inventory)


def session(inv, host=None, **kw):
    ct = inv.container(200)
    return transport.HostSession(host or ct.host, **kw)


def variant(sandbox, tmp_path, mutate):
    """A copy of the sandbox inventory with one host field changed."""
    data = yaml.safe_load(Path(sandbox.inventory).read_text())
    host = next(iter(data["hosts"].values()))
    mutate(host)
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def invoke(*args, env=None):
    return subprocess.run([str(REPO / ".venv/bin/invoke"), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_command_runs_in_the_container_with_the_env_and_cwd_asked_for(inv):
    s = session(inv)
    ct = inv.container(200)
    r = s.exec(ct, ["sh", "-c", 'printf "%s|%s|%s|%s" "$A" "$PWD" "$(hostname)" "$PATH"'],
               env={"A": "x y $(id) `id` ; 'q' \"d\"", "PATH": "/usr/bin:/bin"}, cwd="/tmp")
    a, pwd, hostname, path = r.stdout.split("|")
    assert a == "x y $(id) `id` ; 'q' \"d\""
    assert pwd == "/tmp" and path == "/usr/bin:/bin"
    assert hostname != socket.gethostname()
    # Nothing else leaked in: pct passes no environment and env -i starts from nothing.
    env = s.exec(ct, ["env"], env={"ONLY": "1"}).stdout.split()
    assert env == ["ONLY=1"]
    assert s.connections == 1 and s.round_trips == 2
    s.close()


def test_exit_codes_and_output_are_kept(inv):
    s = session(inv)
    ct = inv.container(200)
    r = s.exec(ct, ["sh", "-c", "echo out; echo err >&2; exit 7"], check=False)
    assert (r.exited, r.stdout, r.stderr) == (7, "out\n", "err\n")
    with pytest.raises(RemoteCommandFailed) as err:
        s.exec(ct, ["sh", "-c", "echo first >&2; echo 'the last line' >&2; exit 3"])
    assert err.value.exited == 3 and "the last line" in str(err.value) and "\n" not in str(err.value)
    s.close()


def test_hostile_values_execute_nothing(inv):
    s = session(inv)
    ct = inv.container(200)
    marker = "/tmp/dflash-pwned"
    hostile = [f"; touch {marker}", f"$(touch {marker})", f"`touch {marker}`", f"a\ntouch {marker}",
               f"' ; touch {marker} ; '", f"\" ; touch {marker} ; \"", f"&& touch {marker}"]
    r = s.exec(ct, ["printf", "%s\\0", *hostile], env={"E": f"$(touch {marker})"}, cwd="/tmp")
    assert r.stdout.split("\0")[:-1] == hostile
    assert s.exec(ct, ["ls", "/tmp"]).stdout.split().count("dflash-pwned") == 0
    assert not Path(marker).exists()
    s.close()


def test_missing_and_stopped_containers_are_told_apart(inv, sandbox):
    s = session(inv)
    ct = inv.container(200)
    missing = dataclasses.replace(ct, ctid=999)
    with pytest.raises(ContainerMissing, match="container 999 does not exist"):
        s.exec(missing, ["true"])
    stopped = inv.container(201)
    with pytest.raises(ContainerStopped, match="container 201 .* is stopped"):
        s.exec(stopped, ["true"])
    # A command that itself exits 255 is not mistaken for either.
    assert s.exec(ct, ["sh", "-c", "exit 255"], check=False).exited == 255
    s.close()


def test_unreachable_port_fails_fast_with_one_line(sandbox, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    path = variant(sandbox, tmp_path, lambda h: h.update(port=closed_port))
    s = session(load_inventory(path))
    with pytest.raises(HostUnreachable, match=f"cannot reach .*127.0.0.1:{closed_port}"):
        s.run("true")


def test_silent_host_times_out_within_the_connect_timeout(sandbox, tmp_path):
    """A host that accepts TCP but never speaks SSH must not hang the task."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held = []
    threading.Thread(target=lambda: held.append(server.accept()), daemon=True).start()
    path = variant(sandbox, tmp_path, lambda h: h.update(port=server.getsockname()[1]))
    s = session(load_inventory(path), connect_timeout=1.5)
    with pytest.raises(HostUnreachable):
        s.run("true")
    server.close()


def test_wrong_key_is_refused(sandbox, tmp_path):
    key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    path = variant(sandbox, tmp_path, lambda h: h.update(key=str(key)))
    with pytest.raises(AuthFailed, match="authentication refused"):
        session(load_inventory(path)).run("true")


def test_unknown_host_key_is_refused_never_trusted(sandbox, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    path = variant(sandbox, tmp_path, lambda h: h.update(known_hosts=str(empty)))
    with pytest.raises(HostKeyUnknown, match="not pinned.*invoke trust-host"):
        session(load_inventory(path)).run("true")
    assert empty.read_text() == ""  # nothing was added behind the user's back


def test_changed_host_key_is_refused_then_pinned_deliberately(sandbox, tmp_path):
    inv0 = load_inventory(sandbox.inventory)
    host = inv0.container(200).host
    forged = tmp_path / "forged"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(forged)], check=True)
    kind, blob = Path(f"{forged}.pub").read_text().split()[:2]
    known = tmp_path / "known_hosts"
    known.write_text(f"{transport.known_hosts_name(host)} {kind} {blob}\n")
    path = variant(sandbox, tmp_path, lambda h: h.update(known_hosts=str(known)))
    with pytest.raises(HostKeyChanged, match="CHANGED.*refusing"):
        session(load_inventory(path)).run("true")

    offered = transport.fingerprint(transport.HostSession(host).offered_host_key())
    wrong = invoke("trust-host", "--host", host.name, "--fingerprint", "SHA256:nope", "--inventory", path)
    assert wrong.returncode != 0 and "fingerprint mismatch" in wrong.stderr
    assert blob in known.read_text()
    ok = invoke("trust-host", "--host", host.name, "--fingerprint", offered, "--inventory", path)
    assert ok.returncode == 0, ok.stderr
    assert session(load_inventory(path)).run("echo ok").stdout == "ok\n"


def test_cli_reports_container_errors_as_one_line_and_exit_code(sandbox):
    # The transport's errors reach the user through any task; trust-host with a bad host is the
    # simplest task that exists in every build of tasks.py.
    r = invoke("trust-host", "--host", "nope", "--inventory", str(sandbox.inventory))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "no host 'nope'" in r.stderr


def test_dry_run_connects_to_nothing(sandbox, tmp_path, capsys):
    path = variant(sandbox, tmp_path, lambda h: h.update(address="unreachable.example"))
    inv = load_inventory(path)
    s = session(inv, dry_run=True)
    r = s.exec(inv.container(200), ["echo", "$(id)"], env={"A": "b c"})
    assert r.exited == 0 and s.connections == 0
    out = capsys.readouterr().out.strip()
    assert out.endswith("exec 200 -- env -i -- 'A=b c' echo '$(id)'")
