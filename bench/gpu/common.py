"""Shared bench helpers: payload import path, timing, FLOP counts, the result table."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REMOTE = os.path.join(ROOT, "remote_scripts")
if REMOTE not in sys.path:
    sys.path.insert(0, REMOTE)

# Qwen3-8B (the drafter's widths come from the target) and the Qwen3.6-27B-class text model.
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                max_position_embeddings=40960, rope_theta=1_000_000.0)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, device, warmup: int = 3, iters: int = 10) -> dict:
    """Median / min / max milliseconds of fn() over `iters` runs after `warmup` (host clock, synced).

    The work timed here is tens of milliseconds or more per call, so a synchronised host clock
    is within a few microseconds of device events.
    """
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times), "n": iters}


def linear_flops(m: int, k: int, n: int) -> float:
    return 2.0 * m * k * n


class Results:
    """Rows of measurements; written to JSON as they come (a killed run keeps what it had)."""

    def __init__(self, out_dir: str | None):
        self.rows: list[dict] = []
        self.path = os.path.join(out_dir, "bench_gpu.json") if out_dir else None

    def add(self, section: str, variant: str, **values) -> dict:
        row = {"section": section, "variant": variant, **values}
        self.rows.append(row)
        print("RESULT " + json.dumps(row), flush=True)
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.rows, f, indent=1)
        return row

    def table(self) -> str:
        cols = ["section", "variant", "ms", "tflops", "mfu_pct", "tokens_per_s", "details"]
        keys = ["fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "rel_err_out_dq_dk_dv",
                "out_vs_sdpa", "rel_err_vs_project", "peak_gib", "ready_s", "first_step_s", "rc", "hung",
                "reached_step", "main_thread_warmup_s", "cold_s", "warm_s", "ratio", "warmup_cold_s",
                "warmup_warm_s", "gpu_util_mean", "gpu_samples",
                "lock_wait_s_per_step", "max_rel_diff_window_pct", "per_seed_max_pct", "note"]
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for row in self.rows:
            row = dict(row, details=" ".join(
                f"{k}={_fmt(row[k])}" for k in keys if row.get(k) not in (None, "")))
            cells = []
            for c in cols:
                v = row.get(c, "")
                cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def curve_gap(base: list[list[float]], fast: list[list[float]], window: int = 20) -> dict:
    """Issue 37's numerics metric: two sets of training-loss curves (one per seed, the same seeds,
    data and steps in both), averaged over the seeds step by step, then cut into `window`-step
    windows; the relative difference (fast - base) / base of each window's mean. Returns the
    largest |difference| in percent, the signed differences and the window means."""
    base_mean = [statistics.fmean(v) for v in zip(*base, strict=True)]
    fast_mean = [statistics.fmean(v) for v in zip(*fast, strict=True)]
    if len(base_mean) != len(fast_mean) or not base_mean:
        raise ValueError(f"curves of {len(base_mean)} and {len(fast_mean)} steps")
    windows = []
    for start in range(0, len(base_mean), window):
        b = statistics.fmean(base_mean[start:start + window])
        f = statistics.fmean(fast_mean[start:start + window])
        windows.append((b, f, (f - b) / abs(b)))
    return {"max_abs_pct": 100 * max(abs(r) for _, _, r in windows),
            "signed_pct": [round(100 * r, 2) for _, _, r in windows],
            "windows": [[round(b, 4), round(f, 4)] for b, f, _ in windows],
            "window": window, "seeds": len(base), "steps": len(base_mean)}
