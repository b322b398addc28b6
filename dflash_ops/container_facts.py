"""Facts about one container, gathered inside it in one round trip; also the compile-cache cleaner.

This file is sent as the text of `python -c` to the container's own interpreter (`container.python`),
so it uses the standard library only and runs on Python >= 3.8. Its one argument is a JSON object;
it prints one JSON object. Parsing lives on the local side (dflash_ops.doctor / deploy / caches).

    python -c "$(cat container_facts.py)" facts '{"code": ..., "want": [...]}'
    python -c "$(cat container_facts.py)" clean-caches '{"caches": {...}, "lock": ..., "force": false}'

"A run is alive" is jobs.py's fact: some process holds `<paths.runs>/.lock` (flock).
"""

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys

MANIFEST = ".dflash-manifest.json"
REQUIREMENTS_STAMP = ".dflash-requirements.sha256"
# Run by the venv's interpreter: a broken venv or torch shows up as a non-zero exit with its stderr.
TORCH_CHECK = ("import json, torch; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
               "'available': torch.cuda.is_available(), 'count': torch.cuda.device_count()}))")


def tree_hashes(root):
    """sha256 of every file under root (relative paths), skipping bytecode and the manifest."""
    out = {}
    for base, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in names:
            path = os.path.join(base, name)
            rel = os.path.relpath(path, root)
            if rel == MANIFEST or name.endswith(".pyc") or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


def code_fact(code):
    if not os.path.isdir(code):
        return {"exists": False}
    fact = {"exists": True, "link": os.path.islink(code), "release": os.path.realpath(code),
            "files": tree_hashes(code), "tree": None}
    try:
        with open(os.path.join(code, MANIFEST)) as f:
            fact["tree"] = json.load(f).get("tree")
    except (OSError, ValueError):
        pass
    return fact


def venv_fact(venv, env):
    python = os.path.join(venv, "bin", "python")
    fact = {"python": os.path.exists(python), "requirements": None, "torch": None}
    try:
        with open(os.path.join(venv, REQUIREMENTS_STAMP)) as f:
            fact["requirements"] = f.read().strip()
    except OSError:
        pass
    if fact["python"]:
        try:
            r = subprocess.run([python, "-c", TORCH_CHECK], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=env, timeout=300, universal_newlines=True)
            fact["torch"] = {"rc": r.returncode, "out": r.stdout.strip()[-2000:], "err": r.stderr.strip()[-600:]}
        except (OSError, subprocess.TimeoutExpired) as exc:
            fact["torch"] = {"rc": -1, "out": "", "err": str(exc)}
    return fact


def model_fact(model):
    """Is there a config.json; for a multimodal config, the text config's shape."""
    path = os.path.join(model, "config.json")
    fact = {"dir": os.path.isdir(model), "config": os.path.isfile(path)}
    if fact["config"]:
        try:
            with open(path) as f:
                cfg = json.load(f)
            text = cfg.get("text_config") or cfg
            fact.update(model_type=cfg.get("model_type"), text_model_type=text.get("model_type"),
                        multimodal="text_config" in cfg, hidden_size=text.get("hidden_size"),
                        layers=text.get("num_hidden_layers"))
        except (OSError, ValueError, AttributeError) as exc:
            fact["error"] = "%s: %s" % (type(exc).__name__, exc)
    return fact


def gpus_fact():
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"smi": False}
    try:
        r = subprocess.run([smi, "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60, universal_newlines=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"smi": True, "rc": -1, "err": str(exc), "gpus": []}
    gpus = [[c.strip() for c in line.split(",")] for line in r.stdout.splitlines() if line.strip()]
    return {"smi": True, "rc": r.returncode, "err": r.stderr.strip()[-400:], "gpus": gpus}


def free_space(path):
    """Free bytes on the filesystem holding path (or its nearest existing parent)."""
    probe = path
    while not os.path.exists(probe) and probe not in ("/", ""):
        probe = os.path.dirname(probe)
    st = os.statvfs(probe or "/")
    return {"path": path, "free": st.f_bavail * st.f_frsize, "total": st.f_blocks * st.f_frsize}


def dir_usage(path):
    """Apparent size and number of files under path (no symlinks followed)."""
    size = files = 0
    if not os.path.isdir(path):
        return {"exists": False, "bytes": 0, "files": 0}
    for base, dirs, names in os.walk(path):
        for name in names:
            try:
                size += os.lstat(os.path.join(base, name)).st_size
                files += 1
            except OSError:
                pass
    return {"exists": True, "bytes": size, "files": files}


def holds_lock(fd):
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def current_run(current):
    try:
        with open(current) as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


def alive_run(lock, current):
    """The alive run's name, or None. A run is alive while its processes hold the runs lock (jobs.py)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None  # no lock file: no run was ever launched here
    try:
        return None if holds_lock(fd) else current_run(current)
    finally:
        os.close(fd)  # releases the lock if we took it


def facts(args):
    want = set(args.get("want", ()))
    env = dict(os.environ)
    out = {"hostname": os.uname()[1]}
    if "code" in want:
        out["code"] = code_fact(args["code"])
    if "venv" in want:
        out["venv"] = venv_fact(args["venv"], env)
    if "model" in want:
        out["model"] = model_fact(args["model"])
    if "gpus" in want:
        out["gpus"] = gpus_fact()
    if "space" in want:
        out["space"] = {"shm": free_space("/dev/shm"), "runs": free_space(args["runs"])}
    if "caches" in want:
        out["caches"] = {name: dict(dir_usage(path), path=path) for name, path in sorted(args["caches"].items())}
    if "runs" in want:
        out["alive"] = alive_run(args["lock"], args["current"])
    return out


def clean_caches(args):
    """Remove the caches while holding the runs lock, so no run can start meanwhile; refuse if one is alive."""
    fd = None
    if os.path.isdir(os.path.dirname(args["lock"])):
        fd = os.open(args["lock"], os.O_CREAT | os.O_RDWR, 0o644)
    alive = None if fd is None or holds_lock(fd) else current_run(args["current"])
    if alive and not args.get("force"):
        return {"refused": alive}
    freed = {}
    for name, path in sorted(args["caches"].items()):
        usage = dir_usage(path)
        if usage["exists"]:
            shutil.rmtree(path, ignore_errors=True)
        usage["left"] = os.path.exists(path)
        usage["path"] = path
        freed[name] = usage
    return {"freed": freed, "alive": alive}


if __name__ == "__main__":
    verb, payload = sys.argv[1], json.loads(sys.argv[2])
    result = {"facts": facts, "clean-caches": clean_caches}[verb](payload)
    sys.stdout.write(json.dumps(result) + "\n")
