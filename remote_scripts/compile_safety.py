"""torch.compile that is safe to call from several drafter threads of one process.

Why (docs/research/torch-compile-threads.md in the repository): the wrapper returned by torch.compile checks,
on every call, a process-wide FX-tracing flag that any other thread's compile may have set
(`Tracer.trace`), and dynamo itself is not thread-safe. Concurrent calls crashed with "Detected
that you are using FX to symbolically trace a dynamo-optimized function" or hung. Locking only the
first call per input signature failed (warm signatures raced a compile, dynamo recompiled warm
signatures under concurrent guard checks). What held in every test: one process-wide re-entrant
lock around EVERY call of the compiled region, plus warming every shape in the main thread before
the workers start. This module is that, and nothing cleverer.

Usage (training script):
    configure_compile(cache_dir=cfg.inductor_cache, recompile_limit=64)
    attention = compiled_flex_attention()
    warm_shapes(train_step_for_shape, shapes)      # main thread, fwd+bwd with grad, as training does
    ... in each worker thread: apply_thread_settings() first, then call `attention(...)` freely.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

log = logging.getLogger("dflash.compile")

# One lock for every compiled call in the process. Re-entrant because a compiled function may call
# another compiled function (a module's forward calling compiled flex_attention).
COMPILE_LOCK = threading.RLock()

# TEST/BENCH ONLY: DFLASH_COMPILE_LOCK=0 switches the lock off so that the regression test and
# bench/bench_race.py can show the race the lock prevents. Never set it in training.
LOCK_SWITCH_ENV = "DFLASH_COMPILE_LOCK"

# Dynamo's message when a function exceeds its recompile limit and then runs uncompiled.
_DYNAMO_FALLBACK_LOGGER = "torch._dynamo.convert_frame"
_DYNAMO_FALLBACK_PREFIX = "torch._dynamo hit config."


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    enabled: bool = True
    cache_dir: str | None = None
    triton_cache_dir: str | None = None
    recompile_limit: int = 64
    mode: str | None = None
    kernel_options: dict[str, Any] | None = None


_settings = CompileSettings()
_state_lock = threading.Lock()  # guards _settings, _stats and the flex singleton, not compiled calls
_stats: dict[str, dict[str, float]] = {}
_thread = threading.local()  # .name: the safe_compile'd function this thread is inside
_flex_singleton: Callable[..., Any] | None = None


def _new_entry() -> dict[str, float]:
    return {"calls": 0, "fallbacks": 0, "lock_wait_s": 0.0}


def lock_enabled() -> bool:
    """False only when DFLASH_COMPILE_LOCK=0 (test/bench only: shows the unfixed race)."""
    return os.environ.get(LOCK_SWITCH_ENV, "1").strip() not in ("0", "false", "off", "no")


def configure_compile(
    cache_dir: str | os.PathLike[str] | None = None,
    recompile_limit: int = 64,
    enabled: bool = True,
    mode: str | None = None,
    kernel_options: dict[str, Any] | None = None,
) -> CompileSettings:
    """Record compile settings process-wide, point the caches at `cache_dir`, apply in this thread.

    Call before the first compiled call: inductor reads TORCHINDUCTOR_CACHE_DIR when it first
    compiles. The cache persists across processes, so warmup_compile.py fills what training reads.
    TRITON_CACHE_DIR goes with it, `<cache_dir>/triton` (torch's own layout), unless the
    environment already names one (the toolkit exports both from the inventory). Not a sibling
    `<parent>/triton`: when that parent was on sys.path (a script's own directory), the empty
    directory shadowed the triton package and `import torch._dynamo` failed (seen here).
    """
    global _settings
    if recompile_limit < 1:
        raise ValueError(f"recompile_limit must be >= 1, got {recompile_limit}")
    inductor_dir = triton_dir = None
    if cache_dir is not None:
        inductor_dir = os.path.abspath(os.fspath(cache_dir))
        triton_dir = os.environ.get("TRITON_CACHE_DIR") or os.path.join(inductor_dir, "triton")
        os.makedirs(inductor_dir, exist_ok=True)
        os.makedirs(triton_dir, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_dir
        os.environ["TRITON_CACHE_DIR"] = triton_dir
    with _state_lock:
        _settings = CompileSettings(
            enabled=enabled,
            cache_dir=inductor_dir,
            triton_cache_dir=triton_dir,
            recompile_limit=recompile_limit,
            mode=mode,
            kernel_options=dict(kernel_options) if kernel_options else None,
        )
    _install_fallback_handler()
    apply_thread_settings()
    log.info(
        "compile: enabled=%s mode=%s recompile_limit=%d inductor cache=%s triton cache=%s lock=%s",
        enabled, mode, recompile_limit, inductor_dir, triton_dir,
        "on" if lock_enabled() else "OFF (test/bench only)",
    )
    return _settings


def current_settings() -> CompileSettings:
    return _settings


def apply_thread_settings() -> None:
    """Apply the recorded dynamo/inductor settings in the calling thread.

    In torch 2.13 config assignments are per thread (ContextVars in torch/utils/_config_module.py):
    a worker thread started after configure_compile() sees torch's defaults (recompile_limit 8)
    until it calls this. Call it first thing in every worker thread.
    """
    settings = _settings
    torch._dynamo.config.recompile_limit = settings.recompile_limit
    # The default, set explicitly: False would make a racing call run uncompiled, silently.
    torch._dynamo.config.error_on_nested_fx_trace = True


def safe_compile(
    fn: Callable[..., Any],
    name: str,
    *,
    use_lock: bool | None = None,
    call_defaults: dict[str, Any] | None = None,
    **compile_kwargs: Any,
) -> Callable[..., Any]:
    """torch.compile(fn) behind COMPILE_LOCK on every call; `fn` itself when compile is disabled.

    `call_defaults`: keyword arguments added to every call that does not give them.
    `use_lock=False` (or DFLASH_COMPILE_LOCK=0) is for the regression test and the bench only.
    """
    settings = _settings
    if not settings.enabled:
        log.warning("compile disabled: %s runs uncompiled (eager)", name)
        return fn
    _install_fallback_handler()
    if settings.mode is not None:
        compile_kwargs.setdefault("mode", settings.mode)
    compiled = torch.compile(fn, **compile_kwargs)
    locked = lock_enabled() if use_lock is None else use_lock
    with _state_lock:
        _stats.setdefault(name, _new_entry())
    return _SafeCompiled(compiled, name, locked, call_defaults or {})


class _SafeCompiled:
    """The compiled callable; every call holds COMPILE_LOCK (when locked) and is counted."""

    def __init__(
        self, compiled: Callable[..., Any], name: str, locked: bool, defaults: dict[str, Any]
    ) -> None:
        self._compiled = compiled
        self.name = name
        self.locked = locked  # the bench flips it after warm-up to measure the lock's cost
        self.defaults = defaults
        self.__wrapped__ = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for key, value in self.defaults.items():
            kwargs.setdefault(key, value)
        if not self.locked:
            return self._call_marked(args, kwargs, 0.0)
        t0 = time.perf_counter()
        with COMPILE_LOCK:
            return self._call_marked(args, kwargs, time.perf_counter() - t0)

    def _call_marked(self, args: tuple[Any, ...], kwargs: dict[str, Any], waited: float) -> Any:
        outer = getattr(_thread, "name", None)
        _thread.name = self.name
        try:
            return self._compiled(*args, **kwargs)
        finally:
            _thread.name = outer
            with _state_lock:
                entry = _stats.setdefault(self.name, _new_entry())
                entry["calls"] += 1
                entry["lock_wait_s"] += waited

    def __repr__(self) -> str:
        return f"<safe_compile {self.name} lock={'on' if self.locked else 'OFF'}>"


def compiled_flex_attention() -> Callable[..., Any]:
    """The process-wide compiled flex_attention (one compiled wrapper, one dynamo cache).

    Passes the configured kernel_options when the caller gives none.
    """
    global _flex_singleton
    with _state_lock:
        if _flex_singleton is not None:
            return _flex_singleton
    from torch.nn.attention.flex_attention import flex_attention

    kernel_options = _settings.kernel_options
    compiled = safe_compile(
        flex_attention, "flex_attention",
        call_defaults={"kernel_options": kernel_options} if kernel_options else None,
    )
    with _state_lock:
        if _flex_singleton is None:
            _flex_singleton = compiled
        return _flex_singleton


def warm_shapes(step_fn: Callable[[Any], Any], shapes: Iterable[Any]) -> dict[Any, float]:
    """Run step_fn(shape) for every shape in the main thread; return {shape: seconds}.

    step_fn is the caller's closure: forward+backward with grad for training shapes, forward
    under no_grad for evaluation, so the graphs compiled here are the ones the workers will run.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("warm_shapes must run in the main thread, before the workers start")
    timings: dict[Any, float] = {}
    for shape in shapes:
        t0 = time.perf_counter()
        step_fn(shape)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        timings[shape] = time.perf_counter() - t0
        log.info("compile warm-up: shape %s took %.2f s", shape, timings[shape])
    return timings


def stats() -> dict[str, Any]:
    """{'calls': n, 'fallbacks': n, 'lock_wait_s': s, 'by_name': {name: {...}}, 'lock': bool}."""
    with _state_lock:
        by_name = {name: dict(entry) for name, entry in _stats.items()}
    return {
        "calls": int(sum(e["calls"] for e in by_name.values())),
        "fallbacks": int(sum(e["fallbacks"] for e in by_name.values())),
        "lock_wait_s": sum(e["lock_wait_s"] for e in by_name.values()),
        "by_name": by_name,
        "lock": lock_enabled(),
    }


class _FallbackHandler(logging.Handler):
    """Turns dynamo's recompile-limit message into a loud WARNING naming our function, and counts it.

    After the limit is hit dynamo runs that function's unmatched inputs uncompiled without another
    message, so one event means "degraded from here on".
    """

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith(_DYNAMO_FALLBACK_PREFIX):
            return
        name = getattr(_thread, "name", None) or "<not a safe_compile function>"
        with _state_lock:
            entry = _stats.setdefault(name, _new_entry())
            entry["fallbacks"] += 1
        limit = record.args[1] if isinstance(record.args, tuple) and len(record.args) > 1 else "?"
        log.warning(
            "COMPILE FALLBACK: %s now runs UNCOMPILED for new input signatures: dynamo hit its "
            "recompile limit (%s); raise recompile_limit or warm fewer shapes", name, limit,
        )


_handler = _FallbackHandler(level=logging.WARNING)


def _install_fallback_handler() -> None:
    dynamo_log = logging.getLogger(_DYNAMO_FALLBACK_LOGGER)
    if _handler not in dynamo_log.handlers:
        dynamo_log.addHandler(_handler)
