"""The frozen target: loading, placement over the target devices, context features, decoding.

Placement (`target.placement`):
- `split`: the decoder layers in contiguous chunks over the devices (one copy; embeddings on the
  first device, final norm and LM head on the last; a forward pre-hook moves each placed module's
  inputs to its device). For targets that do not fit one device. One device works at a time.
- `replicate`: one full copy per device. The weights are read from disk once; the other copies
  are made device to device. Drafter worker w's batches come from replica w % k.
- `auto`: replicate when weights plus activations fit every target device's free memory, else
  split (`choose_placement`, a pure function; the training log and RUN/placement.json say why).

Fast path (`fast_paths=True`, training's `train.fast_paths`, the default): for right-padded batches
(dflash_data.collate) the features come from fast_paths.target_features (no padding mask, no layers
after the last tap). `compile_layers()` (called by training.apply_compile, never implicitly)
compiles each decoder layer up to the last tap on CUDA, behind compile_safety's lock like every
compiled call (bench/RESULTS.md: 54.6% -> 83.7% MFU at the Qwen3-8B shape). `reference_features` is the plain
transformers path. `warm_compiled_layers` fills the compile cache with the target's layer graph
without loading its weights, for warmup_compile.py.

Decoding (`greedy_generate`, `chat_prompt_ids`, `stop_token_ids`, `load_target`) is here too:
regenerate_data.py and eval_dflash.py decode with the target through them.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import hashlib
import json
import logging
import os
import threading
import time

import compile_safety
import fast_paths
import torch
from torch import nn
from train_config import DTYPE_NAMES

log = logging.getLogger("dflash.train")

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


class TargetLoadError(RuntimeError):
    pass


# ----------------------------------------------------------------------------- loading

@contextlib.contextmanager
def _load_errors(path: str, what: str):
    """transformers' loading errors (missing files, bad json) as one-line TargetLoadErrors."""
    try:
        yield
    except (OSError, ValueError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise TargetLoadError(f"cannot load the target {what} from {path}: {first}") from None


def _check_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise TargetLoadError(f"target checkpoint directory not found: {path}")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    _check_dir(path)
    with _load_errors(path, "tokenizer"):
        return AutoTokenizer.from_pretrained(path)


# model_type of the target's text model (a multimodal config's text_config) -> family. These are
# the decoders the drafter, the taps and the fast path are written for: model.model.layers + norm,
# hidden states per layer, an input embedding and an LM head (tied or not) of the same width.
SUPPORTED_ARCHITECTURES = {
    "llama": "Llama", "qwen3": "Qwen3", "qwen3_moe": "Qwen3", "qwen3_5": "Qwen3.5",
    "qwen3_5_text": "Qwen3.5", "qwen3_5_moe": "Qwen3.5", "qwen3_5_moe_text": "Qwen3.5",
}


def check_architecture(config) -> None:
    """Refuse a target whose text model is not one of SUPPORTED_ARCHITECTURES, in one line."""
    text = getattr(config, "text_config", None) or config
    kind = getattr(text, "model_type", None) or getattr(config, "model_type", None)
    if kind not in SUPPORTED_ARCHITECTURES:
        names = sorted(set(SUPPORTED_ARCHITECTURES.values()))
        raise TargetLoadError(
            f"target architecture {kind!r} is not supported; supported: {', '.join(names)} "
            f"(model_type {', '.join(sorted(SUPPORTED_ARCHITECTURES))})")


def load_target_config(path: str):
    """The target's config, refused unless its architecture is supported (check_architecture)."""
    from transformers import AutoConfig

    _check_dir(path)
    with _load_errors(path, "config"):
        config = AutoConfig.from_pretrained(path)
    check_architecture(config)
    return config


def load_causal_lm(path: str, dtype: str) -> nn.Module:
    """The one loader of the target's weights: frozen, eval mode, on the CPU. transformers'
    progress bar is off for the process (it wrote carriage-return bars into every log, and into
    the stderr whose one line is the error of a refused input)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()

    _check_dir(path)
    with _load_errors(path, "model"):
        config = AutoConfig.from_pretrained(path)
    check_architecture(config)  # before the weights are read
    with _load_errors(path, "model"):
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=DTYPES[dtype])
    return model.requires_grad_(False).eval()


def load_target(path: str, device: str, dtype: str):
    """(tokenizer, model on `device`) for decoding: regenerate_data.py and eval_dflash.py."""
    tokenizer = load_tokenizer(path)
    return tokenizer, load_causal_lm(path, dtype).to(device)


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


# ----------------------------------------------------------------------------- placement

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
    """The decoder layers: model.model.layers (transformers' causal LMs, what the fast path runs),
    else the longest ModuleList in the model, whatever the architecture."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise TargetLoadError("target model has no ModuleList of decoder layers")
    return max(lists, key=len)


def place_split(model: nn.Module, devices: list[str]) -> None:
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


def replicate(model: nn.Module, devices: list[str]) -> list[nn.Module]:
    """One full copy per device: `model` moves to the first, each other copy is the same module
    tree whose tensors are copied device to device from the first (tied weights stay tied)."""
    first = model.to(devices[0])
    replicas = [first]
    for device in devices[1:]:
        memo = {}
        for tensor in list(first.parameters()) + list(first.buffers()):
            if id(tensor) not in memo:
                moved = tensor.detach().to(device, copy=True)
                memo[id(tensor)] = nn.Parameter(moved, requires_grad=False) \
                    if isinstance(tensor, nn.Parameter) else moved
        replicas.append(copy.deepcopy(first, memo))
    return replicas


def checkpoint_weight_bytes(path: str, dtype: str) -> int:
    """The target's weights in `dtype`, from the safetensors headers (no tensor is read)."""
    size = DTYPES[dtype].itemsize
    total = 0
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count * size
    if not total:  # other formats: their file sizes
        total = sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*.bin")))
    return total


def activation_bytes(text_config, batch: int, seq: int, taps: int, dtype: str) -> int:
    """Working memory of one fast-path forward: the residual stream and a layer's temporaries,
    the captured taps, the MLP's intermediate activations (a generous bound; flash attention's
    own memory is linear in seq and small beside these)."""
    hidden, inter = text_config.hidden_size, text_config.intermediate_size
    return batch * seq * (hidden * (4 + taps) + 3 * inter) * DTYPES[dtype].itemsize


RESERVE_BYTES = 2 << 30  # CUDA context, cuBLAS workspaces, allocator slack


def choose_placement(requested: str, devices: list[str], weights: int, activations: int,
                     free: dict[str, int]) -> tuple[str, str]:
    """Pure: (placement, why). `free`: free bytes per distinct CUDA device now."""
    if requested != "auto":
        return requested, f"target.placement={requested} in the config"
    if len(devices) == 1:
        return "split", "one target device: split and replicate are the same placement"
    if any(not d.startswith("cuda") for d in devices):
        return "split", "auto: non-CUDA target devices share the host's memory and cores"
    gib = 2**30
    need = weights + activations + RESERVE_BYTES
    short = {d: free[d] for d in free if devices.count(d) * need > free[d]}
    what = (f"a full copy needs {weights / gib:.1f} GiB weights + {activations / gib:.1f} GiB "
            f"activations + {RESERVE_BYTES / gib:.0f} GiB reserve")
    if short:
        device = min(short, key=short.get)
        return "split", (f"auto: {what}, more than {device}'s free "
                         f"{free[device] / gib:.1f} GiB (x{devices.count(device)} copies)")
    least = min(free, key=free.get)
    return "replicate", (f"auto: {what}; it fits each of the {len(devices)} target devices "
                         f"(least free: {free[least] / gib:.1f} GiB on {least})")


def free_memory(devices: list[str]) -> dict[str, int]:
    return {d: torch.cuda.mem_get_info(torch.device(d))[0]
            for d in dict.fromkeys(devices) if d.startswith("cuda")}


# ----------------------------------------------------------------------------- the target

class FeatureCache:
    """The target's features of each conversation already seen, keyed by its real token ids.

    On a target that runs on few cores (the CPU runs) its forward costs more than the drafter's
    step, and every epoch asks for the same features again: with `target.feature_cache_gib` the
    first request computes them and later ones read them back. A real token's features depend
    only on the real tokens up to it (right padding, causal attention), so they are the same in
    any batch; pad positions come back as zeros (nothing reads them: see context_features).
    Rows beyond `max_bytes` are computed each time. Thread-safe (the batch feed's prefetch thread
    and the main thread both ask).
    """

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes, self.hits, self.misses = max_bytes, 0, 0, 0
        self._rows: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(ids: torch.Tensor) -> bytes:
        return hashlib.blake2b(ids.to("cpu", torch.int64).numpy().tobytes(), digest_size=16).digest()

    def features(self, input_ids, attention_mask, out_device, compute,
                 trim: bool = True) -> torch.Tensor:
        """[B, S, F] for right-padded rows; `compute(ids, mask)` makes the missing rows' features
        (`trim`: without the padding after the longest of them; compiled layers keep one shape)."""
        lengths = attention_mask.to("cpu").sum(dim=1).tolist()
        keys = [self.key(input_ids[row, :n]) for row, n in enumerate(lengths)]
        with self._lock:
            found = {row: self._rows.get(k) for row, k in enumerate(keys)}
        missing = [row for row, value in found.items() if value is None]
        if missing:
            width = max(lengths[row] for row in missing) if trim else input_ids.shape[1]
            fresh = compute(input_ids[missing, :width], attention_mask[missing, :width]).to("cpu")
            with self._lock:
                for index, row in enumerate(missing):
                    value = fresh[index, : lengths[row]].clone()
                    found[row] = value
                    size = value.numel() * value.element_size()
                    if keys[row] not in self._rows and self.bytes + size <= self.max_bytes:
                        self._rows[keys[row]] = value
                        self.bytes += size
        with self._lock:
            self.hits += len(lengths) - len(missing)
            self.misses += len(missing)
        first = found[0]
        out = torch.zeros((len(lengths), input_ids.shape[1], first.shape[-1]), dtype=first.dtype)
        for row, n in enumerate(lengths):
            out[row, :n] = found[row]
        return out.to(out_device)


class Target:
    """A frozen causal LM that yields DFlash context features, split or replicated."""

    def __init__(self, path: str, devices: list[str], dtype: str,
                 layer_ids: list[int] | None = None, placement: str = "split", fast_paths: bool = True,
                 feature_cache_bytes: int = 0, feature_dtype: torch.dtype | None = None):
        """feature_dtype: the features' dtype (None: the target's), cast on the target's device
        before they move (training.feature_dtype: the one the drafter reads them in)."""
        self.path, self.fast_paths, self.feature_dtype = path, fast_paths, feature_dtype
        self._place(load_causal_lm(path, dtype), devices, layer_ids, placement)
        self.feature_cache = FeatureCache(feature_cache_bytes) if feature_cache_bytes > 0 else None

    @classmethod
    def from_model(cls, model: nn.Module, devices: list[str], layer_ids: list[int],
                   placement: str = "split", fast_paths: bool = True) -> Target:
        """A Target around a frozen model already in memory (the benchmarks' random weights)."""
        target = cls.__new__(cls)
        target.path, target.fast_paths, target.feature_dtype = None, fast_paths, None
        target._place(model.requires_grad_(False).eval(), devices, layer_ids, placement)
        target.feature_cache = None
        return target

    def _place(self, model: nn.Module, devices: list[str], layer_ids, placement: str) -> None:
        if placement not in ("split", "replicate"):
            raise ValueError(f"placement {placement!r}: resolve auto with choose_placement first")
        self.config = model.config
        self.devices, self.placement, self.layer_ids = devices, placement, layer_ids
        if placement == "replicate":
            self.replicas = replicate(model, devices)
            self.replica_devices = list(devices)
        else:
            place_split(model, devices)
            self.replicas, self.replica_devices = [model], [devices[0]]
        self.model = self.replicas[0]
        self.compiled_layers = 0  # decoder layers compiled per replica (CUDA fast path only)
        self._first_forward_logged = False

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    def replica_for(self, worker: int) -> int:
        """Which replica serves drafter worker `worker`: spread evenly, fixed for the run."""
        return worker % len(self.replicas)

    @torch.no_grad()
    def context_features(self, input_ids, attention_mask, out_device, replica: int = 0):
        """hidden_states[layer_id + 1] for each tapped layer, concatenated -> [B, S, n*H].

        Exact for every real token; pad positions may differ from `reference_features` on the
        fast path, and nothing reads them (anchors are real tokens, a block sees context strictly
        before its anchor).
        """
        model, device = self.replicas[replica], self.replica_devices[replica]
        if not (self.fast_paths and has_fast_path(model) and right_padded(attention_mask)):
            return self.reference_features(input_ids, attention_mask, out_device, replica)
        if self.feature_cache is not None:
            return self.feature_cache.features(
                input_ids, attention_mask, out_device,
                lambda ids, mask: self._fast_features(model, device, ids, "cpu"),
                trim=not self.compiled_layers)
        return self._fast_features(model, device, input_ids, out_device)

    def _fast_features(self, model, device, input_ids, out_device):
        started = time.perf_counter()
        features = fast_paths.target_features(model, input_ids.to(device), self.layer_ids,
                                              out_device, self.feature_dtype)
        if self.compiled_layers and not self._first_forward_logged:
            self._first_forward_logged = True  # the compile happens inside the first call
            log.info("target: first forward with %d compiled decoder layers %.1f s",
                     self.compiled_layers, time.perf_counter() - started)
        return features

    @torch.no_grad()
    def reference_features(self, input_ids, attention_mask, out_device, replica: int = 0):
        """The plain transformers path: padding mask, every layer, output_hidden_states."""
        model, device = self.replicas[replica], self.replica_devices[replica]
        out = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                    output_hidden_states=True, use_cache=False, logits_to_keep=1)
        taps = [fast_paths.moved(out.hidden_states[i + 1], out_device, self.feature_dtype)
                for i in self.layer_ids]
        return torch.cat(taps, dim=-1)

    def compile_layers(self) -> int:
        """On CUDA with compile enabled and the fast path on: every replica's layers up to the last
        tap, once."""
        if self.compiled_layers or not (self.fast_paths and compile_layers_wanted(self.devices)):
            return self.compiled_layers
        for model in self.replicas:
            self.compiled_layers = compile_layers(model, max(self.layer_ids) + 1)
        return self.compiled_layers


def has_fast_path(model: nn.Module) -> bool:
    """fast_paths.target_features applies to this model: a decoder of model.model.layers + norm."""
    inner = getattr(model, "model", None)
    return isinstance(getattr(inner, "layers", None), nn.ModuleList) \
        and isinstance(getattr(inner, "norm", None), nn.Module)


def right_padded(attention_mask) -> bool:
    """Every row is ones then zeros (real tokens first): what dflash_data.collate builds."""
    mask = attention_mask.to("cpu")
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def compile_layers_wanted(devices: list[str]) -> bool:
    return compile_safety.current_settings().enabled and \
        all(str(d).startswith("cuda") for d in devices)


def compile_layers(model: nn.Module, count: int) -> int:
    """Compile the first `count` decoder layers (each call behind COMPILE_LOCK); returns count.

    Every layer shares the decoder layer's code, so dynamo compiles one graph per distinct
    layer kind (and device) and the others reuse it (the weights are graph inputs).
    """
    layers = decoder_layers(model)
    for layer in layers[:count]:
        layer.forward = compile_safety.safe_compile(layer.forward, "target_layer", dynamic=False)
    return min(count, len(layers))


def _one_layer_per_kind(config) -> int:
    """How many leading layers cover every distinct layer kind (layer_types) of the config."""
    kinds = list(getattr(config, "layer_types", None) or [])
    if not kinds:
        return 1
    return max(kinds.index(kind) for kind in set(kinds)) + 1


@torch.no_grad()
def warm_compiled_layers(path: str, dtype: str, devices: list[str], batch: int, seq: int,
                         fast_paths: bool = True) -> dict:
    """Compile the target's decoder-layer graph(s) into the compile cache, weights not loaded.

    A random-weight model of the target's config cut to one layer of each kind runs the fast path
    at the training shape [batch, seq] on each target device in turn: same code, shapes, dtypes
    and devices as training's compiled layers, so training's compile reads the cached graphs.
    Returns {"layers": layer graphs per device, "devices": n, "seconds": s}.
    """
    devices = list(dict.fromkeys(devices))
    if not (fast_paths and compile_layers_wanted(devices)):
        return {"layers": 0, "devices": 0, "seconds": 0.0}
    config = load_target_config(path)
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

    def __init__(self, path: str, dtype: str, layer_ids: list[int],
                 feature_dtype: torch.dtype | None = None):
        self.path = path
        self.config = load_target_config(path)
        text = getattr(self.config, "text_config", None) or self.config
        self.hidden_size, self.dtype = text.hidden_size, DTYPES[dtype]
        self.feature_dtype = feature_dtype or self.dtype
        self.layer_ids = layer_ids
        self._weight = torch.empty(text.vocab_size, text.hidden_size, dtype=self.dtype)
        self._weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))

    @property
    def embed_weight(self) -> torch.Tensor:
        return self._weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self._weight

    def replica_for(self, worker: int) -> int:
        return 0

    def context_features(self, input_ids, attention_mask, out_device, replica: int = 0):
        batch, seq = input_ids.shape
        return torch.randn(batch, seq, len(self.layer_ids) * self.hidden_size,
                           dtype=self.feature_dtype, device=out_device)

    def compile_layers(self) -> int:
        return 0  # warmup_compile.py compiles the layer graph with warm_compiled_layers


# ----------------------------------------------------------------------------- decoding

def stop_token_ids(tokenizer, model) -> list[int]:
    """End-of-turn ids: the tokenizer's eos and the generation config's (a list in Qwen3)."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return sorted(i for i in ids if i is not None)


def chat_prompt_ids(tokenizer, turns: list[dict]) -> list[int]:
    """The conversation so far, rendered with the chat template, ready for the assistant's answer."""
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


GROUPED_ATTENTION = "sdpa_grouped"


def grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0,
                 scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' sdpa attention, without copying the key/value heads when there is a mask.

    With grouped-query attention (fewer key/value heads than query heads) and a padding mask,
    transformers' `sdpa` repeats every key/value head for each of its query heads before the
    kernel (SDPA's own grouped path takes no mask). A left-padded decoding batch always has a
    mask, so each decoding step copied its whole KV cache three times over (SmolLM2: 9 query, 3
    key/value heads). Here the query heads of a group are laid along the query axis instead:
    [B, kv, rep * q, d] against the unrepeated [B, kv, L, d] keys, the mask repeated alike. The
    same attention, the same result up to rounding. Without a mask, or without grouping,
    transformers' own sdpa runs.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    if attention_mask is None or heads == kv_heads or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    rep = heads // kv_heads
    kv_len = attention_mask.shape[-1]
    mask = attention_mask.expand(batch, 1, q_len, kv_len)[:, :, None]
    mask = mask.expand(batch, 1, rep, q_len, kv_len).reshape(batch, 1, rep * q_len, kv_len)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, kv_heads, rep * q_len, head_dim), key, value, attn_mask=mask,
        scale=scaling)
    return out.reshape(batch, heads, q_len, head_dim).transpose(1, 2).contiguous(), None


def use_grouped_attention(model) -> None:
    """Switch `model` from transformers' sdpa to grouped_sdpa (regenerate_data.py's decoding)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if model.config._attn_implementation not in ("sdpa", GROUPED_ATTENTION):
        return
    AttentionInterface.register(GROUPED_ATTENTION, grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_ATTENTION, sdpa_mask)
    model.config._attn_implementation = GROUPED_ATTENTION


def _reserved_cache(model, capacity: int):
    """A DynamicCache whose layers write into key/value buffers of `capacity` positions reserved at
    the first forward (greedy_generate's `reserve`): a decoding step writes its one position in
    place, where DynamicLayer concatenates, copying the whole cache of every layer on every step.
    The keys and values a layer returns are views of the written part, the same values. Dropping
    batch rows (batch_select_indices) copies only the written part. None when a layer of the
    model's cache is not a plain DynamicLayer (sliding windows): then greedy_generate concatenates.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        length = 0

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                batch, heads = key_states.shape[:2]
                self.key_buffer = key_states.new_empty(batch, heads, capacity, key_states.shape[-1])
                self.value_buffer = value_states.new_empty(batch, heads, capacity,
                                                           value_states.shape[-1])
            end = self.length + key_states.shape[-2]
            if end > capacity:
                raise RuntimeError(f"the reserved KV cache holds {capacity} positions, not {end}")
            self.key_buffer[:, :, self.length:end] = key_states
            self.value_buffer[:, :, self.length:end] = value_states
            self.length = end
            self.keys = self.key_buffer[:, :, :end]
            self.values = self.value_buffer[:, :, :end]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if not self.is_initialized:
                return
            for name in ("key_buffer", "value_buffer"):
                old = getattr(self, name)
                new = old.new_empty(len(indices), *old.shape[1:])
                new[:, :, :self.length] = old[:, :, :self.length].index_select(0, indices)
                setattr(self, name, new)
            self.keys = self.key_buffer[:, :, :self.length]
            self.values = self.value_buffer[:, :, :self.length]

    cache = DynamicCache(config=model.config)
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.layers = [ReservedLayer() for _ in cache.layers]
    return cache


@torch.inference_mode()
def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
                    pad_id: int = 0, temperature: float = 0.0,
                    generator: torch.Generator | None = None,
                    reserve: bool = False) -> list[list[int]]:
    """Plain greedy decoding with a KV cache: one target forward per new token.

    With `temperature` > 0 each token is drawn from the softmax of the logits / temperature
    instead (with `generator`, on the model's device): more answers of the target's own
    distribution for a prompt (regenerate_data.py --samples).

    Prompts are left-padded into one batch (explicit position ids, so padding changes nothing).
    Each answer ends with its first stop token (included) or after max_new_tokens. A finished
    answer leaves the batch (its rows of the KV cache too): the forwards after it cost only the
    answers still running (the batch runs as long as its longest answer, and a small model's
    greedy answers range from a few tokens to loops that run to the limit).

    With `reserve` (regenerate_data.py's big batches) the KV cache is reserved up front
    (_reserved_cache) and finished answers leave the batch only once a quarter of it has
    finished: until then they ride along, their tokens dropped. Each step then writes one
    position instead of copying the cache, and the cache is copied once per quarter of the batch
    finishing, not at each step where one answer does. Greedy answers are the same; sampled ones
    (`temperature` > 0) come from the same distributions, but a seed gives other draws than without
    `reserve` (the riding answers draw too). eval_dflash.py's plain decoding, the figure
    speculative decoding is checked against, keeps the default.
    """
    from transformers import DynamicCache

    device = model.device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention[row, width - len(prompt):] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    stops = torch.tensor(stop_ids, device=device)
    cache = _reserved_cache(model, width + max_new_tokens) if reserve else None
    if cache is None:
        cache, reserve = DynamicCache(config=model.config), False
    logits = model(input_ids, attention_mask=attention, position_ids=positions,
                   past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    answers: list[list[int]] = [[] for _ in prompts]
    active = torch.arange(len(prompts), device=device)  # the batch's rows, in batch order
    finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits[:, -1].float() / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            token = logits[:, -1].argmax(-1)
        for row, value, done in zip(active.tolist(), token.tolist(), finished.tolist(),
                                    strict=True):
            if not done:
                answers[row].append(value)
        finished |= torch.isin(token, stops)
        running = int((~finished).sum())
        if not running or step + 1 == max_new_tokens:
            break
        if running < len(active) and (not reserve or running <= len(active) * 3 // 4):
            keep = (~finished).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            active, token, finished = active[keep], token[keep], finished[keep]
            attention, positions = attention[keep], positions[keep]
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        logits = model(token[:, None], attention_mask=attention, position_ids=positions,
                       past_key_values=cache, use_cache=True).logits
    return answers
