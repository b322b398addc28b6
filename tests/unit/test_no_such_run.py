"""The one answer for a run that is not there (runs.no_such_run), whatever the task and the names the
container sends."""

import pytest

from dflash_ops.errors import ExitStatus, NoSuchRun
from dflash_ops.runs import RUNS_SHOWN, no_such_run


def test_the_issues_line_names_the_runs_and_the_closest():
    err = no_such_run("r11", "pve1/200", ["r2", "r1"])
    assert str(err) == "no run 'r11' on pve1/200; runs: r1, r2 (did you mean r1?)"
    assert isinstance(err, NoSuchRun) and err.exit_status == ExitStatus.RUN_STATE


def test_no_guess_when_nothing_is_close_and_no_list_when_there_are_no_runs():
    assert str(no_such_run("zzz", "pve1/200", ["alpha"])) == "no run 'zzz' on pve1/200; runs: alpha"
    assert str(no_such_run("r1", "pve1/200", [])) == ("no run 'r1' on pve1/200; no runs yet: start one "
                                                      "with `invoke train`")
    assert str(no_such_run(None, "pve1/200", [])).startswith("no latest run on pve1/200; no runs yet")


def test_names_from_the_container_are_data_and_capped():
    forged = ["\x1b[31mred", "../etc", 5, None, "ok-1"]
    assert str(no_such_run("ok-2", "pve1/200", forged)) == ("no run 'ok-2' on pve1/200; runs: ok-1 "
                                                           "(did you mean ok-1?)")
    assert str(no_such_run("x", "pve1/200", "bad")).endswith("no runs yet: start one with `invoke train`")
    many = [f"run{i:03d}" for i in range(RUNS_SHOWN + 5)]
    line = str(no_such_run("run000x", "pve1/200", many))
    assert f"runs: {', '.join(sorted(many[:RUNS_SHOWN]))} and 5 more (`invoke runs` lists them)" in line
    assert line.endswith("(did you mean run000?)")


@pytest.mark.parametrize("name", ["a\nb", "x" * 300])
def test_an_odd_asked_name_is_shown_visibly_and_cut(name):
    line = str(no_such_run(name, "pve1/200", ["r1"]))
    assert "\n" not in line and len(line) < 200
