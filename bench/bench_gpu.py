"""GPU benchmarks of drafter training (issue 5). Run from the repository root; prints a table last.

    python bench/bench_gpu.py [--only matmul,attention,drafter,target] [--out DIR]
    python bench/bench_gpu.py --smoke          # tiny sizes on CPU: checks the script still runs

Every figure is measured in the same run as its baseline: the bf16 8192^3 matrix product first
(the machine's ceiling, the denominator of every MFU), then each section's baseline (SDPA with
the dense mask, the project's unchanged path) before its faster variants.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))

import torch  # noqa: E402
from common import Results, time_fn  # noqa: E402

SECTIONS = ["probe", "matmul", "attention", "drafter", "target"]  # + "pipeline" (issue 6)


def probe(results, device):
    info = {"torch": torch.__version__, "python": platform.python_version()}
    if device != "cpu":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, sms=props.multi_processor_count,
                    mem_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
        try:
            info["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            info["nvidia_smi"] = f"unavailable: {exc}"
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    results.add("probe", "versions", note=str(info), **info)


def matmul(results, device, smoke):
    n = 512 if smoke else 8192
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    sets = [(torch.randn(n, n, generator=g, device=device, dtype=dtype),
             torch.randn(n, n, generator=g, device=device, dtype=dtype)) for _ in range(3)]
    out = torch.empty(n, n, device=device, dtype=dtype)
    state = {"i": 0}

    def mm():  # rotate over three input sets (METHOD.md: do not time the cache)
        a, b = sets[state["i"] % 3]
        state["i"] += 1
        torch.matmul(a, b, out=out)

    t = time_fn(mm, device, warmup=5, iters=5 if smoke else 30)
    tflops = 2.0 * n ** 3 / t["ms"] / 1e9
    results.add("matmul", f"{'fp32' if device == 'cpu' else 'bf16'} {n}^3", ms=t["ms"],
                tflops=tflops, mfu_pct=100.0, note="random inputs, median; the MFU ceiling")
    return tflops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU")
    parser.add_argument("--only", default=",".join(SECTIONS))
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--cache-dir", default=None, help="TORCHINDUCTOR_CACHE_DIR (default: temp)")
    parser.add_argument("--attention-variants", default="", help="comma list (default: all)")
    parser.add_argument("--drafter-variants", default="plain,fast")
    parser.add_argument("--drafter-27b-variants", default="plain,fast")
    parser.add_argument("--no-target-compile", action="store_true")
    parser.add_argument("--target-kinds", default="8b", help="target classes: 8b,27b")
    parser.add_argument("--target-batches", default="4,1")
    parser.add_argument("--target-variants", default="", help="reference,fast eager,project (default: all)")
    parser.add_argument("--pipeline-kind", default="4b", help="target class: 4b or 8b")
    parser.add_argument("--pipeline-target-devices", default="cuda:0")
    parser.add_argument("--pipeline-drafter-devices", default="cuda:0,cuda:0,cuda:0")
    parser.add_argument("--pipeline-set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra --set for every pipeline launch (repeatable)")
    parser.add_argument("--launches", default="1-5", help="cold launch numbers, e.g. 1-3 or 4-5")
    parser.add_argument("--pipeline-parts", default="cold,warm,alone")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--parallel", type=int, default=2, help="cold launches at a time")
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument("--work", default="/dev/shm/dflash-bench", help="pipeline scratch dir")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda:0"
    if args.smoke:
        torch.set_num_threads(1)
    only = set(args.only.split(","))
    # a directory of its own: compile_safety puts the triton cache beside the inductor one
    cache_dir = args.cache_dir or os.path.join(tempfile.mkdtemp(prefix="bench-"), "inductor")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir)
    results = Results(args.out)
    if args.out:
        os.makedirs(args.out, exist_ok=True)

    if "probe" in only:
        probe(results, device)
    ceiling = matmul(results, device, args.smoke) if only - {"probe", "pipeline"} else None
    best = None
    if "attention" in only:
        import attention
        variants = [v for v in args.attention_variants.split(",") if v] or None
        best = attention.run(results, device, args.smoke, variants)
    if best:
        print(f"attention: fastest flex variant {best['variant']}: {best.get('options')}", flush=True)
    if "drafter" in only:
        import drafter
        drafter.run_one(results, device, drafter.shape("8b", args.smoke), "qwen3-8b(H4096)",
                        [v for v in args.drafter_variants.split(",") if v], args.smoke,
                        cache_dir, ceiling)
    if "target" in only:
        import target
        for kind in args.target_kinds.split(","):
            target.run(results, device, args.smoke, ceiling,
                       batches=tuple(int(b) for b in args.target_batches.split(",")),
                       compile_layers=not args.no_target_compile, kind=kind,
                       variants=[v for v in args.target_variants.split(",") if v] or None)
            if device != "cpu":
                torch.cuda.empty_cache()
    if "drafter" in only and args.drafter_27b_variants:
        import drafter
        drafter.run_one(results, device, drafter.shape("27b", args.smoke),
                        "27b-class(H5120,hd256)",
                        [v for v in args.drafter_27b_variants.split(",") if v], args.smoke,
                        cache_dir, ceiling)
    if "pipeline" in only:
        import pipeline
        pipeline.DEVICES.update(target=args.pipeline_target_devices,
                                drafters=args.pipeline_drafter_devices)
        pipeline.EXTRA_SETS[:] = args.pipeline_set
        first, last = (int(x) for x in args.launches.split("-"))
        pipeline.run(results, args.work, args.out, args.smoke, args.pipeline_kind,
                     range(first, last + 1), args.steps, args.parallel, args.budget_s,
                     set(args.pipeline_parts.split(",")))
    print("\n" + results.table(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
