"""Facts about one container, gathered inside it in one round trip (deploy's probe, doctor).

Shipped after prelude.py (ship.py) to the container's own interpreter: standard library only,
Python >= 3.8, two verbs (`facts`; `needs`, the paths a payload script needs, checked before it
starts) and one JSON object in, the prelude's one answer out. Parsing
lives on the local side (dflash_ops.doctor / deploy, remote/readings.py).

    python -S -c LOADER <prelude + this file, packed> facts '{"code": ..., "want": [...]}'

The prelude's `alive_run` says which run holds the runs lock and its `dir_usage` measures a cache.
It imports only what a no-change deploy needs: subprocess and shutil wait until torch or nvidia-smi
is asked for.
"""

import json
import os

from dflash_ops.remote.prelude import (
    MANIFEST,
    PLAN_FILE,
    REQUIREMENTS_STAMP,
    Refused,
    alive_run,
    check_deadline,
    container_memory,
    dir_usage,
    open_regular,
    read_json,
    read_text,
    serve,
)

# the interpreter's own sha256: hashlib would first load OpenSSL's libcrypto (slower than the hashing here)
try:
    from _sha256 import sha256
except ImportError:  # Python >= 3.12 names it _sha2; a build without either has hashlib's
    try:
        from _sha2 import sha256
    except ImportError:
        from hashlib import sha256

TORCH_RECORD = ".dflash-torch-check.json"  # the last passing torch check and what it depended on
# Run by the venv's interpreter: a broken venv or torch shows up as a non-zero exit with its stderr.
TORCH_CHECK = ("import json, torch; print(json.dumps({'torch': torch.__version__, 'cuda': "
               "torch.version.cuda, 'available': torch.cuda.is_available(), 'count': "
               "torch.cuda.device_count()}))")


def tree_hashes(root):
    """sha256 of every file under root (relative paths), skipping bytecode and the manifest."""
    out = {}
    for base, dirs, names in os.walk(root):
        check_deadline(f"hashing {root}")
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in names:
            path = os.path.join(base, name)
            rel = os.path.relpath(path, root)
            if rel == MANIFEST or name.endswith(".pyc"):
                continue
            try:
                fd = open_regular(path)
            except OSError:
                continue
            with os.fdopen(fd, "rb") as f:
                out[rel] = sha256(f.read()).hexdigest()
    return out


def code_fact(code):
    if not os.path.isdir(code):
        return {"exists": False}
    fact = {"exists": True, "link": os.path.islink(code), "release": os.path.realpath(code),
            "files": tree_hashes(code), "tree": None}
    manifest = read_json(os.path.join(code, MANIFEST), 1 << 24)
    fact["tree"] = manifest.get("tree") if isinstance(manifest, dict) else None
    return fact


def gpu_set(env):
    """What torch's view of the GPUs depends on besides the venv: the device nodes, the driver and
    the visibility variables. Read from files and the environment: no torch, no nvidia-smi."""
    try:
        nodes = sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))
    except OSError:
        nodes = []
    version = read_text("/proc/driver/nvidia/version", 400)
    driver = version.split("\n")[0].strip() if version is not None else None
    visible = {k: env[k] for k in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES") if k in env}
    return {"devices": nodes, "driver": driver, "visible": visible}


def run_torch_check(python, env, record, key):
    """Import torch in the venv; a passing check is recorded under `key`, a failing one removes the record."""
    import subprocess

    try:
        r = subprocess.run([python, "-c", TORCH_CHECK], capture_output=True, env=env, timeout=300, text=True)
        check = {"rc": r.returncode, "out": r.stdout.strip()[-2000:], "err": r.stderr.strip()[-600:]}
    except (OSError, subprocess.TimeoutExpired) as exc:
        check = {"rc": -1, "out": "", "err": str(exc)}
    try:
        if check["rc"] == 0:
            tmp = f"{record}.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({"key": key, "torch": check}, f, sort_keys=True)
            os.replace(tmp, record)
        elif os.path.exists(record):
            os.unlink(record)
    except OSError:
        pass  # a read-only venv still answers; the next call checks again
    return check


def venv_fact(venv, env, torch_check="always"):
    """The venv's interpreter, requirements stamp and torch check. torch_check "recorded": reuse the
    last passing check while the requirements stamp and the GPU set are the same (no torch import);
    "never" (deploy --dry-run): that record or None, never an import, nothing written."""
    python = os.path.join(venv, "bin", "python")
    fact = {"python": os.path.exists(python), "requirements": None, "torch": None}
    stamp = read_text(os.path.join(venv, REQUIREMENTS_STAMP), 200)
    fact["requirements"] = stamp.strip() if stamp is not None else None
    if fact["python"]:
        key = {"requirements": fact["requirements"], "gpus": gpu_set(env)}
        record = os.path.join(venv, TORCH_RECORD)
        recorded = read_json(record) if torch_check in ("recorded", "never") else None
        if (isinstance(recorded, dict) and recorded.get("key") == key
                and isinstance(recorded.get("torch"), dict)):
            fact["torch"] = dict(recorded["torch"], recorded=True)
        elif torch_check != "never":
            fact["torch"] = run_torch_check(python, env, record, key)
    return fact


def model_fact(model):
    """Is there a config.json; for a multimodal config, the text config's shape."""
    path = os.path.join(model, "config.json")
    fact = {"dir": os.path.isdir(model), "config": os.path.isfile(path)}
    if fact["config"]:
        try:
            cfg = read_json(path, 1 << 20)
            if not isinstance(cfg, dict):
                raise ValueError("not a JSON object of at most 1 MiB")
            text = cfg.get("text_config") or cfg
            fact.update(model_type=cfg.get("model_type"), text_model_type=text.get("model_type"),
                        multimodal="text_config" in cfg, hidden_size=text.get("hidden_size"),
                        layers=text.get("num_hidden_layers"))
        except (ValueError, AttributeError) as exc:
            fact["error"] = f"{type(exc).__name__}: {exc}"
    return fact


def gpus_fact():
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"smi": False}
    try:
        r = subprocess.run([smi, "--query-gpu=index,name,memory.total,driver_version",
                            "--format=csv,noheader"],
                           capture_output=True, timeout=60, text=True)
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


FACTS = ("code", "venv", "model", "gpus", "memory", "space", "caches", "runs", "plan")


def facts(args):
    want = args.get("want", ())
    if not isinstance(want, list) or not set(want) <= set(FACTS):
        raise Refused("bad-input", f"want: a list of facts among {', '.join(FACTS)}")
    want = set(want)
    env = dict(os.environ)
    out = {"hostname": os.uname()[1]}
    if "code" in want:
        out["code"] = code_fact(args["code"])
    if "venv" in want:
        out["venv"] = venv_fact(args["venv"], env, args.get("torch_check", "always"))
    if "model" in want:
        out["model"] = model_fact(args["model"])
    if "gpus" in want:
        out["gpus"] = gpus_fact()
    if "memory" in want:
        out["memory"] = container_memory()
    if "space" in want:
        out["space"] = {"shm": free_space("/dev/shm"), "runs": free_space(args["runs"])}
    if "caches" in want:
        out["caches"] = {name: dict(dir_usage(path), path=path)
                         for name, path in sorted(args["caches"].items())}
    if "runs" in want:
        out["alive"] = alive_run(args["runs"])
    if "plan" in want:  # the last `invoke plan` measurement (plan_layout.py --save), for doctor
        out["plan"] = read_json(os.path.join(args["runs"], PLAN_FILE))
    return out


TESTS = {"d": os.path.isdir, "f": os.path.isfile, "e": os.path.exists}
NEEDS_MAX = 100  # paths checked in one call at most (a task names a handful)


def needs(args):
    """`needs` {"cwd", "needs": [[test, path], ...]}: the indexes of the paths that fail their test
    (d: a directory, f: a regular file, e: either; relative paths under `cwd`, symlinks followed as
    test(1) follows them), before a payload script spends its first seconds importing torch. The
    refusal `no-cwd` when `cwd` is not a directory (not deployed yet)."""
    cwd, wanted = args.get("cwd"), args.get("needs")
    if not isinstance(cwd, str) or not cwd.startswith("/"):
        raise Refused("bad-input", "'cwd' is not an absolute path")
    if (not isinstance(wanted, list) or len(wanted) > NEEDS_MAX
            or not all(isinstance(n, list) and len(n) == 2 and n[0] in TESTS and isinstance(n[1], str)
                       and n[1] and "\0" not in n[1] for n in wanted)):
        raise Refused("bad-input", f"'needs' is not a list of at most {NEEDS_MAX} [test, path] pairs, "
                      f"test among {', '.join(TESTS)}")
    if not os.path.isdir(cwd):
        raise Refused("no-cwd", f"{cwd} does not exist")
    return {"missing": [i for i, (test, path) in enumerate(wanted)
                        if not TESTS[test](os.path.join(cwd, path))]}


VERBS = {"facts": facts, "needs": needs}


if __name__ == "__main__":
    serve(VERBS)
