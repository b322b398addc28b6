"""bench/bench_real_target.py's sum of eval slices: what one eval_dflash.py over every prompt says."""

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from bench_real_target import combine  # noqa: E402


def record(histogram, tokens, plain_tps, spec_tps, forwards, prompts, lossless=True):
    steps = sum(histogram)
    return {"acceptance_histogram": histogram, "new_tokens": tokens, "prompts": prompts,
            "plain_tokens_per_s": plain_tps, "spec_tokens_per_s": spec_tps, "lossless": lossless,
            "target_forwards": {"plain": tokens + prompts, "spec": forwards}, "block_size": 4,
            "step": 3000, "acceptance_length": sum((n + 1) * h for n, h in enumerate(histogram)) / steps}


def test_slices_add_up_to_one_evaluation_of_all_their_prompts():
    # slice 1: steps yielding 1,1,2,4 tokens (8 tokens); slice 2: 3,3,4,4,4 (18 tokens)
    a = record([2, 1, 0, 1], 8, plain_tps=80.0, spec_tps=160.0, forwards=5, prompts=1)
    b = record([0, 0, 2, 3], 18, plain_tps=90.0, spec_tps=270.0, forwards=6, prompts=2)
    row = combine([a, b])
    assert row["acceptance_histogram"] == [2, 1, 2, 4] and row["verify_steps"] == 9
    assert row["acceptance_length"] == pytest.approx(26 / 9)  # not the mean of 2.0 and 3.6
    assert (row["new_tokens"], row["prompts"], row["slices"]) == (26, 3, 2)
    assert row["tokens_per_target_forward"] == pytest.approx(26 / 11)
    assert row["speedup"] == pytest.approx((8 / 80 + 18 / 90) / (8 / 160 + 18 / 270))
    assert row["lossless"] is True and (row["block_size"], row["step"]) == (4, 3000)


def test_one_slice_that_changed_an_output_makes_the_whole_not_lossless():
    a = record([1, 0, 0, 0], 1, 10.0, 10.0, 2, 1)
    b = record([1, 0, 0, 0], 1, 10.0, 10.0, 2, 1, lossless=False)
    assert combine([a, b])["lossless"] is False


def test_a_set_given_to_the_bench_reaches_every_run_and_wins_over_the_benchs_own():
    from bench_real_target import REMOTE, train_args
    sys.path.insert(0, REMOTE)
    from train_config import cli_parser, config_from_args

    data = {"train": "/d/train.jsonl", "heldout": "/d/heldout.jsonl"}
    argv = train_args(os.path.join(REMOTE, "configs", "tiny-cpu.yaml"), "/t", data, "/runs/layers2", 2, "cpu",
                      ["train.max_steps=30", "model.target_layer_ids=[0, 1]",
                       "model.num_draft_layers=1"])
    config = config_from_args(cli_parser("train").parse_args(argv))
    assert config.model.target_layer_ids == [0, 1] and config.model.num_draft_layers == 1
    assert (config.train.max_steps, config.train.run_dir) == (30, "/runs/layers2")
    assert (config.data.train, config.target.path) == ("/d/train.jsonl", "/t")


def test_a_job_stopped_at_its_time_ends_on_sigterm_and_the_job_waiting_for_it_starts_after(tmp_path):
    """Jobs.stop_at (the bench's --train-for): the job gets SIGTERM once its time has come (as
    train_dflash.py it writes what it has and exits 0), and a job ready only when it has ended (the
    eval of `latest`) starts after it and sees what it wrote."""
    from bench_real_target import Jobs

    mark = tmp_path / "checkpoint"
    trainer = ("import signal, sys, time\n"
               "def stop(*_):\n"
               f"    open({str(mark)!r}, 'w').write('at SIGTERM')\n"
               "    sys.exit(0)\n"
               "signal.signal(signal.SIGTERM, stop)\n"
               f"open({str(mark)!r} + '.started', 'w').close()\n"
               "time.sleep(120)\n")
    reader = f"print('eval saw', open({str(mark)!r}).read())"
    jobs = Jobs(limit=4, deadline=time.monotonic() + 100, log_dir=str(tmp_path))
    jobs.add("train", [sys.executable, "-c", trainer])
    jobs.add("eval", [sys.executable, "-c", reader], ready=lambda: "train" in jobs.ended)
    # SIGTERM before the child has set its handler would kill it (-15): its time comes once it is
    assert jobs.run(until=lambda j: os.path.exists(f"{mark}.started") or bool(j.ended))
    assert "train" in jobs.running and "eval" not in jobs.running
    jobs.stop_at("train", time.monotonic())
    assert jobs.run()
    assert jobs.ended == {"train": 0, "eval": 0}
    assert open(jobs.log("eval")).read() == "eval saw at SIGTERM\n"


def _eval_args():
    import argparse
    return argparse.Namespace(eval_tokens=16, device="cpu", eval_dtype=None)


def test_with_latest_the_trained_drafter_is_evaluated_before_the_untrained_one(tmp_path):
    """Both wait for the run's end, and the bench's deadline cuts what starts last: that must be
    the untrained drafter, not the figure the run is for."""
    from bench_real_target import Jobs, add_evals

    jobs = Jobs(limit=4, deadline=time.monotonic() + 100, log_dir=str(tmp_path))
    evals = add_evals(jobs, {5: "/runs/layers5"}, ["latest"], ["s0", "s1"], 5, _eval_args())
    assert [name for name, _, _ in jobs.waiting] == [
        "eval_layers5_latest_0", "eval_layers5_latest_1", "eval_layers5_init_0", "eval_layers5_init_1"]
    assert evals == [("init", 5), ("latest", 5)]  # the table keeps the untrained row first


def test_with_step_checkpoints_the_untrained_drafter_is_queued_first(tmp_path):
    from bench_real_target import Jobs, add_evals

    jobs = Jobs(limit=4, deadline=time.monotonic() + 100, log_dir=str(tmp_path))
    add_evals(jobs, {5: "/runs/layers5"}, [1000], ["s0"], 5, _eval_args())
    assert [name for name, _, _ in jobs.waiting] == ["eval_layers5_init_0", "eval_layers5_step-1000_0"]


def test_a_checkpoint_with_slices_missing_keeps_a_row_over_those_that_finished(tmp_path):
    import json

    from bench_real_target import Jobs, eval_table

    jobs = Jobs(limit=4, deadline=time.monotonic() + 100, log_dir=str(tmp_path))
    done = [record([2, 1, 0, 1], 8, 80.0, 160.0, 5, 1), record([0, 0, 2, 3], 18, 90.0, 270.0, 6, 2)]
    for i, r in enumerate(done):
        with open(jobs.log(f"eval_layers5_latest_{i}"), "w") as f:
            f.write("loading\nRESULT " + json.dumps(r) + "\n")
    with open(jobs.log("eval_layers5_latest_2"), "w") as f:
        f.write("loading\n")  # killed at the deadline before its result
    (row,) = eval_table(jobs, [("init", 5), ("latest", 5)], 3, {5: str(tmp_path / "run")})
    assert (row["checkpoint"], row["prompts"], row["slices"], row["of_slices"]) == ("latest", 3, 2, 3)
    assert row["acceptance_length"] == pytest.approx(26 / 9)
    assert row["decode_walk"] is None  # no metrics.jsonl at that step


def test_the_eval_dtype_reaches_every_eval_job(tmp_path):
    from bench_real_target import Jobs, add_evals

    jobs = Jobs(limit=4, deadline=time.monotonic() + 100, log_dir=str(tmp_path))
    args = _eval_args()
    args.eval_dtype = "float32"
    add_evals(jobs, {5: "/runs/layers5"}, ["latest"], ["s0"], 5, args)
    assert [argv[argv.index("--dtype") + 1] for _, argv, _ in jobs.waiting] == ["float32", "float32"]


def test_the_untrained_row_of_a_run_started_from_other_weights_has_no_held_out_figures(tmp_path):
    """With train.init_from the training's step-0 evaluation is of the weights it started from; the
    `init` checkpoint (eval_dflash.py) is the untrained drafter: the two must not share a row."""
    import json

    from bench_real_target import Jobs, eval_table

    jobs = Jobs(limit=4, deadline=time.monotonic() + 100, log_dir=str(tmp_path))
    untrained = dict(record([4, 0, 0, 0], 4, 10.0, 10.0, 4, 1), step=0)
    with open(jobs.log("eval_layers5_init_0"), "w") as f:
        f.write("RESULT " + json.dumps(untrained) + "\n")
    for run, start in (("fresh", ""), ("warm", "/drafters/step-11312")):
        (tmp_path / run).mkdir()
        (tmp_path / run / "metrics.jsonl").write_text(json.dumps(
            {"kind": "eval", "step": 0, "acceptance_length": 2.21, "decode_acceptance": 2.40}) + "\n")
        (tmp_path / run / "config.yaml").write_text(
            f"model: {{}}\ntarget: {{path: /t}}\ndata: {{train: /d}}\ntrain: {{init_from: '{start}'}}\n")
        (row,) = eval_table(jobs, [("init", 5)], 1, {5: str(tmp_path / run)})
        assert row["acceptance_length"] == 1.0
        expected = (2.21, 2.40) if run == "fresh" else (None, None)
        assert (row["teacher_forced"], row["decode_walk"]) == expected


def test_a_checkpoint_written_at_a_stop_gets_the_last_held_out_figures_before_it(tmp_path):
    """--train-for stops a run between its evaluations (step 2,006 with evaluations every 250):
    its row carries the evaluation of step 2,000, and says which step that was."""
    import json

    from bench_real_target import Jobs, eval_table

    jobs = Jobs(limit=4, deadline=time.monotonic() + 100, log_dir=str(tmp_path))
    for name, step in (("eval_layers5_latest_0", 2006), ("eval_layers5_step-250_0", 250)):
        with open(jobs.log(name), "w") as f:
            f.write("RESULT " + json.dumps(dict(record([4, 3, 1, 0], 13, 10.0, 10.0, 4, 1),
                                                step=step)) + "\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"kind": "eval", "step": 250, "acceptance_length": 1.64, "decode_acceptance": 1.43},
        {"kind": "train", "step": 2000, "acceptance_length": 2.65},
        {"kind": "eval", "step": 2000, "acceptance_length": 2.32, "decode_acceptance": 1.97},
        {"kind": "train", "step": 2006, "acceptance_length": 2.73})))
    latest, at_250 = eval_table(jobs, [("latest", 5), ("step-250", 5)], 1, {5: str(run)})
    assert (latest["teacher_forced"], latest["decode_walk"], latest["held_out_step"]) == \
        (2.32, 1.97, 2000)
    assert (at_250["teacher_forced"], at_250["decode_walk"], at_250["held_out_step"]) == \
        (1.64, 1.43, 250)
