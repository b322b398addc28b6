"""In the container, for `invoke fetch`: find the checkpoint and hash its files (stdlib only).

Shipped after prelude.py by dflash_ops.fetch: the verb `list` with one JSON object
{"runs", "run", "checkpoint", "names"}; streams a {"hashing": name} item every few MiB, then the
prelude's one answer: {"ok": {"dir": ..., "files": [{"name", "size", "disk", "sha256"}]}} (`disk`:
the bytes the file really occupies, st_blocks) or {"error": kind, "message"}.

Everything here is read from files that training code wrote, so nothing is taken on trust: the
checkpoint is a real directory `step-N` directly under the run's `checkpoints/` (the `latest`
pointer is read as a small regular file holding exactly `step-N`), and each file is a regular file
opened without following a symlink. The hash is computed from that open file.

An item is written to stdout every few MiB while hashing: once fetch is gone (killed, connection
lost) the write fails and this process exits, instead of hashing gigabytes for nobody (a real
`pct exec` without a tty leaves the command running when the SSH session is closed).
"""

import hashlib
import os
import re
import stat

from dflash_ops.remote.prelude import Refused, emit, open_regular, resolve_run, serve

STEP = re.compile(r"step-[0-9]{1,12}")
POINTER_MAX = 64
BLOCK = 1 << 20
MARK_EVERY = 8  # blocks


def real_dir(path, code, what):
    try:
        st = os.lstat(path)
    except OSError:
        raise Refused(code, f"no {what} {path}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise Refused("unsafe", f"{path} is not a directory (a symlink or a file): refusing it as the {what}")


def pointer(root):
    """The checkpoint `latest` names, or None when there is no pointer."""
    path = os.path.join(root, "latest")
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    except OSError:
        raise Refused("unsafe", f"{path} is not a regular file: refusing it") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(POINTER_MAX + 1)
    text = raw.decode("utf-8", "backslashreplace")
    text = text[:-1] if text.endswith("\n") else text
    if len(raw) > POINTER_MAX or not STEP.fullmatch(text):
        raise Refused("unsafe",
                      f"{path} holds {text[:POINTER_MAX]!r}, not one step-N under checkpoints/: refusing it")
    return text


def newest(root):
    steps = [n for n in os.listdir(root)
             if STEP.fullmatch(n) and os.path.isfile(os.path.join(root, n, "config.json"))]
    return max(steps, key=lambda n: int(n[5:]), default=None)


def checkpoint_dir(runs, run, want):
    run_dir = os.path.join(runs, run)
    if not os.path.lexists(run_dir):
        resolve_run(runs, run)  # the no-run refusal, with the runs there are
    real_dir(run_dir, "no-run", "run")
    root = os.path.join(run_dir, "checkpoints")
    real_dir(root, "no-checkpoint", "checkpoints directory")
    if want == "latest":
        want = pointer(root) or newest(root)
        if want is None:
            raise Refused("no-checkpoint", f"no checkpoint yet in {root}")
    if not STEP.fullmatch(want):
        raise Refused("usage", f"checkpoint {want!r}: give latest or step-N")
    path = os.path.join(root, want)
    real_dir(path, "no-checkpoint", "checkpoint")
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(root):
        raise Refused("unsafe", f"{path} does not lie in {root}: refusing it")
    return path


def hashed(directory, name):
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name) or ".." in name:
        raise Refused("usage", f"file name {name!r} refused")
    path = os.path.join(directory, name)
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise Refused("missing", f"{path} is missing") from None
    except OSError as exc:
        raise Refused("unsafe", f"{path}: {exc.strerror}: refusing it (a regular file only)") from None
    digest, size = hashlib.sha256(), 0
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        for i, block in enumerate(iter(lambda: f.read(BLOCK), b"")):
            digest.update(block)
            size += len(block)
            if i % MARK_EVERY == MARK_EVERY - 1:
                emit(hashing=name)
    return {"name": name, "size": size, "disk": st.st_blocks * 512, "sha256": digest.hexdigest()}


def listing(args):
    directory = checkpoint_dir(args["runs"], args["run"], args["checkpoint"])
    return {"dir": directory, "files": [hashed(directory, name) for name in args["names"]]}


VERBS = {"list": listing}


if __name__ == "__main__":
    serve(VERBS)
