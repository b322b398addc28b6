"""One race scenario in its own process: threads making compiled calls while another thread compiles.

Run by tests/remote/test_compile_race.py (one process per scenario, so a hang or a stuck global FX
flag cannot poison pytest). Exit codes: 0 ok, 1 crash, 3 hang (watchdog), 4 emulation inactive.

Emulation (why the race is reproducible on CPU, torch 2.13):
- torch 2.13 marks a forward compile as a process-wide "compile session", which makes
  is_fx_symbolic_tracing() False in every thread while any thread compiles, hiding the race;
  torch 2.11 (the incident, GPU) had no such session. --emulate replaces the session with a no-op.
- The FX flag is set only for the few milliseconds Tracer.trace runs; --emulate holds it set for
  --hold seconds at the start of every trace, and racing threads are released the moment a trace
  starts, so a racing call lands inside the window every time instead of by luck.
- The AOT-autograd cache is off (TORCHINDUCTOR_AUTOGRAD_CACHE=0, set by the test): its hit skips
  Tracer.trace, and the race with it. Inductor's FX-graph cache and C++ kernels are still reused.

Compiled regions: flex_attention forward under no_grad (torch 2.13 has no flex backward on CPU)
and a small MLP loss whose forward AND backward compile on CPU, so training steps (with the lazy
backward compile) are covered too.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import sys
import threading
import time
import traceback

import torch
import torch.fx._symbolic_trace as symbolic_trace
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "remote_scripts"))
import compile_safety  # noqa: E402

EXIT_OK, EXIT_CRASH, EXIT_HANG, EXIT_INACTIVE = 0, 1, 3, 4
HEADS, HEAD_DIM, SEQ, WIDTH = 2, 16, 128, 32
STEPS = {"prime": 1, "first_calls": 1, "warm_signatures": 2, "keep_stepping": 4}  # per thread
TRACING = threading.Event()  # set the first time any thread enters Tracer.trace
trace_count = 0


def emulate_older_torch(hold_s: float, keep_session: bool = False) -> None:
    if not keep_session:
        torch.compiler._compile_session_context = contextlib.nullcontext
    original_trace = symbolic_trace.Tracer.trace

    def widened_trace(self, *args, **kwargs):
        global trace_count
        old = symbolic_trace._is_fx_tracing_flag
        symbolic_trace._is_fx_tracing_flag = True  # what original_trace sets; set it earlier
        trace_count += 1
        TRACING.set()
        try:
            time.sleep(hold_s)
            return original_trace(self, *args, **kwargs)
        finally:
            symbolic_trace._is_fx_tracing_flag = old

    symbolic_trace.Tracer.trace = widened_trace


class TinyDrafter(torch.nn.Module):
    """Attention through compiled flex_attention (forward), an MLP head through a compiled loss."""

    def __init__(self, attention, mlp_loss) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.w1 = torch.nn.Parameter(torch.randn(WIDTH, 2 * WIDTH) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(2 * WIDTH, WIDTH) * 0.1)
        self.attention, self.mlp_loss = attention, mlp_loss

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        q, k, v = self.qkv(x).view(batch, SEQ, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        return self.attention(q, k, v).transpose(1, 2).reshape(batch, SEQ, WIDTH)

    def train_step(self, x: torch.Tensor) -> float:
        with torch.no_grad():
            hidden = self.attend(x)
        loss = self.mlp_loss(hidden, self.w1, self.w2)
        loss.backward()
        return float(loss.detach())


def mlp_loss(hidden, w1, w2):
    return (torch.nn.functional.gelu(hidden @ w1) @ w2).pow(2).mean()


def batch_for(thread_index: int) -> torch.Tensor:
    # Thread 0 has a batch size of its own; the racers share another. Two signatures keep
    # 3 and 8 threads equally quick to compile, and warm_signatures can warm all racers' shapes
    # while thread 0's stays cold.
    batch = 1 if thread_index == 0 else 2
    return torch.randn(batch, SEQ, WIDTH)


def run_scenario(args, model: TinyDrafter, errors: list[str]) -> None:
    racers = range(1, args.threads)

    def worker(index: int) -> None:
        compile_safety.apply_thread_settings()
        try:
            x = batch_for(index)
            if index > 0 and not TRACING.wait(args.watchdog):
                return
            for _ in range(args.steps):
                model.train_step(x)
        except BaseException as exc:  # report every failure, whatever it is
            errors.append(f"thread {index}: {type(exc).__name__}: {exc}")
            traceback.print_exc()

    if args.scenario == "prime":
        # Fill the inductor cache once, single-threaded and unhurried: a cold C++ build takes
        # tens of seconds on two busy cores, which the scenarios' watchdog would call a hang.
        compile_safety.warm_shapes(lambda i: model.train_step(batch_for(i)), [0, 1])
        return
    if args.scenario == "warm_signatures":
        # Racers' shapes are compiled (fwd+bwd) in the main thread first; thread 0's is not.
        compile_safety.warm_shapes(lambda i: model.train_step(batch_for(i)), list(racers)[:1])
        TRACING.clear()
    threads = [threading.Thread(target=worker, args=(0,), name="drafter-0", daemon=True)]
    threads += [
        threading.Thread(target=worker, args=(i,), name=f"drafter-{i}", daemon=True)
        for i in racers
    ]
    for thread in threads:
        thread.start()
    # Stop at the first crash: a crashed run may leave the other threads stuck in torch.
    while any(thread.is_alive() for thread in threads) and not errors:
        time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=list(STEPS))
    parser.add_argument("--threads", type=int, default=3)
    parser.add_argument("--lock", choices=["on", "off"], default="on")
    parser.add_argument("--hold", type=float, default=0.1, help="seconds the FX flag is held")
    parser.add_argument("--watchdog", type=float, default=45.0, help="seconds before 'hang'")
    parser.add_argument("--steps", type=int, default=0, help="steps per thread (0: by scenario)")
    parser.add_argument("--keep-session", action="store_true",
                        help="control: widen the window but keep torch 2.13's compile session")
    args = parser.parse_args()
    args.steps = args.steps or STEPS[args.scenario]
    label = f"scenario={args.scenario} threads={args.threads} lock={args.lock}"

    def watchdog() -> None:
        time.sleep(args.watchdog)
        print(f"HANG {label}: not done after {args.watchdog:.0f} s; thread stacks:", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(EXIT_HANG)

    threading.Thread(target=watchdog, name="watchdog", daemon=True).start()
    torch.manual_seed(0)
    emulate_older_torch(args.hold, args.keep_session)
    compile_safety.configure_compile(cache_dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    if args.lock == "off":
        os.environ[compile_safety.LOCK_SWITCH_ENV] = "0"  # the documented test/bench-only switch
    # dynamic=False: every thread's batch size is its own compiled signature, as with the drafters.
    attention = compile_safety.safe_compile(flex_attention, "flex_attention", dynamic=False)
    loss = compile_safety.safe_compile(mlp_loss, "mlp_loss", dynamic=False)
    model = TinyDrafter(attention, loss)
    errors: list[str] = []
    started = time.perf_counter()
    run_scenario(args, model, errors)
    elapsed = time.perf_counter() - started
    stats = compile_safety.stats()
    summary = f"{label} traces={trace_count} calls={stats['calls']} seconds={elapsed:.1f}"
    if errors:
        print(f"CRASH {summary}", *errors, sep="\n", flush=True)
        return EXIT_CRASH
    if trace_count == 0:
        print(f"INACTIVE {summary}: no Tracer.trace ran (a compile cache hit?)", flush=True)
        return EXIT_INACTIVE
    print(f"OK {summary}", flush=True)
    return EXIT_OK


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown: a crashed run may leave threads stuck in torch
