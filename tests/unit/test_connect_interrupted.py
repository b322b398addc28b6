"""Ctrl-C while a task connects: nothing of the half-open SSH connection outlives the interrupt."""

import signal
import socket
import threading

import paramiko
import pytest

from dflash_ops.inventory import Host
from dflash_ops.transport import HostSession


def test_ctrl_c_while_connecting_closes_the_half_open_connection(tmp_path):
    """The host accepts the TCP connection and never sends its banner; Ctrl-C (here SIGALRM raising
    KeyboardInterrupt in the main thread, where Python delivers SIGINT) comes while the transport
    thread waits for it. That thread, left running, was the one thread besides the main one that
    the interpreter still had at exit when an interrupted `invoke status` died of SIGSEGV instead
    of exiting 130 (test_one_cli, once in a fresh-clone run)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        accepted = []
        acceptor = threading.Thread(target=lambda: accepted.append(silent.accept()[0]), daemon=True)
        acceptor.start()
        host = Host(name="silent", address="127.0.0.1", port=silent.getsockname()[1],
                    key=str(tmp_path / "key"), known_hosts=str(tmp_path / "known_hosts"),
                    control_persist=0)
        session = HostSession(host, share=False)
        # other tests in this process may keep connections of their own: only this one's count
        before = {t for t in threading.enumerate() if isinstance(t, paramiko.Transport)}

        def interrupt(signum, frame):
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            # once the TCP connection is accepted, the transport thread is waiting for the banner
            threading.Thread(target=lambda: (acceptor.join(30), signal.setitimer(signal.ITIMER_REAL, 0.3)),
                             daemon=True).start()
            with pytest.raises(KeyboardInterrupt):
                session.connect()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        left = [t for t in threading.enumerate()
                if isinstance(t, paramiko.Transport) and t.is_alive() and t not in before]
        for connection in accepted:
            connection.close()
    assert accepted and left == []
