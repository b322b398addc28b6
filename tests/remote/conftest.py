"""Shared fixtures for the remote_scripts tests: the payload on sys.path, a tiny target, the CLI."""

from __future__ import annotations

import json
import os
import sys

import preload
import pytest

REMOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "remote_scripts")
REMOTE = os.path.normpath(REMOTE)
if REMOTE not in sys.path:
    sys.path.insert(0, REMOTE)

TINY_CONFIG = os.path.join(REMOTE, "configs", "tiny-cpu.yaml")
DATA_CACHE = []  # this session's tokenized-data cache (data.cache_dir), set before any test runs


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory):
    DATA_CACHE[:] = [str(tmp_path_factory.mktemp("data-cache"))]


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> str:
    """A tiny random Qwen3 checkpoint directory, made by make_tiny_target's own functions."""
    import make_tiny_target

    out = str(tmp_path_factory.mktemp("tiny-target"))
    tokenizer = make_tiny_target.build_tokenizer()
    model = make_tiny_target.build_model(tokenizer, seed=0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def run_script(script: str, *args: str, timeout: float = 600, env_extra: dict | None = None):
    """Run a remote script as the toolkit does, `python script args` in a process of its own; forked
    from a server that has torch and transformers imported already (preload.py)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return preload.run([os.path.join(REMOTE, script), *args], env, timeout)


def tiny_args(target: str, run_dir: str, *overrides: str) -> list[str]:
    """Arguments for a short tiny-cpu run: our target, our run dir, the session's data cache."""
    args = ["--config", TINY_CONFIG, "--run-dir", run_dir, "--set", f"target.path={target}",
            "--set", f"compile.cache_dir={run_dir}/inductor",
            "--set", f"data.cache_dir={DATA_CACHE[0]}"]
    for override in overrides:
        args += ["--set", override]
    return args


def read_metrics(run_dir: str, kind: str | None = None) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return [r for r in rows if kind is None or r["kind"] == kind]
