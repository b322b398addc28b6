"""pct's refusals told from a command's own failure by pct's whole last line AND its exit code, for the
texts of pve-container 6.x (docs/design.md, "The pct contract"); a push checked in the container."""

import subprocess

import pytest

from dflash_ops import commands, transport
from dflash_ops.errors import ContainerMissing, ContainerStopped
from dflash_ops.inventory import parse_inventory
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
    """commands.PUSH_CHECK run here by sh, as the container runs it; (exit, stdout, what is left)."""
    part, dest = tmp_path / "f.dflash-part", tmp_path / "f"
    if content is not None:
        part.write_bytes(content)
    p = subprocess.run(["sh", "-c", commands.PUSH_CHECK, "sh", str(dest), str(part), str(size), sha],
                       capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr, sorted(x.name for x in tmp_path.iterdir())


def test_a_whole_push_is_renamed_into_place(tmp_path):
    import hashlib

    data = b"x" * 1000
    assert push_check(tmp_path, data, 1000, hashlib.sha256(data).hexdigest()) == (0, "", "", ["f"])
    assert (tmp_path / "f").read_bytes() == data


@pytest.mark.parametrize("content, said", [(None, "dflash-push: - -\n"), (b"x" * 10, "dflash-push: 10 ")])
def test_a_missing_or_short_push_is_removed_and_said(tmp_path, content, said):
    code, out, err, left = push_check(tmp_path, content, 1000, "a" * 64)
    assert (code, err, left) == (commands.PUSH_CHECK_EXIT, "", [])
    assert out.startswith(said)


def test_push_failure_carries_pcts_words_or_the_short_count():
    failed = Result("", stdout="dflash-push: - -\n", stderr="failed to open /tmp/t.tar.gz for reading\n",
                    exited=commands.PUSH_CHECK_EXIT)
    assert str(transport.push_failure(CT, failed, "the tarball", 1000)) == (
        "pve1/200: pct push of the tarball failed: failed to open /tmp/t.tar.gz for reading; nothing "
        "changed in the container")
    short = Result("", stdout=f"dflash-push: 512 {'e' * 64}\n", exited=commands.PUSH_CHECK_EXIT)
    assert ("wrote 512 of 1000 bytes and said nothing"
            in str(transport.push_failure(CT, short, "the tarball", 1000)))
    assert transport.push_failure(CT, Result("", stdout="dflash-push: - -\n", exited=1), "x", 1) is None
