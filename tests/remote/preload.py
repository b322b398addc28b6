"""Run a remote script in a fresh process without paying for `import torch` + transformers each time.

Each of the tiny training runs, evaluations and data regenerations these tests start spends about
5 s of CPU importing torch and transformers (transformers scans its 3,000 model files), more than
most of them spend working. `run(argv, env, timeout)` instead asks a server that imported those
third-party packages once (per xdist worker) to fork; the child takes the request's environment,
working directory, argv and stdio (passed as file descriptors over a Unix socket), then runs the
script as `__main__` with runpy and exits as `python script.py` would (atexit handlers, thread joins,
an uncaught exception's traceback and exit 1, SystemExit's code). It is the payload's own code in a
fresh process: only the third-party imports are done ahead, and none of the payload's modules.

A fork is not a new interpreter in three ways, and the server guards each:
- values that the interpreter, torch or transformers read from the environment at start-up come
  from the server's environment, not the request's (torch's thread count from OMP_NUM_THREADS, for
  one): a request is forked only by a server started with the same values of every variable
  IMPORT_TIME_ENV names and the same imports (`run(..., modules=)`: the compile-race workers' server
  imports torch, dynamo and inductor instead); others get a server of their own (up to MAX_SERVERS,
  then plain subprocesses);
- a warning printed while importing would show once in the server, not in each run: a server whose
  imports print anything refuses to start, and the runs with its settings are plain subprocesses;
- a thread pool started before the fork would not exist in the child: the server runs no torch op.
DFLASH_TEST_PRELOAD=0 turns it off (every run a plain subprocess), as does a server that fails to
start. Tests about signals and process lifetimes start their scripts with subprocess themselves.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

# What the payload imports from outside the standard library, heaviest first.
PRELOADED = ("torch", "transformers", "transformers.models.auto.modeling_auto",
             "transformers.models.auto.tokenization_auto", "transformers.models.qwen3.modeling_qwen3",
             "tokenizers", "safetensors.torch", "yaml", "numpy")
# Variables read when the interpreter starts or those packages are imported (torch sizes its thread
# pool from OMP_NUM_THREADS then): a request must match the server in all of them to be forked.
IMPORT_TIME_ENV = ("TORCH", "PYTORCH", "CUDA", "HF_", "TRANSFORMERS", "TOKENIZERS", "OMP_", "MKL_", "KMP_",
                   "GOMP_", "PYTHON", "LD_", "MALLOC")


def _env_read_at_import(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


# -- the server (python preload.py SOCKET MODULE...) -----------------------------------------------

def _serve(path: str, started_with: dict[str, str], imports_set: dict[str, str]) -> dict:
    """Accept requests until the worker goes; in a forked child, return the child's request."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    listener.settimeout(1.0)
    print(json.dumps({"ready": True, "env": _env_read_at_import(started_with)}), flush=True)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:
                sys.exit(0)  # the worker that started this server is gone
            continue
        conn.settimeout(None)
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            listener.close()
            for fd, target in zip(fds, (0, 1, 2), strict=True):
                os.dup2(fd, target)
                os.close(fd)
            request["reply"] = conn.detach()
            # What the imports put in the environment (torch sets TORCHINDUCTOR_CACHE_DIR when
            # unset) is there in a plain run too.
            request["env"] = {**imports_set, **request["env"]}
            return request
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            _, status = os.waitpid(pid, 0)
            conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        except OSError:
            pass  # the client went away (it killed the child on a timeout): nothing to tell
        finally:
            conn.close()


def _become(request: dict) -> None:
    """In the forked child: the request's process state, as `python script args` would start with."""
    os.close(request["reply"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # what CPython sets at startup
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False), encoding=sys.stdin.encoding)
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                  encoding=sys.stdout.encoding, errors=sys.stdout.errors,
                                  write_through=unbuffered, line_buffering=False)
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), encoding=sys.stderr.encoding,
                                  errors="backslashreplace", write_through=True)
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))


def _server_main(path: str, modules: list[str]) -> None:
    started_with = dict(os.environ)
    captured = tempfile.TemporaryFile()
    saved = os.dup(2)
    os.dup2(captured.fileno(), 2)
    try:
        for name in modules:
            __import__(name)
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
    captured.seek(0)
    said = captured.read()
    captured.close()
    if said:
        print(json.dumps({"ready": False, "said": said.decode(errors="replace")[-2000:]}), flush=True)
        sys.exit(1)
    imports_set = {k: v for k, v in os.environ.items() if started_with.get(k) != v}
    request = _serve(path, started_with, imports_set)
    _become(request)
    # Exceptions and SystemExit leave through the interpreter's own handling, as in a plain run.
    runpy.run_path(sys.argv[0], run_name="__main__")


# -- the client (the tests' run_script) -------------------------------------------------------------

class _Server:
    def __init__(self, env: dict[str, str], modules: tuple[str, ...]):
        self.dir = tempfile.mkdtemp(prefix="dflash-preload-")
        self.path = os.path.join(self.dir, "s")
        argv = [sys.executable, os.path.abspath(__file__), self.path, *modules]
        self.process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        text=True)
        line = self.process.stdout.readline()
        answer = json.loads(line) if line.startswith("{") else {}
        if not answer.get("ready"):
            self.close()
            raise RuntimeError(f"preload server did not start: {answer or line!r}")
        self.import_env = answer["env"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def run(self, argv: list[str], env: dict[str, str], cwd: str,
            timeout: float) -> subprocess.CompletedProcess:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        devnull = os.open(os.devnull, os.O_RDONLY)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            socket.send_fds(conn, [json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()],
                            [devnull, out_w, err_w])
        finally:
            for fd in (devnull, out_w, err_w):
                os.close(fd)
        replies = conn.makefile("rb")
        pid = json.loads(replies.readline())["pid"]
        chunks = {out_r: [], err_r: []}
        selector = selectors.DefaultSelector()
        for fd in chunks:
            selector.register(fd, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        try:
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    os.kill(pid, signal.SIGKILL)
                    raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
                for key, _ in selector.select(min(left, 1.0)):
                    data = os.read(key.fd, 65536)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
            conn.settimeout(max(deadline - time.monotonic(), 1.0))
            code = json.loads(replies.readline())["exit"]
        finally:
            selector.close()
            replies.close()
            conn.close()
            os.close(out_r)
            os.close(err_r)
        return subprocess.CompletedProcess([sys.executable, *argv], code, _text(chunks[out_r]),
                                           _text(chunks[err_r]))


def _text(chunks: list[bytes]) -> str:
    """As subprocess.run(text=True) decodes: the locale's encoding, universal newlines."""
    import locale

    text = b"".join(chunks).decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")


_servers: dict[str, _Server] = {}  # by server_key: their imports and start-up variables
_failed: set[str] = set()  # keys whose server did not start: their runs are plain subprocesses
MAX_SERVERS = 3  # each holds about 400 MB; a further setting runs as plain subprocesses


def server_key(env: dict[str, str], modules: tuple[str, ...]) -> str:
    """Which server may fork a request: the same imports, the same start-up variables."""
    return json.dumps([list(modules), _env_read_at_import(env)], sort_keys=True)


def run(argv: list[str], env: dict[str, str], timeout: float, cwd: str | None = None,
        modules: tuple[str, ...] | None = None) -> subprocess.CompletedProcess:
    """argv (a script and its arguments) run by this interpreter, as subprocess.run(capture_output=True,
    text=True, stdin=DEVNULL) would: forked by the server started with the same start-up variables
    (started now if there is none) and the same imports (`modules`, default PRELOADED), else as a plain
    subprocess. (stdin is never the worker's: an xdist worker's stdin is its channel to the
    controller.)"""
    cwd = cwd or os.getcwd()
    modules = tuple(modules or PRELOADED)
    key = server_key(env, modules)
    server = _servers.get(key)
    if (server is None and os.environ.get("DFLASH_TEST_PRELOAD", "1") != "0" and key not in _failed
            and len(_servers) < MAX_SERVERS):
        try:
            server = _servers[key] = _Server(env, modules)
            atexit.register(server.close)
        except (OSError, RuntimeError, ValueError) as exc:
            _failed.add(key)
            print(f"preload: running scripts as plain subprocesses ({exc})", file=sys.stderr)
    if server is not None:
        return server.run(argv, env, cwd, timeout)
    return subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


if __name__ == "__main__":
    _server_main(sys.argv[1], sys.argv[2:])
