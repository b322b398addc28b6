"""Which target wrote a dataset's answers: a record beside regenerated data, checked by training.

Teacher-forced acceptance (the training metric) scores the drafter on the dataset's answers. It
predicts real speculative decoding only when those answers are the target's own greedy output,
so regenerate_data.py writes `<out>.provenance.json` (the target's fingerprint, the settings, the
counts) and training compares it with the target it trains against. Stdlib only.

The fingerprint: sha256 of config.json's settings, and of every weight file's name, size and
content (whole files up to SMALL_FILE bytes; larger ones by three 1 MiB samples, head, middle and
tail, so a 27B target in /dev/shm is fingerprinted in well under a second yet a fine-tune of the
same architecture differs). The settings are the JSON without `transformers_version`, the version
of the library that saved it, keys sorted: one GGUF converted on two machines with different
transformers releases is one target. Records written before this rule hold the sha256 of the
file's bytes, which is still accepted.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

SUFFIX = ".provenance.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
SMALL_FILE = 64 << 20
SAMPLE = 1 << 20
NOT_THIS_TARGET = "acceptance in training metrics is teacher-forced on data not produced by this target"


def record_path(data_path: str) -> str:
    return data_path.rstrip("/") + SUFFIX


def _file_digest(path: str, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= SMALL_FILE:
            for block in iter(lambda: f.read(SAMPLE), b""):
                digest.update(block)
        else:
            for offset in (0, size // 2, size - SAMPLE):
                f.seek(offset)
                digest.update(f.read(SAMPLE))
    return digest.hexdigest()


SAVER_KEYS = ("transformers_version",)


def _config_digests(target_path: str) -> tuple[str, str]:
    """(the settings' digest, the file's bytes' digest) of a checkpoint's config.json."""
    with open(os.path.join(target_path, "config.json"), "rb") as f:
        raw = f.read()
    try:
        settings = json.loads(raw)
    except ValueError:
        settings = None
    if not isinstance(settings, dict):
        return hashlib.sha256(raw).hexdigest(), hashlib.sha256(raw).hexdigest()
    canonical = json.dumps({k: v for k, v in settings.items() if k not in SAVER_KEYS},
                           sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest(), hashlib.sha256(raw).hexdigest()


def fingerprint(target_path: str) -> dict:
    """{"config_sha256", "weights_sha256", "weight_files"} of a checkpoint directory."""
    config = _config_digests(target_path)[0]
    weights = hashlib.sha256()
    names = sorted(n for n in os.listdir(target_path) if n.endswith(WEIGHT_SUFFIXES))
    for name in names:
        path = os.path.join(target_path, name)
        size = os.path.getsize(path)
        weights.update(f"{name}\0{size}\0{_file_digest(path, size)}\n".encode())
    return {"config_sha256": config, "weights_sha256": weights.hexdigest(), "weight_files": len(names)}


def write_record(out_path: str, target_path: str, source: str, settings: dict, counts: dict) -> str:
    record = {"kind": "dflash_data_provenance", "time": time.time(), "source": source,
              "target": {"path": target_path, **fingerprint(target_path)},
              "settings": settings, "counts": counts}
    path = record_path(out_path)
    temp = f"{path}.tmp-{os.getpid()}"
    with open(temp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(temp, path)
    return path


def read_record(data_path: str) -> dict:
    """data_path's record; ValueError (why, in a few words) when it is missing or unreadable."""
    try:
        with open(record_path(data_path)) as f:
            record = json.load(f)
        if not isinstance(record["target"], dict) or not isinstance(record["settings"], dict):
            raise TypeError
        return record
    except FileNotFoundError:
        raise ValueError(f"{os.path.basename(data_path)}: no provenance record, not from "
                         "`invoke regenerate`") from None
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{os.path.basename(data_path)}: provenance record unreadable") from None


def answers_not_from(data_path: str, target_path: str, target_print: dict | None = None) -> str | None:
    """None when data_path's record names this target; else why not, in a few words."""
    try:
        recorded = read_record(data_path)["target"]
    except ValueError as exc:
        return str(exc)
    current = target_print or fingerprint(target_path)
    for key, what in (("weights_sha256", "weights"), ("config_sha256", "config")):
        if recorded.get(key) != current[key] and not (
                key == "config_sha256" and recorded.get(key) == _config_digests(target_path)[1]):
            return (f"{os.path.basename(data_path)}: regenerated by another target ({what} differ "
                    f"from those {recorded.get('path')} had then)")
    return None
