"""dflash_ops.mux's pure parts: which master a host's connection goes to, and when sharing is off."""

import dataclasses
import os
import signal
from pathlib import Path

import pytest

from dflash_ops import mux
from dflash_ops.errors import InventoryError
from dflash_ops.inventory import Host


@pytest.fixture
def control(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    return run / "dflash-ops"


def test_every_setting_that_decides_the_connection_names_another_master(control, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("[127.0.0.1]:2222 ssh-ed25519 AAAA\n")
    host = Host(name="pve1", address="127.0.0.1", port=2222, key=str(tmp_path / "k"), known_hosts=str(known))
    base = mux.socket_path(host)
    assert base.parent == control and base.name.endswith(".sock")
    assert mux.socket_path(dataclasses.replace(host, name="other-name", node="n")) == base  # not connection
    changed = [dataclasses.replace(host, port=2223), dataclasses.replace(host, user="ops"),
               dataclasses.replace(host, address="localhost"), dataclasses.replace(host, key=None),
               dataclasses.replace(host, known_hosts=str(tmp_path / "other"))]
    paths = {mux.socket_path(h) for h in changed} | {mux.socket_path(host, jump=host)}
    assert base not in paths and len(paths) == len(changed) + 1
    # A re-pinned host key: the same master's name (disconnect finds it); the master checks the pin at
    # every command (tests/integration/test_shared_connection.py).
    known.write_text("[127.0.0.1]:2222 ssh-ed25519 BBBB\n")
    assert mux.socket_path(host) == base
    assert mux.usable(Path("/run/user/0/dflash-ops") / base.name)
    assert not mux.usable(Path("/" + "d" * 90) / base.name)  # past a Unix socket's 107 bytes


def test_the_control_dir_must_be_private(control):
    assert mux.private_dir(control) and oct(os.stat(control).st_mode & 0o777) == "0o700"
    control.chmod(0o755)
    assert not mux.private_dir(control)
    control.chmod(0o700)
    os.chown(control, 65534, 65534) if os.geteuid() == 0 else pytest.skip("chown needs root")
    assert not mux.private_dir(control)


def test_a_file_in_place_of_the_control_dir_turns_sharing_off(control):
    control.write_text("")
    assert not mux.private_dir(control)


@pytest.mark.parametrize("env,expected", [(None, 45), ("", 45), ("0", 0), ("10", 10), ("junk", 0),
                                          ("-5", 0), ("999999", mux.MAX_PERSIST)])
def test_the_environment_overrides_the_inventory(monkeypatch, env, expected):
    if env is None:
        monkeypatch.delenv(mux.ENV, raising=False)
    else:
        monkeypatch.setenv(mux.ENV, env)
    assert mux.persist_seconds(Host(name="h", address="h.example", control_persist=45)) == expected


def test_no_master_is_no_answer(control, tmp_path):
    assert mux.run(tmp_path / "none.sock", "true") is None
    assert not mux.answers(tmp_path / "none.sock") and not mux.stop(tmp_path / "none.sock")


@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_a_special_known_hosts_is_refused_not_read(control, tmp_path, special):
    path = special
    if special == "fifo":
        path = str(tmp_path / "fifo")
        os.mkfifo(path)  # no writer: a plain open would wait forever

    def stuck(*_):
        raise TimeoutError("socket_path waited on the known_hosts file")

    old = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(10)
    try:
        with pytest.raises(InventoryError, match="not a regular file"):
            mux.socket_path(Host(name="h", address="h.example", known_hosts=path))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
