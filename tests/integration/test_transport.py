"""The transport against the embedded host: real sshd on 127.0.0.1, real pct isolation, real bash."""

import dataclasses
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from dflash_ops import errors, fetch, transport
from dflash_ops.errors import ExitStatus
from dflash_ops.inventory import load_inventory
from dflash_ops.remote import ship

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


def test_a_command_its_deadline_ended_is_a_timeout_whatever_exit_status_comes_back(inv, monkeypatch):
    """The exit status that ending a command produces (the session's end: SIGTERM, 143) may come back
    before invoke's timer thread is done, and invoke's own "timed out" reads that thread's liveness:
    on a loaded 2-core machine `invoke exec` once exited 143 instead of 13. Here the timer thread
    stays alive until the status is back, and the runner waits for the status: still TimedOut."""
    runner = transport.linear_remote()
    kill, got = runner.kill, threading.Event()

    def status_back(channel) -> bool:
        for _ in range(200):  # 10 s at most
            if channel.exit_status != -1:
                return True
            time.sleep(0.05)
        return False

    def slow_kill(self):  # the timer thread, descheduled once it has closed the channel
        kill(self)
        if status_back(self.channel):
            got.set()
        time.sleep(1)

    def returncode(self):  # the main thread, once the ending's status is back
        status_back(self.channel)
        return self.channel.exit_status
    monkeypatch.setattr(runner, "kill", slow_kill)
    monkeypatch.setattr(runner, "returncode", returncode)
    s = session(inv)
    s.own_connection()
    try:
        with pytest.raises(errors.TimedOut, match="timed out after 1 s"):
            s.exec(inv.container(200), ["sh", "-c", "exec sleep 4244"], timeout=1, check=False)
        assert got.wait(15)  # the race happened: a status came back after the channel closed
    finally:
        s.close()


def test_multibyte_characters_cut_by_a_read_arrive_whole(inv):
    # 'x' then 2-byte characters in one write: reads of 1000 bytes end in the middle of one.
    s = session(inv)
    r = s.run("""printf 'x%s' "$(printf 'é%.0s' $(seq 20000))"; """
              """printf 'y%s' "$(printf 'ü%.0s' $(seq 3000))" >&2""")
    assert r.stdout == "x" + "é" * 20000 and r.stderr == "y" + "ü" * 3000
    s.close()


def test_exit_codes_and_output_are_kept(inv):
    s = session(inv)
    ct = inv.container(200)
    r = s.exec(ct, ["sh", "-c", "echo out; echo err >&2; exit 7"], check=False)
    assert (r.exited, r.stdout, r.stderr) == (7, "out\n", "err\n")
    with pytest.raises(errors.RemoteCommandFailed) as err:
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
    with pytest.raises(errors.ContainerMissing, match="container 999 does not exist"):
        s.exec(missing, ["true"])
    stopped = inv.container(201)
    with pytest.raises(errors.ContainerStopped, match="container 201 .* is stopped"):
        s.exec(stopped, ["true"])
    # A command that itself exits 255 is not mistaken for either.
    assert s.exec(ct, ["sh", "-c", "exit 255"], check=False).exited == 255
    # Nor one that prints pct's words with an exit code of its own.
    said = s.exec(ct, ["sh", "-c", "echo \"container '200' not running!\" >&2; exit 1"], check=False)
    assert (said.exited, said.stderr) == (1, "container '200' not running!\n")
    s.close()


def test_push_and_stream_refusals_name_a_stopped_or_missing_container(inv):
    """pct push says "can only push files to a running CT" for both, fetch's streamed `pct exec` its
    own words: `pct status` tells them apart."""
    s = session(inv)
    missing = dataclasses.replace(inv.container(200), ctid=999)
    for ct, error in ((inv.container(201), "container 201 on host pve1 is stopped"),
                      (missing, "container 999 does not exist on host pve1")):
        with pytest.raises(errors.ContainerError, match=error):
            s.run_in(ct, ship.push_line(ct, "/etc/hostname", "/tmp/x", 1, "0" * 64))
        with pytest.raises(errors.ContainerError, match=error):
            list(fetch.stream(s, ct, "/etc/hostname"))
    s.close()


def test_on_a_pty_a_missing_container_is_still_named(inv):
    """`logs --follow` and the warm-up run on a pty, where pct's words arrive on stdout and a real
    missing container exits 2: not "the connection was lost"."""
    s = session(inv)
    missing = dataclasses.replace(inv.container(200), ctid=999)
    with pytest.raises(errors.ContainerMissing, match="container 999 does not exist"):
        s.exec(missing, ["true"], pty=True, check=False)
    s.close()


def test_unreachable_port_fails_fast_with_one_line(sandbox, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    path = variant(sandbox, tmp_path, lambda h: h.update(port=closed_port))
    s = session(load_inventory(path))
    with pytest.raises(errors.HostUnreachable, match=f"cannot reach .*127.0.0.1:{closed_port}"):
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
    with pytest.raises(errors.HostUnreachable):
        s.run("true")
    server.close()


def test_wrong_key_is_refused(sandbox, tmp_path):
    key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    path = variant(sandbox, tmp_path, lambda h: h.update(key=str(key)))
    with pytest.raises(errors.AuthFailed, match="authentication refused"):
        session(load_inventory(path)).run("true")


def test_unknown_host_key_is_refused_never_trusted(sandbox, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    path = variant(sandbox, tmp_path, lambda h: h.update(known_hosts=str(empty)))
    with pytest.raises(errors.HostKeyUnknown, match="not pinned.*invoke trust-host"):
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
    with pytest.raises(errors.HostKeyChanged, match="CHANGED.*refusing"):
        session(load_inventory(path)).run("true")

    offered = transport.fingerprint(transport.HostSession(host).offered_host_key())
    wrong = invoke("trust-host", "--host", host.name, "--fingerprint", "SHA256:nope", "--inventory", path)
    assert wrong.returncode != ExitStatus.OK and "fingerprint mismatch" in wrong.stderr
    assert blob in known.read_text()
    ok = invoke("trust-host", "--host", host.name, "--fingerprint", offered, "--inventory", path)
    assert ok.returncode == ExitStatus.OK, ok.stderr
    assert session(load_inventory(path)).run("echo ok").stdout == "ok\n"


def test_cli_reports_container_errors_as_one_line_and_exit_code(sandbox):
    # The transport's errors reach the user through any task; trust-host with a bad host is the
    # simplest task that exists in every build of tasks.py.
    r = invoke("trust-host", "--host", "nope", "--inventory", str(sandbox.inventory))
    assert r.returncode == ExitStatus.USAGE
    assert r.stderr.strip().count("\n") == 0 and "no host 'nope'" in r.stderr


def test_dry_run_connects_to_nothing(sandbox, tmp_path, capsys):
    path = variant(sandbox, tmp_path, lambda h: h.update(address="unreachable.example"))
    inv = load_inventory(path)
    s = session(inv, dry_run=True)
    r = s.exec(inv.container(200), ["echo", "$(id)"], env={"A": "b c"})
    assert r.exited == 0 and s.connections == 0
    out = capsys.readouterr().out.strip()
    assert out.endswith("dflash-session env -i -- 'A=b c' echo '$(id)'")


# --- pct decodes its arguments with the session's locale ------------------------------------------

UNICODE = ["ünï €", "日本語", "données/é"]


def echoes_unicode(s, ct):
    r = s.exec(ct, ["sh", "-c", 'printf "%s|" "$@" "$U"', "sh", *UNICODE], env={"U": "ünï"}, cwd="/tmp")
    return r.stdout.split("|")[:-1]


def test_non_ascii_values_arrive_intact_when_the_host_locale_is_c(inv):
    # The embedded host's sessions get no LANG (no PAM): pct's locale is C, which alone would make
    # every non-ASCII byte a U+FFFD (test_sandbox.py); pct runs under LC_ALL=C.UTF-8 instead.
    s = session(inv)
    assert echoes_unicode(s, inv.container(200)) == [*UNICODE, "ünï"]
    assert s.round_trips == 2  # the first non-ASCII line is preceded by one check of pct's locale
    assert echoes_unicode(s, inv.container(200)) == [*UNICODE, "ünï"] and s.round_trips == 3
    s.close()


def test_non_ascii_values_arrive_intact_when_the_host_locale_is_utf8(sandbox_factory):
    utf8 = sandbox_factory(containers=(230,), session_locale="C.UTF-8")
    inv = load_inventory(utf8.inventory)
    s = transport.HostSession(inv.container(230).host)
    assert echoes_unicode(s, inv.container(230)) == [*UNICODE, "ünï"]
    s.close()


def test_a_host_where_the_utf8_locale_cannot_reach_pct_refuses_non_ascii_in_one_line(sandbox, tmp_path):
    # A pct that never sees LC_ALL (as under a sudo that drops it, or a host without the locale).
    wrapper = tmp_path / "pct-c-locale"
    wrapper.write_text(f"#!/bin/sh\nexec env -u LC_ALL {sandbox.pct} \"$@\"\n")
    wrapper.chmod(0o755)
    inv = load_inventory(variant(sandbox, tmp_path, lambda h: h.update(pct=str(wrapper))))
    s = session(inv)
    ct = inv.container(200)
    marker = f"/tmp/never-{os.getpid()}"
    with pytest.raises(errors.UnsafeValue) as err:
        s.exec(ct, ["touch", marker, "ü"])
    said = str(err.value)
    assert "\n" not in said and "did not reach pct" in said and "locales" in said
    assert s.exec(ct, ["test", "-e", marker], check=False).exited == 1  # nothing ran
    assert s.exec(ct, ["echo", "ascii"]).stdout == "ascii\n"  # ASCII lines need no check
    s.close()
