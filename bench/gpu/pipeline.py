"""Issue 6 scaled down: the production layout (target + three drafter worker threads) on the GPUs
there are (default: all on cuda:0; `--pipeline-target-devices cuda:0 --pipeline-drafter-devices
cuda:1,cuda:1,cuda:1` on two), run as the container runs it (train_dflash.py / warmup_compile.py
subprocesses).

- launches from a cold compile cache (each its own fresh TORCHINDUCTOR_CACHE_DIR), each to step
  N, with a watchdog; `parallel` of them at a time after the first (which runs alone and gives
  the cold time to the first step);
- warmup_compile.py into a fresh cache, then a launch on that warm cache: the warm time to the
  first step, the steady-state pipeline tokens/s, and nvidia-smi utilisation samples;
- in-process, on the same target and config (the project's Target, build_drafters, warm_up,
  prepare_batch, forward_backward, average_gradients, update): target alone, drafters alone (3
  threads, as the loop runs them), and the drafters with the compile lock on vs off (issue 4).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import torch
from common import REMOTE, time_fn

QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                max_position_embeddings=40960)
CLASSES = {"4b": QWEN3_4B}
ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "CUDA_MODULE_LOADING": "LAZY",
       "PYTHONUNBUFFERED": "1"}


def make_target(out_dir: str, kind: str, smoke: bool) -> str:
    """A random-weight Qwen3 checkpoint of the given class with the tiny target's tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if os.path.isfile(os.path.join(out_dir, "config.json")):  # made by an earlier bench run
        return out_dir
    if kind == "8b":
        from common import QWEN3_8B
        shape = {k: v for k, v in QWEN3_8B.items() if k != "rope_theta"}
    else:
        shape = dict(CLASSES[kind])
    if smoke:
        shape.update(hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)
    config = Qwen3Config(**shape, tie_word_embeddings=False, rope_parameters={
        "rope_type": "default", "rope_theta": 1_000_000.0})
    device = "cpu" if smoke else "cuda:0"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    model.save_pretrained(out_dir)
    import make_tiny_target  # the synthetic data's tokenizer (the tiny target dir is not in git)
    make_tiny_target.build_tokenizer().save_pretrained(out_dir)
    del model
    torch.cuda.empty_cache() if not smoke else None
    return out_dir


def make_long_data(path: str, rows_per_conversation: int, conversations: int) -> str:
    """Long chats (many synthetic turns each) so that sequences fill max_length with real tokens."""
    with open(os.path.join(REMOTE, "data", "train.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(path, "w") as f:
        for i in range(conversations):
            turns = []
            for j in range(rows_per_conversation):
                turns += rows[(i * rows_per_conversation + j) % len(rows)]["conversations"]
            f.write(json.dumps({"id": f"long-{i}", "conversations": turns}) + "\n")
    return path


class Sampler:
    """nvidia-smi utilisation samples in the background: (time, util %, memory MiB)."""

    def __init__(self, path: str, period_ms: int = 250):
        self.path = path
        self.proc = None
        if shutil.which("nvidia-smi"):
            self.file = open(path, "w")
            self.proc = subprocess.Popen(
                ["nvidia-smi",
                 "--query-gpu=timestamp,index,utilization.gpu,memory.used,power.draw",
                 "--format=csv,noheader,nounits", f"-lms={period_ms}"], stdout=self.file,
                stderr=subprocess.DEVNULL)

    def stop(self):
        if self.proc:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.file.close()

    def utilisation(self, start_wall: float, stop_wall: float) -> dict:
        """Mean/min utilisation between two time.time() instants: all GPUs, then each GPU."""
        from datetime import datetime

        by_gpu: dict[str, list[float]] = {}
        if not os.path.exists(self.path):
            return {}
        for line in open(self.path):
            parts = [p.strip() for p in line.split(",")]
            try:
                stamp = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                if start_wall <= stamp <= stop_wall:
                    by_gpu.setdefault(parts[1], []).append(float(parts[2]))
            except (ValueError, IndexError):
                continue
        values = [v for vs in by_gpu.values() for v in vs]
        if not values:
            return {"samples": 0}
        out = {"samples": len(values), "util_mean": sum(values) / len(values),
               "util_min": min(values)}
        if len(by_gpu) > 1:
            for index, vs in sorted(by_gpu.items()):
                out[f"util_mean_gpu{index}"] = sum(vs) / len(vs)
                out[f"util_min_gpu{index}"] = min(vs)
        return out


# the layout: set by run(); "cuda:0" everywhere unless the bench is told otherwise
DEVICES = {"target": "cuda:0", "drafters": "cuda:0,cuda:0,cuda:0"}
EXTRA_SETS: list[str] = []  # --pipeline-set KEY=VALUE: added to every launch's --set list


def _layout(smoke: bool) -> tuple[str, list[str]]:
    if smoke:
        return "cpu", ["cpu"] * 3
    return DEVICES["target"], DEVICES["drafters"].split(",")


STEP_RE = re.compile(r"step (\d+)/(\d+) .*\| ([\d.]+) tok/s")
WARM_RE = re.compile(r"warm-up \(main thread\) done in ([\d.]+) s")
READY_RE = re.compile(r" ready: ")


def launch(script: str, args: list[str], log_path: str, timeout: float, env_extra=None):
    """Run a payload script, stream its output to log_path; time to 'step 1/' and each step."""
    env = dict(os.environ, **ENV, **(env_extra or {}))
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # the config's cache dir rules
        env.pop(name, None)
    t0, wall0 = time.perf_counter(), time.time()
    first_step = compile_s = ready = None
    steps, hung = [], False
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, os.path.join(REMOTE, script), *args], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        timer = threading.Timer(timeout, proc.kill)  # the watchdog: a hang becomes a failure
        timer.start()
        for line in proc.stdout:
            log.write(line)
            if ready is None and READY_RE.search(line):
                ready = time.perf_counter() - t0
            w = WARM_RE.search(line)
            if w:
                compile_s = float(w.group(1))
            m = STEP_RE.search(line)
            if m:
                now = time.perf_counter() - t0
                if first_step is None:
                    first_step = now
                steps.append({"step": int(m.group(1)), "t": now, "wall": time.time(),
                              "tok_s": float(m.group(3))})
        rc = proc.wait()
        hung = not timer.is_alive() and rc != 0
        timer.cancel()
    return {"rc": rc, "hung": hung, "seconds": time.perf_counter() - t0, "wall0": wall0,
            "first_step_s": first_step, "ready_s": ready, "steps": steps,
            "warmup_s": compile_s}


def train_args(config, target, data, cache, run_dir, steps, workers=3, smoke=False):
    target_dev, drafter_devs = _layout(smoke)
    sets = [f"target.path={target}", f"data.train={data}", f"data.heldout={data}",
            f"compile.cache_dir={cache}", "train.log_every=1", "train.eval_batches=1",
            "train.save_every=100000", "train.batch_size=1", *EXTRA_SETS]
    if smoke:
        sets += ["model.attention=dense", "compile.enabled=false", "data.max_length=64",
                 "data.num_anchors=8", "model.block_size=4", "model.num_draft_layers=2",
                 "target.dtype=float32"]
    args = ["--config", config, "--target-devices", target_dev,
            "--drafter-devices", ",".join(drafter_devs[:workers]), "--run-dir", run_dir,
            "--max-steps", str(steps)]
    for s in sets:
        args += ["--set", s]
    return args


def run(results, work: str, out_dir: str | None, smoke: bool, kind: str = "4b",
        launches=range(1, 6), steps: int = 20, parallel: int = 2, budget_s: float = 540.0,
        parts=frozenset({"cold", "warm", "alone"}), watchdog_s: float = 240.0):
    started = time.perf_counter()
    left = lambda: budget_s - (time.perf_counter() - started)  # noqa: E731
    os.makedirs(work, exist_ok=True)
    logs = out_dir or work
    config = os.path.join(REMOTE, "configs", "production-27b.yaml")
    target = make_target(os.path.join(work, f"target-{kind}"), kind, smoke)
    data = make_long_data(os.path.join(work, "long.jsonl"), 150 if not smoke else 3, 16)
    results.add("pipeline", "setup", seconds=time.perf_counter() - started,
                note=f"random {kind}-class target at {target}")
    sampler = Sampler(os.path.join(logs, "nvidia_smi.csv"))
    try:
        def one(i):
            cache = os.path.join(work, f"cold-{i}", "inductor")  # triton cache beside it
            run_dir = os.path.join(work, f"run-{i}")
            r = launch("train_dflash.py",
                       train_args(config, target, data, cache, run_dir, steps, smoke=smoke),
                       os.path.join(logs, f"launch{i}.log") if i == launches[0] else
                       os.path.join(work, f"launch{i}.log"), timeout=min(watchdog_s, max(30.0, left() - 5)))
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.rmtree(os.path.dirname(cache), ignore_errors=True)
            last = r["steps"][-1]["step"] if r["steps"] else 0
            tail = [s["tok_s"] for s in r["steps"] if s["step"] > steps // 2]
            walls = [s["wall"] for s in r["steps"] if s["step"] > steps // 2]
            util = sampler.utilisation(walls[0], walls[-1]) if len(walls) > 1 else {}
            results.add("pipeline", f"cold launch {i}", rc=r["rc"], hung=r["hung"],
                        **{f"gpu_{k}": v for k, v in util.items()},
                        reached_step=last, ms=r["seconds"] * 1e3, first_step_s=r["first_step_s"],
                        ready_s=r["ready_s"],
                        main_thread_warmup_s=r["warmup_s"],
                        tokens_per_s=sum(tail) / len(tail) if tail else None,
                        note=f"ok={r['rc'] == 0 and last == steps}")
            return r

        launches = list(launches) if "cold" in parts else []
        first = one(launches[0]) if launches else {"first_step_s": None}
        pending = launches[1:]
        while pending and left() > 150:
            batch, pending = pending[:parallel], pending[parallel:]
            threads = [threading.Thread(target=one, args=(i,)) for i in batch]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if pending:
            results.add("pipeline", "cold launches skipped", note=f"{pending}: out of time")

        # warm: warmup_compile.py fills a fresh cache, then training reads it
        if "warm" in parts and left() > 90:
            cache = os.path.join(work, "warm", "inductor")
            w = launch("warmup_compile.py",
                       train_args(config, target, data, cache, os.path.join(work, "w"), steps,
                                  smoke=smoke), os.path.join(logs, "warmup.log"), left() - 5)
            r = launch("train_dflash.py",
                       train_args(config, target, data, cache, os.path.join(work, "run-warm"),
                                  steps, smoke=smoke), os.path.join(logs, "launch_warm.log"),
                       max(60.0, left() - 5))
            tail = [s for s in r["steps"] if s["step"] > steps // 2]
            util = sampler.utilisation(tail[0]["wall"], tail[-1]["wall"]) if len(tail) > 1 else {}
            results.add("pipeline", "warmup_compile.py", rc=w["rc"], ms=w["seconds"] * 1e3)
            results.add("pipeline", "warm launch", rc=r["rc"], killed_by_watchdog=r["hung"],
                        reached_step=r["steps"][-1]["step"] if r["steps"] else 0,
                        ms=r["seconds"] * 1e3, first_step_s=r["first_step_s"], ready_s=r["ready_s"],
                        main_thread_warmup_s=r["warmup_s"],
                        tokens_per_s=sum(s["tok_s"] for s in tail) / len(tail) if tail else None,
                        **{f"gpu_{k}": v for k, v in util.items()})
            if first["first_step_s"] and r["first_step_s"]:
                results.add("pipeline", "first step cold/warm",
                            cold_s=first["first_step_s"], warm_s=r["first_step_s"],
                            ratio=first["first_step_s"] / r["first_step_s"],
                            warmup_cold_s=first.get("warmup_s"), warmup_warm_s=r["warmup_s"],
                            note="process start to the 'step 1/' log line, same layout")
            if "alone" in parts and left() > 60:
                alone(results, config, target, data, cache, steps, smoke, sampler)
        elif "alone" in parts:
            alone(results, config, target, data, os.path.join(work, "alone", "inductor"), steps,
                  smoke, sampler)
    finally:
        sampler.stop()
    for path in glob.glob(os.path.join(work, "run-*")):
        shutil.rmtree(path, ignore_errors=True)


def alone(results, config_path, target_path, data, cache, steps, smoke, sampler):
    """Target alone, drafters alone, drafters with the compile lock off: same shapes, in-process."""
    from concurrent.futures import ThreadPoolExecutor

    import compile_safety
    import fast_paths
    import training
    from dflash_data import load_examples
    from target_model import Target, load_tokenizer
    from train_config import load_config

    args = train_args(config_path, target_path, data, cache, "/tmp/unused", steps, smoke=smoke)
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    dev, drafter_devs = _layout(smoke)
    config = load_config(config_path, sets, {"devices.target": dev,
                                             "devices.drafter": ",".join(drafter_devs)})
    tokenizer = load_tokenizer(target_path)
    examples = load_examples(data, tokenizer, config.data.assistant_header,
                             config.data.end_of_turn, config.data.max_length)
    from target_model import load_target_config
    target = Target(target_path, [dev], config.target.dtype,
                    training.target_layer_ids(config, load_target_config(target_path)),
                    fast_paths=config.train.fast_paths)
    drafters = training.build_drafters(config, target, tokenizer, drafter_devs)
    training.apply_compile(config.compile, config.train.fast_paths, target, drafters)
    workers = drafters.workers

    def time_all(fn, warmup, iters):  # synchronise every device of the layout, not only one
        def synced():
            out = fn()
            for d in {dev, *drafter_devs} - {"cpu"}:
                torch.cuda.synchronize(d)
            return out
        return time_fn(synced, dev, warmup=warmup, iters=iters)

    def batch_for(worker, i):
        return training.prepare_batch(examples[i % len(examples): i % len(examples) + 1], config,
                                      target, worker.device, drafters.mask_token_id,
                                      drafters.build_mask,
                                      training.anchor_generator(0, i, worker.index))

    training.warm_up(workers, lambda w: batch_for(w, 0))
    n = 3 if smoke else 10
    tokens = config.data.max_length
    t = time_all(lambda: [batch_for(w, 1) for w in workers], warmup=1, iters=n)
    results.add("pipeline", "target alone (prepare_batch x3)", ms=t["ms"],
                tokens_per_s=3 * tokens / t["ms"] * 1e3)
    batches = [batch_for(w, 2) for w in workers]
    pool = ThreadPoolExecutor(max_workers=3)

    def drafter_step():
        list(pool.map(lambda wb: wb[0].forward_backward(wb[1]), zip(workers, batches, strict=True)))
        training.average_gradients(workers)
        list(pool.map(lambda w: w.update(), workers))

    wait0 = compile_safety.stats()["lock_wait_s"]
    t = time_all(drafter_step, warmup=1, iters=n)
    waited = compile_safety.stats()["lock_wait_s"] - wait0
    results.add("pipeline", "drafters alone (3 threads, lock on)", ms=t["ms"],
                tokens_per_s=3 * tokens / t["ms"] * 1e3,
                lock_wait_s_per_step=waited / (n + 1))
    if not smoke:  # lock off: the same compiled code (warm), the same wrappers with the lock off
        wrappers = [compile_safety.compiled_flex_attention(), *fast_paths._compiled.values()]
        for wrapper in wrappers:
            wrapper.locked = False
        t = time_all(drafter_step, warmup=1, iters=n)
        results.add("pipeline", "drafters alone (3 threads, lock OFF, warm)", ms=t["ms"],
                    tokens_per_s=3 * tokens / t["ms"] * 1e3)
        for wrapper in wrappers:
            wrapper.locked = True
        one = workers[0]
        t = time_all(lambda: (one.forward_backward(batches[0]), one.update()), 1, n)
        results.add("pipeline", "one drafter alone (no contention)", ms=t["ms"],
                    tokens_per_s=tokens / t["ms"] * 1e3)
    pool.shutdown()
