"""Fan-out through the real CLI: deploy, doctor, status, logs, stop, clean-cache on two embedded
hosts (one sshd each, container 200 on pve1, 201 on pve2), then with pve2's sshd killed."""

import json
import re

import pytest
from ct_template import seed
from fanout_cli import Cli, rows
from signals import sshd_stopped

from dflash_ops.errors import ExitStatus

pytestmark = pytest.mark.integration

QUICK = ["--set", "data.heldout=null", "--set", "train.log_every=1", "--set", "train.save_every=1",
         "--set", "train.batch_size=2", "--set", "data.num_anchors=4"]  # small steps


@pytest.fixture(scope="module")
def cli(sandbox_factory, template):
    sb = sandbox_factory(containers=(200,), hosts=2)
    for host, ctid in (("pve1", 200), ("pve2", 201)):
        seed(template, sb, host, ctid)  # the deploys below ship the code; no pip (see ct_template)
    return Cli(sb)


def test_deploy_twice_then_doctor_on_both_hosts(cli):
    first = rows(cli("deploy", "--group", "all").stdout)
    assert set(first) == {"pve1/200", "pve2/201"} and all(ok for ok, _ in first.values()), first
    for _ in range(3):  # other engineers edit remote_scripts/ meanwhile: a change may land in between
        again = rows(cli("deploy", "--ct", "200,201").stdout)
        if all(detail.endswith("(up to date)") for _, detail in again.values()):
            break
    assert all(ok and detail.endswith("(up to date)") and "files_sent=0" in detail
               for ok, detail in again.values()), again
    doctor = rows(cli("doctor", "--group", "all").stdout)
    assert {k: (ok, re.sub(r"\d+", "N", d)) for k, (ok, d) in doctor.items()} == {
        "pve1/200": (True, "all N checks passed"), "pve2/201": (True, "all N checks passed")}, doctor


def test_status_logs_stop_one_row_per_container(cli):
    cli("train", "--ct", "201", "--run", "short", "--max-steps", "2", *QUICK)
    cli("logs", "--follow", "--ct", "201", "--run", "short", "-n", "0")  # returns when the run ends

    # pve1/200 has no run short: its row is the unknown-run line, as logs' below
    status = rows(cli("status", "--group", "all", "--run", "short", code=ExitStatus.FAN_OUT_FAILED).stdout)
    assert not status["pve1/200"][0], status
    assert status["pve1/200"][1].startswith("no run 'short' on pve1/200"), status
    assert re.fullmatch(r"run short: finished \(exit 0\) \| step 2 of 2 \(100\.0%\) \| loss \d+\.\d+ "
                        r"\| tau \d\.\d\d", status["pve2/201"][1]), status
    facts = json.loads(cli("status", "--group", "all", "--run", "short", "--json",
                           code=ExitStatus.FAN_OUT_FAILED).stdout)
    # --json over several containers: each container's facts, or its one error line
    assert sorted(facts) == ["pve1/200", "pve2/201"], facts
    assert facts["pve1/200"]["error"].startswith("no run 'short' on pve1/200"), facts
    assert (facts["pve2/201"]["state"], facts["pve2/201"]["step"]) == ("finished", 2), facts

    # One container has no such run: its row fails, the other's lines and row are still there.
    logs = cli("logs", "--group", "all", "--run", "short", "-n", "5", code=ExitStatus.FAN_OUT_FAILED)
    table = rows(logs.stdout)
    assert not table["pve1/200"][0] and "no run 'short' on pve1/200" in table["pve1/200"][1]
    assert table["pve2/201"] == (True, "run short"), table
    assert "pve2/201 | ==> dflash-ops: run short" in logs.stdout
    assert re.search(r"^pve2/201 \| .*step 2/2", logs.stdout, re.M)
    assert "1 of 2 containers failed: pve1/200" in logs.stderr

    for ctid in (200, 201):
        cli("train", "--ct", str(ctid), "--run", "long", "--max-steps", "400", *QUICK)
    for ctid in (200, 201):  # past start-up: SIGTERM now means checkpoint and exit 0
        cli.wait_for(f"a first step on {ctid}", lambda ctid=ctid: (json.loads(cli(
            "status", "--ct", str(ctid), "--run", "long", "--json").stdout)["step"] or 0) >= 1)
    stopped = rows(cli("stop", "--group", "all", "--run", "long", "--grace", "60").stdout)
    assert all(ok and re.fullmatch(r"run long stopped \(SIGTERM, exit code: 0\); no process left", d)
               for ok, d in stopped.values()) and len(stopped) == 2, stopped
    for host, ctid in (("pve1", 200), ("pve2", 201)):
        left = cli.container(host, ctid, "pgrep", "-f", "train_dflash").stdout
        assert left == "", left
    again = rows(cli("stop", "--group", "all", "--run", "long").stdout)
    assert {d for _, d in again.values()} == {"run long is not running (exit code: 0)"}, again


def test_clean_cache_twice(cli):
    for _ in range(2):
        cleaned = rows(cli("clean-cache", "--group", "all").stdout)
        assert len(cleaned) == 2 and all(ok and d.startswith("freed ") for ok, d in cleaned.values()), cleaned
    assert all(d.startswith("freed 0 B") for _, d in cleaned.values()), cleaned


@pytest.mark.parametrize("task",
                         [["status"], ["doctor"], ["deploy"], ["logs", "-n", "1"], ["stop", "--grace", "0"],
                                  ["clean-cache"]])
def test_one_host_down_never_hides_the_other(cli, task):
    pve2 = cli.sandbox.host("pve2")
    sshd_stopped(pve2)  # (stopped already by an earlier case: returns at once)
    r = cli(*task, "--group", "all", code=ExitStatus.FAN_OUT_FAILED)
    table = rows(r.stdout)
    assert table["pve1/200"][0], table
    assert not table["pve2/201"][0] and "cannot reach pve2" in table["pve2/201"][1], table
    assert "1 of 2 containers failed: pve2/201" in r.stderr
