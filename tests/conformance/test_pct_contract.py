"""What the tool relies on `pct` (pve-container 6.x) to do: docs/design.md, "The pct contract".

Each test is one of `invoke conformance`'s checks (dflash_ops.conformance.CHECKS), against the
embedded host by default; `scripts/test tests/conformance --inventory my.yaml --ct 200` checks a
real one (or, with only the package installed, `invoke conformance --inventory my.yaml --ct 200`).
A failing check says what was sent, what the host did and what the tool expects.
"""

from __future__ import annotations

import pytest

from dflash_ops import conformance


@pytest.mark.parametrize("check", conformance.CHECKS, ids=lambda c: c.name)
def test_pct_contract(pct_host, check):
    outcome = conformance.run_check(pct_host, check)
    if outcome.verdict == conformance.SKIP:
        pytest.skip(outcome.did)
    if outcome.verdict != conformance.PASS:
        pytest.fail(f"pct contract: {check.name}\n  sent:              {check.sent}\n"
                    f"  the host did:      {outcome.did}\n  the tool expects:  {check.expects}",
                    pytrace=False)
