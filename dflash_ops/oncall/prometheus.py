"""`invoke status --prometheus [FILE]`: run facts in the Prometheus text exposition format.

Written for node_exporter's textfile collector: the file is replaced atomically (temp file in the
same directory, fsync, rename), so a scrape never reads half a file. Every series carries the
labels host and ct; a run's series also carry run. Label values are escaped as the format asks
(backslash, double quote, newline): the run name comes from the container and may hold anything.
Pure apart from `write_atomic`; `exposition` is tested with prometheus_client's own parser.
"""

from __future__ import annotations

import errno
import math
import os
import secrets

from ..remote.prelude import STATES
from ..status import RunStatus

# name -> help; every family is a gauge. The order here is the order in the output.
FAMILIES = {
    "dflash_up": "1 when the container's facts were read, 0 when the host or container could not be reached",
    "dflash_run_state": "1 for the run's current state, 0 for the others",
    "dflash_run_step": "last logged training step",
    "dflash_run_loss": "training loss at the last logged step",
    "dflash_run_heldout_loss": "held-out loss at the last evaluation",
    "dflash_run_heldout_decode_acceptance_length":
        "acceptance length greedy decoding has on the held-out answers at the last evaluation",
    "dflash_run_acceptance_length": "mean acceptance length (tau) at the last logged step",
    "dflash_run_slot_accuracy": "per-slot draft accuracy at the last logged step (slots 1..block-1)",
    "dflash_run_tokens_per_second": "target tokens per second over all drafter workers",
    "dflash_run_idle_seconds": "seconds since the last log line or metric",
    "dflash_run_checkpoint_step": "step of the latest checkpoint",
    "dflash_run_checkpoint_age_seconds": "seconds since the latest checkpoint was written",
    "dflash_eval_acceptance_length": "acceptance length of the last `invoke eval` (dflash inference)",
    "dflash_eval_speedup": "wall-clock speedup of the last `invoke eval`",
    "dflash_gpu_utilization_percent": "GPU utilisation reported by nvidia-smi",
    "dflash_gpu_memory_used_bytes": "GPU memory in use",
    "dflash_gpu_memory_total_bytes": "GPU memory in total",
    "dflash_gpu_temperature_celsius": "GPU temperature",
    "dflash_filesystem_free_bytes": "bytes free on the runs directory (fs=runs) and /dev/shm (fs=shm)",
}
MIB = 1 << 20


def escape_label(value) -> str:
    return str(value).replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _number(value) -> str | None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def samples(host: str, ct, st: RunStatus | None) -> list[tuple[str, dict, object]]:
    """(metric, labels, value) for one container; st None: the container could not be read."""
    base = {"host": host, "ct": str(ct)}
    out = [("dflash_up", base, 0 if st is None else 1)]
    if st is None:
        return out
    run = {**base, "run": st.run or ""}
    out += [("dflash_run_state", {**run, "state": s}, int(st.state == s)) for s in STATES]
    if st.run:
        out += [("dflash_run_step", run, st.step), ("dflash_run_loss", run, st.loss),
                ("dflash_run_heldout_loss", run, st.eval_loss),
                ("dflash_run_heldout_decode_acceptance_length", run, st.eval_decode_acceptance),
                ("dflash_run_acceptance_length", run, st.acceptance_length),
                ("dflash_run_tokens_per_second", run, st.tokens_per_s),
                ("dflash_run_idle_seconds", run, st.idle_s),
                ("dflash_run_checkpoint_step", run, st.checkpoint_step),
                ("dflash_run_checkpoint_age_seconds", run, st.checkpoint_age_s)]
        out += [("dflash_run_slot_accuracy", {**run, "slot": str(i)}, acc)
                for i, acc in enumerate(st.slot_accuracy or [], start=1)]
        last = st.last_eval or {}
        out += [("dflash_eval_acceptance_length", run, last.get("acceptance_length")),
                ("dflash_eval_speedup", run, last.get("speedup"))]
    for g in st.gpus:
        gpu = {**base, "gpu": str(g.index)}
        out += [("dflash_gpu_utilization_percent", gpu, g.utilization),
                ("dflash_gpu_memory_used_bytes", gpu,
                 None if g.memory_used_mib is None else g.memory_used_mib * MIB),
                ("dflash_gpu_memory_total_bytes", gpu,
                 None if g.memory_total_mib is None else g.memory_total_mib * MIB),
                ("dflash_gpu_temperature_celsius", gpu, g.temperature_c)]
    out += [("dflash_filesystem_free_bytes", {**base, "fs": "runs"}, st.free_runs),
            ("dflash_filesystem_free_bytes", {**base, "fs": "shm"}, st.free_shm)]
    return out


def exposition(all_samples) -> str:
    """Text format 0.0.4: each family's HELP and TYPE once, then its samples; absent values left out."""
    by_family: dict[str, list[str]] = {name: [] for name in FAMILIES}
    for name, labels, value in all_samples:
        shown = _number(value)
        if shown is None:
            continue
        pairs = ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items())
        by_family[name].append(f"{name}{{{pairs}}} {shown}")
    lines = []
    for name, rows in by_family.items():
        if rows:
            lines += [f"# HELP {name} {FAMILIES[name]}", f"# TYPE {name} gauge", *rows]
    return "\n".join(lines) + "\n"


def write_atomic(path: str, text: str) -> str:
    """Replace `path` in one rename; the temp file's name ends in .tmp so the collector skips it.

    The textfile directory may be writable by others (node_exporter's user): the temp file is created
    O_EXCL|O_NOFOLLOW and made 0644 with fchmod on the open file, never by name (a name another user
    swapped for a symlink to a private file of root's made that file 0644), and renamed only while its
    name is still that file."""
    directory = os.path.dirname(os.path.abspath(path))
    temp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    mine = os.fstat(fd)

    def still_mine() -> bool:
        try:
            now = os.lstat(temp)
        except OSError:
            return False
        return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)

    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), 0o644)  # the collector may run as another user
            os.fsync(f.fileno())
        if not still_mine():
            raise OSError(errno.EEXIST, f"{temp} was replaced by someone else while it was written")
        os.replace(temp, path)
    except BaseException:
        if still_mine():
            os.unlink(temp)
        raise
    return path
