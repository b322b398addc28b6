"""The real training and warm-up scripts, run as subprocesses on CPU with the tiny target."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import checkpoints
import pytest
import torch
from conftest import REMOTE, read_metrics, run_script, tiny_args
from safetensors.torch import load_file

# Short runs: small batches, every step logged, no mid-run saves or evals.
QUICK = ("train.batch_size=4", "train.log_every=1", "train.eval_every=1000",
         "train.eval_batches=1", "train.save_every=1000")


@pytest.mark.slow
def test_tiny_run_lowers_loss_and_raises_acceptance_on_heldout(tiny_target, tmp_path):
    from dflash.model import DFlashDraftModel

    run = str(tmp_path / "run")
    started = time.perf_counter()
    result = run_script("train_dflash.py", *tiny_args(tiny_target, run), timeout=900)
    wall = time.perf_counter() - started
    assert result.returncode == 0, result.stderr[-3000:]
    evals = read_metrics(run, "eval")
    first, last = evals[0], evals[-1]
    print(f"tiny run: held-out loss {first['loss']:.3f} -> {last['loss']:.3f}, acceptance "
          f"{first['acceptance_length']:.2f} -> {last['acceptance_length']:.2f}, {wall:.0f} s")
    assert first["step"] == 0 and last["step"] == 500
    assert last["loss"] < 0.5 * first["loss"]
    assert last["acceptance_length"] > first["acceptance_length"] + 0.5
    train = read_metrics(run, "train")
    assert {"step", "loss", "slot_accuracy", "acceptance_length", "tokens_per_s", "lr",
            "memory_gib"} <= set(train[-1])
    assert os.path.exists(os.path.join(run, "train.log"))
    assert os.path.exists(os.path.join(run, "config.yaml"))
    latest = checkpoints.latest_checkpoint(run)
    assert latest.endswith("step-500")
    model, info = DFlashDraftModel.from_pretrained(latest, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()


def checkpoint_state(directory):
    return load_file(os.path.join(directory, "model.safetensors")), checkpoints.load_state(directory)


SPEED_ON = ("train.autocast=bfloat16", "speed.param_dtype=bfloat16", "speed.fp8_lm_head=true")


@pytest.mark.parametrize("drafters, speed", [("cpu", ()), ("cpu,cpu,cpu", ()), ("cpu", SPEED_ON)],
                         ids=["one-worker", "three-workers", "speed-switches"])
def test_stopped_and_resumed_equals_an_uninterrupted_run_bit_for_bit(tiny_target, tmp_path, drafters, speed):
    """A resume gives every worker its own optimizer and scheduler state: stopped at step 3 and
    resumed to 6, the workers make exactly the losses, weights and optimizer state of a run that
    went straight to 6, and their replicas stay one model at every checkpoint (three workers on one
    device shared the restored state once, and drifted apart). With speed.param_dtype=bfloat16 too:
    the fp32 master weights travel in the optimizer state, so the resumed run continues from them,
    not from the checkpoint's bf16 weights."""
    interrupted, straight = str(tmp_path / "interrupted"), str(tmp_path / "straight")
    for run_dir, stop in ((interrupted, 3), (interrupted, 6), (straight, 6)):
        result = run_script("train_dflash.py", *tiny_args(tiny_target, run_dir, *QUICK, "train.save_every=1",
                                                          *speed),
                            "--drafter-devices", drafters, "--max-steps", str(stop))
        assert result.returncode == 0, result.stderr[-3000:]
    log = open(os.path.join(interrupted, "train.log")).read()
    assert "resumed from" in log and "REPLICAS DIFFER" not in log
    resumed = {r["step"]: r["worker_loss"] for r in read_metrics(interrupted, "train")}
    uninterrupted = {r["step"]: r["worker_loss"] for r in read_metrics(straight, "train")}
    assert sorted(resumed) == sorted(uninterrupted) == [1, 2, 3, 4, 5, 6]
    assert resumed == uninterrupted  # every worker's loss, bit for bit (step 4, the first resumed, too)
    for run_dir in (interrupted, straight):
        saved = read_metrics(run_dir, "checkpoint")
        assert [r["step"] for r in saved] == [1, 2, 3, 4, 5, 6]
        assert [r["replica_max_abs_diff"] for r in saved] == [0.0] * 6

    weights_a, state_a = checkpoint_state(checkpoints.latest_checkpoint(interrupted))
    weights_b, state_b = checkpoint_state(checkpoints.latest_checkpoint(straight))
    assert state_a["step"] == state_b["step"] == 6
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    opt_a, opt_b = state_a["optimizer"]["state"], state_b["optimizer"]["state"]
    assert opt_a.keys() == opt_b.keys()
    for index in opt_a:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_a[index][key], opt_b[index][key])
    assert state_a["scheduler"] == state_b["scheduler"] and state_a["sampler"] == state_b["sampler"]
    masters = state_a["optimizer"].get("master_weights")
    assert (masters is not None) == bool(speed)
    if masters is not None:
        assert all(m.dtype == torch.float32 for m in masters)
        assert all(torch.equal(a, b) for a, b in
                   zip(masters, state_b["optimizer"]["master_weights"], strict=True))


def test_prefetching_the_target_changes_nothing_and_checkpoints_keep_their_own_sampler(
        tiny_target, tmp_path):
    """train.prefetch_target prepares step n+1 while step n trains: the run must be the same one,
    and a checkpoint written mid-run must hold the sampler as of its own step, not the one the
    prefetch already advanced (a resume from it would skip a batch)."""
    runs = {}
    for prefetch in ("true", "false"):
        runs[prefetch] = str(tmp_path / f"prefetch-{prefetch}")
        result = run_script("train_dflash.py", *tiny_args(
            tiny_target, runs[prefetch], *QUICK, f"train.prefetch_target={prefetch}",
            "train.save_every=2", "train.keep_last=3"), "--drafter-devices", "cpu,cpu",
            "--max-steps", "4")
        assert result.returncode == 0, result.stderr[-3000:]
    losses = {p: [(r["step"], r["worker_loss"]) for r in read_metrics(run, "train")]
              for p, run in runs.items()}
    assert [step for step, _ in losses["true"]] == [1, 2, 3, 4]
    assert losses["true"] == losses["false"]
    for step in (2, 4):
        on, off = (checkpoint_state(os.path.join(checkpoints.checkpoint_root(runs[p]),
                                                 f"step-{step}")) for p in ("true", "false"))
        assert on[1]["sampler"] == off[1]["sampler"]
        assert on[1]["sampler"]["position"] > 0
        assert all(torch.equal(on[0][k], off[0][k]) for k in off[0])


def test_sigterm_writes_a_checkpoint_and_exits_zero(tiny_target, tmp_path):
    run = str(tmp_path / "run")
    args = tiny_args(tiny_target, run, *QUICK, "train.max_steps=100000")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = subprocess.Popen([sys.executable, os.path.join(REMOTE, "train_dflash.py"), *args],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 400  # slow under a loaded CI box
        while len(read_metrics(run, "train")) < 3:
            assert process.poll() is None, process.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "training never reached step 3"
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output[-3000:]
    assert "SIGTERM" in output
    last_step = read_metrics(run, "train")[-1]["step"]
    latest = checkpoints.latest_checkpoint(run)
    assert latest.endswith(f"step-{last_step}")
    assert checkpoints.load_state(latest)["step"] == last_step


def test_three_cpu_drafter_threads_train_in_lockstep(tiny_target, tmp_path):
    run = str(tmp_path / "run")
    result = run_script("train_dflash.py", *tiny_args(tiny_target, run, *QUICK),
                        "--drafter-devices", "cpu,cpu,cpu", "--max-steps", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "3 drafter worker(s) on cpu,cpu,cpu" in result.stdout
    train = read_metrics(run, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(len(set(r["worker_loss"])) == 3 for r in train)  # three different batches...
    saved = read_metrics(run, "checkpoint")[-1]
    assert saved["step"] == 4 and saved["replica_max_abs_diff"] == 0.0  # ...one identical model


def test_warmup_runs_the_step_on_each_cpu_drafter_and_says_compile_is_off(tiny_target, tmp_path):
    result = run_script("warmup_compile.py", *tiny_args(tiny_target, str(tmp_path), *QUICK),
                        "--drafter-devices", "cpu,cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    for shape in ("('train', 0)", "('eval', 0)", "('train', 1)", "('eval', 1)"):
        assert f"shape {shape}" in result.stdout
    assert "compile is off" in result.stdout


def test_bad_paths_and_configs_exit_nonzero_with_one_line(tiny_target, tmp_path):
    missing = run_script("train_dflash.py",
                         *tiny_args(str(tmp_path / "no-target"), str(tmp_path / "r")))
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"train_dflash: error: target checkpoint directory not found: {tmp_path / 'no-target'}"]
    missing_config = run_script("train_dflash.py", "--config", str(tmp_path / "nope.yaml"))
    assert missing_config.returncode == 2 and "config file not found" in missing_config.stderr
    flex_on_cpu = run_script("warmup_compile.py", *tiny_args(tiny_target, str(tmp_path / "r"),
                                                             "model.attention=flex"))
    assert flex_on_cpu.returncode == 1
    assert "no flex_attention backward on CPU" in flex_on_cpu.stderr.strip().splitlines()[-1]


def test_replicated_and_split_targets_train_the_same_run(tiny_target, tmp_path):
    """target.placement=replicate (a full copy per target device, the workers' batches made on
    the copies at once, prefetch on) and split (the layers in chunks over the same devices) give
    the same losses, weights and sampler state: placement moves the target, never the run."""
    runs = {}
    for placement in ("split", "replicate"):
        runs[placement] = str(tmp_path / placement)
        result = run_script("train_dflash.py", *tiny_args(
            tiny_target, runs[placement], *QUICK, f"target.placement={placement}",
            "train.save_every=2", "train.keep_last=3"), "--target-devices", "cpu,cpu",
            "--drafter-devices", "cpu,cpu,cpu", "--max-steps", "4")
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"target: placement {placement} over cpu,cpu" in result.stdout
    assert "target: 2 replica(s) loaded" in open(os.path.join(runs["replicate"], "train.log")).read()
    losses = {p: [(r["step"], r["worker_loss"]) for r in read_metrics(run, "train")]
              for p, run in runs.items()}
    assert [step for step, _ in losses["split"]] == [1, 2, 3, 4]
    assert losses["split"] == losses["replicate"]
    for step in (2, 4):
        split, replicated = (checkpoint_state(os.path.join(checkpoints.checkpoint_root(runs[p]),
                                                           f"step-{step}"))
                             for p in ("split", "replicate"))
        assert split[1]["sampler"] == replicated[1]["sampler"]
        assert all(torch.equal(split[0][k], replicated[0][k]) for k in split[0])


def test_fast_paths_off_is_recorded_and_trains_the_same_run(tiny_target, tmp_path):
    """train.fast_paths=false takes the reference paths (full logits, the target's padding-mask
    forward): the same run within float error, and config.yaml says which paths ran."""
    import yaml

    losses = {}
    for fast in (True, False):
        run = str(tmp_path / f"fast-{fast}")
        result = run_script("train_dflash.py", *tiny_args(
            tiny_target, run, *QUICK, f"train.fast_paths={str(fast).lower()}"), "--max-steps", "2")
        assert result.returncode == 0, result.stderr[-3000:]
        assert yaml.safe_load(open(os.path.join(run, "config.yaml")))["train"]["fast_paths"] is fast
        assert ("fast paths off" in result.stdout) is not fast
        losses[fast] = [r["loss"] for r in read_metrics(run, "train")]
    assert len(losses[True]) == 2 and losses[True] == pytest.approx(losses[False], rel=1e-4)


def test_the_first_step_of_every_launch_is_logged_in_the_line_the_launch_waits_for(tiny_target, tmp_path):
    """`invoke train` waits for the first line matching remote/runs.py STEP. With log_every far
    beyond the run, that line must still be step 1's (and, after a resume, the first resumed
    step's), not the next multiple of log_every nor the stop step."""
    import re

    from dflash_ops.remote.runs import READY, STEP

    run = str(tmp_path / "run")
    quiet = (*QUICK, "train.log_every=1000")
    for stop, first in ((3, 1), (5, 4)):
        log = os.path.join(run, "train.log")
        offset = os.path.getsize(log) if os.path.exists(log) else 0
        result = run_script("train_dflash.py", *tiny_args(tiny_target, run, *quiet), "--max-steps", str(stop))
        assert result.returncode == 0, result.stderr[-3000:]
        with open(log) as f:
            f.seek(offset)
            lines = f.read().splitlines()
        ready = next(i for i, line in enumerate(lines) if re.match(READY, line))
        steps = [(i, line) for i, line in enumerate(lines) if re.match(STEP, line)]
        assert steps and steps[0][0] > ready, lines
        assert f" INFO step {first}/{stop} | loss " in steps[0][1], steps[0][1]
        assert [line.split(" INFO step ")[1].split("/")[0] for _, line in steps] == [str(first), str(stop)]



def test_init_from_starts_a_new_run_from_a_checkpoints_weights_with_a_fresh_optimizer(tiny_target, tmp_path):
    """train.init_from: run B starts from run A's step-3 weights (B's step-0 held-out evaluation
    is A's step-3 one, exactly), with the schedule and optimizer of a new run (B's first step has
    A's first learning rate), and a relaunch of B resumes from B's own checkpoint, not from A's."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    first = run_script("train_dflash.py", *tiny_args(tiny_target, a, *QUICK, "train.eval_every=3",
                                                     "train.save_every=3"), "--max-steps", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    source = os.path.join(checkpoints.checkpoint_root(a), "step-3")
    for stop in (2, 4):
        result = run_script("train_dflash.py", *tiny_args(tiny_target, b, *QUICK, "train.save_every=2",
                                                          f"train.init_from={source}"),
                            "--max-steps", str(stop))
        assert result.returncode == 0, result.stderr[-3000:]
    evals_a, evals_b = read_metrics(a, "eval"), read_metrics(b, "eval")
    assert [e["step"] for e in evals_a] == [0, 3] and evals_b[0]["step"] == 0
    assert evals_b[0]["loss"] == evals_a[1]["loss"] != evals_a[0]["loss"]
    assert evals_b[0]["slot_accuracy"] == evals_a[1]["slot_accuracy"]
    train_a, train_b = read_metrics(a, "train"), read_metrics(b, "train")
    assert [r["step"] for r in train_b] == [1, 2, 3, 4]
    assert train_b[0]["lr"] == train_a[0]["lr"]
    assert checkpoints.load_state(checkpoints.latest_checkpoint(b))["step"] == 4
    log = open(os.path.join(b, "train.log")).read()
    assert log.count(f"initialised from {source}") == 1 and "resumed from" in log


def test_init_from_what_does_not_fit_is_refused_in_one_line(tiny_target, tmp_path):
    a = str(tmp_path / "a")
    first = run_script("train_dflash.py", *tiny_args(tiny_target, a, *QUICK, "train.save_every=1"),
                       "--max-steps", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    source = os.path.join(checkpoints.checkpoint_root(a), "step-1")
    cases = {
        "deeper": (("model.num_draft_layers=3",),
                   "does not fit this run's drafter: num_hidden_layers 2 (this run: 3)"),
        "block": (("model.block_size=4",), "block_size 8 (this run: 4)"),
        "nothing": ((), "not a drafter checkpoint (config.json and model.safetensors)"),
    }
    for name, (sets, expected) in cases.items():
        where = str(tmp_path) if name == "nothing" else source
        result = run_script("train_dflash.py", *tiny_args(tiny_target, str(tmp_path / name), *QUICK,
                                                          f"train.init_from={where}", *sets),
                            "--max-steps", "1")
        assert result.returncode == 2, (name, result.stderr[-3000:])
        (line,) = result.stderr.strip().splitlines()  # the target was loaded: no progress bar
        assert line.startswith("train_dflash: error: train.init_from: ") and expected in line, line
        assert not read_metrics(str(tmp_path / name))  # nothing trained


def test_init_from_with_bf16_parameters_sets_the_fp32_masters_from_the_checkpoint(tiny_target, tmp_path):
    """speed.param_dtype=bfloat16 keeps fp32 master weights in the optimizer, made from the run's
    own initialisation when it is built. train.init_from must set them from the checkpoint's
    weights, else the first update writes the random drafter back over the loaded one; and at
    full precision, not from the bf16 parameters they round into. After one step every master is
    its source weight moved by at most that step's learning rate (Adam's first step)."""
    from safetensors.torch import save_file

    a = str(tmp_path / "a")
    first = run_script("train_dflash.py", *tiny_args(tiny_target, a, *QUICK, "train.save_every=1"),
                       "--max-steps", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    trained = os.path.join(checkpoints.checkpoint_root(a), "step-1")
    source = tmp_path / "source"  # far from any initialisation, and off the bf16 grid
    source.mkdir()
    weights = {k: v * 1.5 + 0.0123 for k, v in load_file(os.path.join(trained, "model.safetensors")).items()}
    save_file(weights, str(source / "model.safetensors"))
    (source / "config.json").write_text(open(os.path.join(trained, "config.json")).read())
    b = str(tmp_path / "b")
    result = run_script("train_dflash.py", *tiny_args(tiny_target, b, *QUICK, *SPEED_ON, "train.save_every=1",
                                                      f"train.init_from={source}"), "--max-steps", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    state = checkpoints.load_state(os.path.join(checkpoints.checkpoint_root(b), "step-1"))
    masters = state["optimizer"]["master_weights"]
    lr = read_metrics(b, "train")[0]["lr"]
    # the masters are in the drafter's parameter order: the order of the drafter training builds
    import json

    import target_model
    import training
    from train_config import load_config
    config = load_config(os.path.join(b, "config.yaml"))
    target_config = target_model.load_target_config(tiny_target)
    with open(source / "config.json") as f:
        mask_token_id = json.load(f)["dflash_config"]["mask_token_id"]
    template = training.build_drafter_template(config, target_config, mask_token_id,
                                               training.target_layer_ids(config, target_config))
    names = [name for name, param in template.named_parameters() if param.requires_grad]
    assert sorted(names) == sorted(weights)
    for master, name in zip(masters, names, strict=True):
        assert master.dtype == torch.float32 and master.shape == weights[name].shape, name
        assert (master - weights[name]).abs().max().item() <= lr * 1.001 + 1e-7, name
