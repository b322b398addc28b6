"""`invoke fetch` against a container that lies: what training code can write in its own run directory
(a forged `checkpoints/latest`, symlinks, a checkpoint outside the run) never chooses a path on the
host or here, and fetch refuses it in one line; nor do its sizes: a sparse file is refused by what it
really occupies. Planted by a process in the container, driven through
the real CLI against the embedded host; nothing written outside `--to` on either side.

No deploy: fetch needs only the container's system python.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
import uuid

import pytest
from training_runs import REPO, Deployed

from dflash_ops.errors import ExitStatus

pytestmark = pytest.mark.integration

RUN = "lies"
ROOT = f"/root/runs/{RUN}/checkpoints"
MARK = f"pwned-{uuid.uuid4().hex[:8]}"
# A drafter's config.json (2 layers, hidden 64, fp32: 329,472 bytes of parameters expected; fetch's
# default cap is 1.5x that + 64 MiB) and weights of about that size.
CONFIG = (b'{"dtype": "float32", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, '
          b'"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, '
          b'"dflash_config": {"target_layer_ids": [1, 3]}, "model_type": "qwen3"}\n')
WEIGHTS = os.urandom(300_000)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def box(sandbox):
    return Deployed(sandbox)


def in_container(box, script: str, *args: str, data: bytes | None = None) -> None:
    """A process in the container writes what training code could write."""
    r = subprocess.run([str(box.sandbox.pct), "exec", "200", "--", "sh", "-c", script, "sh", *args],
                       input=data, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr


def good_checkpoint(box, where: str) -> None:
    for name, data in (("config.json", CONFIG), ("model.safetensors", WEIGHTS)):
        in_container(box, 'mkdir -p "$1" && cat > "$1/$2"', where, name, data=data)


# Each case: a shell script run in ROOT (the run's checkpoints/), after step-1 and /root/outside hold a
# complete checkpoint. The forged lines are what the old listing printed, so the old fetch read them
# as files named by the container.
FORGED = f"{sha(WEIGHTS)} {len(WEIGHTS)}"
CASES = {
    # `latest` with a newline: a forged `<sha> <size> /abs/name` line; the name is also a path in the
    # container that the old `[ -f "$dir/config.json" ]` finds.
    "latest with newline, absolute name": (
        f"mkdir -p 'step-1\n{FORGED} /tmp/{MARK}-abs' && touch 'step-1\n{FORGED} "
        f"/tmp/{MARK}-abs/config.json' 'step-1\n{FORGED} /tmp/{MARK}-abs/model.safetensors' && cp "
        f"step-1/model.safetensors /tmp/{MARK}-abs && printf 'step-1\n{FORGED} /tmp/{MARK}-abs' > latest"),
    "latest with newline, .. name": (
        f"mkdir -p 'step-1\n{FORGED} ../{MARK}' && touch 'step-1\n{FORGED} ../{MARK}/config.json' "
        f"'step-1\n{FORGED} ../{MARK}/model.safetensors' && cp step-1/model.safetensors {MARK} && "
        f"printf 'step-1\n{FORGED} ../{MARK}' > latest"),
    "latest climbs out with ..": "printf '../../../outside\n' > latest",
    "latest is an absolute path": "printf '/root/outside\n' > latest",
    "latest is a symlink": "ln -s /root/outside/pointer latest && printf 'step-1\n' > /root/outside/pointer",
    "checkpoint dir is a symlink out of the run": "ln -s /root/outside step-2 && printf 'step-2\n' > latest",
    "weights are a symlink": "rm step-1/model.safetensors && ln -s /etc/hostname step-1/model.safetensors",
    "config is a symlink (fetched by step-N)": "rm step-1/config.json && ln -s /root/outside/config.json "
                                               "step-1/config.json",
}


@pytest.mark.parametrize("case", CASES)
def test_fetch_refuses_what_the_container_forged(box, case, tmp_path):
    in_container(box, f"rm -rf /root/runs/{RUN} /root/outside /tmp/{MARK}*")
    good_checkpoint(box, f"{ROOT}/step-1")
    good_checkpoint(box, "/root/outside")
    in_container(box, f"cd {ROOT} && " + CASES[case])
    to = tmp_path / "here" / "drafter"
    checkpoint = ["--checkpoint", "step-1"] if "by step-N" in case else []
    before_host = set(os.listdir("/tmp"))
    out = box.invoke("fetch", "--run", RUN, "--to", str(to), *checkpoint, check=False)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == ExitStatus.UNTRUSTED, (out.returncode, out.stdout, out.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "refus" in lines[0], out.stderr
    assert "sha256 verified" not in out.stdout
    # Nothing here outside --to (nor --to itself: nothing was fetched), nothing named by the container
    # in the host's /tmp (the embedded host is this machine: the old fetch wrote /tmp/<MARK> there).
    assert sorted(p.name for p in tmp_path.rglob("*")) == [], list(tmp_path.rglob("*"))
    assert not [n for n in set(os.listdir("/tmp")) - before_host if MARK in n]
    assert not [n for n in os.listdir(tmp_path.parent) if MARK in n]


def test_fetch_brings_a_planted_checkpoint_back_and_leaves_no_temp(box, tmp_path):
    in_container(box, f"rm -rf /root/runs/{RUN}")
    good_checkpoint(box, f"{ROOT}/step-3")
    in_container(box, f"printf 'step-3\n' > {ROOT}/latest")
    to = tmp_path / "drafter"
    out = box.invoke("fetch", "--run", RUN, "--to", str(to))
    assert "sha256 verified" in out.stdout and f"{ROOT}/step-3" in out.stdout
    assert sorted(os.listdir(to)) == ["SHA256SUMS", "config.json", "model.safetensors"]
    assert (to / "model.safetensors").read_bytes() == WEIGHTS and (to / "config.json").read_bytes() == CONFIG
    # --force into a directory where a symlink waits under a checkpoint file's name: replaced, not followed.
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    os.remove(to / "model.safetensors")
    os.symlink(victim, to / "model.safetensors")
    box.invoke("fetch", "--run", RUN, "--to", str(to), "--force")
    assert victim.read_bytes() == b"keep" and not os.path.islink(to / "model.safetensors")
    assert (to / "model.safetensors").read_bytes() == WEIGHTS


def test_fetch_refuses_a_symlink_as_the_destination(box, tmp_path):
    in_container(box, f"rm -rf /root/runs/{RUN}")
    good_checkpoint(box, f"{ROOT}/step-3")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "drafter")
    out = box.invoke("fetch", "--run", RUN, "--to", str(tmp_path / "drafter"), "--force", check=False)
    assert out.returncode == ExitStatus.USAGE and "not a directory" in out.stderr, out.stderr
    assert os.listdir(elsewhere) == []


def test_a_sparse_checkpoint_is_refused_before_a_byte_moves(box, tmp_path):
    """Weights of 1 GiB that occupy a few KiB in the container (holes): once copied whole to the host's
    /tmp and here; now refused by the listing's real sizes (st_blocks), nothing written anywhere."""
    in_container(box, f"rm -rf /root/runs/{RUN} && mkdir -p {ROOT}/step-3 && "
                      f"printf '{{}}\\n' > {ROOT}/step-3/config.json && "
                      f"head -c 4096 /dev/urandom > {ROOT}/step-3/model.safetensors && "
                      f"truncate -s 1G {ROOT}/step-3/model.safetensors && printf 'step-3\\n' > {ROOT}/latest")
    to = tmp_path / "out" / "drafter"
    out = box.invoke("fetch", "--run", RUN, "--to", str(to), check=False, timeout=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == ExitStatus.UNTRUSTED, (out.returncode, out.stdout, out.stderr)
    assert len(lines) == 1 and "model.safetensors claims 1073741824 bytes" in lines[0], out.stderr
    assert "sparse" in lines[0] and "nothing written" in lines[0]
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").rglob("*")) == []


def streaming(to) -> bool:
    """Some bytes of the weights are in fetch's temporary directory inside `to`."""
    try:
        return any(f.name == "model.safetensors" and f.stat().st_size > 0
                   for p in to.iterdir() if p.name.startswith(".dflash-fetch-") for f in p.iterdir())
    except OSError:  # not there yet, or already gone
        return False


def test_a_killed_fetch_leaves_nothing_running_or_partial(box, tmp_path):
    """SIGTERM while the weights stream: no file in --to, nothing of fetch left in the container (its
    `cat` ends with the channel); a SIGKILLed one leaves only its temp dir inside --to, which the next
    fetch removes. Nothing is ever written on the host."""
    import signal

    in_container(box, f"rm -rf /root/runs/{RUN} && mkdir -p {ROOT}/step-3 && "
                      f"printf '{{}}\\n' > {ROOT}/step-3/config.json && "
                      f"head -c 200000000 /dev/urandom > {ROOT}/step-3/model.safetensors")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        to = tmp_path / sig.name / "drafter"
        proc = subprocess.Popen(box.invoke_argv("fetch", "--run", RUN, "--to", str(to), "--max-size", "1G"),
                                cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        box.wait_for("the weights to stream",
                     lambda proc=proc, to=to: proc.poll() is not None or streaming(to),
                     timeout=300, every=0.05)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(sig)
        proc.wait(timeout=60)
        if sig == signal.SIGTERM:
            assert proc.returncode == ExitStatus.INTERRUPTED, proc.stderr.read()
            assert not to.exists() and list((tmp_path / sig.name).iterdir()) == []
        else:
            assert [p.name.startswith(".dflash-fetch-") for p in to.iterdir()] == [True]
            box.invoke("fetch", "--run", RUN, "--to", str(to), "--force", "--max-size", "1G", timeout=600)
            assert sorted(os.listdir(to)) == ["SHA256SUMS", "config.json", "model.safetensors"]
        deadline = time.monotonic() + 60
        while any("zlib" in p or "cat -- /root/runs" in p for p in box.processes()):
            assert time.monotonic() < deadline, box.processes()
            time.sleep(0.5)


def refused_and_nothing_here(out, to, code, words):
    lines = out.stderr.strip().splitlines()
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    assert len(lines) == 1 and all(w in lines[0] for w in words), out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert not to.parent.exists() or list(to.parent.rglob("*")) == [], list(to.parent.rglob("*"))


def test_a_checkpoint_past_the_operators_cap_is_refused_before_a_byte_moves(box, tmp_path):
    in_container(box, f"rm -rf /root/runs/{RUN}")
    good_checkpoint(box, f"{ROOT}/step-3")
    to = tmp_path / "out" / "drafter"
    out = box.invoke("fetch", "--run", RUN, "--to", str(to), "--max-size", "100K", check=False)
    refused_and_nothing_here(out, to, ExitStatus.UNTRUSTED,
                             ["more than fetch's cap of 100.0 KiB (--max-size)", "nothing was written here"])
    out = box.invoke("fetch", "--run", RUN, "--to", str(to), "--max-size", "1M")  # within it: fetched
    assert sorted(os.listdir(to)) == ["SHA256SUMS", "config.json", "model.safetensors"]
    bad = box.invoke("fetch", "--run", RUN, "--to", str(tmp_path / "x"), "--max-size", "lots", check=False)
    assert bad.returncode == ExitStatus.USAGE, bad.stderr
    assert bad.stderr.startswith("error: --max-size 'lots'"), bad.stderr


def test_by_default_a_checkpoint_far_past_its_configs_expected_size_is_refused(box, tmp_path):
    """Real bytes this time (no holes): 80 MB of weights for a drafter config that expects 0.3 MB.
    config.json comes first and sets the cap; the weights never move; nothing stays in --to."""
    in_container(box, f"rm -rf /root/runs/{RUN} && mkdir -p {ROOT}/step-3 && "
                      f"head -c 80000000 /dev/urandom > {ROOT}/step-3/model.safetensors")
    in_container(box, 'cat > "$1"', f"{ROOT}/step-3/config.json", data=CONFIG)
    to = tmp_path / "out" / "drafter"
    out = box.invoke("fetch", "--run", RUN, "--to", str(to), check=False, timeout=300)
    refused_and_nothing_here(out, to, ExitStatus.UNTRUSTED,
                             ["more than fetch's cap of 64.5 MiB", "the default: 321.8 KiB expected from its "
                              "config.json, x1.5 + 64.0 MiB"])
    in_container(box, f"printf '{{}}\\n' > {ROOT}/step-3/config.json")  # no drafter: no default
    out = box.invoke("fetch", "--run", RUN, "--to", str(to), check=False, timeout=300)
    refused_and_nothing_here(out, to, ExitStatus.USAGE, ["describes no drafter", "give --max-size SIZE"])
