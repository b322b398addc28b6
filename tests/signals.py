"""Children the tests send Ctrl-C to: the one preexec_fn that lets it reach them."""

from __future__ import annotations

import signal


def sigint_default() -> None:
    """A child's preexec_fn: SIGINT's default disposition, as a terminal gives it, also when the test
    runner was started with SIGINT ignored (a background job without job control), where the child
    would inherit the ignore and Python in it would never raise KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
