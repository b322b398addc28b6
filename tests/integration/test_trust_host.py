"""`invoke trust-host` says what the known_hosts file holds for the host before it acts: "pinned,
matches", "not pinned" or "CHANGED" (it said "not pinned" for a key pinned and matching)."""

import subprocess
import sys
from pathlib import Path

import paramiko
import pytest
import yaml

from dflash_ops.errors import ExitStatus

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def trust_host(sandbox, tmp_path, known_hosts: str | None, *args):
    data = yaml.safe_load(Path(sandbox.inventory).read_text())
    name, host = next(iter(data["hosts"].items()))
    if known_hosts is not None:
        path = tmp_path / "known_hosts"
        path.write_text(known_hosts)
        host["known_hosts"] = str(path)
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump(data))
    return subprocess.run([sys.executable, "-m", "invoke", "trust-host", "--host", name, "--inventory",
                           str(inventory), *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_a_pinned_key_that_matches_says_so(sandbox, tmp_path):
    r = trust_host(sandbox, tmp_path, None)
    assert r.returncode == ExitStatus.OK, r.stderr
    assert "pinned, matches:" in r.stdout and "not pinned" not in r.stdout


def test_no_entry_is_not_pinned(sandbox, tmp_path):
    r = trust_host(sandbox, tmp_path, "")
    assert r.returncode == ExitStatus.OK, r.stderr
    assert "not pinned: re-run with --fingerprint SHA256:" in r.stdout, r.stderr


def test_another_key_is_changed_and_exits_3(sandbox, tmp_path):
    data = yaml.safe_load(Path(sandbox.inventory).read_text())
    host = next(iter(data["hosts"].values()))
    name = host["address"] if host.get("port", 22) == 22 else f"[{host['address']}]:{host['port']}"
    other = paramiko.ECDSAKey.generate()
    r = trust_host(sandbox, tmp_path, f"{name} {other.get_name()} {other.get_base64()}\n")
    assert r.returncode == ExitStatus.UNREACHABLE, r.stdout + r.stderr
    assert "CHANGED:" in r.stdout and "not pinned" not in r.stdout
    assert r.stderr.startswith("error: host key of") and "CHANGED: nothing pinned" in r.stderr
