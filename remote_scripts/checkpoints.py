"""Atomic checkpoints: RUN/checkpoints/step-N/ and a `latest` pointer.

A checkpoint is written to a hidden temp directory, every file fsynced, then renamed into place;
`latest` (a one-line file naming the directory) is replaced atomically afterwards. A crash at any
point leaves either the previous checkpoint or the new one, never a half-written one that resume
would pick. Each directory is dflash-loadable (config.json + model.safetensors) plus
training_state.pt (optimizer, scheduler, step, sampler, RNG). `save_training` and `restore` write
and read a training run's checkpoint: the drafter, and its workers' training state.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil

import torch

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "training_state.pt"


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            _fsync_path(os.path.join(folder, name))
        _fsync_path(folder)


def write_atomic(path: str, data: str) -> None:
    """Write a small text file via temp + fsync + rename."""
    temp = f"{path}.tmp-{os.getpid()}"
    with open(temp, "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)
    _fsync_path(os.path.dirname(os.path.abspath(path)))


def open_for_append(path: str):
    """Open a one-record-per-line file (metrics.jsonl) for appending, first cutting a torn last line
    (a write cut short by a full disk or a kill), so that the next record starts on a line of its own."""
    if os.path.isfile(path):
        with open(path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - (1 << 16)))
            tail = f.read()
            if tail and not tail.endswith(b"\n"):
                cut = tail.rfind(b"\n")
                if cut >= 0 or size <= len(tail):
                    f.truncate(size - len(tail) + cut + 1)
                else:
                    f.write(b"\n")
    return open(path, "a")


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def save_checkpoint(run_dir: str, step: int, write_files, keep_last: int) -> str:
    """write_files(temp_dir) writes the checkpoint's files; returns the final directory."""
    root = checkpoint_root(run_dir)
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"step-{step}")
    if not os.path.isfile(os.path.join(final, STATE_FILE)):
        temp = os.path.join(root, f".tmp-step-{step}-{os.getpid()}")
        shutil.rmtree(temp, ignore_errors=True)
        os.makedirs(temp)
        try:
            write_files(temp)
            _fsync_tree(temp)
        except Exception as exc:
            plain = _failed_save(root, temp, step, exc)
            if plain is exc:
                raise
            raise plain from exc
        shutil.rmtree(final, ignore_errors=True)  # an incomplete leftover of a crashed save
        os.rename(temp, final)
        _fsync_path(root)
    write_atomic(os.path.join(root, "latest"), f"step-{step}\n")
    prune(root, keep_last, keep=f"step-{step}")
    return final


def _failed_save(root: str, temp: str, step: int, exc: Exception) -> Exception:
    """Drop the partial save (frees its space); name a full disk plainly, since torch.save's own
    error for it is an opaque `enforce fail ... unexpected pos` RuntimeError without an errno."""
    written = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(temp) for f in fs)
    shutil.rmtree(temp, ignore_errors=True)
    if getattr(exc, "errno", None) == errno.ENOSPC:
        return exc
    free = shutil.disk_usage(root).free - written  # free space when the write failed
    if free < max(written, 1 << 20):
        return OSError(errno.ENOSPC, f"No space left on device: checkpoint step-{step} did not fit in {root} "
                                     f"({type(exc).__name__}: {str(exc).strip()[:120]})")
    return exc


def complete_steps(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root)
                  if (m := STEP_DIR.match(name)) and os.path.isfile(os.path.join(root, name, STATE_FILE)))


def _remove(root: str, name: str) -> None:
    """Rename out of view first: a kill in the middle of the delete leaves no half-deleted step-N."""
    doomed = os.path.join(root, f".del-{name}-{os.getpid()}")
    os.rename(os.path.join(root, name), doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def prune(root: str, keep_last: int, keep: str) -> None:
    for step in complete_steps(root)[:-keep_last]:
        if f"step-{step}" != keep:
            _remove(root, f"step-{step}")
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if STEP_DIR.match(name) and name != keep and not os.path.isfile(os.path.join(path, STATE_FILE)):
            _remove(root, name)  # half-deleted by an older prune that was killed
        elif name.startswith((".tmp-step-", ".del-", "latest.tmp-")) and not name.endswith(f"-{os.getpid()}"):
            # left by a save, prune or pointer update that died
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)


def latest_checkpoint(run_dir: str) -> str | None:
    """The directory `latest` names, or the highest complete step-N if the pointer is missing."""
    root = checkpoint_root(run_dir)
    pointer = os.path.join(root, "latest")
    if os.path.isfile(pointer):
        name = open(pointer).read().strip()
        if STEP_DIR.match(name) and os.path.isfile(os.path.join(root, name, STATE_FILE)):
            return os.path.join(root, name)
    steps = complete_steps(root)
    return os.path.join(root, f"step-{steps[-1]}") if steps else None


def save_state(directory: str, state: dict) -> None:
    torch.save(state, os.path.join(directory, STATE_FILE))


def load_state(directory: str) -> dict:
    return torch.load(os.path.join(directory, STATE_FILE), map_location="cpu", weights_only=False)


def save_drafter(drafter, directory: str) -> None:
    """config.json (dflash layout) + model.safetensors; loads with DFlashDraftModel.from_pretrained."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    state = {name: tensor.detach().to("cpu").contiguous()
             for name, tensor in drafter.state_dict().items()}
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    config = drafter.config.to_dict()
    config["architectures"] = ["DFlashDraftModel"]
    config["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)



def save_training(run_dir: str, step: int, workers, sampler_state: dict, config) -> str:
    """A checkpoint of `step`: the drafter (dflash-loadable) and the training state; returns its
    directory."""
    worker = workers[0]  # replicas are identical; one copy is the checkpoint

    def write(directory):
        save_drafter(worker.drafter, directory)
        save_state(directory, {
            "step": step, "optimizer": worker.optimizer.state_dict(),
            "scheduler": worker.scheduler.state_dict(), "sampler": dict(sampler_state),
            "rng": {"torch": torch.get_rng_state()}, "config": config.to_dict(),
        })
    return save_checkpoint(run_dir, step, write, config.train.keep_last)


class CheckpointMismatch(ValueError):
    """train.init_from names something that is not a drafter checkpoint of this run's shape."""


# what a drafter's weights fit: config.json keys, and dflash_config's (the taps, the block, the
# mask token: a checkpoint can fit the shapes and still have been trained for other ones)
DRAFTER_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size")
DFLASH_KEYS = ("block_size", "target_layer_ids", "mask_token_id")


def load_weights(directory: str, workers) -> None:
    """model.safetensors of `directory` into every worker's drafter (strict: every key, no other),
    and into its optimizer's fp32 masters where it keeps them (speed.load_weights)."""
    import speed
    from safetensors.torch import load_file

    weights = load_file(os.path.join(directory, "model.safetensors"))
    for worker in workers:
        speed.load_weights(worker.drafter, worker.optimizer, weights)


def init_from(directory: str, workers) -> None:
    """A new run's drafter weights from a drafter checkpoint (config.json + model.safetensors: a
    run's checkpoints/step-N, or any dflash drafter), train.init_from; the optimizer, schedule and
    sampler start fresh. What does not fit this run's drafter is refused in one line that names
    the differences, before any weight is loaded."""
    files = [os.path.join(directory, name) for name in ("config.json", "model.safetensors")]
    if not all(os.path.isfile(f) for f in files):
        raise CheckpointMismatch(f"train.init_from: {directory}: not a drafter checkpoint "
                                 "(config.json and model.safetensors)")
    try:
        with open(files[0]) as f:
            theirs = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointMismatch(f"train.init_from: {files[0]}: unreadable ({exc})") from None
    ours = workers[0].drafter.config.to_dict()
    their_dflash = theirs.get("dflash_config") if isinstance(theirs.get("dflash_config"), dict) else {}
    differences = [f"{key} {theirs.get(key)} (this run: {ours.get(key)})" for key in DRAFTER_KEYS
                   if theirs.get(key) != ours.get(key)]
    differences += [f"{key} {their_dflash.get(key)} (this run: {ours['dflash_config'].get(key)})"
                    for key in DFLASH_KEYS if their_dflash.get(key) != ours["dflash_config"].get(key)]
    if differences:
        raise CheckpointMismatch(f"train.init_from: {directory} does not fit this run's drafter: "
                                 + "; ".join(differences))
    try:
        load_weights(directory, workers)
    except (RuntimeError, OSError) as exc:  # a tensor missing, extra or of another shape
        first = str(exc).strip().splitlines()
        raise CheckpointMismatch(f"train.init_from: {directory}: its weights do not load: "
                                 f"{' '.join(line.strip() for line in first[:3])[:300]}") from None


def restore(directory: str, workers, sampler) -> int:
    """Load a checkpoint written by save_training into every worker and the sampler; returns its step.

    Each worker gets a copy of its own of the optimizer and scheduler state: load_state_dict keeps a
    tensor that is already on the parameter's device, so workers on one device (cpu,cpu,cpu) given
    the same dict would share exp_avg, exp_avg_sq and step, and each update would advance them
    once per worker.
    """
    import copy

    load_weights(directory, workers)
    state = load_state(directory)
    for worker in workers:
        worker.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        worker.scheduler.load_state_dict(copy.deepcopy(state["scheduler"]))
    sampler.load_state_dict(state["sampler"])
    torch.set_rng_state(state["rng"]["torch"])
    return int(state["step"])
