"""Signals the tests send: the one preexec_fn that lets Ctrl-C reach a child, and an embedded
host's sshd stopped."""

from __future__ import annotations

import os
import signal
import socket

from waiting import wait_for


def sigint_default() -> None:
    """A child's preexec_fn: SIGINT's default disposition, as a terminal gives it, also when the test
    runner was started with SIGINT ignored (a background job without job control), where the child
    would inherit the ignore and Python in it would never raise KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def sshd_stopped(host) -> None:
    """SIGTERM to an embedded host's sshd (its listener; open sessions stay), returned once its port
    refuses connections: sshd acts on the signal when it next runs, and a connection made before
    then is still served (a fan-out right after the kill found the host up)."""
    try:
        os.kill(host.sshd_pid, signal.SIGTERM)
    except ProcessLookupError:
        pass  # stopped already

    def refused() -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", host.port)) != 0
    wait_for(f"{host.name}'s sshd to stop listening", refused, timeout=60, every=0.05)
