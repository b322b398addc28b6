"""Waiting for what another process is about to do: the tests' one polling helper."""

from __future__ import annotations

import time


def wait_for(what: str, predicate, timeout: float = 240.0, every: float = 0.5):
    """Call predicate() every `every` seconds until it returns something truthy, and return that; fail
    naming `what` after `timeout` seconds. A bound on a hang, not a timing check. A predicate that runs
    the CLI costs a process and a round trip per call: poll it every 2 s or so, not every 0.1 s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(every)
