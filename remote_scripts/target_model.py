"""The frozen target: loaded from a checkpoint directory, placed over the target devices.

Layers are split into contiguous chunks over the devices (pipeline placement, no accelerate):
the embeddings sit on the first device, the decoder layers on their chunk's device, the rest
(final norm, LM head) on the last one; a forward pre-hook moves each placed module's inputs to
its device. `context_features` returns the tapped hidden states, concatenated, on the device the
caller asks for.

Fast path (fast_paths.ENABLED, the default): for right-padded batches (dflash_data.collate) the
features come from fast_paths.target_features (no padding mask, no layers after the last tap),
and on CUDA with compile enabled each decoder layer up to the last tap is compiled once, behind
compile_safety's lock like every compiled call (bench/RESULTS.md: 54.6% -> 83.7% MFU at the
Qwen3-8B shape). `reference_features` is the plain transformers path, kept for comparison.
`warm_compiled_layers` fills the compile cache with the target's layer graph without loading its
weights, for warmup_compile.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch
from torch import nn

import compile_safety
import fast_paths

log = logging.getLogger("dflash.train")

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
        self.compiled_layers = 0  # decoder layers compiled so far (CUDA fast path only)

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @torch.no_grad()
    def context_features(self, input_ids, attention_mask, out_device) -> torch.Tensor:
        """hidden_states[layer_id + 1] for each tapped layer, concatenated -> [B, S, n*H].

        Exact for every real token; pad positions may differ from `reference_features` on the
        fast path, and nothing reads them (anchors are real tokens, a block sees context strictly
        before its anchor).
        """
        if not (has_fast_path(self.model) and right_padded(attention_mask)):
            return self.reference_features(input_ids, attention_mask, out_device)
        first = self._compile_layers()
        started = time.perf_counter()
        features = fast_paths.target_features(self.model, input_ids.to(self.devices[0]),
                                              self.layer_ids, out_device)
        if first:  # the compile happens inside this first call
            log.info("target: %d decoder layers compiled; first forward %.1f s",
                     self.compiled_layers, time.perf_counter() - started)
        return features

    @torch.no_grad()
    def reference_features(self, input_ids, attention_mask, out_device) -> torch.Tensor:
        """The plain transformers path: padding mask, every layer, output_hidden_states."""
        out = self.model(input_ids=input_ids.to(self.devices[0]),
                         attention_mask=attention_mask.to(self.devices[0]),
                         output_hidden_states=True, use_cache=False, logits_to_keep=1)
        taps = [out.hidden_states[i + 1].to(out_device) for i in self.layer_ids]
        return torch.cat(taps, dim=-1)

    def _compile_layers(self) -> bool:
        """Once, on CUDA with compile enabled: the layers up to the last tap; True if it did."""
        if self.compiled_layers or not compile_layers_wanted(self.devices):
            return False
        self.compiled_layers = compile_layers(self.model, max(self.layer_ids) + 1)
        return True


def has_fast_path(model: nn.Module) -> bool:
    """fast_paths.target_features applies: enabled, and a decoder of model.model.layers + norm."""
    inner = getattr(model, "model", None)
    return fast_paths.ENABLED and isinstance(getattr(inner, "layers", None), nn.ModuleList) \
        and isinstance(getattr(inner, "norm", None), nn.Module)


def right_padded(attention_mask) -> bool:
    """Every row is ones then zeros (real tokens first): what dflash_data.collate builds."""
    mask = attention_mask.to("cpu")
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def compile_layers_wanted(devices: list[str]) -> bool:
    return fast_paths.ENABLED and compile_safety.current_settings().enabled and \
        all(str(d).startswith("cuda") for d in devices)


def compile_layers(model: nn.Module, count: int) -> int:
    """Compile model.model.layers[:count] (each call behind COMPILE_LOCK); returns count.

    Every layer shares the decoder layer's code, so dynamo compiles one graph per distinct
    layer kind and the others reuse it (the weights are graph inputs, not constants).
    """
    layers = fast_paths.decoder_layers(model)
    for layer in layers[:count]:
        layer.forward = compile_safety.safe_compile(layer.forward, "target_layer", dynamic=False)
    return min(count, len(layers))


def _one_layer_per_kind(config) -> int:
    """How many leading layers cover every distinct layer kind (layer_types) of the config."""
    kinds = list(getattr(config, "layer_types", None) or [])
    if not kinds:
        return 1
    return max(kinds.index(kind) for kind in set(kinds)) + 1


def random_weights_model(config, dtype: torch.dtype, device) -> nn.Module:
    """A frozen causal LM of `config` with random weights, created directly on `device`."""
    from transformers import AutoModelForCausalLM

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config).requires_grad_(False).eval()
    finally:
        torch.set_default_dtype(old)


@torch.no_grad()
def warm_compiled_layers(path: str, dtype: str, devices: list[str], batch: int, seq: int) -> dict:
    """Compile the target's decoder-layer graph(s) into the compile cache, weights not loaded.

    A random-weight model of the target's config cut to one layer of each kind runs the fast path
    at the training shape [batch, seq] on each target device in turn: same code, shapes, dtypes
    and devices as training's compiled layers, so training's compile reads the cached graphs.
    Returns {"layers": layer graphs per device, "devices": n, "seconds": s}.
    """
    from transformers import AutoConfig

    devices = list(dict.fromkeys(devices))
    if not compile_layers_wanted(devices):
        return {"layers": 0, "devices": 0, "seconds": 0.0}
    with _load_errors(path, "config"):
        config = AutoConfig.from_pretrained(path)
    text = getattr(config, "text_config", None) or config
    count = _one_layer_per_kind(text)
    text.num_hidden_layers = count
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types)[:count]
    started = time.perf_counter()
    model = random_weights_model(config, DTYPES[dtype], devices[0])
    if not has_fast_path(model):
        return {"layers": 0, "devices": 0, "seconds": 0.0}
    compile_layers(model, count)
    for device in devices:
        model.to(device)
        ids = torch.randint(0, text.vocab_size, (batch, seq), device=device)
        fast_paths.target_features(model, ids, list(range(count)), device).sum().item()
    del model
    return {"layers": count, "devices": len(devices), "seconds": time.perf_counter() - started}


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
