"""fetch's pure parts: the container's answer is checked, pct's failures are named, never 'checksum'."""

import hashlib
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_ops import fetch
from dflash_ops.errors import DflashOpsError, RemoteCommandFailed, RunStateError, UntrustedData, UsageError
from dflash_ops.remote import ship

NAMES = ["config.json", "model.safetensors"]
SHA = "a" * 64
CT = SimpleNamespace(label="pve1/200", host=SimpleNamespace(name="pve1"))


def answer(directory="/root/runs/r/checkpoints/step-3", files=None):
    return {"dir": directory, "files": files if files is not None else
            [{"name": n, "size": 10, "disk": 4096, "sha256": SHA} for n in NAMES]}


def test_a_good_answer():
    directory, files = fetch.parse_listing(answer(), NAMES, "/root/runs", "r")
    assert directory == "/root/runs/r/checkpoints/step-3"
    assert [(f.name, f.size, f.disk, f.sha256) for f in files] == [(n, 10, 4096, SHA) for n in NAMES]


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


FILES = [fetch.RemoteFile("config.json", SHA, 10, 4096),
         fetch.RemoteFile("model.safetensors", "b" * 64, 1000, 4096)]


def test_a_sparse_file_is_refused_before_a_byte_moves():
    """A checkpoint of 3 GiB of holes occupies 2.2 MiB in the container; copied, it is 3 GiB here."""
    sparse = fetch.RemoteFile("model.safetensors", SHA, 3 << 30, 2_306_867)
    with pytest.raises(UntrustedData, match=r"claims 3221225472 bytes but occupies 2306867 .* sparse"):
        fetch.check_caps("pve1/200", [FILES[0], sparse])
    fetch.check_caps("pve1/200", FILES)  # small files: within 1 MiB of slack
    compressed = fetch.RemoteFile("model.safetensors", SHA, 3 << 30, (3 << 30) * 2 // 3)
    fetch.check_caps("pve1/200", [compressed])  # a compressing file system: within twice


def test_free_space_is_checked_first(tmp_path):
    fetch.check_space(str(tmp_path / "new" / "dir"), FILES)
    huge = fetch.RemoteFile("model.safetensors", SHA, 1 << 60, 1 << 60)
    with pytest.raises(UsageError, match=f"{tmp_path} has .* free; the checkpoint needs"):
        fetch.check_space(str(tmp_path / "new" / "dir"), [huge])


def test_receive_stops_at_the_listed_size_and_its_deadline_grows_with_the_bytes_moved(tmp_path):
    f = fetch.RemoteFile("model.safetensors", fetch.hashlib.sha256(b"x" * 10).hexdigest(), 10, 4096)
    tmp_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    sent = []

    def flood():
        while True:  # a container that never stops sending
            sent.append(1)
            yield b"x" * 4

    with pytest.raises(fetch.ChecksumMismatch, match="12 bytes"):
        fetch.receive(flood(), tmp_fd, f, "/to")
    assert len(sent) == 3  # read up to the first byte past the listed size, then stopped
    os.unlink("model.safetensors", dir_fd=tmp_fd)
    fetch.receive(iter([b"x" * 4, b"x" * 6]), tmp_fd, f, "/to")
    assert (tmp_path / "model.safetensors").read_bytes() == b"x" * 10
    os.unlink("model.safetensors", dir_fd=tmp_fd)
    slow = iter([b"x" * 4, b"x" * 6])
    with pytest.raises(RemoteCommandFailed, match="longer than its timeout"):
        fetch.receive((chunk for chunk in slow if not time.sleep(0.02)), tmp_fd, f, "/to", timeout=0.01)
    os.close(tmp_fd)


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
    assert files[1].disk >= 16_000_000  # written, not sparse: its blocks hold every byte
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


# A drafter's config.json as checkpoints.save_drafter writes it (2 layers, hidden 64): 82,368 parameters,
# counted from a DFlashDrafter built with it; its model.safetensors took 331,864 bytes in fp32.
DRAFTER = {"dtype": "float32", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "dflash_config": {"target_layer_ids": [1, 3], "block_size": 8}}


def test_the_expected_size_counts_the_drafters_parameters_at_its_width():
    assert fetch.expected_size(DRAFTER, with_state=False) == 82_368 * 4
    assert fetch.expected_size({**DRAFTER, "dtype": "bfloat16"}, with_state=False) == 82_368 * 2
    assert fetch.expected_size(DRAFTER, with_state=True) == 82_368 * 4 * 4  # + two moments and a copy
    cap, expected = fetch.default_cap(json.dumps(DRAFTER).encode(), with_state=False)
    assert expected == 82_368 * 4 and cap == int(1.5 * expected) + (64 << 20)
    assert 331_864 < cap  # the real file, header included, is within it


@pytest.mark.parametrize("config", [
    b"{}", b"[]", b"not json", b"[" * 100_000,
    json.dumps({**DRAFTER, "hidden_size": True}).encode(),
    json.dumps({**DRAFTER, "hidden_size": 2**40}).encode(),
    json.dumps({**DRAFTER, "num_hidden_layers": 0}).encode(),
    json.dumps({**DRAFTER, "head_dim": "16"}).encode(),
    json.dumps({**DRAFTER, "dflash_config": {"target_layer_ids": []}}).encode(),
    json.dumps({k: v for k, v in DRAFTER.items() if k != "dflash_config"}).encode(),
])
def test_a_config_that_describes_no_drafter_gives_no_default(config):
    assert fetch.default_cap(config, with_state=False) == (None, None)


def test_the_default_never_passes_its_ceiling():
    huge = {**DRAFTER, "hidden_size": 2**20, "intermediate_size": 2**20, "num_hidden_layers": 4096}
    assert fetch.default_cap(json.dumps(huge).encode(), with_state=True)[0] == fetch.DEFAULT_CEILING


def test_the_total_past_the_cap_is_one_line_naming_the_cap():
    big, fits = (fetch.RemoteFile("model.safetensors", SHA, size, size) for size in (2 << 20, 1 << 20))
    with pytest.raises(UntrustedData, match=r"more than fetch's cap of 1\.0 MiB \(--max-size\); nothing"):
        fetch.check_total("pve1/200", [big], 1 << 20, "--max-size")
    fetch.check_total("pve1/200", [fits], 1 << 20, "x")
