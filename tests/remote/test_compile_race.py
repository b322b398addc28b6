"""remote_scripts/compile_safety.py: the thread-safe compile, and the race it prevents.

The race tests run tests/remote/race/race_worker.py, one process per scenario, with the older
torch semantics emulated and the FX-tracing window widened (the worker's docstring says how and
why). With the lock every scenario completes; with the lock switched off the same scenario must
crash or hang, which shows the test can see the race at all.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import preload
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "remote_scripts"))
import compile_safety  # noqa: E402

WORKER = Path(__file__).with_name("race") / "race_worker.py"
SCENARIOS = ["first_calls", "warm_signatures", "keep_stepping"]
THREADS = [3, 8]
WATCHDOG_S = 120  # a warm scenario took 3-39 s on two cores at load 14; a hang never ends
PRIME_WATCHDOG_S = 300  # the first, cold compile of the session builds C++ kernels
# What the worker imports before its scenario starts (none of it compiles or starts a thread).
WORKER_IMPORTS = ("torch", "torch._dynamo", "torch._inductor.compile_fx",
                  "torch.nn.attention.flex_attention")
FX_RACE_ERROR = "Detected that you are using FX to symbolically trace a dynamo-optimized function"


@pytest.fixture(scope="session")
def race_env(request):
    env = {k: v for k, v in os.environ.items() if k != compile_safety.LOCK_SWITCH_ENV}
    # Persistent across pytest runs (.pytest_cache, git-ignored): later runs reuse the C++ kernels.
    env["TORCHINDUCTOR_CACHE_DIR"] = str(request.config.cache.mkdir("dflash-race-inductor"))
    env["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"  # a hit would skip Tracer.trace: no race to see
    env.pop("TRITON_CACHE_DIR", None)
    code, output = run_worker(env, "prime", 1, "on", watchdog_s=PRIME_WATCHDOG_S)
    assert code == 0, f"priming the compile cache failed (exit {code}):\n{output[-4000:]}"
    return env


def run_worker(env: dict[str, str], scenario: str, threads: int, lock: str,
               watchdog_s: int = WATCHDOG_S):
    argv = [sys.executable, str(WORKER), "--scenario", scenario, "--threads", str(threads),
            "--lock", lock, "--watchdog", str(watchdog_s)]
    try:  # forked from a server that imported torch, dynamo and inductor (preload.py): ~5 s of CPU less
        done = preload.run(argv[1:], env, watchdog_s + 60, modules=WORKER_IMPORTS)
    except subprocess.TimeoutExpired as exc:  # the worker's own watchdog did not fire either
        pytest.fail(f"worker hung past its watchdog: {argv}\n{exc.stdout}\n{exc.stderr}")
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_lock_holds_under_the_race(race_env, scenario, threads):
    code, output = run_worker(race_env, scenario, threads, "on")
    assert code == 0, f"exit {code} with the lock on:\n{output[-4000:]}"
    assert f"OK scenario={scenario} threads={threads} lock=on" in output


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_race_is_detected_without_the_lock(race_env, scenario, threads):
    code, output = run_worker(race_env, scenario, threads, "off")
    print(output[-3000:])  # kept for the record: `pytest -s` shows the unfixed failure
    assert code in (1, 3), f"exit {code}: the unfixed scenario did not fail:\n{output[-4000:]}"
    if code == 1:
        assert FX_RACE_ERROR in output


# ---- the API itself, in this process (cheap: the eager backend, no inductor) ----

@pytest.fixture
def fresh_settings(monkeypatch):
    """Undo what configure_compile changes process-wide, so tests do not leak into each other."""
    monkeypatch.setattr(compile_safety, "_settings", compile_safety.CompileSettings())
    monkeypatch.setattr(compile_safety, "_flex_singleton", None)
    monkeypatch.setattr(compile_safety, "_stats", {})
    saved_env = dict(os.environ)
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", compile_safety.LOCK_SWITCH_ENV):
        os.environ.pop(name, None)
    limit = torch._dynamo.config.recompile_limit
    yield
    torch._dynamo.config.recompile_limit = limit
    os.environ.clear()
    os.environ.update(saved_env)


def setting_seen_by_new_thread(apply: bool) -> int:
    seen = []

    def worker():
        if apply:
            compile_safety.apply_thread_settings()
        seen.append(torch._dynamo.config.recompile_limit)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    return seen[0]


def test_thread_settings_reach_a_worker_only_through_apply(fresh_settings):
    compile_safety.configure_compile(recompile_limit=37)
    assert torch._dynamo.config.recompile_limit == 37
    assert setting_seen_by_new_thread(apply=False) != 37  # torch 2.13: per-thread config
    assert setting_seen_by_new_thread(apply=True) == 37


def test_configure_points_both_caches_at_the_given_directory(fresh_settings, tmp_path):
    settings = compile_safety.configure_compile(cache_dir=tmp_path / "inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "inductor" / "triton")
    assert settings.triton_cache_dir == str(tmp_path / "inductor" / "triton")
    assert (tmp_path / "inductor" / "triton").is_dir()


def test_configure_keeps_a_triton_cache_the_environment_names(fresh_settings, tmp_path):
    os.environ["TRITON_CACHE_DIR"] = str(tmp_path / "from-inventory")
    compile_safety.configure_compile(cache_dir=tmp_path / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "from-inventory")


@pytest.mark.parametrize("switch, owned", [(None, True), ("0", False)])
def test_every_call_holds_the_lock_unless_switched_off(fresh_settings, monkeypatch, switch, owned):
    if switch is not None:
        monkeypatch.setenv(compile_safety.LOCK_SWITCH_ENV, switch)
    compiled = compile_safety.safe_compile(lambda x: x + 1, "probe", backend="eager")
    held = []
    probe = lambda x: held.append(compile_safety.COMPILE_LOCK._is_owned())  # noqa: E731
    monkeypatch.setattr(compiled, "_compiled", probe)
    for _ in range(3):  # not only the first call: warm calls raced compiles in the research
        compiled(torch.ones(2))
    assert held == [owned] * 3
    assert compile_safety.stats()["by_name"]["probe"]["calls"] == 3


def test_recompile_limit_fallback_is_loud_and_counted(fresh_settings, caplog):
    compile_safety.configure_compile(recompile_limit=1)
    compiled = compile_safety.safe_compile(lambda x: x * 2, "doubler", backend="eager",
                                           dynamic=False)
    with caplog.at_level(logging.WARNING, logger="dflash.compile"):
        for size in (1, 2, 3):
            assert torch.equal(compiled(torch.ones(size)), torch.full((size,), 2.0))
    loud = [r for r in caplog.records if r.name == "dflash.compile" and "doubler" in r.message]
    assert loud and all(r.levelno == logging.WARNING for r in loud)
    assert "UNCOMPILED" in loud[0].message
    assert compile_safety.stats()["by_name"]["doubler"]["fallbacks"] >= 1


def test_disabled_compile_returns_the_function_itself(fresh_settings):
    compile_safety.configure_compile(enabled=False)

    def step(x):
        return x

    assert compile_safety.safe_compile(step, "step") is step


def test_flex_attention_is_one_locked_wrapper_per_process(fresh_settings):
    compile_safety.configure_compile(kernel_options={"BLOCK_M": 64})
    first = compile_safety.compiled_flex_attention()
    assert compile_safety.compiled_flex_attention() is first
    assert first.locked and first.name == "flex_attention"
    assert first.defaults == {"kernel_options": {"BLOCK_M": 64}}


def test_warm_shapes_times_every_shape_and_refuses_worker_threads(fresh_settings):
    ran = []
    timings = compile_safety.warm_shapes(ran.append, [(1, 128), (2, 256)])
    assert ran == [(1, 128), (2, 256)] and list(timings) == ran
    errors = []

    def worker():
        try:
            compile_safety.warm_shapes(ran.append, [(3, 128)])
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert errors and ran == [(1, 128), (2, 256)]
