"""Fan-out is decided once, in op_task: one container shows the body's describe(), several give one
row each (row()) or go to the task's own function, and a one-container task refuses several."""

import invoke
import pytest
from invoke import Exit

from dflash_ops.cli import ROWS, op_task
from dflash_ops.errors import ExitStatus
from tests.unit.test_cli_options import write_inventory


class Found:
    def __init__(self, label):
        self.label = label

    def describe(self):
        return f"all about {self.label}"

    def row(self):
        return f"row of {self.label}"


def task(fan_out):
    @op_task(fan_out=fan_out)
    def probe(t, ct=None, group=None, inventory=None, dry_run=False):
        """Probe."""
        return Found(t.container.label)

    return probe


@pytest.fixture
def inventory(tmp_path) -> str:
    return str(write_inventory(tmp_path / "inv.yaml", tmp_path))


def test_one_container_shows_describe(inventory, capsys):
    task(ROWS)(invoke.Context(), ct="200", inventory=inventory)
    assert capsys.readouterr().out == "all about pve1/200\n"


def test_several_containers_give_one_row_each(inventory, capsys):
    task(ROWS)(invoke.Context(), ct="200,201", inventory=inventory)
    out = capsys.readouterr().out
    assert "row of pve1/200" in out and "row of pve1/201" in out and "all about" not in out


def test_a_function_takes_all_the_targets(inventory):
    seen = []
    task(lambda targets, **options: seen.append(([t.container.ctid for t in targets], options["ct"])))(
        invoke.Context(), ct="200,201", inventory=inventory)
    assert seen == [([200, 201], "200,201")]


def test_a_one_container_task_refuses_several(inventory, capsys):
    with pytest.raises(Exit) as refused:
        task(None)(invoke.Context(), ct="200,201", inventory=inventory)
    assert refused.value.code == ExitStatus.USAGE and "give a single --ct" in str(refused.value.message)
