"""Our drafter step beside SpecForge's DFlash step, in one process on one GPU (issue 37).

    python bench/bench_peers.py --wheels .whl --out DIR          # on the GPU machine
    python bench/bench_peers.py --smoke                          # tiny shapes on CPU

Sections (`--only`, comma list; default all but curve27b):
- matmul:  the bf16 8192^3 product, the ceiling every MFU is taken against;
- profile: torch.profiler over steps of one of our variants (`--profile-variants`): kernel time by
           category and the top 10 kernels, each as a share of the step;
- peers:   the training step of each peer and of our variants at the Qwen3-8B shape (5 draft
           layers, block 16, 512 anchors, S 3072, 5 taps): the same batch for all, each built from
           a fresh seed, median ms of `--iters` steps, peak memory, loss after the timed steps;
- 27b:     our variants at the 27B-class shape;
- curve:   `--curve-steps` steps of ours with every speed switch off and of each of
           `--curve-variants` (default every switch on), the same batches in the same order;
           the largest relative difference of the 20-step means (common.curve_gap, the metric
           bench_numerics.py takes over train_dflash.py runs), on the mean curve of
           `--curve-seeds` and per seed;
- threads: three workers of ours (every switch on) on one device, stepping in threads as
           training does (warm-up first); the replicas must stay identical.

Peers come from wheels in `--wheels` (pure Python; the GPU machine has no network): SpecForge 0.2.0
(its OnlineDFlashModel, DFlashDraftModel and BF16Optimizer; only those modules and what they import
are loaded, not the package's __init__) and speculators 0.9.0. A peer that cannot run gets one line
saying why. MFU counts bf16-equivalent matrix FLOPs (bench/gpu/drafter.py step_flops) over the
measured bf16 ceiling, whatever precision a product ran in.
"""

from __future__ import annotations

import argparse
import gc
import glob
import importlib
import os
import statistics
import sys
import tempfile
import time
import types
import zipfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))

import torch  # noqa: E402
from common import Results, curve_gap, sync, time_fn  # noqa: E402

SECTIONS = ["matmul", "profile", "peers", "27b", "curve", "threads"]
# our variants: name -> --set overrides on top of the production config
OURS = {
    "ours": [],
    "ours+compile_layers": ["speed.compile_layers=true"],
    "ours+bf16_master": ["speed.param_dtype=bfloat16"],
    "ours+fp8_head": ["speed.fp8_lm_head=true"],
    "ours+bf16_master+fp8_head": ["speed.param_dtype=bfloat16", "speed.fp8_lm_head=true"],
    "ours+all": ["speed.compile_layers=true", "speed.param_dtype=bfloat16",
                 "speed.fp8_lm_head=true"],
}
PEERS = ["specforge-fp32-autocast", "specforge-bf16"]


# ----------------------------------------------------------------------------- timing / memory

def free(device):
    gc.collect()
    if device != "cpu" and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device != "cpu" else 0.0


def timed_steps(step, device, warmup: int, iters: int) -> dict:
    """First call's seconds, then common.time_fn's median/min/max ms of `iters` synced steps."""
    t0 = time.perf_counter()
    step()
    sync(device)
    first = time.perf_counter() - t0
    return dict(time_fn(step, device, warmup=warmup, iters=iters), first_step_s=first)


# ----------------------------------------------------------------------------- ours

def our_worker(variant: str, shape_kind: str, device: str, smoke: bool, cache_dir: str,
               seed: int = 1, extra=(), workers: int = 1):
    """(worker, batch, step FLOPs, config) for one of our variants at a shape; with `workers` > 1
    the first item is the list of workers (one replica each, all on `device`)."""
    import drafter
    import training

    # on CPU (--smoke) every variant runs under bf16 autocast too: the plain bf16 path
    config = drafter.make_config(cache_dir, smoke,
                                 (["train.autocast=bfloat16"] if smoke else []) + OURS[variant]
                                 + list(extra))
    from transformers import Qwen3Config
    target_shape = drafter.shape(shape_kind, smoke)
    target_cfg = Qwen3Config(**target_shape)
    vocab = target_shape["vocab_size"]
    torch.manual_seed(seed)
    with torch.device(device):
        template = training.build_drafter_template(
            config, target_cfg, vocab - 1, training.target_layer_ids(config, target_cfg))
    dcfg = template.config
    dtype = torch.bfloat16 if config.train.autocast else torch.float32
    g = torch.Generator(device=device).manual_seed(seed)
    embed = (torch.randn(vocab, dcfg.hidden_size, generator=g, device=device) * 0.02).to(dtype)
    head = (torch.randn(vocab, dcfg.hidden_size, generator=g, device=device) * 0.02).to(dtype)
    batch, pairs = drafter.make_batch(config, dcfg, device)
    flops = drafter.step_flops(dcfg, config.data.max_length, batch.num_blocks,
                               config.model.block_size, pairs)
    # as training.build_drafters + apply_compile do (a stand-in target: no layers to compile)
    attention, build_mask, _ = training.make_attention(config.model.attention, compiled=False)
    built = [training.DrafterWorker(i, device, template, config, embed, head, attention)
             for i in range(workers)]
    drafters = training.Drafters(built, built[0].drafter, vocab - 1, config.model.attention,
                                 build_mask)
    training.apply_compile(config.compile, config.train.fast_paths, _NoTarget(), drafters)
    return (built[0] if workers == 1 else built), batch, flops, config


def run_threads(results, variant, device, smoke, cache_dir, count=3, steps=5):
    """`count` workers on one device stepping in threads as training runs them: warm-up in the
    main thread, then each step's forward+backward in one thread per worker, the gradient
    average, the updates. Replicas must stay identical (the same batch for each)."""
    import threading

    import compile_safety
    import training

    free(device)
    workers, batch, _, _ = our_worker(variant, "8b", device, smoke, cache_dir, workers=count)
    training.warm_up(workers, lambda worker: batch)
    losses, errors = [], []

    def work(worker, out):
        try:
            out[worker.index] = worker.forward_backward(batch)[0]
        except Exception as exc:  # reported below, with the others' results
            errors.append(f"{type(exc).__name__}: {exc}"[:200])

    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = [None] * count
        threads = [threading.Thread(target=work, args=(w, out)) for w in workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        training.average_gradients(workers)
        for worker in workers:
            worker.update()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(out)
    results.add("threads", f"8b:{variant}x{count}", ms=statistics.median(times),
                errors=errors, losses=losses, replica_max_diff=training.replica_max_diff(workers),
                compile_stats=compile_safety.stats(),
                note=f"{count} workers in threads on one GPU; ms per step of all {count}")
    workers = batch = None
    free(device)


class _NoTarget:
    """The drafter step needs no target: its features come from the batch."""

    def compile_layers(self) -> int:
        return 0


def failed(results, section, variant, exc) -> dict:
    import traceback
    traceback.print_exc()
    line = f"{variant}: could not run: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    print("FAILED " + line, flush=True)
    return results.add(section, variant, note=line)


def run_ours(results, variant, shape_kind, device, smoke, cache_dir, ceiling, iters):
    try:
        return _run_ours(results, variant, shape_kind, device, smoke, cache_dir, ceiling, iters)
    except Exception as exc:
        return failed(results, "peers", f"{shape_kind}:{variant}", exc)
    finally:
        free(device)


def _run_ours(results, variant, shape_kind, device, smoke, cache_dir, ceiling, iters):
    free(device)
    worker, batch, flops, config = our_worker(variant, shape_kind, device, smoke, cache_dir)
    losses = []

    def step():
        loss, _ = worker.forward_backward(batch)
        worker.update()
        losses.append(loss)

    t = timed_steps(step, device, warmup=2, iters=iters)
    # the FP8 product: the LM head's logits (the input-gradient product stays bf16)
    fp8_flops = 2.0 * batch.num_blocks * config.model.block_size \
        * worker.drafter.config.hidden_size * worker.head_weight.shape[0]
    row = results.add(
        "peers", f"{shape_kind}:{variant}", **t, tflops=flops / t["ms"] / 1e9,
        mfu_pct=100 * flops / t["ms"] / 1e9 / ceiling if ceiling else None,
        tokens_per_s=config.data.max_length / t["ms"] * 1e3, peak_gib=peak_gib(device),
        loss_first_last=[losses[0], losses[-1]], steps=len(losses), step_tflop=flops / 1e12,
        fp8_share_pct=100 * fp8_flops / flops if config.speed.fp8_lm_head else 0.0,
        speed=dict(config.to_dict()["speed"]))
    worker = batch = None  # frees the GPU memory before the next variant
    free(device)
    return row


# ----------------------------------------------------------------------------- peers

def _stub_packages(root: str, names: list[str]) -> None:
    """Empty package modules whose __path__ points into a wheel: importing a submodule then
    loads only that module and what it imports, never the packages' __init__ files."""
    for name in names:
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [os.path.join(root, *name.split("."))]
            sys.modules[name] = module


def load_wheel(wheels: str, project: str) -> str:
    found = sorted(glob.glob(os.path.join(wheels, f"{project}-*.whl")))
    if not found:
        raise FileNotFoundError(f"no {project}-*.whl in {wheels}")
    with zipfile.ZipFile(found[-1]) as z:  # a wheel is importable as a zip (pure Python)
        z.testzip()
    if found[-1] not in sys.path:
        sys.path.insert(0, found[-1])
    return found[-1]


def specforge_step(variant: str, wheels: str, device: str, smoke: bool, seed: int = 1):
    """SpecForge 0.2.0's DFlash training step at our bench shape; returns (step, model)."""
    import drafter
    import training

    whl = load_wheel(wheels, "specforge")
    _stub_packages(whl, ["specforge", "specforge.algorithms", "specforge.algorithms.common",
                         "specforge.modeling", "specforge.modeling.draft", "specforge.core"])
    family = importlib.import_module("specforge.algorithms.common.dflash_family_model")
    draft_mod = importlib.import_module("specforge.modeling.draft.dflash")
    config = drafter.make_config(tempfile.gettempdir(), smoke)
    from transformers import Qwen3Config
    target_shape = drafter.shape("8b", smoke)
    target_cfg = Qwen3Config(**target_shape)
    vocab, hidden = target_shape["vocab_size"], target_shape["hidden_size"]
    ours = training.build_drafter_template(config, target_cfg, vocab - 1,
                                           training.target_layer_ids(config, target_cfg))
    dcfg = ours.config  # the same Qwen3Config fields; SpecForge reads block_size from the top
    dcfg.block_size = config.model.block_size
    dcfg._attn_implementation = "sdpa" if smoke else "flex_attention"
    del ours
    torch.manual_seed(seed)
    bf16 = variant == "specforge-bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    with torch.device(device):
        draft = draft_mod.DFlashDraftModel(dcfg)
        head = torch.nn.Linear(hidden, vocab, bias=False)
        embed = torch.nn.Embedding(vocab, hidden)
    for module in (head, embed):
        module.weight.requires_grad_(False)
    model = family.OnlineDFlashModel(
        draft, head, embed, mask_token_id=vocab - 1, block_size=config.model.block_size,
        attention_backend="sdpa" if smoke else "flex_attention",
        num_anchors=config.data.num_anchors, loss_decay_gamma=config.model.gamma,
    ).to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(0)  # the batch drafter.make_batch draws (seed 0)
    seq = config.data.max_length
    taps = len(dcfg.dflash_config["target_layer_ids"])
    input_ids = torch.randint(0, vocab - 1, (1, seq), generator=g).to(device)
    loss_mask = torch.ones(1, seq, device=device)
    features = torch.float32 if smoke and not bf16 else torch.bfloat16  # no autocast on CPU
    hidden_states = torch.randn(1, seq, taps * hidden, generator=g).to(device, features)
    if bf16:  # SpecForge's own precision: bf16 parameters, fp32 masters in its BF16Optimizer
        optim_mod = importlib.import_module("specforge.optimizer")
        optimizer = optim_mod.BF16Optimizer(draft, lr=config.train.lr,
                                            max_grad_norm=config.train.grad_clip,
                                            total_steps=config.train.max_steps,
                                            warmup_ratio=config.train.warmup_ratio)

        def update():
            optimizer.step()
    else:  # our precision: fp32 parameters under bf16 autocast, torch's AdamW
        params = [p for p in draft.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=config.train.lr)

        def update():
            torch.nn.utils.clip_grad_norm_(params, config.train.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16,
                              enabled=not bf16 and not smoke)
    losses = []

    def step():
        with autocast:
            loss, _, _ = model(input_ids=input_ids, hidden_states=hidden_states,
                               loss_mask=loss_mask)
        loss.backward()
        update()
        losses.append(loss.item())
    return step, losses, seq


def run_peer(results, variant, wheels, device, smoke, ceiling, flops, iters):
    free(device)
    try:
        step, losses, seq = specforge_step(variant, wheels, device, smoke)
        t = timed_steps(step, device, warmup=2, iters=iters)
    except Exception as exc:  # one line: which peer, why
        line = f"{variant}: could not run: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        print("PEER " + line, flush=True)
        return results.add("peers", f"8b:{variant}", note=line)
    row = results.add(
        "peers", f"8b:{variant}", **t, tflops=flops / t["ms"] / 1e9,
        mfu_pct=100 * flops / t["ms"] / 1e9 / ceiling if ceiling else None,
        tokens_per_s=seq / t["ms"] * 1e3, peak_gib=peak_gib(device),
        loss_first_last=[losses[0], losses[-1]], steps=len(losses))
    step = None
    free(device)
    return row


def try_speculators(results, wheels) -> None:
    """speculators 0.9.0's DFlash trains through its own config objects (pydantic) and loads the
    verifier's embeddings and LM head from a checkpoint on disk; say in one line how far it got."""
    try:
        load_wheel(wheels, "speculators")
        importlib.import_module("speculators.models.dflash.core")  # its __init__ imports it all
        line = ("speculators-0.9.0: imported, not run: its DFlashDraftModel loads the verifier's "
                "embeddings and LM head from a checkpoint (load_verifier_weights); no bench "
                "driver for that yet")
    except Exception as exc:
        line = (f"speculators-0.9.0: could not run: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200]}")
    print("PEER " + line, flush=True)
    results.add("peers", "8b:speculators-0.9.0", note=line)


# ----------------------------------------------------------------------------- profile

CATEGORIES = [  # first match wins (lower-case kernel names)
    ("flex_attention", ("flex", "triton_tem_fused")),
    ("fp8 GEMM", ("f8", "fp8", "e4m3", "scaled_mm")),
    ("GEMM", ("nvjet", "gemm", "cutlass", "xmma", "sm90_")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("fused Triton (compiled)", ("triton_",)),
    ("copies and casts", ("copy", "cast", "convert")),
    ("elementwise and reductions", ("elementwise", "functor", "reduce", "kernel")),
]


def category(name: str) -> str:
    low = name.lower()
    for label, keys in CATEGORIES:
        if any(k in low for k in keys):
            return label
    return "other"


def profile_ours(results, variant, device, smoke, cache_dir, steps=3):
    from torch.profiler import ProfilerActivity, profile
    free(device)
    worker, batch, _, _ = our_worker(variant, "8b", device, smoke, cache_dir)
    events = {}

    def region(name, fn):
        if device == "cpu":
            return fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        events.setdefault(name, []).append((start, end))
        return out

    def step():
        worker.optimizer.zero_grad(set_to_none=True)
        loss, _ = region("forward + LM-head loss", lambda: worker.loss(batch))
        region("backward", loss.backward)
        region("clip + optimizer", worker.update)

    for _ in range(4):
        step()
    sync(device)
    events.clear()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    kernels = {}
    for evt in prof.key_averages():
        dev = getattr(evt, "self_device_time_total", 0) or 0
        if dev <= 0 or evt.device_type != torch.autograd.DeviceType.CUDA or "#" in evt.key \
                or getattr(evt, "is_user_annotation", False):  # ranges, not kernels
            continue
        k = kernels.setdefault(evt.key, [0.0, 0])
        k[0] += dev / 1e3 / steps
        k[1] += evt.count // steps
    total = sum(v[0] for v in kernels.values())
    by_cat = {}
    for name, (ms, _) in kernels.items():
        by_cat[category(name)] = by_cat.get(category(name), 0.0) + ms
    regions = {name: statistics.median(s.elapsed_time(e) for s, e in pairs)
               for name, pairs in events.items()}
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:10]
    results.add("profile", f"8b:{variant}", ms=wall_ms, kernel_ms=total,
                regions_ms=regions,
                categories={c: [round(ms, 2), round(100 * ms / total, 1)]
                            for c, ms in sorted(by_cat.items(), key=lambda kv: -kv[1])},
                top10=[[name[:90], round(ms, 2), round(100 * ms / total, 1), n]
                       for name, (ms, n) in top],
                note="categories/top10: [ms per step, % of the step's kernel time(, launches)]; "
                     "wall ms is under the profiler")
    worker = batch = prof = None
    free(device)


# ----------------------------------------------------------------------------- loss curves

def curve_batch(config, dcfg, embed, device, step: int, seed: int = 7, noise: float = 0.3):
    """Step `step`'s batch, the same for every variant: each row counts up by a stride from a
    random start, and a fraction `noise` of its tokens is replaced by random ones, so there is
    something to learn and a floor under the loss (a fresh batch each step: nothing to memorise);
    target features = the tokens' embeddings, per tap."""
    import dflash_model as dm
    import objective
    import training

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    seq, block = config.data.max_length, config.model.block_size
    taps = len(dcfg.dflash_config["target_layer_ids"])
    span = min(4096, dcfg.vocab_size - 1)
    start = int(torch.randint(0, span, (1,), generator=g))
    stride = int(torch.randint(1, 7, (1,), generator=g))
    input_ids = ((start + stride * torch.arange(seq)) % span)[None]
    swap = torch.rand(1, seq, generator=g) < noise
    input_ids = torch.where(swap, torch.randint(0, span, (1, seq), generator=g), input_ids)
    loss_mask = torch.ones(1, seq)
    anchors, keep = objective.sample_anchors(loss_mask, config.data.num_anchors, g)
    noise_ids, position_ids = objective.block_inputs(input_ids, anchors, keep, block,
                                                     dcfg.dflash_config["mask_token_id"])
    labels, valid = objective.block_labels(input_ids, loss_mask, anchors, keep, block)
    feats = embed[input_ids.to(device)].float() * 50.0
    hidden = torch.cat([feats * (1 + 0.1 * i) for i in range(taps)], dim=-1)
    anchors, keep = anchors.to(device), keep.to(device)
    build = dm.dense_dflash_mask if config.model.attention == "dense" else dm.flex_dflash_mask
    dtype = torch.bfloat16 if config.train.autocast else torch.float32
    return training.Batch(
        target_hidden=hidden.to(dtype), noise_ids=noise_ids.to(device),
        position_ids=position_ids.to(device), mask=build(anchors, keep, seq, block),
        labels=labels.to(device), valid=valid.to(device), num_blocks=anchors.shape[1],
        tokens=seq)


def run_curves(results, device, smoke, cache_dir, steps, shape_kind="8b", window=20,
               variants=("ours+all",), seeds=(0,)):
    """Each of `variants` against "ours" (every switch off): the same batches in the same order,
    the learning-rate schedule of a run of `steps` steps (warm-up 4%, cosine), for each seed.

    Seed k sets the drafter's initialisation (train.seed k), the stand-in target's embedding and
    head (3 + k) and the batches (7 + k); seed 0 is the one curve of the earlier calls. The gap is
    taken on the curves averaged over the seeds step by step (common.curve_gap), and per seed.
    Each finished curve is recorded at once (a killed run keeps the seeds it finished)."""
    curves: dict[str, list[list[float]]] = {}
    for seed in seeds:  # seed by seed: a run cut short keeps whole seeds, every variant of each
        for variant in ("ours", *variants):
            free(device)
            worker, _, _, config = our_worker(variant, shape_kind, device, smoke, cache_dir,
                                              seed=3 + seed,
                                              extra=[f"train.max_steps={steps}",
                                                     f"train.seed={seed}"])
            losses = []
            t0 = time.perf_counter()
            for i in range(steps):
                batch = curve_batch(config, worker.drafter.config, worker.embed_weight, device, i,
                                    seed=7 + seed)
                loss, _ = worker.forward_backward(batch)
                worker.update()
                losses.append(loss)
            curves.setdefault(variant, []).append(losses)
            seconds = time.perf_counter() - t0
            print(f"curve {variant} seed {seed}: {steps} steps in {seconds:.1f} s, loss "
                  f"{losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
            results.add("curve-run", f"{shape_kind}:{variant}:seed{seed}", steps=steps,
                        seconds=round(seconds, 1), losses=[round(x, 5) for x in losses])
            worker = batch = None
            free(device)
    where = "cpu" if device == "cpu" else "gpu"
    for variant in variants:
        gap = curve_gap(curves["ours"], curves[variant], window)
        per_seed = {f"seed{seed}": round(curve_gap([base], [fast], window)["max_abs_pct"], 3)
                    for seed, base, fast in zip(seeds, curves["ours"], curves[variant], strict=True)}
        results.add("curve", f"{shape_kind}:{where}:{variant}", steps=steps, seeds=list(seeds),
                    max_rel_diff_window_pct=gap["max_abs_pct"], signed_pct=gap["signed_pct"],
                    per_seed_max_pct=per_seed, windows=gap["windows"],
                    note=f"{window}-step means of the seeds' mean curve, {variant} vs every "
                         "switch off (on CPU: compile_layers off)")


# ----------------------------------------------------------------------------- main

def peers_section(results, args, device, cache_dir, ceiling) -> None:
    flops = None
    for variant in [v for v in args.ours.split(",") if v]:
        row = run_ours(results, variant, "8b", device, args.smoke, cache_dir, ceiling, args.iters)
        flops = flops or row.get("step_tflop", 0) * 1e12
    for variant in [v for v in args.peers.split(",") if v]:
        run_peer(results, variant, args.wheels, device, args.smoke, ceiling, flops or 1.0,
                 args.iters)
    try_speculators(results, args.wheels)


def print_profiles(results) -> None:
    for row in results.rows:
        if row["section"] == "profile" and "top10" in row:
            print(f"\nprofile {row['variant']}: {row['ms']:.1f} ms/step wall, kernels "
                  f"{row['kernel_ms']:.1f} ms; regions {row['regions_ms']}")
            for name, (ms, pct) in row["categories"].items():
                print(f"  {pct:5.1f}%  {ms:7.2f} ms  {name}")
            for name, ms, pct, n in row["top10"]:
                print(f"  top {pct:5.1f}%  {ms:7.2f} ms  x{n:<4d} {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--only", default="matmul,profile,peers,27b,curve")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--wheels", default=".whl", help="directory with the peers' wheels")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--ours", default=",".join(OURS), help="our variants, comma list")
    parser.add_argument("--ours-27b", default="ours,ours+all")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--profile-variants", default="ours")
    parser.add_argument("--curve-steps", type=int, default=300)
    parser.add_argument("--curve-variants", default="ours+all",
                        help="our variants whose curves are compared with ours (all off)")
    parser.add_argument("--curve-seeds", default="0",
                        help="seeds of the curves, comma list; the gap is taken on their mean")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda:0"
    if args.smoke:
        torch.set_num_threads(1)
    only = set(args.only.split(","))
    cache_dir = os.path.join(tempfile.mkdtemp(prefix="peers-"), "inductor")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    results = Results(args.out)
    results.path = os.path.join(args.out, "bench_peers.json") if args.out else None
    ceiling = None
    if "matmul" in only:
        from bench_gpu import matmul
        ceiling = matmul(results, device, args.smoke)
    if "profile" in only:
        for variant in [v for v in args.profile_variants.split(",") if v]:
            try:
                profile_ours(results, variant, device, args.smoke, cache_dir)
            except Exception as exc:
                failed(results, "profile", f"8b:{variant}", exc)
            free(device)
    if "peers" in only:
        peers_section(results, args, device, cache_dir, ceiling)
    if "threads" in only:
        try:
            run_threads(results, "ours+all", device, args.smoke, cache_dir)
        except Exception as exc:
            failed(results, "threads", "8b:ours+all", exc)
    if "27b" in only:
        for variant in [v for v in args.ours_27b.split(",") if v]:
            run_ours(results, variant, "27b", device, args.smoke, cache_dir, ceiling,
                     max(4, args.iters // 2))
    if "curve" in only:
        try:
            run_curves(results, device, args.smoke, cache_dir, args.curve_steps,
                       variants=[v for v in args.curve_variants.split(",") if v],
                       seeds=[int(v) for v in args.curve_seeds.split(",") if v])
        except Exception as exc:
            failed(results, "curve", "8b", exc)
    print_profiles(results)
    print("\n" + results.table(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
