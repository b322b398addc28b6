"""fanout.run returns outcomes and prints nothing; fanout.Rows is what cli.show draws and raises."""

from types import SimpleNamespace

import pytest

from dflash_ops import cli, fanout
from dflash_ops.errors import DflashOpsError, FanOutFailed, HostUnreachable


def target(host: str, ctid: int):
    return SimpleNamespace(container=SimpleNamespace(label=f"{host}/{ctid}", ctid=ctid,
                                                     host=SimpleNamespace(name=host)))


class Checked:
    """A result whose row() refuses, as doctor's does when a check failed."""

    def row(self) -> str:
        raise DflashOpsError("1 of 12 checks failed: deployed code")


def test_outcomes_in_the_targets_order_and_nothing_printed(capsys):
    targets = [target("pve2", 201), target("pve1", 200), target("pve2", 202), target("pve1", 203)]
    calls = []

    def action(t):
        calls.append(t.container.label)
        if t.container.label == "pve2/201":
            raise HostUnreachable("cannot reach pve2")
        if t.container.label == "pve1/203":
            return Checked()
        if t.container.label == "pve1/200":
            raise ValueError("a bug")
        return "never: pve2 is down"

    outcomes = fanout.run(targets, action)
    assert capsys.readouterr() == ("", "")
    assert [o.label for o in outcomes] == ["pve2/201", "pve1/200", "pve2/202", "pve1/203"]
    assert "pve2/202" not in calls  # its host could not be reached: one timeout per host
    assert [(o.ok, o.detail) for o in outcomes] == [
        (False, "cannot reach pve2"), (False, "ValueError: a bug"), (False, "cannot reach pve2"),
        (False, "1 of 12 checks failed: deployed code")]

    failed = "4 of 4 containers failed: pve2/201, pve1/200, pve2/202, pve1/203"
    with pytest.raises(FanOutFailed, match=failed):
        cli.show(fanout.Rows("doctor", outcomes))
    assert "1 of 12 checks failed" in capsys.readouterr().out


def test_rows_of_results_text_and_none():
    outcomes = fanout.run([target("pve1", 200), target("pve1", 201)],
                          lambda t: None if t.container.label == "pve1/200" else "freed 0 B")
    assert [(o.ok, o.detail) for o in outcomes] == [(True, "ok"), (True, "freed 0 B")]
    assert fanout.Rows("clean-cache", outcomes).error is None
