"""A deployed container's venv and tiny target, built once per test run for all xdist workers
(tests/conftest.py's `template` fixture), and `seed`, which gives them to another container so that its
`invoke deploy` ships only the code: a real deploy costs minutes of pip on 2 cores."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

from dflash_ops import sandbox as sandbox_mod

REPO = Path(__file__).resolve().parents[1]


def requirements_key() -> str:
    """What the template's venv is built from (the payload's pinned requirements, the container's
    python), as deploy keys the venv."""
    python = sandbox_mod.CONTAINER_DEFAULTS["python"].encode()
    data = python + b"\0" + (REPO / "remote_scripts" / "requirements.txt").read_bytes()
    return hashlib.sha256(data).hexdigest()[:16]


def build_template(out: Path, bring_up):
    """A fresh container deployed with the real `invoke deploy`; its venv and tiny target are kept."""
    sb = bring_up(str(out / "state"), containers=(200,))
    try:
        argv = [str(REPO / ".venv/bin/invoke"), "deploy", "--inventory", str(sb.inventory), "--ct", "200"]
        r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, (f"template deploy: exit {r.returncode}\n"
                                   f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        model = sandbox_mod.CONTAINER_DEFAULTS["paths"]["model"]
        with open(out / "model.tar", "wb") as f:
            subprocess.run([str(sb.pct), "exec", "200", "--", "tar", "-C", os.path.dirname(model), "-cf", "-",
                            os.path.basename(model)], stdout=f, check=True, timeout=120)
    finally:
        sandbox_mod.down(sb.state_dir)
    os.rename(out / "state" / "pve1" / "ct" / "200" / "root" / "venv", out / "venv")


def seed(template: Path, sandbox, host: str = "pve1", vmid: int = 200) -> None:
    """Give a running container the template's venv and tiny target where it has none, as a deploy
    would have left them. The venv is hard-linked, not copied (1.4 GB): a test must not write into a
    seeded venv's files in place (pip and Python replace files, which is fine); tests that change a
    venv use a fresh, unseeded container (deployed_box.deployed_box)."""
    paths = sandbox_mod.CONTAINER_DEFAULTS["paths"]
    root = sandbox.host(host).dir / "ct" / str(vmid) / "root"
    venv = root / paths["venv"].removeprefix("/root/")
    if not venv.exists():
        subprocess.run(["cp", "-al", str(template / "venv"), str(venv)], check=True)
    model = paths["model"]
    with open(template / "model.tar", "rb") as f:
        subprocess.run([str(sandbox.host(host).pct), "exec", str(vmid), "--", "sh", "-c",
                        'test -e "$1/$2/config.json" || tar -C "$1" -xf -', "sh", os.path.dirname(model),
                        os.path.basename(model)], stdin=f, check=True, timeout=120)
