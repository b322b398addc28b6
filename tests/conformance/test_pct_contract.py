"""What the tool relies on `pct` (pve-container 6.x) to do: docs/design.md, "The pct contract".

Read-mostly: runs commands in a running container and in a scratch dir of its own there and on the
host. Against the embedded host by default; `scripts/test tests/conformance --inventory my.yaml
--ct 200` checks a real one. A failing check says what the host did and what the tool expects.
"""

from __future__ import annotations

import hashlib
import os
import re

import pytest
from pct_host import contract, shown

from dflash_ops import commands, fetch, transport
from dflash_ops.errors import ContainerMissing, ContainerStopped, RemoteCommandFailed

PATH = {"PATH": commands.SYSTEM_PATH}
ARGV = ["a b", "'single'", '"double"', "$(touch /tmp/pwned)", "`id`", "-n", "", "line\nbreak", "*", "x=y",
        "\\", "--"]


# --- exec ------------------------------------------------------------------------------------------

def test_exec_passes_every_argument_unchanged(pct_host):
    r = pct_host.session.exec(pct_host.ct, ["printf", "%s\\0", *ARGV], env=PATH, check=False)
    if r.exited != 0 or r.stdout.split("\0")[:-1] != ARGV:
        contract("`pct exec CT -- argv` runs argv as given, parsed once by the host's shell", shown(r),
                 f"exit 0 and the arguments {ARGV!r} back, NUL-separated")


def test_exec_passes_non_ascii_arguments_intact(pct_host):
    """pct decodes its arguments with the SSH session's locale (U+FFFD under C): whatever the host's
    locale, the tool's line must bring UTF-8 values (a --set value, a run name's path) through whole."""
    values = ["ü", "日本語", "emoji 🙂", "Ωmega=1"]
    r = pct_host.session.exec(pct_host.ct, ["printf", "%s\\0", *values], env=PATH, check=False)
    if r.exited != 0 or r.stdout.split("\0")[:-1] != values:
        contract("non-ASCII arguments reach the container unchanged through commands.pct_exec's line",
                 shown(r),
                 f"exit 0 and {values!r} back, NUL-separated")


def test_exec_gives_the_command_exactly_the_env_and_cwd_the_tool_sets(pct_host):
    env = {"DFLASH_A": "1", "DFLASH_B": "two words", **PATH}
    r = pct_host.session.exec(pct_host.ct, ["sh", "-c", "pwd; env"], env=env, cwd=pct_host.ct_scratch,
                              check=False)
    lines = r.stdout.splitlines()
    got = dict(line.split("=", 1) for line in lines[1:] if "=" in line)
    for own in ("PWD", "SHLVL", "_"):  # what the shell itself sets
        got.pop(own, None)
    if r.exited != 0 or lines[:1] != [pct_host.ct_scratch] or got != env:
        contract("`pct exec CT -- env -i -C DIR -- K=V ... argv` (commands.pct_exec): the command sees only "
                 "K=V, in DIR",
                 shown(r), f"exit 0, cwd {pct_host.ct_scratch}, environment {env}")


def test_exec_keeps_stdout_and_stderr_apart(pct_host):
    r = pct_host.session.exec(pct_host.ct, ["sh", "-c", "printf 'to out'; printf 'to err' >&2"], env=PATH,
                              check=False)
    if (r.exited, r.stdout, r.stderr) != (0, "to out", "to err"):
        contract("without a tty, the command's stdout and stderr come back apart and untouched", shown(r),
                 "exit 0, stdout 'to out', stderr 'to err'")


@pytest.mark.parametrize("script, code", [("exit 0", 0), ("exit 3", 3), ("exit 255", 255),
                                          ("kill -TERM $$", 128 + 15), ("kill -KILL $$", 128 + 9)])
def test_exec_passes_the_exit_code_through(pct_host, script, code):
    r = pct_host.session.exec(pct_host.ct, ["sh", "-c", script], env=PATH, check=False)
    if r.exited != code:
        contract(f"`pct exec` exits with the command's code (`{script}`; 128+N for signal N)", shown(r),
                 f"exit {code}")


# --- a missing and a stopped container -------------------------------------------------------------

def missing_line(pct_host) -> str:
    return f"Configuration file 'nodes/{pct_host.node}/lxc/{pct_host.missing.ctid}.conf' does not exist"


@pytest.mark.parametrize("verb", ["exec", "status"])
def test_a_missing_container_is_named_with_exit_2(pct_host, verb):
    args = [verb, pct_host.missing.ctid] + (["--", "true"] if verb == "exec" else [])
    r = pct_host.run(pct_host.pct(*args))
    if transport.pct_said(r) != missing_line(pct_host) or r.exited not in transport.MISSING_EXITS:
        contract(f"`pct {verb}` of a container the host does not have", shown(r),
                 f"exit 2 (or 255) and the last stderr line {missing_line(pct_host)!r} (the "
                 "inventory's node name)")


def test_the_tool_says_a_missing_container_is_missing(pct_host):
    with pytest.raises(ContainerMissing):
        pct_host.session.exec(pct_host.missing, ["true"], env=PATH)
    with pytest.raises(ContainerMissing):  # push: "can only push files to a running CT", then pct status
        pct_host.session.run_in(pct_host.missing, pct_host.pct("push", pct_host.missing.ctid, "/etc/hostname",
                                                               "/tmp/dflash-never"))


@pytest.mark.parametrize("verb, said", [("push", "can only push files to a running CT"),
                                        ("pull", "can only pull files from a running VM at ... line N.")])
def test_push_and_pull_refuse_a_container_that_does_not_run(pct_host, verb, said):
    """The same words for a missing and a stopped container: the tool asks `pct status` which it is."""
    for ct in filter(None, [pct_host.missing, pct_host.stopped]):
        src, dst = ("/etc/hostname", "/tmp/dflash-never") if verb == "push" else ("/etc/hostname",
                                                                                 f"{pct_host.host_scratch}/never")
        r = pct_host.run(pct_host.pct(verb, ct.ctid, src, dst))
        if not transport.transfer_refused(r.stderr, r.exited):
            contract(f"`pct {verb}` to container {ct.ctid}, which does not run", shown(r),
                     f"exit 255 and the last stderr line {said!r}")


def test_a_stopped_container_is_named_with_exit_255(pct_host, stopped):
    r = pct_host.run(pct_host.pct("exec", stopped.ctid, "--", "true"))
    expected = f"container '{stopped.ctid}' not running!"
    if (transport.pct_said(r), r.exited) != (expected, 255):
        contract("`pct exec` of a stopped container", shown(r),
                 f"exit 255 and the last stderr line {expected!r}")
    status = pct_host.run(pct_host.pct("status", stopped.ctid))
    if (status.exited, status.stdout.strip()) != (0, "status: stopped"):
        contract("`pct status` of a stopped container", shown(status), "exit 0, stdout 'status: stopped'")
    with pytest.raises(ContainerStopped):
        pct_host.session.exec(stopped, ["true"], env=PATH)


# --- push and pull -----------------------------------------------------------------------------------

@pytest.fixture
def host_file(pct_host):
    """A 1 MiB file of random bytes in the host's scratch dir: (path, bytes)."""
    data = os.urandom(1 << 20)
    path = f"{pct_host.host_scratch}/src-{os.urandom(4).hex()}"
    pct_host.session.put_bytes(data, path)
    return path, data


def test_push_then_pull_round_trip(pct_host, host_file):
    src, data = host_file
    dest, back = f"{pct_host.ct_scratch}/pushed", f"{pct_host.host_scratch}/pulled"
    digest = hashlib.sha256(data).hexdigest()
    line = commands.pct_push_verified(pct_host.ct.ctid, src, dest, len(data), digest,
                                      pct=pct_host.ct.host.pct_command)
    pushed = pct_host.run(line)
    if not pushed.ok:
        contract("`pct push` of 1 MiB, checked in the container (size and sha256)", shown(pushed),
                 f"exit 0: {dest} holds the {len(data)} bytes pushed")
    pulled = pct_host.run(f"{pct_host.pct('pull', pct_host.ct.ctid, dest, back)} && sha256sum < "
                          f"{commands.quote(back)}")
    if not pulled.ok or pulled.stdout.split()[:1] != [digest]:
        contract("`pct pull` of the pushed file", shown(pulled), f"exit 0 and sha256 {digest} on the host")


def test_a_push_that_fails_is_caught_by_the_check_with_pcts_words(pct_host, host_file):
    """A real pct push prints why and exits 0: only the check in the container tells, and nothing is left."""
    src, data = host_file
    for source, dest in [(f"{src}-absent", f"{pct_host.ct_scratch}/a"),
                         (src, f"{pct_host.ct_scratch}/no-such-dir/b")]:
        line = commands.pct_push_verified(pct_host.ct.ctid, source, dest, len(data),
                                          hashlib.sha256(data).hexdigest(),
                                          pct=pct_host.ct.host.pct_command)
        r = pct_host.run(line)
        caught = transport.push_failure(pct_host.ct, r, dest, len(data)) is not None or r.exited != 0
        if not caught or not r.stderr.strip():
            contract(f"`pct push {source} {dest}.dflash-part` cannot work", shown(r),
                     "pct's reason on stderr, and a non-zero exit from pct (the tool says `exit N: <pct's "
                     "words>`) or exit 0 and then the check in the container fails (exit "
                     f"{commands.PUSH_CHECK_EXIT}, 'dflash-push: ...')")
    left = pct_host.session.exec(pct_host.ct, ["ls", "-A", pct_host.ct_scratch], env=PATH)
    if set(left.stdout.split()) - {"pushed"}:
        contract("a failed push leaves nothing in the container", f"left {left.stdout.split()}", "nothing")


def test_a_pull_that_fails_is_named_and_leaves_no_whole_looking_file(pct_host):
    """A real pct pull of a missing file prints why, exits 0 and leaves an empty destination: fetch
    pulls into a private dir and checks size and sha256 there, and names pct's words."""
    absent = fetch.RemoteFile("absent", "0" * 64, 10)
    directory = pct_host.ct_scratch
    r = pct_host.run(fetch.pull_line(pct_host.ct, directory, pct_host.host_scratch, [absent]))
    landed = fetch.parse_host_check(r.stdout, [absent])
    said = fetch.pull_errors(r.stderr).get("absent", "")
    if not said or landed.get("absent", (None,))[0] not in (None, 0):
        contract(f"`pct pull` of {directory}/absent, which does not exist", shown(r),
                 "pct's reason on stderr; on the host no file, or an empty one")
    with pytest.raises(RemoteCommandFailed, match=re.escape(said) if said else "."):
        fetch.check_pulls(pct_host.ct, directory, [absent], landed, fetch.pull_errors(r.stderr),
                          "the destination")
