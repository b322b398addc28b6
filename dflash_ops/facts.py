"""Container-side helpers shipped per call: the loader, the facts command, and reading JSON answers.

The in-container sides are `container_runs.py` (the run protocol: jobs, status, logs, metrics,
clean-cache) and `container_facts.py` (deploy's and doctor's facts, sent after container_runs.py's
definitions, which it uses), both sent verbatim as `python -c` to `container.python`; what they
print is one JSON object, read here.
"""

from __future__ import annotations

import base64
import functools
import json
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from . import commands
from .errors import RemoteCommandFailed
from .inventory import Container


def _source(name: str) -> str:
    return Path(__file__).with_name(name).read_text(encoding="utf-8")


CONTAINER_RUNS = _source("container_runs.py")
# The facts script alone answers code, venv, model, gpus, space and plan (deploy's probe); "caches"
# and "runs" use container_runs.py's definitions (everything before its main guard), sent first.
FACTS_ALONE = _source("container_facts.py")
CONTAINER_FACTS = CONTAINER_RUNS.partition('\nif __name__ == "__main__":')[0] + "\n\n" + FACTS_ALONE
RUNS_FACTS = frozenset({"caches", "runs"})
ALL_FACTS = ("code", "venv", "model", "gpus", "space", "caches", "runs", "plan")


# The script travels compressed as one argument, so a host line stays one line (dry-run prints one
# per line) and short; the loader is a constant and the values are separate arguments.
LOADER = "import base64,sys,zlib;exec(zlib.decompress(base64.b64decode(sys.argv.pop(1))))"


@functools.lru_cache(maxsize=8)
def packed(script: str) -> str:
    return base64.b64encode(zlib.compress(script.encode("utf-8"), 9)).decode("ascii")


def script_line(container: Container, script: str, verb: str | None, payload: dict, *,
                no_site: bool = False) -> str:
    """Host line: the container's system python runs a constant script; the values travel as JSON.
    `no_site`: python -S, for a script that needs the standard library only (a third of the start)."""
    argv = [container.python, *(["-S"] if no_site else []), "-c", LOADER, packed(script),
            *([verb] if verb else []),
            json.dumps(payload, sort_keys=True)]
    return commands.pct_exec(container.ctid, argv, env=container.run_env(), pct=container.host.pct_command)


def facts_payload(container: Container, want: Iterable[str], torch_check: str = "always") -> dict:
    p = container.paths
    return {"code": p.code, "venv": p.venv, "model": p.model, "runs": p.runs, "caches": p.caches.all(),
            "want": sorted(want), "torch_check": torch_check}


def facts_script(want: Iterable[str]) -> str:
    """The smallest script that answers `want`: the facts script alone unless runs or caches are asked."""
    return CONTAINER_FACTS if RUNS_FACTS.intersection(want) else FACTS_ALONE


def facts_line(container: Container, want: Iterable[str] = ALL_FACTS, torch_check: str = "always") -> str:
    """torch_check "always" imports torch in the venv (doctor); "recorded" reuses the venv's last passing
    check while its requirements and the container's GPU set are unchanged (deploy). The script is
    stdlib-only and runs without site (-S); the venv's torch check is a process of its own."""
    want = tuple(want)
    return script_line(container, facts_script(want), "facts", facts_payload(container, want, torch_check),
                       no_site=True)


def runs_argv(container: Container, verb: str, payload: dict) -> list[str]:
    """Container argv: one verb of container_runs.py on the container's system python."""
    # -S: no site module (the helper is stdlib only): a third of the interpreter's start.
    return [container.python, "-S", "-c", LOADER, packed(CONTAINER_RUNS), verb,
            json.dumps(payload, sort_keys=True)]


def runs_line(container: Container, verb: str, payload: dict) -> str:
    """Host line of a verb that needs no run environment (status, logs-tail, metrics, stop, ...)."""
    return commands.pct_exec(container.ctid, runs_argv(container, verb, payload),
                             env={"PATH": commands.SYSTEM_PATH, "LANG": "C.UTF-8"},
                             pct=container.host.pct_command)


def json_answer(text: str, what: str, limit: int = 64 << 20) -> dict:
    """A verb's stdout -> its JSON object (the last line); ValueError, one line, for anything else.

    Lines are split on `\n` only: a JSON answer escapes every other control character.
    """
    if not isinstance(text, str) or len(text) > limit:
        raise ValueError(f"{what}: the answer is missing or larger than {limit} bytes")
    lines = [ln.rstrip("\r") for ln in text.split("\n") if ln.strip()]
    try:
        answer = json.loads(lines[-1]) if lines else None
    except (ValueError, RecursionError):
        answer = None
    if not isinstance(answer, dict):
        # A truncated answer (connection lost mid-way) must not look like a healthy run.
        raise ValueError(f"{what}: no complete JSON answer from the container")
    return answer


def parse_json_line(stdout: str, what: str) -> dict:
    """The last non-empty line of a script's stdout as a JSON object ({} when nothing was printed).

    Lines are split on `\n` only: a JSON answer escapes every other control character.
    """
    lines = [ln.rstrip("\r") for ln in stdout.split("\n") if ln.strip()]
    if not lines:
        return {}
    try:
        value = json.loads(lines[-1])
    except (ValueError, RecursionError):
        raise RemoteCommandFailed(f"{what}: unreadable answer from the container: "
                                  f"{lines[-1][:200]!r}") from None
    if not isinstance(value, dict):
        raise RemoteCommandFailed(f"{what}: unexpected answer from the container: {lines[-1][:200]!r}")
    return value


@dataclass(frozen=True)
class TorchInfo:
    ok: bool
    version: str | None = None
    cuda: str | None = None
    gpus: int = 0
    error: str = ""
    recorded: bool = False  # the venv's recorded check, not a fresh import of torch


def torch_info(venv_fact: dict | None) -> TorchInfo:
    """What the venv's torch says about itself, or why it could not say it (any answer: one line)."""
    from .terminal import visible

    if not isinstance(venv_fact, dict) or not venv_fact.get("python"):
        return TorchInfo(False, error="no python in the venv")
    check = venv_fact.get("torch") if isinstance(venv_fact.get("torch"), dict) else {}
    out = check.get("out") if isinstance(check.get("out"), str) else ""
    if check.get("rc") != 0:
        err = check.get("err") if isinstance(check.get("err"), str) else ""
        tail = err.strip().splitlines()[-1:] or ["no output"]
        return TorchInfo(False, error=f"torch does not import: {visible(tail[0])[:300]}")
    try:
        data = json.loads(out.splitlines()[-1])
    except (ValueError, IndexError, RecursionError):
        data = None
    if not isinstance(data, dict):
        return TorchInfo(False, error=f"unreadable torch check output: {visible(out[:120])!r}")
    count = data.get("count")
    version, cuda = data.get("torch"), data.get("cuda")
    return TorchInfo(True, version if isinstance(version, str) else None,
                     cuda if isinstance(cuda, str) else None,
                     count if isinstance(count, int) and not isinstance(count, bool) and 0 <= count < 1 << 16
                     else 0,
                     recorded=check.get("recorded") is True)


def gpus_needed(container: Container) -> int:
    """Devices torch must see: one past the highest GPU index the roles name (0 for a CPU-only inventory)."""
    gpus = container.roles.gpus
    return max(gpus) + 1 if gpus else 0


def gpu_verdict(container: Container, visible: int) -> tuple[bool, str]:
    need = gpus_needed(container)
    roles = (f"target {container.roles.devices('target') or '-'}, drafter "
             f"{container.roles.devices('drafter') or '-'}")
    if need == 0:
        if visible:
            return True, f"{visible} GPU(s) visible, the roles use CPU only ({roles})"
        return True, f"0 GPUs visible, as the CPU-only roles expect ({roles})"
    if visible < need:
        return False, (f"{visible} GPU(s) visible, the roles need {need} ({roles}): check the "
                       "container's GPU passthrough (lxc.cgroup2.devices.allow / lxc.mount.entry for "
                       "/dev/nvidia*)")
    return True, f"{visible} GPU(s) visible, the roles need {need} ({roles})"


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "?"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
