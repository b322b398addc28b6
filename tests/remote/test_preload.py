"""preload.run, which run_script uses, gives what a plain `python script args` subprocess gives."""

from __future__ import annotations

import os
import subprocess
import sys

import preload
import pytest

PROBE = '''
import atexit, os, sys, threading, time
import torch
print("argv", sys.argv[1:], "cwd", os.getcwd(), "X", os.environ.get("X"), "name", __name__)
print("threads", torch.get_num_threads(), "buffered", not sys.stdout.write_through)
print("to stderr: caf\\u00e9", file=sys.stderr)
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
how = sys.argv[1]
if how == "raise":
    raise ValueError("boom")
if how == "message":
    sys.exit("a message for stderr")
if how == "sleep":
    time.sleep(60)
if how == "stdin":
    print("stdin", repr(sys.stdin.read()))
sys.exit(int(how))
'''


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    path = tmp_path_factory.mktemp("probe") / "probe.py"
    path.write_text(PROBE)
    return str(path)


BASE = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}  # run_script's


def both(probe, how, tmp_path, **env):
    env = {**os.environ, **BASE, **env}
    plain = subprocess.run([sys.executable, probe, how], env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=120, stdin=subprocess.DEVNULL)
    forked = preload.run([probe, how], env, 120, cwd=str(tmp_path))
    return plain, forked


@pytest.fixture(scope="module")
def servers():
    """This module's servers, its own (closed at its end): the counts below see only them. They
    import torch only (the probe's one import), not all of PRELOADED: a third of the start-up."""
    own = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(preload, "_servers", own)
        patch.setattr(preload, "PRELOADED", ("torch",))
        yield own
    for server in own.values():
        server.close()


@pytest.fixture
def forks(servers, monkeypatch):
    """The runs that went through a server."""
    seen = []
    real = preload._Server.run

    def counted(self, argv, *args):
        seen.append(argv)
        return real(self, argv, *args)

    monkeypatch.setattr(preload._Server, "run", counted)
    return seen


@pytest.mark.parametrize("how", ["0", "3", "raise", "message", "stdin"])
def test_a_forked_run_is_a_plain_run(probe, how, tmp_path, forks):
    plain, forked = both(probe, how, tmp_path, X="y")
    assert forks == [[probe, how]]  # it did go through the server
    assert (forked.returncode, forked.stdout) == (plain.returncode, plain.stdout)
    # tracebacks name the same file and line; only the frames above the script differ (runpy's)
    assert forked.stderr.splitlines()[-1:] == plain.stderr.splitlines()[-1:]
    assert forked.stderr.splitlines()[0] == plain.stderr.splitlines()[0] == "to stderr: café"
    assert "threads 1 buffered False" in forked.stdout and "thread joined\natexit ran" in forked.stdout
    assert f"cwd {tmp_path}" in forked.stdout and "X y name __main__" in forked.stdout


@pytest.mark.parametrize("variable", ["OMP_NUM_THREADS", "TORCH_SHOW_CPP_STACKTRACES", "PYTHONHASHSEED"])
def test_a_variable_read_at_start_up_that_differs_gets_a_server_started_with_it(probe, tmp_path, servers,
                                                                                   forks, variable):
    """torch sizes its thread pool from OMP_NUM_THREADS when imported: a fork keeps its server's."""
    both(probe, "0", tmp_path)
    for server in list(servers):
        if server != preload.server_key({**os.environ, **BASE}, preload.PRELOADED):
            servers.pop(server).close()  # room for this test's second server (MAX_SERVERS)
    plain, other = both(probe, "0", tmp_path, **{variable: "1" if variable.startswith("TORCH") else "2"})
    assert len(forks) == 2 and other.returncode == 0 and other.stdout == plain.stdout
    if variable == "OMP_NUM_THREADS":
        assert "threads 2" in other.stdout
    assert len(servers) == 2


def test_a_server_whose_imports_warn_is_not_used(probe, tmp_path, servers, forks, capsys):
    """torch warns at import about an invalid TORCH_SHOW_CPP_STACKTRACES: each plain run shows it."""
    plain, other = both(probe, "0", tmp_path, TORCH_SHOW_CPP_STACKTRACES="2")
    assert forks == [] and "preload server did not start" in capsys.readouterr().err
    assert "Ignoring invalid value for boolean flag TORCH_SHOW_CPP_STACKTRACES" in plain.stderr
    assert (other.returncode, other.stdout, other.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    again = both(probe, "0", tmp_path)[1]  # other settings still fork
    assert again.returncode == 0 and len(forks) == 1


def test_a_timeout_kills_the_run_as_subprocess_run_does(probe, tmp_path, servers):
    with pytest.raises(subprocess.TimeoutExpired):
        preload.run([probe, "sleep"], {**os.environ}, 3, cwd=str(tmp_path))
    again = preload.run([probe, "0"], {**os.environ}, 120, cwd=str(tmp_path))  # the server goes on
    assert again.returncode == 0, again.stderr
