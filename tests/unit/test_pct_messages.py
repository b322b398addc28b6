"""pct's refusals told from a command's own failure by pct's whole last line AND its exit code, for the
texts of pve-container 6.x (docs/design.md, "The pct contract"); a push checked in the container."""

import hashlib
import json
import subprocess
import sys

import pytest

from dflash_ops import transport
from dflash_ops.errors import ContainerMissing, ContainerStopped
from dflash_ops.inventory import parse_inventory
from dflash_ops.remote import ship
from dflash_ops.transport import Result

CT = parse_inventory({"hosts": {"pve1": {"address": "pve1.example"}},
                      "containers": {200: {"host": "pve1"}}}).container(200)
MISSING = "Configuration file 'nodes/pve1/lxc/200.conf' does not exist"
STOPPED = "container '200' not running!"


@pytest.mark.parametrize("stderr, exited, expected", [
    (MISSING + "\n", 2, ContainerMissing),            # the real exit (inferred: errno ENOENT)
    (MISSING + "\n", 255, ContainerMissing),          # a die with errno unset
    (STOPPED + "\n", 255, ContainerStopped),
    # another node's name
    ("Configuration file 'nodes/pve2/lxc/200.conf' does not exist\n", 2, ContainerMissing),
    (MISSING + "\n", 1, None),                        # a command that prints pct's words, with its own code
    (STOPPED + "\n", 2, None),
    ("Configuration file 'nodes/pve1/lxc/2000.conf' does not exist\n", 2, None),  # another container
    ("error: " + STOPPED + "\n", 255, None),          # not pct's whole line
    (STOPPED + "\nthen the command went on\n", 255, None),
    ("", 255, None),
])
def test_exec_refusals_need_the_message_and_the_exit_code(stderr, exited, expected):
    found = transport.classify_container_failure(CT, Result("", stderr=stderr, exited=exited))
    assert found is None if expected is None else isinstance(found, expected)


def test_on_a_pty_pcts_words_come_on_stdout():
    result = Result("", stdout="\r\n" + MISSING + "\r\n", exited=2)
    assert transport.classify_container_failure(CT, result) is None
    assert isinstance(transport.classify_container_failure(CT, result, pty=True), ContainerMissing)


@pytest.mark.parametrize("said, exited, refused", [
    ("can only push files to a running CT", 255, True),
    ("can only pull files from a running VM at /usr/share/perl5/PVE/CLI/pct.pm line 664.", 255, True),
    ("can only pull files from a running VM", 255, True),
    ("can only push files to a running CT", 0, False),
    ("can only push files to a running CT, said a command", 255, False),
    ("failed to open /x for reading", 0, False),
])
def test_push_and_pull_refusals(said, exited, refused):
    assert transport.transfer_refused(said, exited) is refused


def push_check(tmp_path, content: bytes | None, size: int, sha: str):
    """release.py's push-check verb run here as the container runs it (the prelude and the helper through
    the loader, python -S); (exit, its one answer, stderr, what is left)."""
    part, dest = tmp_path / "f.dflash-part", tmp_path / "f"
    if content is not None:
        part.write_bytes(content)
    payload = {"part": str(part), "dest": str(dest), "size": size, "sha256": sha}
    p = subprocess.run([sys.executable, "-S", "-c", ship.LOADER, ship.packed("release"), "push-check",
                        json.dumps(payload)], capture_output=True, text=True, timeout=60)
    return p.returncode, json.loads(p.stdout), p.stderr, sorted(x.name for x in tmp_path.iterdir())


def test_a_whole_push_is_renamed_into_place(tmp_path):
    data = b"x" * 1000
    code, answer, err, left = push_check(tmp_path, data, 1000, hashlib.sha256(data).hexdigest())
    assert (code, err, left) == (0, "", ["f"])
    assert answer == {"ok": {"dest": str(tmp_path / "f"), "bytes": 1000}}
    assert (tmp_path / "f").read_bytes() == data


@pytest.mark.parametrize("content, got", [(None, None), (b"x" * 10, 10), (b"y" * 1000, 1000)])
def test_a_missing_short_or_corrupted_push_is_removed_and_refused(tmp_path, content, got):
    code, answer, err, left = push_check(tmp_path, content, 1000, hashlib.sha256(b"x" * 1000).hexdigest())
    assert (code, err, left) == (0, "", [])
    assert (answer["error"], answer["got"]) == ("short-push", got)
    assert answer["sha256"] == (hashlib.sha256(content).hexdigest() if content is not None else None)


def refused(got) -> str:
    return json.dumps({"error": "short-push", "message": "m", "got": got, "sha256": None}) + "\n"


def test_push_failure_carries_pcts_words_or_the_short_count():
    failed = Result("", stdout=refused(None), stderr="failed to open /tmp/t.tar.gz for reading\n")
    assert str(ship.push_failure(CT, failed, "the tarball", 1000)) == (
        "pve1/200: pct push of the tarball failed: failed to open /tmp/t.tar.gz for reading; nothing "
        "changed in the container")
    short = Result("", stdout=refused(512))
    said = str(ship.push_failure(CT, short, "the tarball", 1000))
    assert "wrote 512 of 1000 bytes and said nothing" in said
    # the check's answer only: a whole push, another refusal, no answer at all
    for stdout in ('{"ok": {"dest": "/x", "bytes": 1}}\n', '{"error": "mismatch", "message": "m"}\n', ""):
        assert ship.push_failure(CT, Result("", stdout=stdout), "x", 1) is None
