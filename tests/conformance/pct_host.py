"""The conformance suite's view of a host: its session, containers, scratch dirs, and how a check fails."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dflash_ops import commands
from dflash_ops.inventory import Container
from dflash_ops.transport import HostSession, Result

SCRATCH = "/tmp/dflash-conformance.XXXXXX"


def contract(what: str, did, expects) -> None:
    """Fail a check with what the host did and what the tool expects (no traceback: the
    words are the point)."""
    pytest.fail(f"pct contract: {what}\n  the host did:      {did}\n  the tool expects:  {expects}",
                pytrace=False)


def shown(result: Result) -> str:
    return f"exit {result.exited}, stdout {result.stdout[-300:]!r}, stderr {result.stderr[-300:]!r}"


@dataclass
class PctHost:
    session: HostSession
    ct: Container                 # a running container
    missing: Container            # an id the host does not have
    stopped: Container | None     # a stopped container, when one may be used
    embedded: bool
    ct_scratch: str = ""          # the scratch dir in the container
    host_scratch: str = ""        # the scratch dir on the host

    @property
    def node(self) -> str:
        return self.ct.host.node_name

    def pct(self, *args) -> str:
        """A host line running pct as the tool starts it (`env LC_ALL=C.UTF-8 [sudo -n] pct`), each
        argument quoted."""
        return commands.pct_line(self.ct.host.pct_command, *map(str, args))

    def run(self, line: str) -> Result:
        return self.session.run(line, check=False)


def missing_id(listing: str) -> int:
    """The highest valid CT id that `pct list` does not show."""
    taken = {int(row.split()[0]) for row in listing.splitlines()[1:]
             if row.split() and row.split()[0].isdigit()}
    return next(i for i in range(999_999_999, 100, -1) if i not in taken)


