"""The stand-in pct's view of /proc: a process that is reaped while pct reads its stat file.

`pct stop` polls the container's init until it is gone or a zombie. Between open() and read() of
/proc/PID/stat the process can be reaped, and the read fails with ESRCH (ProcessLookupError); that
race broke `pct stop` with a traceback in CI."""
import builtins
import importlib.machinery
import importlib.util
import io
import json
import os
import shutil
from pathlib import Path

import dflash_ops

PCT = Path(dflash_ops.__file__).parent / "sandbox" / "pct"


def _standin(tmp_path):
    """The stand-in loaded as a module, as it lies in a host's bin/ (it reads ../host.json)."""
    (tmp_path / "bin").mkdir()
    script = shutil.copy(PCT, tmp_path / "bin" / "pct")
    (tmp_path / "host.json").write_text(json.dumps({"node": "pve1"}))
    loader = importlib.machinery.SourceFileLoader("standin_pct", str(script))
    spec = importlib.util.spec_from_loader("standin_pct", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class _Reaped(io.StringIO):
    def read(self, *args):
        raise ProcessLookupError(3, "No such process")


def test_a_process_reaped_between_open_and_read_counts_as_gone(monkeypatch, tmp_path):
    pct = _standin(tmp_path)
    real_open = builtins.open

    def racing_open(path, *args, **kwargs):
        if str(path).startswith("/proc/") and str(path).endswith("/stat"):
            return _Reaped()
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", racing_open)
    assert pct.is_zombie(12345) is True
    assert pct.proc_start_time(12345) is None


def test_a_live_process_is_neither_gone_nor_a_zombie(tmp_path):
    pct = _standin(tmp_path)
    assert pct.is_zombie(os.getpid()) is False
    assert pct.proc_start_time(os.getpid()) is not None
    assert pct.is_zombie(2 ** 22 + 1) is True  # above pid_max: no such process
