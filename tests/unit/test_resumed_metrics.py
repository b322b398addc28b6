"""`invoke metrics` and its plot read each step's values from the latest segment: a run resumed from
an earlier checkpoint logs steps again, and the abandoned ones are neither shown nor drawn (pure)."""

import json

from rich.console import Console

from dflash_ops import metrics


def answer(records) -> str:
    return json.dumps({"ok": {"run": "r1", "metrics": [json.dumps(r) for r in records], "evals": []}}) + "\n"


def train(step, loss):
    return {"kind": "train", "step": step, "loss": loss, "acceptance_length": 1.0}


# Segment 1 reached step 7 (checkpoint at 5, held-out evals at 0 and 6); segment 2 resumed from the
# checkpoint of step 5 and logged 6..9 again (eval at 8, checkpoint at 9).
RESUMED = ([{"kind": "eval", "step": 0, "loss": 9.0}] + [train(s, 10.0 - s) for s in range(1, 8)]
           + [{"kind": "checkpoint", "step": 5, "path": "step-5"}, {"kind": "eval", "step": 6, "loss": 4.4}]
           + [train(s, 100.0 + s) for s in range(6, 10)]
           + [{"kind": "eval", "step": 8, "loss": 0.8}, {"kind": "checkpoint", "step": 9, "path": "step-9"}])


def test_a_resumed_runs_steps_come_from_its_latest_segment():
    m = metrics.parse_metrics(answer(RESUMED), "r1")
    assert [(r["step"], r["loss"]) for r in m.train] == [
        (1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 5.0), (6, 106.0), (7, 107.0), (8, 108.0), (9, 109.0)]
    assert [r["step"] for r in m.eval] == [0, 8]  # the old segment's eval of step 6 was abandoned
    assert [r["step"] for r in m.checkpoints] == [5, 9]
    assert m.skipped == 0


def test_the_table_and_the_plot_get_each_step_once(tmp_path):
    m = metrics.parse_metrics(answer(RESUMED), "r1")
    steps, _ = metrics._series(m.train, "loss")  # what the plot draws: x strictly increasing, no loop
    assert steps == sorted(set(steps)) == list(range(1, 10))
    console = Console(width=100, record=True)
    console.print(metrics.table(m, 0))
    column = [line.split()[0] for line in console.export_text().splitlines() if line.strip()[:1].isdigit()]
    assert column == [str(s) for s in range(1, 10)]
    assert metrics.plot(m, str(tmp_path / "p.png")) == str(tmp_path / "p.png")


def test_two_resumes_and_records_without_a_step():
    records = ([train(s, 1.0) for s in (1, 2, 3, 4)] + [{"kind": "train", "loss": 5.0}]
               + [train(s, 2.0) for s in (3, 4, 5)] + [train(s, 3.0) for s in (2, 3)])
    kept = metrics.latest_values(records)
    assert [(r.get("step"), r["loss"]) for r in kept] == [(1, 1.0), (None, 5.0), (2, 3.0), (3, 3.0)]
    # stopped at the checkpointed step and resumed from it: nothing is dropped
    plain = [train(s, 1.0) for s in (1, 2, 3)] + [train(s, 2.0) for s in (4, 5)]
    assert metrics.latest_values(plain) == plain


def test_a_forged_file_of_rewinds_leaves_its_last_segment():
    # every other record goes back (0, 1, 0, 1, ...): each 0 starts a segment; read in one pass, so
    # 200,000 of them are not 200,000 filters of what came before
    records = [train(s % 2, float(s)) for s in range(200_000)]
    kept = metrics.latest_values(records)
    assert [(r["step"], r["loss"]) for r in kept] == [(0, 199_998.0), (1, 199_999.0)]
