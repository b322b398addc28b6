"""Local inputs read as data: the inventory YAML strictly (duplicate keys, alias bombs), regular files of
bounded size only (no /dev/zero, no FIFO), and a private key that OpenSSH would refuse is refused."""

import os
import threading
from pathlib import Path

import pytest

from dflash_ops import localfiles, transport
from dflash_ops.errors import InventoryError
from dflash_ops.inventory import Host, load_inventory

REPO = Path(__file__).resolve().parents[2]


def good_text() -> str:
    return next(p for p in sorted((REPO / "inventory").glob("*.yaml"))).read_text()


def test_duplicate_keys_are_refused_with_file_key_and_line(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("default_container: 200\nhosts:\n  pve1: {address: a.example}\n"
                   "  pve1: {address: b.example}\ncontainers: {}\n")
    with pytest.raises(InventoryError) as caught:
        load_inventory(inv)
    assert str(caught.value) == f"{inv}: line 4: duplicate key 'pve1' (first at line 3): remove one of them"


def test_duplicate_top_level_key_is_refused(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text(good_text() + "\ndefault_container: 201\n")
    with pytest.raises(InventoryError, match="duplicate key 'default_container'"):
        load_inventory(inv)


BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8))


def test_an_alias_bomb_is_refused_quickly(tmp_path):
    inv = tmp_path / "bomb.yaml"
    inv.write_text(BOMB)
    result = {}
    worker = threading.Thread(target=lambda: result.update(error=_load_error(inv)), daemon=True)
    worker.start()
    worker.join(60)  # a bound on a hang, not a timing check: walking it would take hours
    assert not worker.is_alive(), "the alias bomb was expanded"
    assert result["error"].startswith(f"{inv}: line ") and "(an alias bomb?)" in result["error"], result


def _load_error(path) -> str:
    try:
        load_inventory(path)
    except InventoryError as exc:
        return str(exc)
    return "loaded"


def test_a_few_aliases_still_load():
    assert (localfiles.load_yaml("a: &x {k: 1}\nb: *x\nc: *x\n", "f")
            == {"a": {"k": 1}, "b": {"k": 1}, "c": {"k": 1}})


def test_self_referring_alias_is_refused():
    with pytest.raises(InventoryError, match="refers to itself"):
        localfiles.load_yaml("a: &x [1, *x]\n", "f")


def test_deep_nesting_is_one_line(tmp_path):
    inv = tmp_path / "deep.yaml"
    inv.write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(InventoryError, match="nested too deeply"):
        load_inventory(inv)


@pytest.mark.parametrize("what", ["dev_zero", "fifo", "directory", "too_big"])
def test_inventory_must_be_a_small_regular_file(tmp_path, what):
    path = tmp_path / "inv.yaml"
    if what == "dev_zero":
        path = Path("/dev/zero")
    elif what == "fifo":
        os.mkfifo(path)  # no writer: a plain open would wait forever
    elif what == "directory":
        path.mkdir()
    else:
        path.write_text("# " + "x" * localfiles.INVENTORY_MAX + "\n")
    with pytest.raises(InventoryError) as caught:
        load_inventory(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: the inventory ") and "\n" not in message
    assert ("more than" in message) if what == "too_big" else ("not a regular file" in message)


def host(tmp_path, **kw) -> Host:
    return Host(name="pve1", address="127.0.0.1", port=1, user="root", **kw)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_private_key_others_can_read_is_refused_like_openssh(tmp_path, mode):
    key = tmp_path / "id_ed25519"
    key.write_text("not really a key\n")
    key.chmod(mode)
    with pytest.raises(InventoryError) as caught:
        transport.HostSession(host(tmp_path, key=str(key), known_hosts=str(tmp_path / "kh"))).connect()
    assert str(caught.value) == (f"{key}: UNPROTECTED PRIVATE KEY FILE: permissions {mode:04o} are too "
                                 "open (group or others can read it), and OpenSSH ignores such a key: run "
                                 f"`chmod 600 {key}`")


@pytest.mark.parametrize("where", ["key", "known_hosts"])
@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_key_and_known_hosts_must_be_regular_files(tmp_path, where, special):
    path = special
    if special == "fifo":
        path = str(tmp_path / "fifo")
        os.mkfifo(path)
    kw = {"key": path, "known_hosts": str(tmp_path / "kh")} if where == "key" else {"known_hosts": path}
    with pytest.raises(InventoryError, match="not a regular file"):
        transport.HostSession(host(tmp_path, **kw)).connect()


def test_pinning_refuses_a_special_known_hosts(tmp_path):
    with pytest.raises(InventoryError, match="not a regular file"):
        transport.pin_host_key(host(tmp_path, known_hosts="/dev/zero"), None)


def test_yaml_errors_still_name_the_line(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("a: [1, 2\n")
    with pytest.raises(InventoryError, match="not valid YAML"):
        load_inventory(inv)
