"""The frozen target: loaded from a checkpoint directory, placed over the target devices.

Layers are split into contiguous chunks over the devices (pipeline placement, no accelerate):
the embeddings sit on the first device, the decoder layers on their chunk's device, the rest
(final norm, LM head) on the last one; a forward pre-hook moves each placed module's inputs to
its device. `context_features` returns the tapped hidden states, concatenated, on the device the
caller asks for.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TargetLoadError(RuntimeError):
    pass


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise TargetLoadError(f"target checkpoint directory not found: {path}")
    with _load_errors(path, "tokenizer"):
        return AutoTokenizer.from_pretrained(path)


@contextlib.contextmanager
def _load_errors(path: str, what: str):
    """transformers' loading errors (missing files, bad json) as one-line TargetLoadErrors."""
    try:
        yield
    except (OSError, ValueError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise TargetLoadError(f"cannot load the target {what} from {path}: {first}") from None


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _move_inputs_hook(device):
    def hook(module, args, kwargs):
        return _to(args, device), _to(kwargs, device)
    return hook


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The longest ModuleList in the model: the decoder layers, whatever the architecture."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise TargetLoadError("target model has no ModuleList of decoder layers")
    return max(lists, key=len)


def place(model: nn.Module, devices: list[str]) -> None:
    """Move the model onto one device, or split its decoder layers over several."""
    if len(devices) == 1:
        model.to(devices[0])
        return
    layers = decoder_layers(model)
    model.to(devices[-1])
    model.get_input_embeddings().to(devices[0])
    per_device = -(-len(layers) // len(devices))
    for index, layer in enumerate(layers):
        device = devices[index // per_device]
        layer.to(device)
        layer.register_forward_pre_hook(_move_inputs_hook(device), with_kwargs=True)
    placed = {id(m) for m in layers.modules()} | {id(model.get_input_embeddings())}
    for module in model.modules():  # final norm, head, rotary: inputs to the last device
        if id(module) not in placed and not list(module.children()):
            module.register_forward_pre_hook(_move_inputs_hook(devices[-1]), with_kwargs=True)


class Target:
    """A frozen causal LM that yields DFlash context features."""

    def __init__(self, path: str, devices: list[str], dtype: str, layer_ids: list[int] | None = None):
        from transformers import AutoConfig, AutoModelForCausalLM

        if not os.path.isdir(path):
            raise TargetLoadError(f"target checkpoint directory not found: {path}")
        self.path = path
        with _load_errors(path, "model"):
            self.config = AutoConfig.from_pretrained(path)
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
        self.model.requires_grad_(False).eval()
        place(self.model, devices)
        self.devices = devices
        self.layer_ids = layer_ids

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @torch.no_grad()
    def context_features(self, input_ids, attention_mask, out_device) -> torch.Tensor:
        """hidden_states[layer_id + 1] for each tapped layer, concatenated -> [B, S, n*H]."""
        out = self.model(input_ids=input_ids.to(self.devices[0]),
                         attention_mask=attention_mask.to(self.devices[0]),
                         output_hidden_states=True, use_cache=False, logits_to_keep=1)
        taps = [out.hidden_states[i + 1].to(out_device) for i in self.layer_ids]
        return torch.cat(taps, dim=-1)


class ShapeOnlyTarget:
    """The target's shapes and dtype without its weights: random features, random embeddings.

    warmup_compile.py uses it: compiled graphs depend on shapes and dtypes only, so the warm-up
    need not load a 27B checkpoint to fill the compile cache that training then reads.
    """

    def __init__(self, path: str, dtype: str, layer_ids: list[int]):
        from transformers import AutoConfig

        if not os.path.isdir(path):
            raise TargetLoadError(f"target checkpoint directory not found: {path}")
        self.path = path
        with _load_errors(path, "config"):
            self.config = AutoConfig.from_pretrained(path)
        text = getattr(self.config, "text_config", None) or self.config
        self.hidden_size, self.dtype = text.hidden_size, DTYPES[dtype]
        self.layer_ids = layer_ids
        self._weight = torch.empty(text.vocab_size, text.hidden_size, dtype=self.dtype)
        self._weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))

    @property
    def embed_weight(self) -> torch.Tensor:
        return self._weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self._weight

    def context_features(self, input_ids, attention_mask, out_device) -> torch.Tensor:
        batch, seq = input_ids.shape
        return torch.randn(batch, seq, len(self.layer_ids) * self.hidden_size,
                           dtype=self.dtype, device=out_device)
