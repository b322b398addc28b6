"""Stage a new code release inside the container and swap it in atomically.

Shipped after prelude.py to `container.python` (standard library only, Python >= 3.8): one verb,
`install`, with one JSON object {"code", "releases", "tarball", "release", "tree", "keep"}; the
prelude's one answer out ({"ok": {"release", "previous", "pruned"}}, or a refusal).

Layout: `code` is a symlink to `releases/<release>`. The new release is built in
`releases/.stage-<release>-<pid>` from a copy of the current one plus the tarball's changed files
(the tarball also carries the new manifest), checked file by file against the manifest, renamed to
`releases/<release>`, and only then does `code` point at it (symlink + rename(2): atomic). Killed at
any moment before that rename, the previous release is untouched and `code` still points at it.
"""

import fcntl
import hashlib
import json
import os
import shutil
import tarfile
import time

from dflash_ops.remote.prelude import Refused, serve

MANIFEST = ".dflash-manifest.json"


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def complete(release_dir, tree):
    """A finished release: its manifest names this tree and every file matches its hash."""
    try:
        with open(os.path.join(release_dir, MANIFEST)) as f:
            manifest = json.load(f)
        return manifest.get("tree") == tree and all(
            sha256(os.path.join(release_dir, rel)) == digest for rel, digest in manifest["files"].items())
    except (OSError, ValueError, KeyError):
        return False


def safe_members(tar):
    for member in tar.getmembers():
        name = os.path.normpath(member.name)
        if name.startswith(("/", "..")) or not (member.isfile() or member.isdir()):
            raise Refused("unsafe", f"deploy: refusing tar member {member.name!r}")
        yield member


def stage(current, tarball, stage_dir):
    if current:
        shutil.copytree(current, stage_dir, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        os.makedirs(stage_dir)
    with tarfile.open(tarball) as tar:
        for member in safe_members(tar):
            target = os.path.join(stage_dir, member.name)
            if os.path.lexists(target) and not os.path.isdir(target):
                os.unlink(target)  # never write through a file the previous release may share
            tar.extract(member, stage_dir)
    with open(os.path.join(stage_dir, MANIFEST)) as f:
        manifest = json.load(f)
    wanted = set(manifest["files"]) | {MANIFEST}
    for base, _dirs, names in os.walk(stage_dir, topdown=False):
        for name in names:
            rel = os.path.relpath(os.path.join(base, name), stage_dir)
            if rel not in wanted:
                os.unlink(os.path.join(base, name))
        if base != stage_dir and not os.listdir(base):
            os.rmdir(base)
    for rel, digest in manifest["files"].items():
        if sha256(os.path.join(stage_dir, rel)) != digest:
            raise Refused("mismatch",
                          f"deploy: {rel} does not match its hash after staging; previous release kept")


def swap(code, release_dir):
    link = code + ".dflash-new-link"
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(release_dir, link)
    os.rename(link, code)  # atomic replacement of the old symlink (mv -T)


def prune(releases, keep, protect):
    dirs = [os.path.join(releases, n) for n in os.listdir(releases) if not n.startswith(".")]
    dirs.sort(key=lambda d: os.stat(d).st_mtime, reverse=True)
    pruned = []
    for d in dirs[keep:]:
        if os.path.realpath(d) not in protect:
            shutil.rmtree(d, ignore_errors=True)
            pruned.append(os.path.basename(d))
    return pruned


def main(args):
    code, releases = args["code"], args["releases"]
    os.makedirs(releases, exist_ok=True)
    lock = os.open(os.path.join(releases, ".lock"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one deploy at a time per container
        return install(code, releases, args)
    finally:
        os.close(lock)


def install(code, releases, args):
    for name in os.listdir(releases):
        if name.startswith(".stage-"):  # left by an interrupted deploy
            shutil.rmtree(os.path.join(releases, name), ignore_errors=True)
    if os.path.isdir(code) and not os.path.islink(code):
        # A code directory from before dflash-ops managed it: keep it as a release, then link.
        legacy = os.path.join(releases, f"legacy-{int(time.time())}")
        os.rename(code, legacy)
        os.symlink(legacy, code)
    current = os.path.realpath(code) if os.path.isdir(code) else None
    release_dir = os.path.join(releases, args["release"])
    if not complete(release_dir, args["tree"]):
        if os.path.realpath(release_dir) == current:
            # The live release was edited in place: stage beside it, swap, let pruning remove it later.
            release_dir = f"{release_dir}.{os.getpid()}"
        elif os.path.lexists(release_dir):
            shutil.rmtree(release_dir)
        stage_dir = os.path.join(releases, f".stage-{args['release']}-{os.getpid()}")
        stage(current, args["tarball"], stage_dir)
        os.rename(stage_dir, release_dir)
    swap(code, release_dir)
    os.utime(release_dir)  # newest first when pruning
    pruned = prune(releases, args["keep"], {os.path.realpath(release_dir), current})
    return {"release": release_dir, "previous": current, "pruned": pruned}


def install_verb(args):
    """`install`: stage and swap; the uploaded tarball is removed whatever happens."""
    try:
        return main(args)
    finally:
        if os.path.exists(args["tarball"]):
            os.unlink(args["tarball"])


VERBS = {"install": install_verb}


if __name__ == "__main__":
    serve(VERBS)
