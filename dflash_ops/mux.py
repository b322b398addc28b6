"""Connection sharing between invocations, as OpenSSH's ControlMaster/ControlPersist (Ansible's default).

The first task that connects to a host leaves a master behind: a small background process holding
one verified SSH connection, listening on a Unix socket in a private directory. For the next
`control_persist` seconds (inventory, default 60; `DFLASH_CONTROL_PERSIST=0` turns it off), a task's
command lines for that host go through it: no paramiko import, no key exchange, no authentication,
the same remote session per command. The master exits once idle that long, or when its connection
drops.

What goes through a master: command lines without a pty (`HostSession.run`). A pty, SFTP and file
streams open the task's own connection, as before. The master is found by a name made of everything
that decides where and how to connect (user, address, port, key, the known_hosts file, the jump
host), so `invoke disconnect` finds it from the inventory's host, also after a re-pin. Its socket
lives in a directory only this user can use, and it serves only clients of this user (SO_PEERCRED).
Nothing of the host is in the master's argv (its spec comes on stdin): `ps` shows
`python -m dflash_ops.mux`, not the address, the user or the key's path.

The host key is checked again while a master lives (`Master.host_key_changed`): at every command, the
key its connection was opened with must still be the one known_hosts pins for the host (a re-pin to
another key ends the master); and at the first command after HOST_KEY_RECHECK_S seconds without a
check, the host is asked for its key anew (one key exchange, no authentication) and must offer the
same one. A changed key: the master refuses the command (`R`) and leaves, and the client's own
connection meets the changed key as any task does (HostKeyChanged, exit 4).

Protocol on the socket, one command per client connection: the client sends a 4-byte big-endian
length and a JSON header {"line": ...}; the master answers frames of one type byte, a 4-byte length and
the data: `s` the command started, `o` stdout bytes, `e` stderr bytes, `x` the exit status (text), `E`
the connection was lost (text), `R` refused before the command started (text). A client that gets `R`,
or loses the master before `s` (it was exiting, idle), runs the command on its own connection. The
client closing its end (Ctrl-C, a timeout) closes the channel: sshd ends the session, and the command
with it (commands.SESSION_SCRIPT).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import select
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ENV = "DFLASH_CONTROL_PERSIST"
DEFAULT_PERSIST = 60
MAX_PERSIST = 86_400
HEADER_MAX = 1 << 20
FRAME = struct.Struct(">cI")
CHUNK = 1 << 16
SUN_PATH_MAX = 107
HOST_KEY_RECHECK_S = 5.0  # the longest a master serves on a host key it has not seen offered again
SPEC_MAX = 1 << 16
MASTER_MODULE = "dflash_ops.transport"  # `python -m` it with a spec: a master (transport.master_main)


class Refused(Exception):
    """The master could not start the command (no channel): use a connection of one's own."""


class Lost(Exception):
    """The master's connection dropped while the command ran."""


def persist_seconds(host) -> int:
    """The host's control_persist, or $DFLASH_CONTROL_PERSIST when set (0: no sharing)."""
    raw = os.environ.get(ENV)
    if raw is None or raw.strip() == "":
        return host.control_persist
    try:
        value = int(raw)
    except ValueError:
        return 0
    return min(max(value, 0), MAX_PERSIST)


def control_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime and os.path.isdir(runtime) else Path.home() / ".cache"
    return base / "dflash-ops"


def private_dir(path: Path) -> bool:
    """`path` exists (made if missing) as a directory of this user that nobody else may enter."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def _identity(host) -> list:
    """What decides where and how `host` is reached; not the pinned keys themselves, which the master
    checks at every command, so that a re-pinned host keeps its name (`disconnect` finds it). A
    known_hosts file that is not a regular file of bounded size is refused here as everywhere
    (InventoryError)."""
    from .localfiles import KNOWN_HOSTS_MAX, read_regular

    try:
        read_regular(os.path.expanduser(host.known_hosts), KNOWN_HOSTS_MAX, "known_hosts file")
    except FileNotFoundError:
        pass
    return [host.user, host.address, host.port, host.key, host.known_hosts]


def socket_path(host, jump=None) -> Path:
    """Where the master for `host` (through `jump`) listens. InventoryError: a special known_hosts."""
    ident = json.dumps([_identity(host), _identity(jump) if jump is not None else None])
    return control_dir() / (hashlib.sha256(ident.encode()).hexdigest()[:16] + ".sock")


def usable(path: Path) -> bool:
    """A Unix socket's path holds at most 107 bytes (sun_path): a longer one turns sharing off."""
    return len(os.fsencode(path)) <= SUN_PATH_MAX


def _send_header(sock: socket.socket, header: dict) -> None:
    data = json.dumps(header).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _send(sock: socket.socket, kind: bytes, data: bytes = b"") -> None:
    sock.sendall(FRAME.pack(kind, len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise EOFError("the master closed the connection")
        buf += part
    return buf


# --- client ---------------------------------------------------------------------------------------
STREAMED_TAIL = 1 << 20  # what a result keeps of output that was handed to a sink as it came


class OutputTail(list):
    """The captured text of a stream whose output goes to a sink as it comes: only its last
    STREAMED_TAIL characters are kept (the end lines a caller looks at), so that following a log of
    any size holds a bounded amount (a followed 256 MiB log held 582 MiB). Amortized linear."""

    size = 0

    def append(self, text: str) -> None:
        super().append(text)
        self.size += len(text)
        if self.size > 2 * STREAMED_TAIL:
            tail = "".join(self)[-STREAMED_TAIL:]
            self[:] = [tail]
            self.size = len(tail)


class TooLarge(Exception):
    """The command wrote more than the caller's limit: it was ended (the client closed its end)."""


class _Output:
    """A command's output as the frames bring it: decoded per stream (one incremental UTF-8 decoder
    each), kept (only its tail, OutputTail, where a callback takes it as it comes), and handed to
    the callbacks as it comes."""

    def __init__(self, on_out, on_err, limit: int | None = None):
        self.limit, self.sizes = limit, {b"o": 0, b"e": 0}
        self.decoders = {b"o": codecs.getincrementaldecoder("utf-8")("replace"),
                         b"e": codecs.getincrementaldecoder("utf-8")("replace")}
        self.sinks = {b"o": on_out, b"e": on_err}
        self.parts: dict[bytes, list[str]] = {k: [] if sink is None else OutputTail()
                                              for k, sink in self.sinks.items()}

    def add(self, kind: bytes, data: bytes, final: bool = False) -> None:
        self.sizes[kind] += len(data)
        if self.limit is not None and self.sizes[kind] > self.limit:
            raise TooLarge(f"more than {self.limit} bytes on std{'out' if kind == b'o' else 'err'}")
        text = self.decoders[kind].decode(data, final=final)
        if text:
            self.parts[kind].append(text)
            if self.sinks[kind] is not None:
                self.sinks[kind](text)

    def finish(self, exited: int) -> tuple[str, str, int]:
        for kind in self.decoders:
            self.add(kind, b"", final=True)
        return "".join(self.parts[b"o"]), "".join(self.parts[b"e"]), exited


def _wait(sock: socket.socket, deadline: float | None) -> None:
    """TimeoutError once `deadline` passes with nothing to read."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            raise TimeoutError


def run(path: Path, line: str, *, on_out=None, on_err=None, timeout: float | None = None,
        limit: int | None = None):
    """Run `line` through the master at `path`: (stdout, stderr, exited), or None when no master
    answers there. Output is decoded as UTF-8 (invalid bytes replaced) and handed to on_out/on_err as
    it comes (then the result keeps its tail only, OutputTail). Raises Refused, Lost, TimeoutError,
    or TooLarge (`limit` bytes passed on stdout or stderr); the command was ended."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        return None
    deadline = None if timeout is None else time.monotonic() + timeout
    output = _Output(on_out, on_err, limit)
    started = False
    with sock:
        try:
            _send_header(sock, {"line": line})
        except OSError:
            return None
        while True:
            _wait(sock, deadline)
            try:
                kind, size = FRAME.unpack(_recv_exact(sock, FRAME.size))
                data = _recv_exact(sock, size)
            except (OSError, EOFError) as exc:
                if not started:
                    return None  # the master went away before it started the command
                raise Lost(str(exc) or type(exc).__name__) from None
            if kind == b"s":
                started = True
            elif kind in output.parts:
                output.add(kind, data)
            elif kind == b"x":
                return output.finish(int(data))
            elif kind == b"R":
                raise Refused(data.decode("utf-8", "replace"))
            else:  # b"E" or anything unexpected
                raise Lost(data.decode("utf-8", "replace") or "the master stopped")


def stop(path: Path) -> bool:
    """Ask the master at `path` to leave (as `ssh -O exit`): it stops taking commands at once and
    exits when the running ones end. False: no master answered there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        _send_header(sock, {"exit": True})
        sock.settimeout(10)
        return FRAME.unpack(_recv_exact(sock, FRAME.size))[0] == b"x"
    except (OSError, EOFError):
        return False
    finally:
        sock.close()


@dataclass
class Closed:
    """`invoke disconnect`: one line per host, whether a shared connection was closed."""

    closed: list  # [(host name, closed?)]

    def describe(self) -> str:
        return "\n".join(f"{name}: {'closed' if done else 'no shared connection'}"
                         for name, done in self.closed)

    def row(self) -> str:
        return self.describe().replace("\n", "; ")


def disconnect(hosts) -> Closed:
    """Ask the master of each (host, jump) to leave (`stop`)."""
    return Closed([(host.name, stop(socket_path(host, jump))) for host, jump in hosts])


def answers(path: Path) -> bool:
    """Whether a master listens at `path` (a socket file left by a killed one does not)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        sock.close()


def start_master(host, jump, persist: int, path: Path) -> None:
    """Leave a master for `host` behind (it connects by itself; nothing waits for it)."""
    spec = json.dumps({"host": asdict(host), "jump": asdict(jump) if jump is not None else None,
                       "persist": persist, "path": str(path)})
    package_parent = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (package_parent, os.environ.get("PYTHONPATH")) if p)}
    # sh puts it in the background and exits: the master is nobody's child here, and the task does
    # not wait for its connection. Its entry point is transport.py's (`python -m dflash_ops.transport`),
    # which makes the session. The spec (address, user, key path) comes on its stdin, a pipe that
    # holds it whole (SPEC_MAX), never in argv, which every local user can read in /proc.
    if len(spec) > SPEC_MAX:
        return
    # (An asynchronous command's stdin is /dev/null unless redirected: hence fd 3.)
    subprocess.run(["/bin/sh", "-c", 'exec 3<&0; exec "$@" <&3 3<&- >/dev/null 2>&1 &', "sh",
                    sys.executable, "-m", MASTER_MODULE], input=spec.encode(), env=env, cwd="/",
                   start_new_session=True, check=False)


# --- master ---------------------------------------------------------------------------------------
class Master:
    def __init__(self, session, persist: int, path: Path):
        self.session, self.persist, self.path = session, persist, path
        self.active = 0
        self.leaving = False
        self.last = time.monotonic()
        self.lock = threading.Lock()
        self.key = session.connect().transport.get_remote_server_key()
        self.key_checked = time.monotonic()  # the connection verified it just now
        self.key_lock = threading.Lock()

    def host_key_changed(self) -> str:
        """Why this master may not serve another command on its connection ("" : it may)."""
        with self.key_lock:
            if not self.session.key_pinned(self.key):
                return "known_hosts no longer pins the host key this connection was opened with"
            if time.monotonic() - self.key_checked < HOST_KEY_RECHECK_S:
                return ""
            try:
                offered = self.session.offered_host_key()
            except Exception as exc:  # noqa: BLE001 - unreachable for a new connection: the client finds out
                return f"cannot ask the host for its key again: {exc or type(exc).__name__}"
            if offered != self.key:
                return "the host offers another key than the one this connection was opened with"
            self.key_checked = time.monotonic()
            return ""

    def leave(self) -> None:
        self.leaving = True
        self.path.unlink(missing_ok=True)

    def serve(self, listener: socket.socket) -> None:
        transport = self.session.connect().transport
        listener.settimeout(1.0)
        while transport.is_active():
            with self.lock:
                if not self.active and (self.leaving or time.monotonic() - self.last > self.persist):
                    if not self.leaving:
                        self.path.unlink(missing_ok=True)  # new clients find no master, not a dying one
                    return
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            creds = client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            if struct.unpack("3i", creds)[1] != os.getuid():
                client.close()
                continue
            with self.lock:
                self.active += 1
            threading.Thread(target=self._handle, args=(client, transport), daemon=True).start()

    def _handle(self, client: socket.socket, transport) -> None:
        try:
            with client:
                self._relay(client, transport)
        except (OSError, EOFError, ValueError):
            pass
        finally:
            with self.lock:
                self.active -= 1
                self.last = time.monotonic()

    def _relay(self, client: socket.socket, transport) -> None:
        client.settimeout(10)
        (size,) = struct.unpack(">I", _recv_exact(client, 4))
        if size > HEADER_MAX:
            return
        header = json.loads(_recv_exact(client, size))
        if header.get("exit"):
            self.leave()
            _send(client, b"x", b"0")
            return
        line = header["line"]
        why = self.host_key_changed()
        if why:  # the client connects itself and meets the key as any task does
            self.leave()
            _send(client, b"R", why.encode())
            return
        client.settimeout(None)
        try:
            channel = transport.open_session(timeout=10)
            channel.exec_command(line)
        except Exception as exc:  # noqa: BLE001 - any failure to start: the client connects itself
            _send(client, b"R", str(exc).encode()[:1000])
            return
        _send(client, b"s")
        try:
            while True:
                # Both streams at their end (seen before the last reads, so nothing comes after them;
                # the channel's readiness pipe then stays set, so it is not watched): done once the
                # exit status is in too. A command that closed its output and runs on is waited for.
                ended = channel.eof_received or channel.closed
                while channel.recv_ready():
                    _send(client, b"o", channel.recv(CHUNK))
                while channel.recv_stderr_ready():
                    _send(client, b"e", channel.recv_stderr(CHUNK))
                if ended and channel.exit_status_ready():
                    _send(client, b"x", str(channel.recv_exit_status()).encode())
                    return
                if not transport.is_active():
                    _send(client, b"E", b"the shared connection dropped")
                    return
                if ended:  # the status comes with no byte on the channel's pipe: wait for it
                    channel.status_event.wait(0.05)
                    ready = select.select([client], [], [], 0)[0]
                else:
                    ready = select.select([channel, client], [], [], 1.0)[0]
                if client in ready:
                    return  # the client went away (Ctrl-C, a timeout): the channel closes below
        finally:
            channel.close()


def serve(spec: dict, session) -> int:
    """The master's life: `spec` from `start_master`, `session` an unconnected HostSession for its
    host (transport.py builds it: this module imports neither transport nor inventory)."""
    import fcntl

    path = Path(spec["path"])
    if not private_dir(path.parent):
        return 1
    lock = os.open(str(path) + ".lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # held for life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return 0  # another master for this host is starting or serving
    session.connect()  # verified and authenticated as any task's connection, or the master ends here
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(old)
    listener.listen(64)
    mine = os.stat(path).st_ino
    try:
        Master(session, int(spec["persist"]), path).serve(listener)
    finally:
        listener.close()
        try:
            if os.stat(path).st_ino == mine:
                path.unlink()
        except OSError:
            pass
        session.close()
    return 0
