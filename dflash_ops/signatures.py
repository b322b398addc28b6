"""Known failure signatures in training output, each pointing at the runbook on-call should read.

Pure: a table of patterns and a scanner. `logs` highlights matching lines, `status` and `warmup`
name the runbook when a run's last lines match. Runbooks live in docs/runbooks/<page>.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

RUNBOOK_DIR = "docs/runbooks"


@dataclass(frozen=True)
class Signature:
    key: str
    title: str
    page: str
    pattern: re.Pattern

    @property
    def runbook(self) -> str:
        return f"{RUNBOOK_DIR}/{self.page}"


def _sig(key, title, page, *patterns) -> Signature:
    return Signature(key, title, page, re.compile("|".join(f"(?:{p})" for p in patterns)))


SIGNATURES: tuple[Signature, ...] = (
    # The multi-threaded first-compile race (see the warm-up incident): dynamo's global FX flag.
    _sig("compile-race", "torch.compile FX-tracing race between drafter threads", "compile-race.md",
         r"Detected that you are using FX to symbolically trace a dynamo-optimized function"),
    _sig("cuda-oom", "CUDA out of memory", "cuda-oom.md",
         r"CUDA out of memory", r"torch\.(?:cuda\.)?OutOfMemoryError", r"CUBLAS_STATUS_ALLOC_FAILED"),
    _sig("nccl", "NCCL error", "nccl.md",
         r"NCCL error", r"\bnccl(?:InternalError|SystemError|UnhandledCudaError|RemoteError|InvalidUsage)\b",
         r"ProcessGroupNCCL.*(?:[Tt]imeout|Watchdog caught)", r"NCCL WARN"),
    _sig("disk-full", "disk full", "disk-full.md",
         r"No space left on device", r"\[Errno 28\]"),
    _sig("venv-torch", "broken venv or torch/CUDA mismatch", "venv-torch.md",
         r"ModuleNotFoundError: No module named '(?:torch|transformers|safetensors|yaml)'",
         r"CUDA driver version is insufficient", r"Found no NVIDIA driver",
         r"undefined symbol: .*(?:torch|cuda|c10)", r"libcudart\.so.*cannot open shared object file"),
    _sig("slow-compile", "compile stuck or recompiling", "slow-compile.md",
         r"torch\._dynamo hit config\.(?:recompile|cache_size)_limit", r"compile fallback\(s\)"),
)

# States reported by `status` that have their own runbook (not log lines).
STALLED = _sig("stalled-run", "no new log line or metric", "stalled-run.md", r"(?!x)x")
CONTAINER = _sig("container", "container stopped or missing", "container.md", r"(?!x)x")
HOST_KEY = _sig("ssh-host-key", "SSH host key unknown or changed", "ssh-host-key.md", r"(?!x)x")


def match(line: str) -> Signature | None:
    """The first known signature a line shows, or None."""
    for sig in SIGNATURES:
        if sig.pattern.search(line):
            return sig
    return None


def scan(lines: Iterable[str]) -> list[tuple[Signature, str]]:
    """Each signature found in `lines` once, with the last line that showed it, in table order."""
    found: dict[str, tuple[Signature, str]] = {}
    for line in lines:
        sig = match(line)
        if sig is not None:
            found[sig.key] = (sig, line)
    return [found[s.key] for s in SIGNATURES if s.key in found]


def advice(sig: Signature) -> str:
    return f"{sig.title}: read {sig.runbook}"
