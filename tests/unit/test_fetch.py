"""fetch's pure parts: the container's answer is checked, pct's failures are named, never 'checksum'."""

import hashlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_ops import fetch
from dflash_ops.errors import DflashOpsError, RemoteCommandFailed, RunStateError, UntrustedData
from dflash_ops.remote import ship

NAMES = ["config.json", "model.safetensors"]
SHA = "a" * 64
CT = SimpleNamespace(label="pve1/200", host=SimpleNamespace(name="pve1"))


def answer(directory="/root/runs/r/checkpoints/step-3", files=None):
    return {"dir": directory, "files": files if files is not None else
            [{"name": n, "size": 10, "sha256": SHA} for n in NAMES]}


def test_a_good_answer():
    directory, files = fetch.parse_listing(answer(), NAMES, "/root/runs", "r")
    assert directory == "/root/runs/r/checkpoints/step-3"
    assert [(f.name, f.size, f.sha256) for f in files] == [(n, 10, SHA) for n in NAMES]


@pytest.mark.parametrize("bad", [
    answer(directory="/root/runs/r/checkpoints/step-3/../../x"),
    answer(directory="/etc"),
    answer(directory="/root/runs/r/checkpoints/step-3\nabc"),
    answer(files=[{"name": "/etc/passwd", "size": 1, "sha256": SHA},
                  {"name": "x", "size": 1, "sha256": SHA}]),
    answer(files=[{"name": n, "size": 1, "sha256": SHA} for n in NAMES + ["../x"]]),
    answer(files=[{"name": n, "size": True, "sha256": SHA} for n in NAMES]),
    answer(files=[{"name": n, "size": -1, "sha256": SHA} for n in NAMES]),
    answer(files=[{"name": n, "size": 1, "sha256": "x\x1b"} for n in NAMES]),
    answer(files="nope"),
    answer(files=[["config.json"], "model.safetensors"]),
    {"error": "x is a symlink: refusing it", "code": "unsafe"},
])
def test_anything_else_is_refused(bad):
    with pytest.raises(UntrustedData):
        fetch.parse_listing(bad, NAMES, "/root/runs", "r")


def test_a_missing_checkpoint_is_run_state():
    with pytest.raises(RunStateError, match="no checkpoint"):
        fetch.raise_refusal(ship.Refusal("pve1/200: fetch", "no-checkpoint",
                                         "no checkpoint yet in /root/runs/r/checkpoints", {}))
    with pytest.raises(UntrustedData, match="symlink"):
        fetch.raise_refusal(ship.Refusal("pve1/200: fetch", "unsafe", "x is a symlink: refusing it", {}))


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                    lambda c: st.lists(c) | st.dictionaries(
    st.text(), c), max_leaves=20))
def test_arbitrary_json_is_a_value_or_one_line(value):
    try:
        fetch.parse_listing(value if isinstance(value, dict) else {"dir": value}, NAMES, "/root/runs", "r")
    except DflashOpsError as exc:
        assert "\n" not in str(exc) and "\x1b" not in str(exc)


FILES = [fetch.RemoteFile("config.json", SHA, 10), fetch.RemoteFile("model.safetensors", "b" * 64, 1000)]
# What a real pct pull prints (exit 0) when the source cannot be read (pct-real.md).
PCT_STDERR = ("dflash-fetch: pull config.json\ndflash-fetch: pull model.safetensors\n"
              "failed to open /root/runs/r/checkpoints/step-3/model.safetensors for reading\n")


def test_a_failed_pull_names_pcts_reason_not_a_checksum():
    landed = fetch.parse_host_check(f"config.json 10 {SHA}\nmodel.safetensors 0 {'e' * 64}\n", FILES)
    with pytest.raises(RemoteCommandFailed, match="pct pull of .*model.safetensors failed: failed to open"):
        fetch.check_pulls(CT, "/d", FILES, landed, fetch.pull_errors(PCT_STDERR), "/to")


def test_a_silent_short_pull_says_so():
    landed = fetch.parse_host_check(f"config.json 10 {SHA}\nmodel.safetensors 512 {'e' * 64}\n", FILES)
    with pytest.raises(RemoteCommandFailed, match="wrote 512 of 1000 bytes .* said nothing"):
        fetch.check_pulls(CT, "/d", FILES, landed, {}, "/to")


def test_a_whole_pull_passes_and_a_changed_one_is_a_mismatch():
    fetch.check_pulls(CT, "/d", FILES, fetch.parse_host_check(
        f"config.json 10 {SHA}\nmodel.safetensors 1000 {'b' * 64}\n", FILES), {}, "/to")
    with pytest.raises(fetch.ChecksumMismatch):
        fetch.check_pulls(CT, "/d", FILES, fetch.parse_host_check(
            f"config.json 10 {SHA}\nmodel.safetensors 1000 {'c' * 64}\n", FILES), {}, "/to")


def test_pct_output_is_shown_visible():
    landed = fetch.parse_host_check("config.json - -\n", FILES)
    with pytest.raises(RemoteCommandFailed) as caught:
        fetch.check_pulls(CT, "/d", FILES, landed, fetch.pull_errors(
            "dflash-fetch: pull config.json\n\x1b]0;title\x07can only pull files from a running VM\n"), "/to")
    assert "\x1b" not in str(caught.value) and "^[]0;title^G" in str(caught.value)


def run_container_side(tmp_path, checkpoint="latest", names=NAMES):
    """remote/fetch.py run here, as the container runs it (system python, the shipped text): its "ok"
    value, or its refusal."""
    payload = json.dumps({"runs": str(tmp_path / "runs"), "run": "r", "checkpoint": checkpoint,
                          "names": names})
    out = subprocess.run([sys.executable, "-S", "-c", ship.LOADER, ship.packed("fetch"), "list", payload],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout.splitlines()[-1])
    return reply.get("ok", reply)


def test_container_side_resolves_latest_and_hashes_in_place(tmp_path):
    ckpt = tmp_path / "runs" / "r" / "checkpoints" / "step-20"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"\x00weights" * 2_000_000)
    (ckpt.parent / "latest").write_text("step-20\n")
    got = run_container_side(tmp_path)
    directory, files = fetch.parse_listing(got, NAMES, str(tmp_path / "runs"), "r")
    assert directory == str(ckpt)
    assert [(f.name, f.size) for f in files] == [("config.json", 2), ("model.safetensors", 16_000_000)]
    assert files[1].sha256 == hashlib.sha256(b"\x00weights" * 2_000_000).hexdigest()
    assert run_container_side(tmp_path, "step-99")["error"] == "no-checkpoint"
    (ckpt.parent / "latest").unlink()
    assert run_container_side(tmp_path)["dir"] == str(ckpt)  # no pointer: the newest complete step
    (ckpt.parent / "latest").write_text("step-20\nx")
    assert run_container_side(tmp_path)["error"] == "unsafe"
    (ckpt.parent / "latest").unlink()
    os.mkfifo(ckpt.parent / "latest")  # a FIFO would block a plain read forever
    assert run_container_side(tmp_path)["error"] == "unsafe"
    assert run_container_side(tmp_path, "step-20", ["../x"])["error"] == "usage"
