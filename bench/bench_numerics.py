"""Issue 37's numerics: the training loss of remote_scripts/train_dflash.py with every speed switch
on against every switch off, over the same steps, seeds and data.

    python bench/bench_numerics.py --out DIR                         # the tiny CPU run, seeds 0-2
    python bench/bench_numerics.py --shape qwen3-8b --device cuda:0 --seeds 0 --jobs 2 --out DIR

Each seed runs train_dflash.py from configs/tiny-cpu.yaml, with `train.autocast: bfloat16` in
every run (the plain bf16 path) and a loss logged every step: every switch off, and every switch
on (speed.compile_layers, speed.param_dtype bfloat16, speed.fp8_lm_head; compile_layers applies on
CUDA only); `--variants fp8,no-fp8` adds FP8 alone and the other two together,
`fp8,compile,bf16-params` each switch alone. The target is made by make_tiny_target.py: the
tiny one, or with `--shape qwen3-8b` Qwen3-8B's widths, heads and vocabulary (151,936) with 6
random layers, built on the GPU; the drafter then has the production shape's 5 layers and block
16 with flex_attention compiled, 32 rows of the synthetic chats a step.

The metric (bench/gpu/common.py curve_gap, also bench_peers.py's GPU curve): the seeds' losses
averaged step by step, 20-step window means, the largest relative difference on vs off. One
tiny run alone is chaotic at that scale: a change of rounding only (the LM head's input-gradient
product in fp32 instead of bf16) moved single runs' windows by up to 0.96%; the mean of three
seeds moved by 0.52%. So the CPU figure is over three seeds, and the bound is 1%.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))

from common import REMOTE, curve_gap  # noqa: E402

VARIANTS = {
    "off": [],
    "on": ["speed.compile_layers=true", "speed.param_dtype=bfloat16", "speed.fp8_lm_head=true"],
    # one switch group at a time (--variants), to tell which one moves the curve
    "fp8": ["speed.fp8_lm_head=true"],
    "no-fp8": ["speed.compile_layers=true", "speed.param_dtype=bfloat16"],
    "compile": ["speed.compile_layers=true"],
    "bf16-params": ["speed.param_dtype=bfloat16"],
}
COMMON = ["train.autocast=bfloat16", "train.log_every=1", "train.eval_every=100000",
          "train.save_every=100000", "data.heldout=null"]
# The 8B-shaped launch: the production drafter's layers, block, attention and optimiser settings.
SHAPES = {
    "tiny": {"target": [], "sets": []},
    "qwen3-8b": {
        "target": ["--hidden-size", "4096", "--layers", "6", "--vocab-size", "151936",
                   "--dtype", "bfloat16"],
        "sets": ["target.dtype=bfloat16", "model.attention=flex", "compile.enabled=true",
                 "model.num_draft_layers=5", "model.block_size=16", "model.drafter_overrides={}",
                 "data.num_anchors=16", "train.batch_size=32", "train.lr=6.0e-4",
                 "train.warmup_ratio=0.04", "train.grad_clip=1.0", "train.weight_decay=0.0"],
    },
}


def make_target(shape: str, device: str, out: str) -> None:
    device_args = ["--device", device] if shape != "tiny" else []
    subprocess.run([sys.executable, os.path.join(REMOTE, "make_tiny_target.py"), "--out", out,
                    *SHAPES[shape]["target"], *device_args], check=True,
                   stdout=subprocess.DEVNULL)


def train(run_dir: str, target: str, shape: str, device: str, seed: int, steps: int,
          variant: str, work: str) -> dict:
    sets = [f"target.path={target}", f"data.cache_dir={work}/data-cache",
            f"compile.cache_dir={work}/inductor-{variant}-{seed}", f"train.seed={seed}",
            f"train.max_steps={steps}", f"devices.target={device}", f"devices.drafter={device}",
            *COMMON, *SHAPES[shape]["sets"], *VARIANTS[variant]]
    args = [sys.executable, os.path.join(REMOTE, "train_dflash.py"),
            "--config", os.path.join(REMOTE, "configs", "tiny-cpu.yaml"), "--run-dir", run_dir]
    for item in sets:
        args += ["--set", item]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    started = time.perf_counter()
    done = subprocess.run(args, cwd=REMOTE, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))] \
        if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else []
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    problems = [line for line in (done.stdout + done.stderr).splitlines()
                if "ERROR" in line or "Traceback" in line or "WARNING" in line]
    return {"variant": variant, "seed": seed, "rc": done.returncode, "wall_s": round(wall, 1),
            "losses": losses, "problems": problems[:10],
            "tail": (done.stdout + done.stderr)[-2000:] if done.returncode else ""}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    choices = ", ".join(v for v in VARIANTS if v != "off")
    parser.add_argument("--variants", default="on", help=f"compared with off: {choices}")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS) | ({"off"} & set(variants)))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {choices}")
    work = tempfile.mkdtemp(prefix="numerics-")
    target = os.path.join(work, "target")
    started = time.perf_counter()
    make_target(args.shape, args.device, target)
    print(f"target {args.shape} made in {time.perf_counter() - started:.1f} s", flush=True)
    jobs = [(variant, seed) for seed in seeds for variant in ("off", *variants)]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(lambda job: train(os.path.join(work, f"run-{job[0]}-{job[1]}"),
                                                target, args.shape, args.device, job[1],
                                                args.steps, job[0], work), jobs))
    for run in runs:
        last = f"{run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}" if run["losses"] else "none"
        print(f"{run['variant']:3s} seed {run['seed']}: rc {run['rc']}, {len(run['losses'])} "
              f"steps in {run['wall_s']} s, loss {last}; {len(run['problems'])} warning/error "
              f"lines {run['problems'][:3]}{run['tail']}", flush=True)
    complete = all(r["rc"] == 0 and len(r["losses"]) == args.steps for r in runs)
    result = {"shape": args.shape, "device": args.device, "seeds": seeds, "steps": args.steps,
              "runs": [{k: v for k, v in r.items() if k != "losses"} for r in runs]}
    if complete:
        curves = {v: [r["losses"] for r in runs if r["variant"] == v] for v in ("off", *variants)}
        result["losses"] = {v: [[round(x, 5) for x in c] for c in cs] for v, cs in curves.items()}
        for variant in variants:
            gap = result[f"gap_{variant}"] = curve_gap(curves["off"], curves[variant], args.window)
            singles = [curve_gap([off], [fast], args.window)["max_abs_pct"]
                       for off, fast in zip(curves["off"], curves[variant], strict=True)]
            result[f"single_seeds_{variant}"] = singles
            print(f"\n{args.shape} on {args.device}, {args.steps} steps, seeds {args.seeds}, "
                  f"{variant} vs off: largest {args.window}-step difference (seed means) "
                  f"{gap['max_abs_pct']:.2f}% (bound 1%); single seeds " + ", ".join(
                      f"{s}: {g:.2f}%" for s, g in zip(seeds, singles, strict=True)))
            print("signed %: " + " ".join(f"{x:+.2f}" for x in gap["signed_pct"]))
            print("window means off/on: " + ", ".join(f"{b:.3f}/{f:.3f}" for b, f in gap["windows"]))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"numerics-{args.shape}.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
