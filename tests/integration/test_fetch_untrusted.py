"""`invoke fetch` against a container that lies: what training code can write in its own run directory
(a forged `checkpoints/latest`, symlinks, a checkpoint outside the run) never chooses a path on the
host or here, and fetch refuses it in one line. Planted by a process in the container, driven through
the real CLI against the embedded host; nothing written outside `--to` on either side.

No deploy: fetch needs only the container's system python.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid

import pytest
from training_runs import REPO, Deployed

pytestmark = pytest.mark.integration

RUN = "lies"
ROOT = f"/root/runs/{RUN}/checkpoints"
MARK = f"pwned-{uuid.uuid4().hex[:8]}"
CONFIG, WEIGHTS = b'{"model_type": "qwen3"}\n', os.urandom(300_000)


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
    assert out.returncode == 11, (out.returncode, out.stdout, out.stderr)
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
    # (the host's private dir is removed too; not checked here: other fetches may run on this machine)
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
    assert out.returncode == 2 and "not a directory" in out.stderr, out.stderr
    assert os.listdir(elsewhere) == []


# --- what a real `pct pull` does (pct-real.md): exits 0 when it fails, truncates its destination before
# opening the source, writes short without a word. A host-side wrapper gives the stand-in those habits
# for model.safetensors only; the inventory names it as the host's `pct`.
REAL_PULL = {
    "fails": ': > "$4"; printf "failed to open %s for reading\\n" "$3" >&2; exit 0',
    "short": '"$PCT" "$@" || exit; truncate -s 100 "$4"; exit 0',
}


def real_pct_inventory(box, tmp_path, habit: str) -> str:
    import yaml

    wrapper = tmp_path / "pct-real"
    wrapper.write_text(f'#!/bin/sh\nPCT={box.sandbox.pct}\n'
                       'if [ "$1" = pull ] && [ "${3##*/}" = model.safetensors ]; then '
                       f'{REAL_PULL[habit]}; fi\nexec "$PCT" "$@"\n')
    wrapper.chmod(0o755)
    inv = yaml.safe_load(open(box.inventory))
    for h in inv["hosts"].values():
        h["pct"] = str(wrapper)
    path = tmp_path / "real-pct.yaml"
    path.write_text(yaml.safe_dump(inv))
    return str(path)


@pytest.mark.parametrize("habit,said", [("fails", "failed: failed to open /root/runs/lies/checkpoints/step-3/"
                                                  "model.safetensors for reading"),
                                        ("short",
                                         f"wrote 100 of {len(WEIGHTS)} bytes on host pve1 and said nothing")])
def test_a_failed_pull_names_its_cause_and_leaves_nothing(box, tmp_path, habit, said):
    in_container(box, f"rm -rf /root/runs/{RUN}")
    good_checkpoint(box, f"{ROOT}/step-3")
    to = tmp_path / "out" / "drafter"
    out = box.invoke("fetch", "--run", RUN, "--to", str(to), check=False,
                     inventory=real_pct_inventory(box, tmp_path, habit))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 5, (out.returncode, out.stdout, out.stderr)
    assert len(lines) == 1 and "pct pull of" in lines[0] and said in lines[0], out.stderr
    assert "checksum" not in out.stderr and "sha256 verified" not in out.stdout
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").rglob("*")) == []


def host_temp_dirs() -> list[str]:
    """The host's fetch dirs (the embedded host's /tmp is this machine's) with an owner and a weights file."""
    return [d for d in glob.glob("/tmp/dflash-fetch.*")
            if all(os.path.exists(os.path.join(d, name)) for name in (".owner", "model.safetensors"))]


def test_a_fetch_removes_the_host_dirs_of_fetches_whose_connection_is_gone(box, tmp_path):
    """Only root's own dirs whose `.owner` names a process that no longer runs (or, without `.owner`,
    a day old); a live owner's dir, another user's, a symlink and a fresh unowned dir stay."""
    in_container(box, f"rm -rf /root/runs/{RUN}")
    good_checkpoint(box, f"{ROOT}/step-3")
    alive = subprocess.Popen(["sleep", "600"])
    gone = subprocess.Popen(["sleep", "600"])
    started = {p.pid: open(f"/proc/{p.pid}/stat").read().rsplit(") ", 1)[1].split()[19]  # field 22
               for p in (alive, gone)}
    gone.kill()
    gone.wait()
    made = {}
    try:
        for name, owner in (("gone", gone.pid), ("alive", alive.pid), ("old", None), ("fresh", None),
                            ("other-user", gone.pid)):
            made[name] = tempfile.mkdtemp(prefix="dflash-fetch.", dir="/tmp")
            if owner:
                with open(os.path.join(made[name], ".owner"), "w") as f:
                    f.write(f"{owner} {started[owner]}\n")
        old_time = time.time() - 2 * 86400
        os.utime(made["old"], (old_time, old_time))
        os.chown(made["other-user"], 65534, 65534)
        made["link"] = f"/tmp/dflash-fetch.{uuid.uuid4().hex[:8]}"
        os.symlink(made["gone"], made["link"])
        box.invoke("fetch", "--run", RUN, "--checkpoint", "step-3", "--to", str(tmp_path / "drafter"))
        left = {name for name, path in made.items() if os.path.lexists(path)}
        assert left == {"alive", "fresh", "other-user", "link"}, left
    finally:
        alive.kill()
        alive.wait()
        for path in made.values():
            if os.path.islink(path):
                os.remove(path)
            else:
                shutil.rmtree(path, ignore_errors=True)


def streaming(to) -> bool:
    """Some bytes of the weights are in fetch's temporary directory inside `to`."""
    try:
        return any(f.name == "model.safetensors" and f.stat().st_size > 0
                   for p in to.iterdir() if p.name.startswith(".dflash-fetch-") for f in p.iterdir())
    except OSError:  # not there yet, or already gone
        return False


def test_a_killed_fetch_leaves_nothing_running_or_partial(box, tmp_path):
    """SIGTERM while the weights stream: no file in --to, nothing of fetch left in the container; a
    SIGKILLed one leaves only its temp dir inside --to, which the next fetch removes."""
    import signal

    in_container(box, f"rm -rf /root/runs/{RUN} && mkdir -p {ROOT}/step-3 && "
                      f"printf '{{}}\\n' > {ROOT}/step-3/config.json && "
                      f"head -c 200000000 /dev/urandom > {ROOT}/step-3/model.safetensors")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        to = tmp_path / sig.name / "drafter"
        proc = subprocess.Popen(box.invoke_argv("fetch", "--run", RUN, "--to", str(to)), cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        box.wait_for("the weights to stream",
                     lambda proc=proc, to=to: proc.poll() is not None or streaming(to),
                     timeout=300, every=0.05)
        assert proc.poll() is None, proc.communicate()
        # The host's private dir of this fetch: the one with these 200 MB weights (no other test's).
        [host_copy] = [d for d in host_temp_dirs()
                       if os.path.getsize(os.path.join(d, "model.safetensors")) == 200_000_000]
        proc.send_signal(sig)
        proc.wait(timeout=60)
        if sig == signal.SIGTERM:
            assert proc.returncode == 130, proc.stderr.read()
            assert not to.exists() and list((tmp_path / sig.name).iterdir()) == []
            assert not os.path.exists(host_copy)  # removed by the fetch itself
        else:
            assert [p.name.startswith(".dflash-fetch-") for p in to.iterdir()] == [True]
            assert os.path.exists(host_copy)  # a killed fetch cannot remove its copy on the host ...
            box.invoke("fetch", "--run", RUN, "--to", str(to), "--force", timeout=600)
            assert sorted(os.listdir(to)) == ["SHA256SUMS", "config.json", "model.safetensors"]
            assert not os.path.exists(host_copy)  # ... the next fetch does: its connection is gone
        deadline = time.monotonic() + 60
        while any("zlib" in p or "cat -- /root/runs" in p for p in box.processes()):
            assert time.monotonic() < deadline, box.processes()
            time.sleep(0.5)
