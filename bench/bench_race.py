"""The compile race on real hardware: fresh processes, 3 drafter threads, first compiled steps at once.

    python bench/bench_race.py                                   # GPU: 10 processes per mode
    python bench/bench_race.py --device cuda:0,cuda:1,cuda:2     # one drafter thread per GPU
    python bench/bench_race.py --device cpu --processes 2        # smoke check (forward only)

Each process builds the real drafter (remote_scripts/dflash_model.py, small sizes) per thread, each
thread with its own batch size, releases the threads together and has each do its first steps
through compiled flex_attention (forward+backward; forward only on CPU, where torch 2.13 has no
flex backward). Modes: "lock" (compile_safety as training uses it) and "no-lock"
(DFLASH_COMPILE_LOCK=0, the test/bench-only switch). A watchdog turns a hang into exit 3.
`--cache fresh` (default) gives every process an empty inductor cache, as in the incident.

Then one process measures what the lock costs: all shapes warmed in the main thread, the three
threads step with the lock, then without it (nothing left to compile, so no contention), in
alternating rounds; the ratio of the two is the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "remote_scripts"))

EXIT_OK, EXIT_CRASH, EXIT_HANG = 0, 1, 3
STATUS = {EXIT_OK: "ok", EXIT_CRASH: "crash", EXIT_HANG: "hang"}
SIZES = {  # the drafter's shape: GPU sizes are a small real drafter, CPU sizes a smoke check
    "gpu": dict(hidden=1024, heads=8, kv_heads=4, head_dim=128, layers=2, context=512, blocks=16),
    "cpu": dict(hidden=128, heads=2, kv_heads=1, head_dim=64, layers=1, context=128, blocks=8),
}
BLOCK_SIZE = 16


# ----------------------------------------------------------------------------- child process

class Drafter:
    """One drafter thread's model and batch: the real DFlashDrafter on its device."""

    def __init__(self, index: int, device: str, sizes: dict, attention) -> None:
        import dflash_model as dm
        import objective
        import torch

        self.torch, self.device, self.attention = torch, torch.device(device), attention
        self.backward = self.device.type != "cpu"  # torch 2.13: no flex backward on CPU
        config = dm.create_drafter_config(
            num_draft_layers=sizes["layers"], hidden_size=sizes["hidden"],
            intermediate_size=2 * sizes["hidden"], num_attention_heads=sizes["heads"],
            num_key_value_heads=sizes["kv_heads"], head_dim=sizes["head_dim"], vocab_size=1024,
            block_size=BLOCK_SIZE)
        torch.manual_seed(0)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = dm.DFlashDrafter(config).to(self.device, dtype)
        batch, context, blocks = 1 + index, sizes["context"], sizes["blocks"]  # own batch size
        taps = len(self.model.target_layer_ids)
        gen = torch.Generator().manual_seed(index)
        self.target_hidden = torch.randn(batch, context, taps * sizes["hidden"], generator=gen)
        self.noise = torch.randn(batch, blocks * BLOCK_SIZE, sizes["hidden"], generator=gen)
        anchors = torch.randint(1, context, (batch, blocks), generator=gen)
        keep = torch.ones(batch, blocks, dtype=torch.bool)
        ids = torch.zeros(batch, context, dtype=torch.long)
        _, self.positions = objective.block_inputs(ids, anchors, keep, BLOCK_SIZE, 0)
        self.target_hidden = self.target_hidden.to(self.device, dtype)
        self.noise = self.noise.to(self.device, dtype)
        self.positions = self.positions.to(self.device)
        self.mask = dm.flex_dflash_mask(anchors.to(self.device), keep.to(self.device), context,
                                        BLOCK_SIZE)

    def step(self) -> None:
        torch = self.torch
        with torch.set_grad_enabled(self.backward):
            hidden = self.model(self.target_hidden, self.noise, self.positions, self.mask,
                                self.attention)
            if self.backward:
                hidden.float().pow(2).mean().backward()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def run_threads(drafters: list[Drafter], steps: int) -> list[str]:
    """All drafters step at once (released by a barrier); returns the errors, one line each."""
    import compile_safety

    barrier, errors = threading.Barrier(len(drafters)), []

    def worker(drafter: Drafter) -> None:
        compile_safety.apply_thread_settings()
        try:
            barrier.wait()
            for _ in range(steps):
                drafter.step()
        except BaseException as exc:  # every failure is a result here
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            traceback.print_exc()

    threads = [threading.Thread(target=worker, args=(d,), daemon=True) for d in drafters]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads) and not errors:
        time.sleep(0.02)
    return errors


def child(args) -> int:
    import compile_safety

    started = time.perf_counter()

    def watchdog() -> None:
        time.sleep(args.watchdog)
        print("RESULT " + json.dumps({"status": "hang", "wall_s": time.perf_counter() - started}),
              flush=True)
        import faulthandler
        faulthandler.dump_traceback(all_threads=True)
        os._exit(EXIT_HANG)

    threading.Thread(target=watchdog, daemon=True).start()
    devices = args.device.split(",")
    sizes = SIZES["cpu" if devices[0] == "cpu" else "gpu"]
    compile_safety.configure_compile(cache_dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    attention_fn = compile_safety.compiled_flex_attention()
    import dflash_model as dm

    attention = dm.make_flex_attention(attention_fn)
    drafters = [Drafter(i, devices[i % len(devices)], sizes, attention) for i in range(args.threads)]
    result: dict = {}
    if args.child == "race":
        errors = run_threads(drafters, args.steps)
        result["status"] = "crash" if errors else "ok"
        result["error"] = errors[0] if errors else ""
    else:
        result.update(throughput(drafters, attention_fn, args))
        result["status"] = "crash" if result.get("error") else "ok"
    stats = compile_safety.stats()
    result.update(wall_s=time.perf_counter() - started, calls=stats["calls"],
                  fallbacks=stats["fallbacks"], lock=stats["lock"],
                  lock_wait_s=round(stats["lock_wait_s"], 2))
    print("RESULT " + json.dumps(result), flush=True)
    return EXIT_CRASH if result["status"] == "crash" else EXIT_OK


def throughput(drafters: list[Drafter], attention_fn, args) -> dict:
    """Steps/s of all threads with the lock vs without it, after a main-thread warm-up."""
    import compile_safety

    warm = compile_safety.warm_shapes(lambda i: drafters[i].step(), range(len(drafters)))
    rates: dict[str, list[float]] = {"lock": [], "no-lock": []}
    for _ in range(args.rounds):
        for mode in ("lock", "no-lock"):
            attention_fn.locked = mode == "lock"
            t0 = time.perf_counter()
            errors = run_threads(drafters, args.tput_steps)
            if errors:
                return {"error": f"{mode}: {errors[0]}", "rates": rates}
            rates[mode].append(len(drafters) * args.tput_steps / (time.perf_counter() - t0))
    attention_fn.locked = True
    return {"warm_s": sum(warm.values()), "rates": rates}


# ----------------------------------------------------------------------------- parent

def spawn(args, mode: str, kind: str, cache_root: str, index: int) -> dict:
    env = dict(os.environ)
    env["DFLASH_COMPILE_LOCK"] = "1" if mode == "lock" else "0"
    cache = os.path.join(cache_root, f"{mode}-{index}" if args.cache == "fresh" else "shared")
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    argv = [sys.executable, os.path.abspath(__file__), "--child", kind, "--device", args.device,
            "--threads", str(args.threads), "--steps", str(args.steps), "--watchdog",
            str(args.watchdog), "--rounds", str(args.rounds), "--tput-steps", str(args.tput_steps)]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True,
                              timeout=args.watchdog + 60)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired:
        output, code = "", EXIT_HANG
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    result = json.loads(lines[-1][7:]) if lines else {}
    result.setdefault("status", STATUS.get(code, f"exit {code}"))
    result.setdefault("error", "" if code == EXIT_OK else (output.strip().splitlines() or [""])[-1])
    result.update(mode=mode, index=index, process_s=time.perf_counter() - t0)
    if args.verbose or result["status"] not in ("ok",):
        print(f"--- {mode} #{index}: {result['status']}\n{output[-1500:]}", flush=True)
    return result


def print_table(results: list[dict]) -> None:
    print(f"\n{'mode':8} {'#':>3} {'status':7} {'wall s':>7} {'waited s':>8}  error")
    print("(waited s: seconds all threads spent waiting for COMPILE_LOCK, summed)")
    for r in results:
        print(f"{r['mode']:8} {r['index']:>3} {r['status']:7} {r['process_s']:7.1f} "
              f"{r.get('lock_wait_s', 0):8.1f}  {str(r.get('error', ''))[:90]}")
    print(f"\n{'mode':8} {'ok':>3} {'crash':>5} {'hang':>4} {'other':>5}  wall s min/median/max")
    for mode in ("lock", "no-lock"):
        rows = [r for r in results if r["mode"] == mode]
        if not rows:
            continue
        count = {s: sum(r["status"] == s for r in rows) for s in ("ok", "crash", "hang")}
        walls = [r["process_s"] for r in rows]
        print(f"{mode:8} {count['ok']:>3} {count['crash']:>5} {count['hang']:>4} "
              f"{len(rows) - sum(count.values()):>5}  "
              f"{min(walls):.1f} / {statistics.median(walls):.1f} / {max(walls):.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cpu, or a list: cuda:0,cuda:1")
    parser.add_argument("--processes", type=int, default=10, help="fresh processes per mode")
    parser.add_argument("--threads", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps per thread in a race process")
    parser.add_argument("--watchdog", type=float, default=150, help="seconds before 'hang'")
    parser.add_argument("--modes", default="lock,no-lock")
    parser.add_argument("--cache", choices=["fresh", "shared"], default="fresh")
    parser.add_argument("--rounds", type=int, default=2, help="throughput: rounds per mode")
    parser.add_argument("--tput-steps", type=int, default=20, help="throughput: steps per thread")
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="print every child's output")
    parser.add_argument("--child", choices=["race", "throughput"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda":
        args.device = "cuda:0"
    if args.child:
        return child(args)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-race-") as cache_root:
        for mode in args.modes.split(","):
            for index in range(args.processes):
                results.append(spawn(args, mode, "race", cache_root, index))
        print_table(results)
        if not args.no_throughput:
            tput = spawn(args, "lock", "throughput", cache_root, 0)
            rates = tput.get("rates", {})
            if tput["status"] != "ok" or not rates.get("no-lock"):
                print(f"\nthroughput: {tput['status']} {tput.get('error', '')}")
            else:
                lock, free = statistics.median(rates["lock"]), statistics.median(rates["no-lock"])
                print(f"\nthroughput after warm-up ({args.threads} threads, {args.device}, "
                      f"median of {args.rounds} rounds): lock {lock:.2f} steps/s, no lock "
                      f"{free:.2f} steps/s, lock/no-lock = {lock / free:.3f}; warm-up "
                      f"{tput.get('warm_s', 0):.1f} s")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # a crashed child may leave threads stuck in torch: skip teardown
