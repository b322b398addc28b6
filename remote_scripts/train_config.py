"""Training configs: YAML -> frozen dataclasses, validated on load.

Unknown keys and bad values are refused with the file, the key and the reason. `--set a.b=value`
overrides are applied to the YAML tree before validation (the value is parsed as YAML, so
`--set train.lr=1e-3` is a float and `--set model.target_layer_ids=[1,3]` a list).
Relative paths in a config file are relative to the payload root (the directory of this file).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

PAYLOAD_ROOT = os.path.dirname(os.path.abspath(__file__))


class ConfigError(ValueError):
    """A bad config file, key, value or path. The message is one line."""


@dataclass(frozen=True)
class ModelConfig:
    num_draft_layers: int = 5
    block_size: int = 16
    target_layer_ids: list | None = None    # default: spread over the target's layers
    mask_token_id: int | None = None        # default: the tokenizer's mask token
    attention: str = "flex"                    # flex (GPU, production) | dense (CPU, reference)
    gradient_checkpointing: bool = False
    loss_gamma: float | None = None         # slot-weight decay; default 7 for block 16
    drafter_overrides: dict = field(default_factory=dict)  # Qwen3Config fields, e.g. intermediate_size

    def __post_init__(self):
        _check_types(self, "model")
        _check(self.num_draft_layers >= 1, "model.num_draft_layers", "must be >= 1")
        _check(self.block_size >= 2, "model.block_size", "must be >= 2")
        ids = self.target_layer_ids
        _check(ids is None or (ids and all(_is_int(i) and i >= 0 for i in ids) and len(set(ids)) == len(ids)),
               "model.target_layer_ids", "must be null or a non-empty list of distinct layer indices >= 0")
        _check(self.mask_token_id is None or self.mask_token_id >= 0, "model.mask_token_id", "must be >= 0")
        _check(self.attention in ("flex", "dense"), "model.attention", "must be flex or dense")
        _check(self.loss_gamma is None or self.loss_gamma > 0, "model.loss_gamma", "must be > 0")
        _check(all(isinstance(k, str) and k.isidentifier() for k in self.drafter_overrides),
               "model.drafter_overrides", "keys must be Qwen3Config field names")

    @property
    def gamma(self) -> float:
        # 7 for block 16 as in the DFlash recipe; scaled with the block size otherwise.
        return self.loss_gamma if self.loss_gamma is not None else 7.0 * self.block_size / 16


@dataclass(frozen=True)
class TargetConfig:
    path: str = ""
    dtype: str = "bfloat16"
    # over several target devices: split (layers in chunks, one copy), replicate (one full copy
    # per device, the drafters' batches spread over them) or auto (replicate when it fits)
    placement: str = "split"
    # keep each conversation's features after its first target forward, up to this many GiB in
    # host memory (0: off): for targets on few cores, where the forward costs more than the step
    feature_cache_gib: float = 0.0

    def __post_init__(self):
        _check_types(self, "target")
        _check(self.feature_cache_gib >= 0, "target.feature_cache_gib", "must be >= 0")
        _check(bool(self.path), "target.path", "is required")
        _check(self.dtype in DTYPE_NAMES, "target.dtype", f"must be one of {sorted(DTYPE_NAMES)}")
        _check(self.placement in PLACEMENTS, "target.placement",
               f"must be one of {', '.join(PLACEMENTS)}")


@dataclass(frozen=True)
class DataConfig:
    train: str = ""
    heldout: str | None = None
    max_length: int = 3072
    num_anchors: int = 512
    assistant_header: str = "<|im_start|>assistant\n"
    end_of_turn: str = "<|im_end|>"
    max_bad_fraction: float = 0.05    # more unusable rows than this stops the run
    # true: refuse data whose assistant turns were not written by this target (teacher-forced
    # acceptance on someone else's answers says little about real speculative decoding)
    require_target_answers: bool = False
    # where tokenized data is kept between launches (dflash_data.load_examples); null: tokenize every time
    cache_dir: str | None = "~/.cache/dflash/data"

    def __post_init__(self):
        _check_types(self, "data")
        _check(bool(self.train), "data.train", "is required")
        _check(0 <= self.max_bad_fraction < 1, "data.max_bad_fraction", "must be in [0, 1)")
        _check(self.heldout is None or bool(self.heldout), "data.heldout", "must be null or a path")
        _check(self.cache_dir is None or bool(self.cache_dir), "data.cache_dir", "must be null or a path")
        _check(self.max_length >= 4, "data.max_length", "must be >= 4")
        _check(self.num_anchors >= 1, "data.num_anchors", "must be >= 1")
        for name in ("assistant_header", "end_of_turn"):
            _check(bool(getattr(self, name)), f"data.{name}", "must not be empty")


@dataclass(frozen=True)
class TrainConfig:
    run_dir: str = "runs/default"
    seed: int = 0
    batch_size: int = 1            # per drafter worker
    max_steps: int = 1000          # length of the LR schedule (and the default stop)
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    autocast: str | None = None  # bfloat16 on GPUs; None = full precision
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    save_every: int = 500
    keep_last: int = 3
    # prepare step n+1's batches (target forward, anchors, masks) in a background thread while
    # the drafters train on step n; the same batches, in the same order, either way
    prefetch_target: bool = True
    # the GPU-speed paths of fast_paths.py (chunked LM-head loss, fused AdamW, tuned flex kernels,
    # the target's maskless forward and compiled layers); false: the reference paths, same results
    fast_paths: bool = True
    # a drafter checkpoint directory (config.json + model.safetensors: a run's checkpoints/step-N,
    # or any dflash drafter of this shape) whose weights a new run starts from, with a fresh
    # optimizer and schedule; a run that has a checkpoint of its own resumes from that instead
    init_from: str = ""

    def __post_init__(self):
        _check_types(self, "train")
        _check(bool(self.run_dir), "train.run_dir", "must not be empty")
        _check(0 <= self.seed < 2**32, "train.seed", "must be in [0, 2**32)")
        for name in ("batch_size", "max_steps", "log_every", "eval_every", "eval_batches", "save_every",
                     "keep_last"):
            _check(getattr(self, name) >= 1, f"train.{name}", "must be >= 1")
        _check(self.lr > 0, "train.lr", "must be > 0")
        _check(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]")
        _check(0 <= self.warmup_ratio < 1, "train.warmup_ratio", "must be in [0, 1)")
        _check(self.weight_decay >= 0, "train.weight_decay", "must be >= 0")
        _check(self.grad_clip > 0, "train.grad_clip", "must be > 0")
        _check(self.autocast in (None, "bfloat16", "float16"), "train.autocast",
               "must be null, bfloat16 or float16")


@dataclass(frozen=True)
class CompileConfig:
    enabled: bool = False
    cache_dir: str = "~/.cache/dflash/inductor"
    recompile_limit: int = 64

    def __post_init__(self):
        _check_types(self, "compile")
        _check(bool(self.cache_dir), "compile.cache_dir", "must not be empty")
        _check(self.recompile_limit >= 1, "compile.recompile_limit", "must be >= 1")


@dataclass(frozen=True)
class SpeedConfig:
    """Speed switches of the drafter step (remote_scripts/speed.py says what each one does)."""
    compile_layers: bool = False     # torch.compile each draft layer (CUDA, compile.enabled, flex)
    param_dtype: str = "float32"     # bfloat16: bf16 parameters, fp32 master weights in AdamW
    fp8_lm_head: bool = False        # the frozen LM head's logits in e4m3 (row-scaled)

    def __post_init__(self):
        _check_types(self, "speed")
        _check(self.param_dtype in ("float32", "bfloat16"), "speed.param_dtype",
               "must be float32 or bfloat16")


@dataclass(frozen=True)
class DevicesConfig:
    target: str = "cpu"       # comma list: cuda:0,cuda:1 or cpu
    drafter: str = "cpu"      # one worker thread per entry: cuda:5,cuda:6,cuda:7 or cpu,cpu,cpu

    def __post_init__(self):
        _check_types(self, "devices")
        for name in ("target", "drafter"):
            devices = [d.strip() for d in getattr(self, name).split(",") if d.strip()]
            _check(bool(devices), f"devices.{name}", "empty device list")
            for device in devices:
                _check(DEVICE.fullmatch(device), f"devices.{name}",
                       f"{device!r} is not a device (use cpu or cuda:N)")


@dataclass(frozen=True)
class Config:
    model: ModelConfig
    target: TargetConfig
    data: DataConfig
    train: TrainConfig
    compile: CompileConfig
    devices: DevicesConfig
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    source: str = ""

    def __post_init__(self):
        _check(self.speed.param_dtype == "float32" or self.train.autocast == self.speed.param_dtype,
               "speed.param_dtype", "bfloat16 parameters need train.autocast: bfloat16")

    def to_dict(self) -> dict:
        tree = dataclasses.asdict(self)
        tree.pop("source")
        return tree


DTYPE_NAMES = ("float32", "bfloat16", "float16")  # target_model.DTYPES maps them to torch dtypes
PLACEMENTS = ("split", "replicate", "auto")
DEVICE = re.compile(r"cpu|cuda:[0-9]+")
SECTIONS = {"model": ModelConfig, "target": TargetConfig, "data": DataConfig,
            "train": TrainConfig, "compile": CompileConfig, "devices": DevicesConfig,
            "speed": SpeedConfig}


def _check(ok: bool, key: str, reason: str):
    if not ok:
        raise ConfigError(f"{key}: {reason}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _typed(key: str, value, kind):
    """`value` as the field's type (YAML gives 5 for 5.0 and, in YAML 1.1, a string for 5e-3), or
    ConfigError naming the key."""
    shown = repr(value)[:80]
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # Optional[X]
        return None if value is None else _typed(key, value, typing.get_args(kind)[0])
    if kind is bool:
        _check(isinstance(value, bool), key, f"expected true/false, got {shown}")
        return value
    if kind in (int, float):
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        expected = f"expected {'an integer' if kind is int else 'a number'}, got {shown}"
        _check(_is_int(value) or (isinstance(value, float) and math.isfinite(value)), key, expected)
        _check(kind is float or _is_int(value) or value.is_integer(), key, expected)
        return kind(value)
    names = {str: "a string", list: "a list", dict: "a mapping"}
    _check(isinstance(value, kind), key, f"expected {names[kind]}, got {shown}")
    return value


def _check_types(section, prefix: str) -> None:
    """Every field of a frozen config section checked (and converted) against its annotation."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value = _typed(f"{prefix}.{f.name}", getattr(section, f.name), hints[f.name])
        object.__setattr__(section, f.name, value)


def _build(cls, tree: dict, prefix: str):
    known = {f.name for f in dataclasses.fields(cls)}
    for key in tree:
        if key not in known:
            raise ConfigError(f"{prefix}{key}: unknown key (known: {', '.join(sorted(known))})")
    return cls(**tree)


def apply_override(tree: dict, assignment: str) -> None:
    """Apply one `a.b=value` to the YAML tree (value parsed as YAML)."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment}: expected key=value, e.g. train.lr=1e-4")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {part} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        why = getattr(exc, "problem", None) or str(exc).replace("\n", " ")  # a ReaderError has no .problem
        raise ConfigError(f"--set {key}: value is not valid YAML ({why})") from None


def config_from_tree(tree: dict, source: str = "<config>") -> Config:
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: top level must be a mapping of sections")
    for key in tree:
        if key not in SECTIONS:
            raise ConfigError(f"{source}: {key}: unknown section (known: {', '.join(SECTIONS)})")
    try:
        sections = {}
        for name, cls in SECTIONS.items():
            subtree = tree.get(name) or {}
            if not isinstance(subtree, dict):
                raise ConfigError(f"{name}: must be a mapping")
            sections[name] = _build(cls, subtree, f"{name}.")
        return Config(source=source, **sections)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except TypeError as exc:  # a required field missing
        raise ConfigError(f"{source}: {exc}") from None


def load_config(path: str, overrides: list[str] = (), cli: dict[str, Any] | None = None) -> Config:
    """Read a YAML config, apply --set overrides and CLI flags ({'devices.target': ...})."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: config file not found")
    with open(path) as f:
        try:
            tree = yaml.safe_load(f) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({exc})".replace("\n", " ")) from None
    for assignment in overrides:
        apply_override(tree, assignment)
    for key, value in (cli or {}).items():
        if value is not None:
            section, name = key.split(".")
            tree.setdefault(section, {})[name] = value
    return config_from_tree(tree, source=path)


def cli_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of train_dflash.py, shared by warmup_compile.py and preflight.py."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set train.lr=1e-4 (repeatable)")
    parser.add_argument("--target-devices", help="e.g. cuda:0,cuda:1,cuda:2 or cpu")
    parser.add_argument("--drafter-devices", help="one worker per entry, e.g. cuda:5,cuda:6 or cpu,cpu")
    parser.add_argument("--run-dir", help="run directory (default: train.run_dir)")
    parser.add_argument("--max-steps", type=int, help="stop at this step; past train.max_steps it also "
                        "lengthens the LR schedule to it (a finished run continued)")
    return parser


def config_from_args(args) -> Config:
    config = load_config(args.config, args.set, {
        "devices.target": args.target_devices, "devices.drafter": args.drafter_devices,
        "train.run_dir": os.path.abspath(args.run_dir) if args.run_dir else None})
    return with_schedule_to(config, args.max_steps)


def with_schedule_to(config: Config, max_steps: int | None) -> Config:
    """--max-steps past train.max_steps (a finished run continued) lengthens the LR schedule to it:
    train.max_steps becomes max_steps, and config.yaml records it. Shorter, the schedule stays."""
    if not max_steps or max_steps <= config.train.max_steps:
        return config
    return dataclasses.replace(config, train=dataclasses.replace(config.train, max_steps=max_steps))


def stop_step(config: Config, max_steps: int | None) -> int:
    """The step a run stops at: --max-steps, else train.max_steps."""
    return max_steps or config.train.max_steps


def setup_logging(run_dir: str | None) -> None:
    """INFO lines on stdout, and in RUN/train.log when there is a run directory."""
    handlers = [logging.StreamHandler(sys.stdout)]
    if run_dir:
        handlers.append(logging.FileHandler(os.path.join(run_dir, "train.log")))
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")


def resolve_path(path: str | None, base: str = PAYLOAD_ROOT) -> str | None:
    """Config paths: ~ expanded; relative ones are relative to the payload root."""
    if path is None:
        return None
    path = os.path.expanduser(path)
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(base, path))


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
