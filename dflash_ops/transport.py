"""The only module that touches fabric/paramiko: one SSH connection per host per invocation.

Host keys are verified against the inventory's known_hosts file (RejectPolicy); an unknown or changed
key is refused, never trusted silently. Failures become one-line `dflash_ops.errors` exceptions.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import socket
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import paramiko
from fabric import Config, Connection
from invoke.exceptions import CommandTimedOut

from . import commands
from .errors import (AuthFailed, ContainerMissing, ContainerStopped, HostKeyChanged, HostKeyUnknown,
                     HostUnreachable, RemoteCommandFailed, UnsafeValue)
from .inventory import Container, Host

DEFAULT_CONNECT_TIMEOUT = 10.0
# paramiko's transport thread logs a dropped socket ("Socket exception: ...") through logging's
# last-resort handler onto stderr, beside our own one-line error: keep it out unless logging is set up.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
# The host's shell gets the line as one argument of `sh -c`: Linux caps one argument at 128 KiB
# (MAX_ARG_STRLEN, NUL included). Longer lines failed as "Argument list too long", and past sshd's
# packet size as a reset connection that looked like a network fault.
MAX_LINE_BYTES = 131072 - 1
STDERR_TAIL_LINES = 5


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


def classify_container_failure(ct: Container, result: Result):
    """Map pct's own messages to container errors (exit 255 is also a legal exit code of the command)."""
    err = result.stderr
    if f"lxc/{ct.ctid}.conf' does not exist" in err:
        return ContainerMissing(f"container {ct.ctid} does not exist on host {ct.host.name} "
                                f"(pct: Configuration file ... lxc/{ct.ctid}.conf does not exist); check the inventory")
    if f"container '{ct.ctid}' not running" in err:
        return ContainerStopped(f"container {ct.ctid} on host {ct.host.name} is stopped; "
                                f"start it with `pct start {ct.ctid}` on the host")
    return None


class HostSession:
    """Commands to one host over one lazily opened SSH connection, reused for the whole invocation."""

    def __init__(self, host: Host, *, jump: Host | None = None, dry_run: bool = False,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT, secrets: Sequence[str] = (),
                 echo: Callable[[str], None] | None = None):
        self.host = host
        self.jump = jump
        self.dry_run = dry_run
        self.connect_timeout = connect_timeout
        self.secrets = tuple(secrets)
        self.echo = echo or (lambda line: print(line, flush=True))
        self.connections = 0
        self.round_trips = 0
        self._conn: Connection | None = None

    # --- connection -----------------------------------------------------------------------------
    def _connection(self, host: Host, gateway: Connection | None = None) -> Connection:
        connect_kwargs = {
            "timeout": self.connect_timeout,
            "banner_timeout": self.connect_timeout,
            "auth_timeout": self.connect_timeout,
            "look_for_keys": host.key is None,
            "allow_agent": host.key is None,
        }
        if host.key:
            connect_kwargs["key_filename"] = [host.key]
        conn = Connection(host.address, user=host.user, port=host.port, gateway=gateway,
                          config=Config(overrides={"load_ssh_configs": False}),
                          connect_kwargs=connect_kwargs)
        conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        known = os.path.expanduser(host.known_hosts)
        if os.path.exists(known):
            conn.client.load_host_keys(known)
        return conn

    def _open(self, conn: Connection, host: Host) -> None:
        where = f"{host.name} ({host.address}:{host.port})"
        try:
            conn.open()
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
        except (socket.timeout, TimeoutError) as exc:
            raise HostUnreachable(f"cannot reach {where}: timed out after {self.connect_timeout:g} s") from exc
        except (OSError, EOFError, paramiko.ssh_exception.NoValidConnectionsError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            raise HostUnreachable(f"cannot reach {where}: {reason}") from None

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
        return conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # --- commands -------------------------------------------------------------------------------
    def shown(self, line: str) -> str:
        return commands.mask(line, self.secrets)

    def run(self, line: str, *, stream: bool = False, check: bool = True, timeout: float | None = None,
            pty: bool = False, out_stream=None, err_stream=None) -> Result:
        """Run one host command line (one round trip). `check` raises RemoteCommandFailed on non-zero."""
        size = len(line.encode("utf-8", "surrogateescape"))
        if size > MAX_LINE_BYTES:
            raise UnsafeValue(f"{self.host.name}: the command line would be {size} bytes, more than the "
                              f"{MAX_LINE_BYTES} a remote shell accepts; shorten the longest value "
                              f"(--set, --config, --run or the inventory's env)")
        if self.dry_run:
            self.echo(self.shown(line))
            return Result(line=line)
        conn = self.connect()
        self.round_trips += 1
        hide = not stream and out_stream is None
        try:
            r = conn.run(line, hide=hide, warn=True, pty=pty, timeout=timeout,
                         in_stream=False,  # stdin is polled byte by byte: files go over SFTP instead
                         out_stream=out_stream, err_stream=err_stream)
        except CommandTimedOut:
            raise RemoteCommandFailed(f"{self.host.name}: command timed out after {timeout:g} s: "
                                      f"{self.shown(line)[:200]}") from None
        except (socket.error, EOFError, paramiko.SSHException) as exc:
            self._conn = None
            raise HostUnreachable(f"connection to {self.host.name} lost: {exc or type(exc).__name__}") from None
        result = Result(line=line, stdout=r.stdout, stderr=r.stderr, exited=r.exited)
        if check and not result.ok:
            raise RemoteCommandFailed(
                f"{self.host.name}: exit {result.exited}: {self.shown(stderr_tail(result.stderr)) or '(no stderr)'}",
                exited=result.exited, stderr_tail=stderr_tail(result.stderr))
        return result

    def exec(self, ct: Container, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
             cwd: str | None = None, check: bool = True, **kwargs) -> Result:
        """Run argv inside container `ct` (same host) and classify pct's own failures."""
        line = commands.pct_exec(ct.ctid, argv, env=env, cwd=cwd, pct=ct.host.pct)
        return self.run_in(ct, line, check=check, **kwargs)

    def run_in(self, ct: Container, line: str, *, check: bool = True, **kwargs) -> Result:
        """Run a host line that addresses container `ct` (pct exec/push/pull), mapping pct's errors."""
        result = self.run(line, check=False, **kwargs)
        if not result.ok:
            container_error = classify_container_failure(ct, result)
            if container_error is None and result.exited > 128:
                container_error = self.container_gone(ct)
            if container_error is not None:
                raise container_error
            if check and result.exited == -1:  # paramiko's "no exit status": the connection dropped
                self._conn = None
                raise HostUnreachable(f"connection to {self.host.name} lost while a command ran in {ct.label} "
                                      f"(no exit status came back); check with `invoke status` or "
                                      f"`invoke doctor`, then run the task again")
            if check:
                raise RemoteCommandFailed(
                    f"{ct.label}: exit {result.exited}: {self.shown(stderr_tail(result.stderr)) or '(no stderr)'}",
                    exited=result.exited, stderr_tail=stderr_tail(result.stderr))
        return result

    def container_gone(self, ct: Container):
        """After a command killed by a signal: ContainerStopped/Missing if the container went away under it."""
        probe = self.run(commands.shell_line([ct.host.pct, "status", str(ct.ctid)]), check=False)
        if "status: stopped" in probe.stdout:
            return ContainerStopped(f"container {ct.ctid} on host {ct.host.name} stopped while the command ran; "
                                    f"start it with `pct start {ct.ctid}` on the host, then check `invoke status`")
        return classify_container_failure(ct, probe)

    # --- files (SFTP to the host; pct push/pull moves them in and out of containers) -----------
    def put_bytes(self, data: bytes, host_path: str, mode: int = 0o600) -> None:
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
        except (socket.error, EOFError, paramiko.SSHException) as exc:
            self._conn = None
            raise HostUnreachable(f"connection to {self.host.name} lost while sending {len(data)} bytes to "
                                  f"{host_path}: {str(exc) or type(exc).__name__}; nothing was changed in a "
                                  f"container, run the task again") from None

    def get_bytes(self, host_path: str) -> bytes:
        if self.dry_run:
            self.echo(f"# sftp get {host_path}")
            return b""
        try:
            sftp = self.connect().sftp()
            self.round_trips += 1
            with sftp.open(host_path, "rb") as fh:
                fh.prefetch()
                return fh.read()
        except (socket.error, EOFError, paramiko.SSHException) as exc:
            self._conn = None
            raise HostUnreachable(f"connection to {self.host.name} lost while reading {host_path}: "
                                  f"{str(exc) or type(exc).__name__}") from None

    # --- host keys --------------------------------------------------------------------------------
    def offered_host_key(self) -> paramiko.PKey:
        """The key the host presents, fetched without trusting or saving it."""
        sock = socket.create_connection((self.host.address, self.host.port), timeout=self.connect_timeout)
        t = paramiko.Transport(sock)
        try:
            t.start_client(timeout=self.connect_timeout)
            return t.get_remote_server_key()
        finally:
            t.close()


def pin_host_key(host: Host, key: paramiko.PKey) -> str:
    """Replace the host's entry in its known_hosts file with `key` (only after an explicit check)."""
    path = os.path.expanduser(host.known_hosts)
    keys = paramiko.HostKeys()
    if os.path.exists(path):
        keys.load(path)
    name = known_hosts_name(host)
    if name in keys:
        del keys[name]
    keys.add(name, key.get_name(), key)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    keys.save(path)
    return path
