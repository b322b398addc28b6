"""`invoke conformance`: what the tool relies on `pct` (pve-container 6.x) to do, checked on a host.

docs/design.md, "The pct contract". Each `Check` sends one thing to the host and compares what the
host did with what the tool expects; `run_checks` runs them all and returns a `Report` (one row per
check and a verdict). tests/conformance runs the same checks as pytest tests.

Read-mostly: commands run in a running container and in a scratch dir of its own there and on the
host (`mktemp -d`), removed at the end; no container is ever started or stopped. The missing-container
checks use an id `pct list` does not show; the stopped-container checks need a stopped container
(--stopped-ct), and are skipped without one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from . import commands, terminal, transport
from .errors import (
    ContainerMissing,
    ContainerStopped,
    DflashOpsError,
    ExitStatus,
    RemoteCommandFailed,
    UsageError,
)
from .inventory import Container
from .remote import ship
from .target import Target
from .transport import HostSession, Result

SCRATCH = "/tmp/dflash-conformance.XXXXXX"
PATH = {"PATH": commands.SYSTEM_PATH}
CHECK_TIMEOUT_S = 120.0  # each command of the checks (the slowest: a 1 MiB pct push or pull)
ARGV = ["a b", "'single'", '"double"', "$(touch /tmp/pwned)", "`id`", "-n", "", "line\nbreak", "*", "x=y",
        "\\", "--"]
NON_ASCII = ["ü", "日本語", "emoji 🙂", "Ωmega=1"]
PASS, FAIL, SKIP = "ok", "FAIL", "skip"


class ConformanceFailed(DflashOpsError, exit_status=ExitStatus.CHECK_FAILED):
    """At least one check of the pct contract failed on the host (its row says what it did)."""


def shown(result: Result) -> str:
    return f"exit {result.exited}, stdout {result.stdout[-300:]!r}, stderr {result.stderr[-300:]!r}"


@dataclass
class PctHost:
    """The host under check: its session, a running, a missing and maybe a stopped container, and the
    scratch dirs (in the container and on the host) the checks may write."""

    session: HostSession
    ct: Container                 # a running container
    missing: Container            # an id the host does not have
    stopped: Container | None     # a stopped container, when one may be used
    ct_scratch: str = ""
    host_scratch: str = ""

    @property
    def node(self) -> str:
        return self.ct.host.node_name

    def pct(self, *args) -> str:
        """A host line running pct as the tool starts it (`env LC_ALL=C.UTF-8 [sudo -n] pct`), each
        argument quoted."""
        return commands.pct_line(self.ct.host.pct_command, *map(str, args))

    def run(self, line: str) -> Result:
        return self.session.run(line, check=False)

    def exec(self, ct: Container, argv, **kwargs) -> Result:
        return self.session.exec(ct, argv, env=kwargs.pop("env", PATH), check=False, **kwargs)


def missing_id(listing: str) -> int:
    """The highest valid CT id that `pct list` does not show."""
    taken = {int(row.split()[0]) for row in listing.splitlines()[1:]
             if row.split() and row.split()[0].isdigit()}
    return next(i for i in range(999_999_999, 100, -1) if i not in taken)


@contextlib.contextmanager
def opened(session: HostSession, ct: Container, stopped: Container | None) -> Iterator[PctHost]:
    """The host ready for the checks: `ct` runs, `stopped` (if given) is stopped, scratch dirs made;
    they are removed on the way out. A container that is not as asked is a usage error (exit 2)."""
    listing = session.run(commands.pct_line(ct.host.pct_command, "list"), check=False)
    if not listing.ok:
        raise RemoteCommandFailed(f"`{ct.host.pct} list` on {ct.host.name} failed ({shown(listing)}): "
                                  "fix the inventory or the host's pct first")
    rows = ", ".join(" ".join(r.split()[:2]) for r in listing.stdout.splitlines()[1:] if r.split()) or "none"
    if not re.search(rf"^{ct.ctid}\s+running\s", listing.stdout, re.M):
        raise UsageError(f"--ct {ct.ctid}: not a running container on {ct.host.name} (pct list: "
                         f"{terminal.visible(rows)[:300]}); the checks never start one: give a running one")
    if stopped is not None and not re.search(rf"^{stopped.ctid}\s+stopped\s", listing.stdout, re.M):
        raise UsageError(f"--stopped-ct {stopped.ctid}: not a stopped container on {ct.host.name} (pct list: "
                         f"{terminal.visible(rows)[:300]}); the checks never stop one")
    host = PctHost(session, ct, dataclasses.replace(ct, ctid=missing_id(listing.stdout)), stopped)
    host.ct_scratch = session.exec(ct, ["mktemp", "-d", SCRATCH], env=PATH).stdout.strip()
    try:
        host.host_scratch = session.run(commands.shell_line(["mktemp", "-d", SCRATCH])).stdout.strip()
        yield host
    finally:
        session.exec(ct, ["rm", "-rf", "--", host.ct_scratch], env=PATH, check=False)
        if host.host_scratch:
            session.run(commands.shell_line(["rm", "-rf", "--", host.host_scratch]), check=False)


# --- the checks -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    """One point of the contract: `probe(host)` sends `sent` and returns (as expected?, what the host did)."""

    name: str
    sent: str
    expects: str
    probe: Callable[[PctHost], tuple[bool, str]]
    needs_stopped: bool = False


@dataclass(frozen=True)
class Outcome:
    check: Check
    verdict: str   # PASS, FAIL or SKIP
    did: str


def run_check(host: PctHost, check: Check) -> Outcome:
    if check.needs_stopped and host.stopped is None:
        return Outcome(check, SKIP, "no stopped container to check with: give --stopped-ct ID "
                                    "(the checks never stop one)")
    try:
        ok, did = check.probe(host)
    except DflashOpsError as exc:  # the host answered in a way the tool turned into an error
        ok, did = False, f"{type(exc).__name__}: {exc}"
    return Outcome(check, PASS if ok else FAIL, did)


def _exec_argv(host):
    r = host.exec(host.ct, ["printf", "%s\\0", *ARGV])
    return r.exited == 0 and r.stdout.split("\0")[:-1] == ARGV, shown(r)


def _exec_non_ascii(host):
    r = host.exec(host.ct, ["printf", "%s\\0", *NON_ASCII])
    return r.exited == 0 and r.stdout.split("\0")[:-1] == NON_ASCII, shown(r)


def _exec_env_cwd(host):
    env = {"DFLASH_A": "1", "DFLASH_B": "two words", **PATH}
    r = host.exec(host.ct, ["sh", "-c", "pwd; env"], env=env, cwd=host.ct_scratch)
    lines = r.stdout.splitlines()
    got = dict(line.split("=", 1) for line in lines[1:] if "=" in line)
    for own in ("PWD", "SHLVL", "_"):  # what the shell itself sets
        got.pop(own, None)
    return r.exited == 0 and lines[:1] == [host.ct_scratch] and got == env, shown(r)


def _exec_streams(host):
    r = host.exec(host.ct, ["sh", "-c", "printf 'to out'; printf 'to err' >&2"])
    return (r.exited, r.stdout, r.stderr) == (0, "to out", "to err"), shown(r)


def _exec_exit_code(script: str, code: int):
    def probe(host):
        r = host.exec(host.ct, ["sh", "-c", script])
        return r.exited == code, shown(r)
    return probe


def missing_line(host: PctHost) -> str:
    return f"Configuration file 'nodes/{host.node}/lxc/{host.missing.ctid}.conf' does not exist"


def _missing_named(verb: str):
    def probe(host):
        r = host.run(host.pct(verb, host.missing.ctid, *(["--", "true"] if verb == "exec" else [])))
        return (transport.pct_said(r) == missing_line(host) and r.exited in transport.MISSING_EXITS), shown(r)
    return probe


def _raises(kind, call) -> tuple[bool, str]:
    try:
        call()
    except kind as exc:
        return True, f"{type(exc).__name__}: {exc}"
    except DflashOpsError as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return False, "no error"


def _tool_says_missing(host):
    ok, did = _raises(ContainerMissing, lambda: host.session.exec(host.missing, ["true"], env=PATH))
    if not ok:
        return ok, f"exec: {did}"
    # push: "can only push files to a running CT", then pct status tells which
    return _raises(ContainerMissing, lambda: host.session.run_in(
        host.missing, host.pct("push", host.missing.ctid, "/etc/hostname", "/tmp/dflash-never")))


def _transfer_refused(verb: str):
    def probe(host):
        did = []
        for ct in filter(None, [host.missing, host.stopped]):
            dst = "/tmp/dflash-never" if verb == "push" else f"{host.host_scratch}/never"
            r = host.run(host.pct(verb, ct.ctid, "/etc/hostname", dst))
            did.append(f"CT {ct.ctid}: {shown(r)}")
            if not transport.transfer_refused(r.stderr, r.exited):
                return False, "; ".join(did)
        return True, "; ".join(did)
    return probe


def _stopped_exec(host):
    r = host.run(host.pct("exec", host.stopped.ctid, "--", "true"))
    expected = (f"container '{host.stopped.ctid}' not running!", 255)
    return (transport.pct_said(r), r.exited) == expected, shown(r)


def _stopped_status(host):
    r = host.run(host.pct("status", host.stopped.ctid))
    return (r.exited, r.stdout.strip()) == (0, "status: stopped"), shown(r)


def _tool_says_stopped(host):
    return _raises(ContainerStopped, lambda: host.session.exec(host.stopped, ["true"], env=PATH))


def _host_file(host: PctHost) -> tuple[str, bytes]:
    """A 1 MiB file of random bytes in the host's scratch dir: (path, bytes)."""
    data = os.urandom(1 << 20)
    path = f"{host.host_scratch}/src-{os.urandom(4).hex()}"
    host.session.put_bytes(data, path)
    return path, data


def _push(host, src: str, dest: str, data: bytes) -> tuple[Result, str | None]:
    """`pct push` then the push check in the container (ship.push_line): the result, and why the file
    is not whole at `dest` (None: it is)."""
    r = host.run(ship.push_line(host.ct, src, dest, len(data), hashlib.sha256(data).hexdigest()))
    if not r.ok:
        return r, f"exit {r.exited}"
    failed = ship.push_failure(host.ct, r, dest, len(data))
    if failed is not None:
        return r, str(failed)
    try:
        ship.answer(r.stdout, f"{host.ct.label}: push")
    except DflashOpsError as exc:
        return r, str(exc)
    return r, None


def _push_pull(host):
    src, data = _host_file(host)
    dest, back = f"{host.ct_scratch}/pushed", f"{host.host_scratch}/pulled"
    pushed, failed = _push(host, src, dest, data)
    if failed is not None:
        return False, f"push: {failed}; {shown(pushed)}"
    pulled = host.run(f"{host.pct('pull', host.ct.ctid, dest, back)} && sha256sum < {commands.quote(back)}")
    digest = hashlib.sha256(data).hexdigest()
    return pulled.ok and pulled.stdout.split()[:1] == [digest], f"push: whole; pull: {shown(pulled)}"


def _failed_push_caught(host):
    src, data = _host_file(host)
    did = []
    for source, dest in [(f"{src}-absent", f"{host.ct_scratch}/a"),
                         (src, f"{host.ct_scratch}/no-such-dir/b")]:
        r, failed = _push(host, source, dest, data)
        did.append(f"{source} -> {dest}: {failed or 'whole'}; {shown(r)}")
        if failed is None or not r.stderr.strip():
            return False, "; ".join(did)
    left = host.exec(host.ct, ["ls", "-A", host.ct_scratch])
    extra = set(left.stdout.split()) - {"pushed"}
    did.append(f"left in the scratch dir: {sorted(extra) or 'nothing'}")
    return not extra, "; ".join(did)


def _checks() -> list[Check]:
    exec_line = "pct exec CT -- env -i [-C DIR] -- K=V ... argv (commands.pct_exec)"
    checks = [
        Check("exec: every argument unchanged", f"{exec_line}: printf '%s\\0' {ARGV!r}",
              "exit 0 and the arguments back, NUL-separated (parsed once by the host's shell)", _exec_argv),
        Check("exec: non-ASCII arguments intact", f"{exec_line}: printf '%s\\0' {NON_ASCII!r}",
              "exit 0 and the values back whole, whatever the host's locale", _exec_non_ascii),
        Check("exec: exactly the env and cwd set", f"{exec_line}: sh -c 'pwd; env' with DFLASH_A, DFLASH_B, "
              "PATH in the scratch dir", "exit 0, cwd the scratch dir, only those variables", _exec_env_cwd),
        Check("exec: stdout and stderr apart", f"{exec_line}: sh -c \"printf 'to out'; printf 'to err' >&2\"",
              "exit 0, stdout 'to out', stderr 'to err'", _exec_streams),
    ]
    for script, code in [("exit 0", 0), ("exit 3", 3), ("exit 255", 255), ("kill -TERM $$", 128 + 15),
                         ("kill -KILL $$", 128 + 9)]:
        checks.append(Check(f"exec: exit code of `{script}`", f"{exec_line}: sh -c '{script}'",
                            f"exit {code} (the command's code; 128+N for signal N)",
                            _exec_exit_code(script, code)))
    for verb in ("exec", "status"):
        checks.append(Check(f"{verb}: a missing container is named", f"pct {verb} MISSING"
                            + (" -- true" if verb == "exec" else ""),
                            "exit 2 (or 255) and the last stderr line \"Configuration file "
                            "'nodes/NODE/lxc/MISSING.conf' does not exist\" (the inventory's node name)",
                            _missing_named(verb)))
    checks.append(Check("the tool: a missing container is missing",
                        "pct exec MISSING -- true; pct push MISSING",
                        "ContainerMissing from both (a push's refusal is resolved with pct status)",
                        _tool_says_missing))
    for verb, said in [("push", "can only push files to a running CT"),
                       ("pull", "can only pull files from a running VM at ... line N.")]:
        checks.append(Check(f"{verb}: refused for a container that does not run",
                            f"pct {verb} MISSING|STOPPED /etc/hostname DEST",
                            f"exit 255 and the last stderr line {said!r}", _transfer_refused(verb)))
    checks += [
        Check("exec: a stopped container", "pct exec STOPPED -- true",
              "exit 255 and the last stderr line \"container 'STOPPED' not running!\"", _stopped_exec, True),
        Check("status: a stopped container", "pct status STOPPED", "exit 0, stdout 'status: stopped'",
              _stopped_status, True),
        Check("the tool: a stopped container is stopped", "pct exec STOPPED -- true", "ContainerStopped",
              _tool_says_stopped, True),
        Check("push then pull round trip", "pct push of 1 MiB (size and sha256 checked in the container), "
              "then pct pull and sha256sum on the host", "both exit 0 and the same sha256 on the host",
              _push_pull),
        Check("a failed push is caught with pct's words", "pct push of a missing file; pct push into a "
              "missing dir (remote.ship.push_line)",
              "pct's reason on stderr, and a non-zero exit or the check in the container failing "
              "(its short-push refusal); nothing left in the container", _failed_push_caught),
    ]
    return checks


CHECKS = _checks()


# --- the report -------------------------------------------------------------------------------------

@dataclass
class Report:
    container: Container
    outcomes: list[Outcome]

    def count(self, verdict: str) -> int:
        return sum(o.verdict == verdict for o in self.outcomes)

    def verdict(self) -> str:
        failed, skipped = self.count(FAIL), self.count(SKIP)
        where = f"{self.container.host.name}, {self.container.label}"
        if failed:
            return (f"conformance: {failed} of {len(self.outcomes)} checks failed on {where}: the tool "
                    "will not work as documented on this host (docs/design.md, \"The pct contract\")")
        return (f"conformance: all {len(self.outcomes) - skipped} checks passed on {where}"
                + (f" ({skipped} skipped: give --stopped-ct ID for them)" if skipped else ""))

    @property
    def error(self) -> ConformanceFailed | None:
        return ConformanceFailed(self.verdict()) if self.count(FAIL) else None

    def facts(self) -> dict:
        return {"host": self.container.host.name, "container": self.container.label,
                "verdict": self.verdict(), "failed": self.count(FAIL),
                "checks": [{"check": o.check.name, "verdict": o.verdict, "sent": o.check.sent, "did": o.did,
                            "expects": o.check.expects} for o in self.outcomes]}

    def describe(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"pct contract: {self.container.host.name}, {self.container.label}")
        for column in ("", "check", "sent", "the host did", "the tool expects"):
            table.add_column(column, overflow="fold")
        style = {PASS: "green", FAIL: "bold red", SKIP: "yellow"}
        for o in self.outcomes:
            # what the host did is the host's data: shown, never markup
            table.add_row(Text(o.verdict, style=style[o.verdict]), Text(o.check.name),
                          Text(terminal.visible(o.check.sent)), Text(terminal.visible(o.did)),
                          Text(terminal.visible(o.check.expects)))
        return Group(table, Text(self.verdict()))


def run_checks(t: Target, stopped_ct=None) -> Report:
    stopped = t.inventory.container(stopped_ct) if stopped_ct not in (None, "") else None
    if stopped is not None and stopped.host.name != t.container.host.name:
        raise UsageError(f"--stopped-ct {stopped.ctid} is on host {stopped.host.name}, --ct "
                         f"{t.container.ctid} on {t.container.host.name}: give a stopped container of the "
                         "same host")
    t.session.default_timeout = CHECK_TIMEOUT_S  # every command of the checks: one that hangs is TimedOut
    with opened(t.session, t.container, stopped) as host:
        return Report(t.container, [run_check(host, c) for c in CHECKS])
