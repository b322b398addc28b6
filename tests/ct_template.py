"""A deployed container's venv and tiny target, built once per test run for all xdist workers
(tests/conftest.py's `template` fixture), and `seed`, which gives them to another container so that its
`invoke deploy` ships only the code: a real deploy costs minutes of pip on 2 cores."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from dflash_ops import sandbox as sandbox_mod
from dflash_ops.errors import ExitStatus

REPO = Path(__file__).resolve().parents[1]


# What a template is made from, besides the container's defaults: the pinned requirements (the venv),
# the script that makes the tiny target, the deploy that runs both and records the torch check, and
# this file. A template kept between runs is used only while all of them are unchanged.
TEMPLATE_INPUTS = ("remote_scripts/requirements.txt", "remote_scripts/make_tiny_target.py",
                   "dflash_ops/deploy.py", "dflash_ops/remote/ship.py", "dflash_ops/remote/prelude.py",
                   "dflash_ops/remote/facts.py", "dflash_ops/remote/release.py", "tests/ct_template.py")


def template_key() -> str:
    """The template's key: a hash of what it is built from (TEMPLATE_INPUTS, the container's defaults
    but the environment its runs get, which neither the venv nor the tiny target depends on)."""
    shaping = {k: v for k, v in sandbox_mod.CONTAINER_DEFAULTS.items() if k not in ("env", "secret_env")}
    digest = hashlib.sha256(repr(sorted(shaping.items())).encode())
    for name in TEMPLATE_INPUTS:
        digest.update(b"\0" + name.encode() + b"\0" + (REPO / name).read_bytes())
    return digest.hexdigest()[:16]


def prune(kept: Path, current: str) -> None:
    """Remove the templates of other keys from the dir that keeps them (each holds a 1.4 GB venv)."""
    for old in kept.glob("ct-template-*"):
        if old.is_dir() and old.name != current:
            shutil.rmtree(old, ignore_errors=True)


def build_template(out: Path, bring_up):
    """A fresh container deployed with the real `invoke deploy`; its venv and tiny target are kept."""
    sb = bring_up(str(out / "state"), containers=(200,))
    try:
        argv = [str(REPO / ".venv/bin/invoke"), "deploy", "--inventory", str(sb.inventory), "--ct", "200"]
        r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900)
        assert r.returncode == ExitStatus.OK, (f"template deploy: exit {r.returncode}\n"
                                   f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        # The deploy's pip writes no bytecode (release.py's venv verb, --no-compile): compile the venv
        # once here, or every container seeded from it would compile what its runs import. Exit status
        # not checked: compileall reports files it cannot compile (tests and templates written for
        # other Pythons).
        venv = sandbox_mod.CONTAINER_DEFAULTS["paths"]["venv"]
        subprocess.run([str(sb.pct), "exec", "200", "--", f"{venv}/bin/python", "-m", "compileall", "-q",
                        "-j", "0", venv], capture_output=True, timeout=900)
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
    venv use a fresh, unseeded container (deployed_box.deployed_box). The template was built in an
    unprivileged container: its files belong to the container's root (uid 100000 on the host), as
    every unprivileged container of the sandbox maps it, so a seeded container owns its venv."""
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
