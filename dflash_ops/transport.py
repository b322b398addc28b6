"""The only module that touches fabric/paramiko: one SSH connection per host per invocation, or the
connection a master shares between invocations (`mux`). paramiko and fabric are imported only when a
connection of the task's own is opened: through a master, a task starts without them.

Host keys are verified against the inventory's known_hosts file (RejectPolicy); an unknown or changed
key is refused, never trusted silently. Failures become one-line `dflash_ops.errors` exceptions.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import commands, localfiles, mux, terminal
from .errors import (
    AuthFailed,
    ContainerMissing,
    ContainerStopped,
    HostKeyChanged,
    HostKeyUnknown,
    HostUnreachable,
    RemoteCommandFailed,
    SudoRefused,
    TimedOut,
    UnsafeValue,
    UntrustedData,
    UsageError,
)
from .inventory import Container, Host

if TYPE_CHECKING:
    import paramiko
    from fabric import Connection

DEFAULT_CONNECT_TIMEOUT = 10.0
# paramiko's transport thread logs a dropped socket ("Socket exception: ...") through logging's
# last-resort handler onto stderr, beside our own one-line error: keep it out unless logging is set up.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
# The host's shell gets the line as one argument of `sh -c`: Linux caps one argument at 128 KiB
# (MAX_ARG_STRLEN, NUL included). Longer lines failed as "Argument list too long", and past sshd's
# packet size as a reset connection that looked like a network fault.
MAX_LINE_BYTES = 131072 - 1
# After a command killed by a signal: how long a container that still says "running" is asked again.
STOP_SETTLE_S = 2.0
STOP_SETTLE_EVERY_S = 0.25
STDERR_TAIL_LINES = 5
PROBE_TIMEOUT_S = 30.0  # the session's own probes: `pct status` after a failure, the locale check


class OutputTooLarge(Exception):
    """A command wrote more than its caller's limit; reading stopped there (inside the runner)."""


class AnswerTooLarge(UntrustedData):
    """What the caller gets for it: the command was ended, nothing past `limit` was read."""

    def __init__(self, message: str, limit: int):
        super().__init__(message)
        self.limit = limit


@functools.cache
def linear_remote():
    """fabric's Remote runner, two things mended. Invoke's runner joins the whole captured output on
    every chunk read to feed its watchers: quadratic in the output's size (a 16 MiB log took 47 s); we
    give it no watchers, so skip that. And it decodes each 1000-byte read on its own: a multi-byte
    UTF-8 character cut by a read's end came out as two U+FFFD; one incremental decoder per stream
    keeps it whole. Output shown as it comes (an out_stream) is kept in the result by its tail only
    (mux.OutputTail): following a log holds bounded memory whatever it prints. A connection's
    `output_limit` (bytes per stream) ends the reading there."""
    import codecs

    from fabric.runners import Remote

    class LinearRemote(Remote):
        def respond(self, buffer_):
            if self.watchers:
                super().respond(buffer_)

        def _handle_output(self, buffer_, hide, output, reader):
            if hide:
                return super()._handle_output(buffer_, hide, output, reader)
            kept = mux.OutputTail()  # shown as it came: the result keeps the tail only
            for data in self.read_proc_output(reader):
                self.write_our_output(stream=output, string=data)
                kept.append(data)
            buffer_[:] = kept

        def kill(self):
            # Invoke's timer calls this when the deadline passes (nothing else does). Said on the
            # connection before the channel closes: invoke's own `timed_out` reads whether the timer
            # thread is still alive, and the exit status that ending the command produces (the
            # session's end is its SIGTERM: 143) can come back while that thread is (a loaded
            # 2-core machine: `invoke exec` exited 143, not 13).
            self.context.deadline_passed = True
            super().kill()

        def read_proc_output(self, reader):
            decoder = codecs.getincrementaldecoder(self.encoding)("replace")
            limit, size = getattr(self.context, "output_limit", None), 0
            while data := reader(self.read_chunk_size):
                size += len(data)
                if limit is not None and size > limit:
                    raise OutputTooLarge(f"more than {limit} bytes of output")
                if text := decoder.decode(data):
                    yield text
            if text := decoder.decode(b"", final=True):
                yield text

    return LinearRemote


@dataclass
class Result:
    line: str
    stdout: str = ""
    stderr: str = ""
    exited: int = 0

    @property
    def ok(self) -> bool:
        return self.exited == 0


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style `SHA256:...` fingerprint."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_hosts_name(host: Host) -> str:
    return host.address if host.port == 22 else f"[{host.address}]:{host.port}"


def trust_hint(host: Host) -> str:
    return (f"verify the host's key out of band, then run `invoke trust-host --host {host.name} "
            f"--fingerprint SHA256:...` to pin it in {host.known_hosts}")


def stderr_tail(stderr: str, lines: int = STDERR_TAIL_LINES) -> str:
    kept = [ln for ln in stderr.strip().splitlines() if ln.strip()][-lines:]
    return " | ".join(kept)


# pct's own refusals (pve-container 6.x; docs/design.md, "The pct contract"), told from a command's by
# the whole last line pct prints AND its exit code: a command in the container may print anything and
# exit with any code. Exit codes are Perl's for an uncaught die: errno when set, else 255.
MISSING_EXITS = (2, 255)     # load_config's failed read leaves ENOENT (inferred); 255 if errno is unset
NOT_RUNNING_EXITS = (255,)
TRANSFER_REFUSED = re.compile(r"can only push files to a running CT"
                              r"|can only pull files from a running VM( at \S+ line \d+\.)?")


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.replace("\r", "").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def pct_said(result: Result, pty: bool = False) -> str:
    """pct's last line: on stderr, or on stdout for a command run on a pty (the pty carries both)."""
    return last_line(result.stdout if pty else result.stderr)


def classify_container_failure(ct: Container, result: Result, pty: bool = False):
    """Map pct's refusals of exec and status to container errors (None: the command's own failure)."""
    said = pct_said(result, pty)
    if (re.fullmatch(rf"Configuration file 'nodes/[^/']+/lxc/{ct.ctid}\.conf' does not exist", said)
            and result.exited in MISSING_EXITS):
        return ContainerMissing(f"container {ct.ctid} does not exist on host {ct.host.name} "
                                f"(pct: Configuration file ... lxc/{ct.ctid}.conf does not exist); check "
                                "the inventory")
    if said == f"container '{ct.ctid}' not running!" and result.exited in NOT_RUNNING_EXITS:
        return ContainerStopped(f"container {ct.ctid} on host {ct.host.name} is stopped; "
                                f"start it with `pct start {ct.ctid}` on the host")
    return None


def transfer_refused(said: str, exited: int | None) -> bool:
    """pct push/pull's refusal, the same words for a stopped and a missing container."""
    return bool(TRANSFER_REFUSED.fullmatch(last_line(said))) and exited in NOT_RUNNING_EXITS


def classify_become_failure(host: Host, result: Result, pty: bool = False):
    """`become: sudo` runs `sudo -n pct`: a sudo that would ask for a password fails at once with
    its own line (also when the user may not run pct at all): one clear error, never a prompt."""
    if host.become == "sudo" and pct_said(result, pty) == "sudo: a password is required":
        return SudoRefused(f"{host.name}: sudo wants a password for user {host.user} to run {host.pct} "
                           f"(become: sudo runs `sudo -n {host.pct}`, which never prompts); allow it without "
                           f"one in sudoers, e.g. `{host.user} ALL=(root) NOPASSWD: /usr/sbin/pct`")
    return None


CLOSE_JOIN_S = 5.0  # a bound on a half-open connection's thread ending, not a timing


class HostSession:
    """Commands to one host over one lazily opened SSH connection, reused for the whole invocation;
    or, without a pty, through the master that shares a connection between invocations (`mux`) when
    one serves this host. `share=False`: never through a master, and leave none behind."""

    def __init__(self, host: Host, *, jump: Host | None = None, dry_run: bool = False,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT, secrets: Sequence[str] = (),
                 echo: Callable[[str], None] | None = None, share: bool = True):
        self.host = host
        self.jump = jump
        self.dry_run = dry_run
        self.connect_timeout = connect_timeout
        self.secrets = tuple(secrets)
        self.echo = echo or (lambda line: print(line, flush=True))
        self.connections = 0
        self.round_trips = 0
        self.share = share
        # The deadline of a command given none (None: none); a task whose commands all share one sets it.
        self.default_timeout: float | None = None
        self._conn: Connection | None = None
        self._locale_checked = False
        self._shared_path = None  # the master's socket (mux), once looked up; False: no sharing
        self._master_started = False

    # --- connection -----------------------------------------------------------------------------
    def _connection(self, host: Host, gateway: Connection | None = None) -> Connection:
        import paramiko
        from fabric import Config, Connection

        connect_kwargs = {
            "timeout": self.connect_timeout,
            "banner_timeout": self.connect_timeout,
            "auth_timeout": self.connect_timeout,
            "look_for_keys": host.key is None,
            "allow_agent": host.key is None,
        }
        if host.key:
            localfiles.check_private_key(os.path.expanduser(host.key))  # as OpenSSH: 0600 or refused
            connect_kwargs["key_filename"] = [host.key]
        conn = Connection(host.address, user=host.user, port=host.port, gateway=gateway,
                          config=Config(overrides={"load_ssh_configs": False,
                                                   "runners": {"remote": linear_remote()}}),
                          connect_kwargs=connect_kwargs)
        conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        known = os.path.expanduser(host.known_hosts)
        if os.path.exists(known):
            localfiles.check_file(known, localfiles.KNOWN_HOSTS_MAX, "known_hosts file")
            conn.client.load_host_keys(known)
        return conn

    def _open(self, conn: Connection, host: Host) -> None:
        import paramiko

        where = f"{host.name} ({host.address}:{host.port})"
        try:
            self._open_half(conn)
        except paramiko.BadHostKeyException as exc:
            raise HostKeyChanged(
                f"host key of {where} CHANGED: it offers {fingerprint(exc.key)}, {host.known_hosts} "
                f"pins {fingerprint(exc.expected_key)}; refusing to connect. If the host was reinstalled, "
                + trust_hint(host)) from None
        except paramiko.AuthenticationException as exc:
            raise AuthFailed(f"authentication refused by {where} for user {host.user} "
                             f"(key {host.key or 'agent/default'}): {exc}") from None
        except paramiko.SSHException as exc:
            if "not found in known_hosts" in str(exc):
                raise HostKeyUnknown(f"host key of {where} is not pinned in {host.known_hosts}; "
                                     f"refusing to trust it blindly: " + trust_hint(host)) from None
            raise HostUnreachable(f"cannot talk SSH to {where}: {exc}") from None
        except TimeoutError as exc:
            raise HostUnreachable(f"cannot reach {where}: timed out after "
                                  f"{self.connect_timeout:g} s") from exc
        except (OSError, EOFError, paramiko.ssh_exception.NoValidConnectionsError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            raise HostUnreachable(f"cannot reach {where}: {reason}") from None

    @staticmethod
    def _open_half(conn: Connection) -> None:
        """conn.open(), and if it fails or is interrupted (Ctrl-C), the half-open connection closed:
        its transport thread, waiting for a banner that may never come, would outlive the failure:
        at an interrupted task's exit it was still running, and one such exit died of SIGSEGV."""
        try:
            conn.open()
        except BaseException:
            transport = conn.client.get_transport()
            conn.client.close()  # Fabric's close() skips a client whose connect did not finish
            if transport is not None and transport.is_alive():  # closed, its thread ends at its
                transport.join(CLOSE_JOIN_S)                    # next read (0.1 s): wait for it
            raise

    def connect(self) -> Connection:
        if self._conn is not None and self._conn.is_connected:
            return self._conn
        gateway = None
        if self.jump is not None:
            gateway = self._connection(self.jump)
            self._open(gateway, self.jump)
        conn = self._connection(self.host, gateway)
        self._open(conn, self.host)
        conn.transport.set_keepalive(15)
        self._conn = conn
        self.connections += 1
        self._leave_master()
        return conn

    # --- the connection shared between invocations (mux) ----------------------------------------
    def shared_path(self):
        """The socket of this host's master, or None: sharing is off (control_persist 0, a dry run,
        share=False), the control directory is not private, or the socket's path is too long."""
        if self._shared_path is None:
            self._shared_path = False
            if self.share and not self.dry_run and mux.persist_seconds(self.host) > 0:
                path = mux.socket_path(self.host, self.jump)  # a special known_hosts: InventoryError
                if mux.usable(path) and mux.private_dir(path.parent):
                    self._shared_path = path
        return self._shared_path or None

    def own_connection(self) -> None:
        """From now on, this session's commands go over a connection of its own, never a master's
        (doctor: the connection itself, the host key and the authentication, is what it checks)."""
        self.share, self._shared_path = False, None

    def _leave_master(self) -> None:
        """After a connection of our own: start a master for the next invocations, unless one serves."""
        path = self.shared_path()
        if path is None or self._master_started:
            return
        self._master_started = True
        if not mux.answers(path):
            mux.start_master(self.host, self.jump, mux.persist_seconds(self.host), path)

    def _too_large(self, line: str, limit: int) -> AnswerTooLarge:
        return AnswerTooLarge(f"{self.host.name}: the command wrote more than {limit} bytes: refused unread "
                              f"and ended: {self.shown(line)[:120]}", limit)

    def _run_shared(self, line: str, *, show: bool, timeout: float | None, out_stream,
                    err_stream, limit: int | None = None) -> Result | None:
        """`line` through the master (one round trip), or None: no master took it."""
        path = self.shared_path()
        if path is None:
            return None
        def shown_on(stream):
            def write(text):
                stream.write(text)
                stream.flush()
            return write if show else None

        try:
            got = mux.run(path, line, on_out=shown_on(out_stream), on_err=shown_on(err_stream),
                          timeout=timeout, limit=limit)
        except mux.Refused:
            return None
        except mux.TooLarge:
            self.round_trips += 1
            raise self._too_large(line, limit) from None
        except TimeoutError:
            self.round_trips += 1
            raise TimedOut(f"{self.host.name}: command timed out after {timeout:g} s: "
                                      f"{self.shown(line)[:200]}") from None
        except mux.Lost as exc:
            self.round_trips += 1
            raise HostUnreachable(f"connection to {self.host.name} lost (shared connection): {exc}") from None
        if got is None:
            return None
        self.round_trips += 1
        stdout, stderr, exited = got
        return Result(line=line, stdout=stdout, stderr=stderr, exited=exited)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # --- commands -------------------------------------------------------------------------------
    def shown(self, line: str) -> str:
        return commands.mask(line, self.secrets)

    def run(self, line: str, *, stream: bool = False, check: bool = True, timeout: float | None = None,
            pty: bool = False, out_stream=None, err_stream=None, limit: int | None = None,
            stdin: bool = False) -> Result:
        """Run one host command line (one round trip). `check` raises RemoteCommandFailed on non-zero.
        `limit`: bytes of stdout (and of stderr) read at most; past it the command is ended and
        UntrustedData raised, before anything of it is parsed. `stdin`: this process's stdin goes to
        the command (`invoke shell`; else it gets none)."""
        size = len(line.encode("utf-8", "surrogateescape"))
        if size > MAX_LINE_BYTES:
            raise UnsafeValue(f"{self.host.name}: the command line would be {size} bytes, more than the "
                              f"{MAX_LINE_BYTES} a remote shell accepts; shorten the longest value "
                              f"(--set, --config, --run or the inventory's env)")
        if self.dry_run:
            self.echo(self.shown(line))
            return Result(line=line)
        timeout = self.default_timeout if timeout is None else timeout
        hide = not stream and out_stream is None
        if not hide:  # what is shown as it comes is the container's: through the terminal's filter
            out_stream = out_stream or terminal.Visible(sys.stdout)
            err_stream = err_stream or terminal.Visible(sys.stderr)
        result = None
        if not (pty or stdin) and self._conn is None:
            result = self._run_shared(line, show=not hide, timeout=timeout, out_stream=out_stream,
                                      err_stream=err_stream, limit=limit)
        if result is None:
            result = self._run_own(line, hide=hide, timeout=timeout, pty=pty, out_stream=out_stream,
                                   err_stream=err_stream, limit=limit, stdin=stdin)
        if check and not result.ok:
            raise RemoteCommandFailed(
                f"{self.host.name}: exit {result.exited}: "
                f"{self.shown(stderr_tail(result.stderr)) or '(no stderr)'}",
                exited=result.exited, stderr_tail=stderr_tail(result.stderr))
        return result

    def _run_own(self, line: str, *, hide: bool, timeout: float | None, pty: bool, out_stream,
                 err_stream, limit: int | None = None, stdin: bool = False) -> Result:
        import paramiko
        from invoke.exceptions import CommandTimedOut, ThreadException

        conn = self.connect()
        self.round_trips += 1
        conn.output_limit = limit  # read by linear_remote's reader threads
        conn.deadline_passed = False  # set by linear_remote's kill: the timer ended the command
        try:
            r = conn.run(line, hide=hide, warn=True, pty=pty, timeout=timeout,
                         # stdin is polled byte by byte: files go over SFTP instead; only a shell gets it
                         in_stream=None if stdin else False,
                         out_stream=out_stream, err_stream=err_stream)
        except ThreadException as exc:
            if any(isinstance(e.value, OutputTooLarge) for e in exc.exceptions):
                raise self._too_large(line, limit) from None
            raise
        except CommandTimedOut:
            raise TimedOut(f"{self.host.name}: command timed out after {timeout:g} s: "
                                      f"{self.shown(line)[:200]}") from None
        except (OSError, EOFError, paramiko.SSHException) as exc:
            self._conn = None
            raise HostUnreachable(f"connection to {self.host.name} lost: "
                                  f"{exc or type(exc).__name__}") from None
        if conn.deadline_passed:
            # the runner's timer closed the channel: whatever exit status came back, if any, is the
            # ending's (no status at all is not a lost connection either)
            raise TimedOut(f"{self.host.name}: command timed out after {timeout:g} s: "
                                      f"{self.shown(line)[:200]}")
        return Result(line=line, stdout=r.stdout, stderr=r.stderr, exited=r.exited)

    def exec(self, ct: Container, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
             cwd: str | None = None, check: bool = True, **kwargs) -> Result:
        """Run argv inside container `ct` (same host) and classify pct's own failures."""
        line = commands.pct_exec(ct.ctid, argv, env=env, cwd=cwd, pct=ct.host.pct_command,
                                 tied=not kwargs.get("stdin"))
        return self.run_in(ct, line, check=check, **kwargs)

    def run_in(self, ct: Container, line: str, *, check: bool = True, **kwargs) -> Result:
        """Run a host line that addresses container `ct` (pct exec/push/pull), mapping pct's errors."""
        if not line.isascii():
            self.check_pct_locale(ct)
        result = self.run(line, check=False, **kwargs)
        if not result.ok:
            pty = bool(kwargs.get("pty"))
            container_error = (classify_become_failure(ct.host, result, pty)
                               or classify_container_failure(ct, result, pty))
            if container_error is None and transfer_refused(pct_said(result, pty), result.exited):
                container_error = self.container_state(ct, during=False)
            if container_error is None and result.exited > 128:
                container_error = self.container_state(ct)
            if container_error is not None:
                raise container_error
            if check and result.exited == -1:  # paramiko's "no exit status": the connection dropped
                self._conn = None
                raise HostUnreachable(f"connection to {self.host.name} lost while a command ran in "
                                      f"{ct.label} (no exit status came back); check with `invoke status` or "
                                      f"`invoke doctor`, then run the task again")
            if check:
                raise RemoteCommandFailed(
                    f"{ct.label}: exit {result.exited}: "
                    f"{self.shown(stderr_tail(result.stderr)) or '(no stderr)'}",
                    exited=result.exited, stderr_tail=stderr_tail(result.stderr))
        return result

    def check_pct_locale(self, ct: Container) -> None:
        """Before the first line with non-ASCII characters: does pct pass them on unchanged? pct
        decodes its arguments with its locale (commands.PCT_LOCALE here); where that locale is not
        installed, or sudo drops LC_ALL, each non-ASCII byte would become U+FFFD in the container.
        One round trip per session, only for such lines; a failure other than the answer is left
        to the command itself."""
        if self._locale_checked or self.dry_run:
            return
        sample = "ü€"
        probe = self.run(commands.pct_exec(ct.ctid, ["printf", "%s", sample], pct=ct.host.pct_command),
                         check=False, timeout=PROBE_TIMEOUT_S)
        if probe.ok and probe.stdout != sample:
            raise UnsafeValue(
                f"{self.host.name}: pct would turn non-ASCII characters into U+FFFD ({sample!r} arrived as "
                f"{probe.stdout[:40]!r}): LC_ALL={commands.PCT_LOCALE} did not reach pct; install that "
                f"locale on the host (Debian: package locales), or with become: sudo keep LC_ALL in "
                f"sudoers' env_keep; or use ASCII values")
        self._locale_checked = probe.ok

    def container_state(self, ct: Container, during: bool = True):
        """ContainerStopped/Missing from `pct status`, or None when it runs. `during`: it went away under a
        command (killed by a signal); else pct refused a push or pull.

        A container being stopped has its processes killed before `pct status` says so (pct stop kills
        the init, waits for it, then lets go of the container): after a command killed by a signal,
        a container that still runs is asked again, for up to STOP_SETTLE_S."""
        settle_by = time.monotonic() + (STOP_SETTLE_S if during else 0)
        while True:
            probe = self.run(commands.pct_line(ct.host.pct_command, "status", str(ct.ctid)), check=False,
                             timeout=PROBE_TIMEOUT_S)
            if "status: running" not in probe.stdout or time.monotonic() >= settle_by:
                break
            time.sleep(STOP_SETTLE_EVERY_S)
        if "status: stopped" in probe.stdout:
            if during:
                return ContainerStopped(f"container {ct.ctid} on host {ct.host.name} stopped while the "
                                        f"command ran; start it with `pct start {ct.ctid}` on the host, "
                                        "then check `invoke status`")
            return ContainerStopped(f"container {ct.ctid} on host {ct.host.name} is stopped (pct: can "
                                    "only push/pull files to a running CT); start it with `pct start "
                                    f"{ct.ctid}` on the host")
        return classify_container_failure(ct, probe)

    # --- files (SFTP to the host; pct push/pull moves them in and out of containers) -----------
    def put_bytes(self, data: bytes, host_path: str, mode: int = 0o600) -> None:
        import paramiko

        if self.dry_run:
            self.echo(f"# sftp put {len(data)} bytes -> {host_path}")
            return
        try:
            sftp = self.connect().sftp()
            self.round_trips += 1
            with sftp.open(host_path, "wb") as fh:
                fh.set_pipelined(True)
                fh.write(data)
            sftp.chmod(host_path, mode)
        except (OSError, EOFError, paramiko.SSHException) as exc:
            self._conn = None
            raise HostUnreachable(f"connection to {self.host.name} lost while sending {len(data)} bytes to "
                                  f"{host_path}: {str(exc) or type(exc).__name__}; nothing was changed in a "
                                  f"container, run the task again") from None

    def iter_command(self, line: str, *, block: int = 1 << 20,
                     stall_timeout: float = 60.0) -> Iterator[bytes]:
        """A host line's stdout as it comes, on an SSH channel of its own: memory stays bounded by the
        SSH window whatever its size (fetch streams a checkpoint out of a container this way). No
        byte for `stall_timeout` seconds: HostUnreachable; the command failing: RemoteCommandFailed
        with its stderr's tail. Closing the generator early closes the channel."""
        if self.dry_run:
            self.echo(self.shown(line))
            return
        import paramiko

        try:
            transport = self.connect().transport
            channel = transport.open_session()
            self.round_trips += 1
            # paramiko's own rekey (every 512 MiB) can deadlock against a session channel being read
            # ("Key-exchange timed out waiting for key negotiation", paramiko#822, seen here at 512 MiB):
            # while streaming, only sshd starts a rekey (its RekeyLimit), as the workaround says.
            packetizer = transport.packetizer
            packetizer.REKEY_BYTES = packetizer.REKEY_PACKETS = 1 << 40
            try:
                channel.settimeout(stall_timeout)
                channel.exec_command(line)
                while data := channel.recv(block):
                    yield data
                exited = channel.recv_exit_status()
                if exited != 0:
                    err = channel.recv_stderr(4096).decode("utf-8", "replace")
                    raise RemoteCommandFailed(f"{self.host.name}: {self.shown(line)[:120]} failed (exit "
                                              f"{exited}): {stderr_tail(err) or '(no stderr)'}",
                                              exited=exited, stderr_tail=stderr_tail(err))
            finally:
                channel.close()
                del packetizer.REKEY_BYTES, packetizer.REKEY_PACKETS  # paramiko's defaults again
        except (OSError, EOFError, paramiko.SSHException) as exc:
            self._conn = None
            raise HostUnreachable(f"connection to {self.host.name} lost while streaming "
                                  f"{self.shown(line)[:120]}: {str(exc) or type(exc).__name__}") from None

    # --- host keys --------------------------------------------------------------------------------
    def key_pinned(self, key: paramiko.PKey) -> bool:
        """Whether the host's known_hosts file (read now) still pins `key` (a master asks before each
        command it serves)."""
        return host_key_pinned(self.host, key)

    def offered_host_key(self) -> paramiko.PKey:
        """The key the host presents, fetched without trusting or saving it (through the jump host's
        connection when this session has one open)."""
        import paramiko

        gateway = getattr(self._conn, "gateway", None) if self._conn is not None else None
        if gateway is not None and gateway.transport is not None and gateway.transport.is_active():
            sock = gateway.transport.open_channel("direct-tcpip", (self.host.address, self.host.port),
                                                  ("127.0.0.1", 0), timeout=self.connect_timeout)
        else:
            sock = socket.create_connection((self.host.address, self.host.port),
                                            timeout=self.connect_timeout)
        t = paramiko.Transport(sock)
        try:
            t.start_client(timeout=self.connect_timeout)
            return t.get_remote_server_key()
        finally:
            t.close()


def pinned_keys(host: Host) -> dict:
    """The keys the host's known_hosts file (read now) pins for it, by key type ({} when none)."""
    import paramiko

    path = os.path.expanduser(host.known_hosts)
    keys = paramiko.HostKeys()
    try:
        localfiles.check_file(path, localfiles.KNOWN_HOSTS_MAX, "known_hosts file")
        keys.load(path)
    except Exception:  # noqa: BLE001 - unreadable, special or malformed: not pinned
        return {}
    return dict(keys.lookup(known_hosts_name(host)) or {})


def host_key_pinned(host: Host, key: paramiko.PKey) -> bool:
    """Whether the host's known_hosts file (read now) pins `key` for it."""
    pinned = pinned_keys(host).get(key.get_name())
    return pinned is not None and pinned.asbytes() == key.asbytes()


@dataclass
class KeyCheck:
    """`invoke trust-host`: the key a host offers, and whether it was pinned (`error`: a fingerprint
    that does not match, shown after the offered key)."""

    host: Host
    key_name: str
    offered: str
    pinned_in: str | None = None
    error: Exception | None = None
    was: str = "not pinned"      # before this task: "pinned, matches", "not pinned" or "CHANGED"
    pinned_before: tuple = ()    # CHANGED: the fingerprints known_hosts pins instead

    def describe(self) -> str:
        h = self.host
        lines = [f"{h.name} ({h.address}:{h.port}) offers {self.key_name} {self.offered}"]
        if self.pinned_in:
            lines.append(f"pinned in {self.pinned_in}" + (" (it was CHANGED: the old key is replaced)"
                                                          if self.was == "CHANGED" else ""))
        elif self.was == "pinned, matches":
            lines.append(f"pinned, matches: {h.known_hosts} pins this key; nothing to do")
        elif self.was == "CHANGED":
            lines.append(f"CHANGED: {h.known_hosts} pins {', '.join(self.pinned_before)} for this host, not "
                         f"the key it offers; check on the host's console before re-pinning with "
                         f"--fingerprint {self.offered} (docs/runbooks/ssh-host-key.md)")
        elif self.error is None:
            lines.append(f"not pinned: re-run with --fingerprint {self.offered} once you have checked it "
                         "on the host")
        return "\n".join(lines)

    def facts(self) -> dict:
        return {"host": self.host.name, "key": self.key_name, "offered": self.offered, "was": self.was,
                "pinned_in": self.pinned_in, "pinned_before": list(self.pinned_before)}

    def row(self) -> str:
        return self.describe().splitlines()[-1]


def trust_host(host: Host, given: str | None = None) -> KeyCheck:
    """Fetch the host's key; pin it only when `given` (the fingerprint checked out of band) matches."""
    key = HostSession(host).offered_host_key()
    offered = fingerprint(key)
    check = KeyCheck(host, key.get_name(), offered)
    pinned = pinned_keys(host)
    if host_key_pinned(host, key):
        check.was = "pinned, matches"
    elif pinned:
        check.was, check.pinned_before = "CHANGED", tuple(fingerprint(k) for k in pinned.values())
    if given is None:
        if check.was == "CHANGED":
            check.error = HostKeyChanged(f"host key of {host.name} CHANGED: nothing pinned")
        return check
    if given.strip() != offered:
        check.error = UsageError(f"fingerprint mismatch: you gave {given}, the host offers {offered}; "
                                 "nothing pinned")
        return check
    check.pinned_in = pin_host_key(host, key)
    return check


def pin_host_key(host: Host, key: paramiko.PKey) -> str:
    """Replace the host's entry in its known_hosts file with `key` (only after an explicit check)."""
    import paramiko

    path = os.path.expanduser(host.known_hosts)
    keys = paramiko.HostKeys()
    if os.path.exists(path):
        localfiles.check_file(path, localfiles.KNOWN_HOSTS_MAX, "known_hosts file")
        keys.load(path)
    name = known_hosts_name(host)
    if name in keys:
        del keys[name]
    keys.add(name, key.get_name(), key)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    keys.save(path)
    return path


# --- a shared connection's master (mux.start_master runs `python -m dflash_ops.transport SPEC`) -----
def master_main(spec_text: str) -> int:
    """A master for one host: mux serves the socket, this module makes its verified connection."""
    spec = json.loads(spec_text)
    if not isinstance(spec, dict):
        return 1
    host = Host(**spec["host"])
    jump = Host(**spec["jump"]) if spec["jump"] else None
    return mux.serve(spec, HostSession(host, jump=jump, share=False))


if __name__ == "__main__":
    try:
        sys.exit(master_main(sys.stdin.read(mux.SPEC_MAX + 1)))
    except Exception:  # noqa: BLE001 - nobody reads a master's errors; the next task connects itself
        sys.exit(1)
