"""The pieces train_dflash.py and warmup_compile.py share: devices, compile, batches, workers.

One DrafterWorker per drafter device holds a full replica (drafter, optimizer, scheduler, frozen
copies of the target's embeddings and LM head). Workers run as threads of one process; batches
(target forward, anchors, masks) come from batch_feed.BatchFeed (a step ahead, in background
threads, during training); the main thread averages the gradients and runs evaluation and
warm-up. Every compiled call goes through compile_safety (one process-wide lock), whichever
thread makes it; `apply_compile` lists the compiled regions and installs them.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import random
import resource
from dataclasses import dataclass

import compile_safety
import dflash_model as dm
import fast_paths
import objective
import speed
import torch
import torch.nn.functional as F
from dflash_data import collate, load_examples
from train_config import CompileConfig, Config, ConfigError, resolve_path

log = logging.getLogger("dflash.train")


# ----------------------------------------------------------------------------- devices

def parse_devices(spec: str, key: str) -> list[str]:
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    if not devices:
        raise ConfigError(f"{key}: empty device list")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for device in devices:
        if device == "cpu":
            continue
        match = device.startswith("cuda:") and device[5:].isdigit()
        if not match:
            raise ConfigError(f"{key}: {device!r} is not a device (use cpu or cuda:N)")
        if int(device[5:]) >= count:
            raise ConfigError(f"{key}: {device} not available (this machine has {count} CUDA "
                              f"devices)")
    return devices


def configured_devices(config: Config) -> tuple[list[str], list[str]]:
    """(target devices, drafter devices) from the config, checked against this machine and the
    attention kind."""
    target_devices = parse_devices(config.devices.target, "devices.target")
    drafter_devices = parse_devices(config.devices.drafter, "devices.drafter")
    check_attention(config, drafter_devices)
    return target_devices, drafter_devices


def one_batch_of_examples(config: Config, tokenizer) -> list:
    """The training data's first train.batch_size examples: what a warm-up or `plan` steps on (only
    those are tokenized; every row is still read and checked)."""
    return load_examples(resolve_path(config.data.train), tokenizer, config.data.assistant_header,
                         config.data.end_of_turn, config.data.max_length, limit=config.train.batch_size)


def check_attention(config: Config, drafter_devices: list[str]) -> None:
    if config.model.attention == "flex" and "cpu" in drafter_devices:
        raise ConfigError("model.attention=flex on a cpu drafter: torch 2.13 has no flex_attention "
                          "backward on CPU; use --set model.attention=dense for CPU training")


def memory_gib(devices: list[str]) -> float:
    """Peak memory: the largest CUDA device's allocation, or the process's RSS on CPU."""
    cuda = sorted({d for d in devices if d.startswith("cuda")})
    if cuda:
        return max(torch.cuda.max_memory_allocated(d) for d in cuda) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# ----------------------------------------------------------------------------- attention / compile

def make_attention(kind: str, compiled: bool):
    """(attention_fn, mask_builder, description) for model.attention = `kind`; flex compiled or not."""
    if kind == "dense":
        return dm.dense_attention, dm.dense_dflash_mask, "dense reference attention (no compile)"
    if compiled:
        flex = compile_safety.compiled_flex_attention()
        what = "compiled flex_attention (every call under COMPILE_LOCK)"
    else:
        from torch.nn.attention.flex_attention import flex_attention as flex
        what = "UNCOMPILED flex_attention (materializes the score matrix: debug only)"
    return dm.make_flex_attention(flex), dm.flex_dflash_mask, what


def configure_compile(settings: CompileConfig, kernel_options: dict | None = None) -> None:
    """compile_safety's process-wide settings from the config's compile section."""
    compile_safety.configure_compile(cache_dir=resolve_path(settings.cache_dir),
                                     recompile_limit=settings.recompile_limit,
                                     enabled=settings.enabled, kernel_options=kernel_options)


def apply_compile(settings: CompileConfig, fast: bool, target, drafters: Drafters) -> str:
    """Compile settings, then the compiled regions, in the order a step runs them:

    1. the target's decoder layers up to the last tap (every replica; CUDA fast path only),
    2. the drafter's flex_attention (one process-wide wrapper; compile.enabled, model.attention=flex),
       installed in every worker; with speed.compile_layers (CUDA), each worker's draft layers
       instead, flex_attention traced inside their graph,
    3. the LM-head loss chunk of fast_paths.lm_head_loss (runs compiled on CUDA only).
    `fast` is train.fast_paths: off, the flex kernels keep torch's options and regions 1 and 3 are
    not compiled. torch.compile is lazy: each region compiles on its first call, which warm_up makes
    in the main thread. Every call of every region holds compile_safety.COMPILE_LOCK. Returns what
    was compiled, for the log.
    """
    head_dim = drafters.template.config.head_dim
    kernel_options = fast_paths.flex_kernel_options(head_dim) if fast else None
    configure_compile(settings, kernel_options)
    layers = target.compile_layers()
    attention, build_mask, description = make_attention(drafters.attention_kind, settings.enabled)
    drafters.use_attention(attention, build_mask)
    draft_layers = speed.compile_layers(drafters.workers, kernel_options)
    heads = fast_paths.compile_lm_head_loss() if fast else 0
    if layers or heads or draft_layers:
        description += (f"; compiled: {layers} target layer(s) per replica, {heads} LM-head "
                        f"region(s), {draft_layers} draft layer(s) per worker (speed.compile_layers)")
    return description + ("" if fast else "; fast paths off (train.fast_paths=false)")


# ----------------------------------------------------------------------------- batches

@dataclass
class Batch:
    target_hidden: torch.Tensor
    noise_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: object              # dense bool tensor or flex BlockMask
    labels: torch.Tensor
    valid: torch.Tensor
    num_blocks: int
    tokens: int               # real (non-pad) tokens, for throughput


def anchor_generator(seed: int, step: int, worker: int) -> torch.Generator:
    """Anchors depend only on (seed, step, worker): a resumed run draws the same ones."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 131 + worker)


def prepare_batch(examples, config: Config, target, device: str, mask_token_id: int,
                  build_mask, generator: torch.Generator, replica: int = 0) -> Batch:
    input_ids, attention, loss_mask = collate(examples, config.data.max_length, pad_id=0)
    anchors, keep = objective.sample_anchors(loss_mask, config.data.num_anchors, generator)
    target_hidden = target.context_features(input_ids, attention, device, replica)
    return anchored_batch(config, input_ids, loss_mask, anchors, keep, target_hidden, device,
                          mask_token_id, build_mask, int(attention.sum()))


def anchored_batch(config: Config, input_ids, loss_mask, anchors, keep, target_hidden,
                   device: str, mask_token_id: int, build_mask, tokens: int = 0) -> Batch:
    """The blocks at `anchors` ([B, N], `keep` marking the real ones) over features already made."""
    block_size, max_length = config.model.block_size, config.data.max_length
    noise_ids, position_ids = objective.block_inputs(input_ids, anchors, keep, block_size, mask_token_id)
    labels, valid = objective.block_labels(input_ids, loss_mask, anchors, keep, block_size)
    anchors, keep = anchors.to(device), keep.to(device)
    return Batch(target_hidden=target_hidden, noise_ids=noise_ids.to(device),
                 position_ids=position_ids.to(device),
                 mask=build_mask(anchors, keep, max_length, block_size),
                 labels=labels.to(device), valid=valid.to(device),
                 num_blocks=anchors.shape[1], tokens=tokens)


@dataclass
class WalkSet:
    """Held-out conversations with their features, for decode_walk: every anchor, evaluated in
    chunks of the training's shape (objective.every_anchor) when the evaluation runs."""
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    target_hidden: torch.Tensor


def walk_set(examples, config: Config, batch: Batch) -> WalkSet:
    """`examples` for decode_walk, with the features `batch` (a batch of the same examples)
    already holds."""
    input_ids, _, loss_mask = collate(examples, config.data.max_length, pad_id=0)
    return WalkSet(input_ids, loss_mask, batch.target_hidden)


def held_out_walk(worker, walk: WalkSet, mask_token_id: int, build_mask) -> tuple[int, int]:
    """(tokens, steps) of greedy speculative decoding over `walk`'s answers with `worker`'s
    drafter (objective.decode_walk): the run of a block at every anchor, then the walk."""
    runs = torch.full(walk.loss_mask.shape, -1, dtype=torch.long)
    for anchors, keep in objective.every_anchor(walk.loss_mask, worker.config.data.num_anchors):
        batch = anchored_batch(worker.config, walk.input_ids, walk.loss_mask, anchors, keep,
                               walk.target_hidden, worker.device, mask_token_id, build_mask)
        _, stats = worker.evaluate(batch, runs=True)
        rows, columns = keep.nonzero(as_tuple=True)
        runs[rows, anchors[rows, columns]] = torch.tensor(stats["runs"])[rows, columns]
    return objective.decode_walk(runs, walk.loss_mask)


def worker_batch(config: Config, target, drafters, worker, examples,
                 generator: torch.Generator) -> Batch:
    """prepare_batch for one drafter worker: on its device, from the target replica serving it."""
    return prepare_batch(examples, config, target, worker.device, drafters.mask_token_id,
                         drafters.build_mask, generator, target.replica_for(worker.index))


# ----------------------------------------------------------------------------- workers

def lr_lambda(config: Config):
    total = config.train.max_steps
    warmup = max(1, int(config.train.warmup_ratio * total))
    floor = config.train.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


class DrafterWorker:
    """One data-parallel replica on one drafter device."""

    def __init__(self, index: int, device: str, template: dm.DFlashDrafter, config: Config,
                 embed_weight: torch.Tensor, head_weight: torch.Tensor, attention):
        self.index, self.device, self.config = index, device, config
        self.drafter = copy.deepcopy(template).to(device)
        self.drafter.train()
        frozen_dtype = _autocast_dtype(config) or torch.float32
        self.embed_weight = embed_weight.detach().to(device, frozen_dtype)
        self.head_weight = (self.embed_weight if head_weight.data_ptr() == embed_weight.data_ptr()
                            else head_weight.detach().to(device, frozen_dtype))
        self.fp8_head = speed.fp8_head(self.head_weight, config)
        self.attention = attention
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = speed.make_optimizer(self.drafter, self.params, config)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))

    def _autocast(self):
        dtype = _autocast_dtype(self.config)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.device).type, dtype=dtype)

    def loss(self, batch: Batch, runs: bool = False):
        with self._autocast():
            noise = F.embedding(batch.noise_ids, self.embed_weight)
            hidden = self.drafter(batch.target_hidden, noise, batch.position_ids, batch.mask,
                                  self.attention)
            if not self.config.train.fast_paths:  # the reference path: [B*N*bs, V] logits
                logits = objective.draft_logits(hidden, self.head_weight, batch.num_blocks,
                                         self.config.model.block_size)
                return objective.dflash_loss(logits, batch.labels, batch.valid,
                                             self.config.model.gamma, runs)
        return fast_paths.lm_head_loss(hidden, self.head_weight, batch.labels, batch.valid,
                                       self.config.model.gamma, fp8=self.fp8_head, runs=runs)

    def forward_backward(self, batch: Batch) -> tuple[float, dict]:
        """Training forward + backward (grad enabled); gradients left in .grad."""
        compile_safety.apply_thread_settings()  # torch 2.13 keeps dynamo settings per thread
        self.drafter.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss, stats = self.loss(batch)
        loss.backward()
        return loss.item(), stats

    def update(self) -> None:
        compile_safety.apply_thread_settings()
        torch.nn.utils.clip_grad_norm_(speed.grad_params(self.optimizer, self.params),
                                       self.config.train.grad_clip)
        self.optimizer.step()
        self.scheduler.step()

    @torch.no_grad()
    def evaluate(self, batch: Batch, runs: bool = False) -> tuple[float, dict]:
        self.drafter.eval()
        try:
            loss, stats = self.loss(batch, runs)
        finally:
            self.drafter.train()
        return loss.item(), stats


def _autocast_dtype(config: Config):
    return {None: None, "bfloat16": torch.bfloat16, "float16": torch.float16}[config.train.autocast]


def feature_dtype(config: Config) -> torch.dtype | None:
    """The dtype the drafter reads the target's features in: under autocast its first layer (fc,
    a Linear) casts them to the autocast dtype, so features made in that dtype on the target's
    device change no bit of the training and take half the memory, copies and feature cache of a
    float32 target's (test_speed). None (the target's own dtype) without autocast."""
    return _autocast_dtype(config)


@torch.no_grad()
def average_gradients(workers: list[DrafterWorker]) -> None:
    """Every replica gets the mean gradient (same bits everywhere: one sum, copied out)."""
    if len(workers) == 1:
        return
    for params in zip(*(w.params for w in workers), strict=True):
        grads = [p.grad for p in params]
        total = grads[0].clone()
        for grad in grads[1:]:
            total += grad.to(total.device, non_blocking=True)
        total /= len(grads)
        for grad in grads:
            grad.copy_(total, non_blocking=True)


@torch.no_grad()
def replica_max_diff(workers: list[DrafterWorker]) -> float:
    first = workers[0].drafter.state_dict()
    worst = 0.0
    for worker in workers[1:]:
        for name, tensor in worker.drafter.state_dict().items():
            diff = (tensor.to(first[name].device) - first[name]).abs().max().item()
            worst = max(worst, diff)
    return worst


def target_layer_ids(config: Config, target_config) -> list[int]:
    """The target layers the drafter reads: model.target_layer_ids, else drafter_overrides',
    else spread over the target's layers as DFlash does. Known before the target loads."""
    layers = dm.text_config(target_config).num_hidden_layers
    ids = config.model.target_layer_ids
    if ids is None:
        ids = config.model.drafter_overrides.get("target_layer_ids")
    if ids is None:
        return dm.build_target_layer_ids(layers, config.model.num_draft_layers)
    if not all(isinstance(i, int) and 0 <= i < layers for i in ids):
        raise ConfigError(f"model.target_layer_ids: {list(ids)} out of range for a "
                          f"{layers}-layer target")
    return list(ids)


def build_drafter_template(config: Config, target_config, mask_token_id: int,
                           layer_ids: list[int], device: str = "cpu") -> dm.DFlashDrafter:
    """One initialisation (seeded) that every worker copies: replicas start identical.

    Built on `device`: the first drafter GPU in training, where initialising and copying a
    1B-parameter drafter takes a fraction of the seconds it takes on the CPU.
    """
    overrides = dict(config.model.drafter_overrides, target_layer_ids=list(layer_ids))
    drafter_config = dm.create_drafter_config(
        config.model.num_draft_layers, target_config, block_size=config.model.block_size,
        mask_token_id=mask_token_id, **overrides)
    torch.manual_seed(config.train.seed)
    with torch.device(device):
        return dm.DFlashDrafter(drafter_config, config.model.gradient_checkpointing)


def resolve_mask_token_id(config: Config, tokenizer, vocab_size: int) -> int:
    if config.model.mask_token_id is not None:
        token = config.model.mask_token_id
    elif tokenizer.mask_token_id is not None:
        token = tokenizer.mask_token_id
    elif len(tokenizer) < vocab_size:
        token = len(tokenizer)  # an unused embedding row, as DFlash's Qwen3 drafters do
    else:
        raise ConfigError("model.mask_token_id: the tokenizer has no mask token and no spare "
                          "embedding row; set model.mask_token_id")
    if not 0 <= token < vocab_size:
        raise ConfigError(f"model.mask_token_id: {token} outside the target vocab ({vocab_size})")
    return int(token)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def warm_up(workers: list[DrafterWorker], make_batch) -> dict:
    """Run every shape the workers will see, on each drafter device in turn, in the main thread.

    Training forward+backward with grad (the graph training needs; the incident's warm-up ran
    under no_grad, which compiles a different one) and evaluation without grad. Gradients are
    dropped afterwards: the replicas are unchanged.
    """
    shapes = [(kind, w.index) for w in workers for kind in ("train", "eval")]

    def step(shape):
        kind, index = shape
        worker = workers[index]
        batch = make_batch(worker)
        if kind == "train":
            worker.forward_backward(batch)
            worker.optimizer.zero_grad(set_to_none=True)
        else:
            worker.evaluate(batch)

    return compile_safety.warm_shapes(step, shapes)


@dataclass
class Drafters:
    workers: list
    template: dm.DFlashDrafter
    mask_token_id: int
    attention_kind: str       # model.attention: flex | dense
    build_mask: object        # the mask builder of the workers' attention

    def use_attention(self, attention, build_mask) -> None:
        """Every worker attends with `attention`; batches get masks from `build_mask`."""
        for worker in self.workers:
            worker.attention = attention
        self.build_mask = build_mask


def build_drafters(config: Config, target, tokenizer, drafter_devices: list[str]) -> Drafters:
    """Drafter config from the target, one seeded init, one worker per device (uncompiled
    attention until apply_compile)."""
    vocab_size = dm.text_config(target.config).vocab_size
    mask_token_id = resolve_mask_token_id(config, tokenizer, vocab_size)
    init_device = drafter_devices[0] if drafter_devices[0].startswith("cuda") else "cpu"
    template = build_drafter_template(config, target.config, mask_token_id, target.layer_ids,
                                      init_device)
    attention, build_mask, _ = make_attention(config.model.attention, compiled=False)
    workers = [DrafterWorker(i, device, template, config, target.embed_weight,
                             target.lm_head_weight, attention)
               for i, device in enumerate(drafter_devices)]
    log.info("drafter: %d layers, %.1fM parameters, taps %s, block %d, mask token %d; %d worker(s)",
             template.config.num_hidden_layers, dm.parameter_count(template) / 1e6,
             template.target_layer_ids, config.model.block_size, mask_token_id, len(workers))
    # worker 0's replica stands for the template from here: the template itself (on the first
    # drafter GPU in training) would otherwise hold a second copy of the weights there
    return Drafters(workers, workers[0].drafter, mask_token_id, config.model.attention, build_mask)
