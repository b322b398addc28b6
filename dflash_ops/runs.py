"""A training run's vocabulary, shared by every module that names one: its name, its directory and
lock, how it ended (the exit description, the last error line) and the known failure signatures in
its output, each pointing at the runbook on-call should read. Pure: no connection, no output.

`logs` highlights lines that match a signature, `status` and `warmup` name the runbook when a run's
last lines match. Runbooks live in docs/runbooks/<page>. The run directory's files are listed in
launch.py.
"""

from __future__ import annotations

import datetime as _dt
import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass

from . import terminal
from .errors import NoSuchRun, UsageError
from .remote.prelude import describe_exit  # noqa: F401 - the one wording of an exit, the container's too

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


# --- names and paths ---------------------------------------------------------------------------------

def validate_run_name(name: str) -> str:
    """A run name becomes a directory: letters, digits, '.', '_', '-', at most 64, no leading dot."""
    if not isinstance(name, str) or not RUN_NAME.match(name) or name.endswith("\n"):
        shown = repr(name)[:80]
        raise UsageError(f"--run {shown}: a run name is 1-64 characters of letters, digits, '.', '_' "
                         f"or '-', starting with a letter or digit")
    return name


def default_run_name(now: _dt.datetime | None = None) -> str:
    return (now or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y%m%d-%H%M%S")


def shown_name(value) -> str:
    """A run name from the container, for a message: itself when valid, else '?'."""
    return value if isinstance(value, str) and RUN_NAME.match(value) else "?"


def run_dir(ct, name: str) -> str:
    return f"{ct.paths.runs}/{validate_run_name(name)}"


RUNS_SHOWN = 20  # run names an unknown-run line lists at most


def no_such_run(name, label: str, names) -> NoSuchRun:
    """The one answer of every task for a run that is not there: `no run 'r11' on pve1/200; runs: r1,
    r2 (did you mean r1?)`. `names`: the runs the container has (its answer, newest first: only
    valid run names are shown, at most RUNS_SHOWN of the newest, in name order)."""
    names = [n for n in (names if isinstance(names, list) else [])
             if isinstance(n, str) and RUN_NAME.match(n)]
    asked = name if isinstance(name, str) and RUN_NAME.match(name) else None
    if name is None:
        what = f"no latest run on {label}"
    else:
        what = f"no run {asked or terminal.visible(str(name))[:80]!r} on {label}"
    if not names:
        return NoSuchRun(f"{what}; no runs yet: start one with `invoke train`")
    shown = sorted(names[:RUNS_SHOWN])
    left = len(names) - len(shown)
    more = f" and {left} more (`invoke runs` lists them)" if left else ""
    close = difflib.get_close_matches(asked, names, n=1) if asked else []
    guess = f" (did you mean {close[0]}?)" if close else ""
    return NoSuchRun(f"{what}; runs: {', '.join(shown)}{more}{guess}")


# --- how a run ended ---------------------------------------------------------------------------------

WRAPPER_LINE = re.compile(r"^dflash-ops: (launch |restart |not restarting |training process \d+ ended"
                          r"|.*: restart \d+ of \d+ in )")
ERROR_LINE = re.compile(r"error|exception|killed|fatal|denied|no space|not found", re.I)
QUIET_LINE = re.compile(r"^\S+ (?:INFO|DEBUG) ")  # the training script's own informational lines


def last_error_line(lines: list[str], only_errors: bool = False) -> str | None:
    """The line that says why a run died: the last one that reads like an error, else the last one
    (only_errors: else None; an INFO or DEBUG line of the training script is never an error)."""
    own = [ln for ln in lines if ln.strip() and not WRAPPER_LINE.match(ln)]
    errors = [ln for ln in own if ERROR_LINE.search(ln) and not QUIET_LINE.match(ln)]
    return (errors or ([] if only_errors else own) or [None])[-1]


def why_it_failed(lines: list[str], nothing: str = "(no output)") -> str:
    """A failed process's output -> `<its last error line>; <the runbook>`, visible, on one line."""
    last = last_error_line(lines) or nothing
    found = scan(lines)
    hint = advice(found[-1][0]) if found else "read docs/runbooks/README.md"
    return f"{terminal.visible(last)[:300]}; {hint}"


# --- known failure signatures ------------------------------------------------------------------------

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
CONTAINER_OOM = _sig("container-oom", "killed by the container's memory limit (OOM killer)",
                     "container-oom.md", r"(?!x)x")


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


# --- automatic restarts (`train --max-restarts N`) ----------------------------------------------------
# A crash with one of these signatures is transient: the same run relaunched from its latest checkpoint
# is expected to go on (as Slurm's requeue or SkyPilot's managed jobs relaunch). The training process
# killed by one of TRANSIENT_SIGNALS (the OOM killer's and a stop's SIGKILL, a crashed native library's
# SIGSEGV/SIGBUS), or a failure whose log shows a TRANSIENT_KEYS signature or a TRANSIENT_CUDA line.
# Anything else is never restarted: a stop on request, a clean finish, a config or preflight error,
# CUDA out of memory (the same config fails again). The container decides (remote/runs.py `ended`).

TRANSIENT_SIGNALS = ("SIGKILL", "SIGSEGV", "SIGBUS")
TRANSIENT_KEYS = ("nccl",)
TRANSIENT_CUDA = (r"CUDA error: unspecified launch failure", r"uncorrectable ECC error",
                  r"CUDA-capable device\(s\) is/are busy or unavailable", r"\bXid\b")
MAX_RESTARTS = 100


def restart_policy(max_restarts: int | None) -> dict:
    """The `ended` verb's policy for a launch: {"max", "signals": [numbers], "patterns": [regexes]}."""
    import signal

    most = check_max_restarts(max_restarts) or 0
    patterns = [sig.pattern.pattern for sig in SIGNATURES if sig.key in TRANSIENT_KEYS]
    return {"max": most, "signals": [int(signal.Signals[name]) for name in TRANSIENT_SIGNALS],
            "patterns": patterns + list(TRANSIENT_CUDA)}


def check_max_restarts(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RESTARTS:
        raise UsageError(f"--max-restarts {value}: give 0..{MAX_RESTARTS} automatic restarts")
    return value
