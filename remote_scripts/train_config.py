"""Training configs: YAML -> frozen dataclasses, validated on load.

Unknown keys and bad values are refused with the file, the key and the reason. `--set a.b=value`
overrides are applied to the YAML tree before validation (the value is parsed as YAML, so
`--set train.lr=1e-3` is a float and `--set model.target_layer_ids=[1,3]` a list).
Relative paths in a config file are relative to the payload root (the directory of this file).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

PAYLOAD_ROOT = os.path.dirname(os.path.abspath(__file__))


class ConfigError(ValueError):
    """A bad config file, key, value or path. The message is one line."""


@dataclass(frozen=True)
class ModelConfig:
    num_draft_layers: int = 5
    block_size: int = 16
    target_layer_ids: Optional[list] = None    # default: spread over the target's layers
    mask_token_id: Optional[int] = None        # default: the tokenizer's mask token
    attention: str = "flex"                    # flex (GPU, production) | dense (CPU, reference)
    gradient_checkpointing: bool = False
    loss_gamma: Optional[float] = None         # slot-weight decay; default 7 for block 16
    drafter_overrides: dict = field(default_factory=dict)  # Qwen3Config fields, e.g. intermediate_size

    def __post_init__(self):
        _check(self.num_draft_layers >= 1, "model.num_draft_layers", "must be >= 1")
        _check(self.block_size >= 2, "model.block_size", "must be >= 2")
        _check(self.attention in ("flex", "dense"), "model.attention", "must be flex or dense")
        _check(self.loss_gamma is None or self.loss_gamma > 0, "model.loss_gamma", "must be > 0")

    @property
    def gamma(self) -> float:
        # 7 for block 16 as in the DFlash recipe; scaled with the block size otherwise.
        return self.loss_gamma if self.loss_gamma is not None else 7.0 * self.block_size / 16


@dataclass(frozen=True)
class TargetConfig:
    path: str = ""
    dtype: str = "bfloat16"

    def __post_init__(self):
        _check(bool(self.path), "target.path", "is required")
        _check(self.dtype in DTYPES, "target.dtype", f"must be one of {sorted(DTYPES)}")


@dataclass(frozen=True)
class DataConfig:
    train: str = ""
    heldout: Optional[str] = None
    max_length: int = 3072
    num_anchors: int = 512
    assistant_header: str = "<|im_start|>assistant\n"
    end_of_turn: str = "<|im_end|>"

    def __post_init__(self):
        _check(bool(self.train), "data.train", "is required")
        _check(self.max_length >= 4, "data.max_length", "must be >= 4")
        _check(self.num_anchors >= 1, "data.num_anchors", "must be >= 1")


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
    autocast: Optional[str] = None  # bfloat16 on GPUs; None = full precision
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    save_every: int = 500
    keep_last: int = 3
    # prepare step n+1's batches (target forward, anchors, masks) in a background thread while
    # the drafters train on step n; the same batches, in the same order, either way
    prefetch_target: bool = True

    def __post_init__(self):
        for name in ("batch_size", "max_steps", "log_every", "eval_every", "save_every",
                     "keep_last"):
            _check(getattr(self, name) >= 1, f"train.{name}", "must be >= 1")
        _check(self.lr > 0, "train.lr", "must be > 0")
        _check(0 <= self.warmup_ratio < 1, "train.warmup_ratio", "must be in [0, 1)")
        _check(self.autocast in (None, "bfloat16", "float16"), "train.autocast",
               "must be null, bfloat16 or float16")


@dataclass(frozen=True)
class CompileConfig:
    enabled: bool = False
    cache_dir: str = "~/.cache/dflash/inductor"
    recompile_limit: int = 64


@dataclass(frozen=True)
class DevicesConfig:
    target: str = "cpu"       # comma list: cuda:0,cuda:1 or cpu
    drafter: str = "cpu"      # one worker thread per entry: cuda:5,cuda:6,cuda:7 or cpu,cpu,cpu


@dataclass(frozen=True)
class Config:
    model: ModelConfig
    target: TargetConfig
    data: DataConfig
    train: TrainConfig
    compile: CompileConfig
    devices: DevicesConfig
    source: str = ""

    def to_dict(self) -> dict:
        tree = dataclasses.asdict(self)
        tree.pop("source")
        return tree


DTYPES = {"float32", "bfloat16", "float16"}
SECTIONS = {"model": ModelConfig, "target": TargetConfig, "data": DataConfig,
            "train": TrainConfig, "compile": CompileConfig, "devices": DevicesConfig}


def _check(ok: bool, key: str, reason: str):
    if not ok:
        raise ConfigError(f"{key}: {reason}")


def _build(cls, tree: dict, prefix: str):
    known = {f.name for f in dataclasses.fields(cls)}
    for key in tree:
        if key not in known:
            raise ConfigError(f"{prefix}{key}: unknown key (known: {', '.join(sorted(known))})")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in tree:
            continue
        value = tree[f.name]
        default = getattr(cls, f.name, None) if f.default is not dataclasses.MISSING else None
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ConfigError(f"{prefix}{f.name}: expected true/false, got {value!r}")
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            if isinstance(value, str):  # YAML 1.1 reads 5e-3 (no dot) as a string
                try:
                    value = float(value)
                except ValueError:
                    pass
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{prefix}{f.name}: expected a number, got {value!r}")
            value = type(default)(value) if isinstance(default, float) else value
            if isinstance(default, int) and not float(value).is_integer():
                raise ConfigError(f"{prefix}{f.name}: expected an integer, got {value!r}")
            value = int(value) if isinstance(default, int) else value
        if isinstance(default, str) and not isinstance(value, str):
            raise ConfigError(f"{prefix}{f.name}: expected a string, got {value!r}")
        values[f.name] = value
    return cls(**values)


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
        raise ConfigError(f"--set {key}: value is not valid YAML ({exc.problem})") from None


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


def resolve_path(path: str | None, base: str = PAYLOAD_ROOT) -> str | None:
    """Config paths: ~ expanded; relative ones are relative to the payload root."""
    if path is None:
        return None
    path = os.path.expanduser(path)
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(base, path))


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
