"""Conversations -> token ids + assistant loss mask, and a resumable batch sampler.

Rows are read by chat_formats (ShareGPT, OpenAI messages, ours; several file types). Conversations
are rendered with the target tokenizer's chat template; the loss mask covers the assistant turns
(from just after `assistant_header` up to and including `end_of_turn`), found in the rendered
text and mapped to tokens through the tokenizer's offsets. Batches are padded to the fixed
max_length so that every step has the same shapes (one compiled graph, no recompiles).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from dataclasses import dataclass

import chat_formats
import provenance
import torch
from chat_formats import DataError, Row, data_files, prompt_key, read_dataset

__all__ = ["DataError", "Row", "read_conversations", "load_examples", "data_report", "collate",
           "Sampler"]
OVERLAP_WARN_FRACTION = 0.01
# Tokenized data kept in data.cache_dir: the newest entries, by last use.
CACHE_KEEP = 8
CACHE_SUFFIX = ".tokens.pt"


def read_conversations(path: str, max_bad_fraction: float = 0.05, log=None) -> list[list[dict]]:
    """The turns of every usable row of a file or shard directory (any format chat_formats reads)."""
    return [row.turns for row in read_dataset(path, max_bad_fraction, log=log)]


def assistant_spans(text: str, header: str, end: str) -> list[tuple[int, int]]:
    spans, start = [], 0
    while (found := text.find(header, start)) >= 0:
        begin = found + len(header)
        stop = text.find(end, begin)
        stop = len(text) if stop < 0 else stop + len(end)
        spans.append((begin, stop))
        start = stop
    return spans


def tokenize_conversation(tokenizer, turns, header: str, end: str, max_length: int):
    """Return (input_ids, loss_mask) lists, truncated to max_length."""
    text = tokenizer.apply_chat_template(turns, tokenize=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = assistant_spans(text, header, end)
    offsets = encoded["offset_mapping"][:max_length]
    return encoded["input_ids"][:max_length], [int(e > s and _in_spans(s, spans)) for s, e in offsets]


def _in_spans(offset: int, spans: list[tuple[int, int]]) -> bool:
    return any(a <= offset < b for a, b in spans)


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]
    prompt: str = ""  # chat_formats.prompt_key: the held-out overlap check


def load_examples(path: str, tokenizer, header: str, end: str, max_length: int,
                  max_bad_fraction: float = 0.05, log=None, limit: int | None = None,
                  cache_dir: str | None = None) -> list[Example]:
    """Every usable conversation of `path` as an Example (token ids, loss mask, prompt key).

    limit: stop tokenizing once that many examples are found (every row is still read and checked).
    cache_dir: keep the result there, keyed by everything it depends on (the data files' bytes, the
    tokenizer and its chat template, the arguments, this code), and read it back instead of
    tokenizing again; the read's report lines go to `log` either way. A cache that cannot be read
    or written is a line in the log, never an error."""
    key = None
    if cache_dir and limit is None and getattr(tokenizer, "backend_tokenizer", None) is not None:
        key = cache_key(path, tokenizer, header, end, max_length, max_bad_fraction)
        cached = _read_cache(cache_dir, key, log)
        if cached is not None:
            return cached
    lines = []

    def keep(line):
        lines.append(line)
        if log:
            log(line)

    examples = []
    for turns in read_conversations(path, max_bad_fraction, keep):
        ids, mask = tokenize_conversation(tokenizer, turns, header, end, max_length)
        if sum(mask[:-1]) > 0:  # an anchor needs a masked token with one after it
            examples.append(Example(ids, mask, prompt_key(turns)))
            if limit is not None and len(examples) >= limit:
                break
    if not examples:
        raise DataError(f"{path}: no conversation has assistant tokens (assistant_header "
                        f"{header!r} not found in the rendered chat template?)")
    if key:
        _write_cache(cache_dir, key, examples, lines, log)
    return examples


def cache_key(path: str, tokenizer, header: str, end: str, max_length: int, max_bad_fraction: float) -> str:
    """What load_examples' result depends on, hashed: a change to any of it is a new key."""
    digest = hashlib.sha256()

    def part(value) -> None:
        data = value if isinstance(value, bytes) else repr(value).encode()
        digest.update(len(data).to_bytes(8, "little") + data)

    for module in (__file__, chat_formats.__file__):  # the code that reads and tokenizes
        with open(module, "rb") as f:
            part(f.read())
    part((header, end, max_length, max_bad_fraction))
    # The tokenizer as it tokenizes: its full definition (vocabulary, merges, normalizer, added
    # tokens) and the chat template that renders the turns.
    part(tokenizer.backend_tokenizer.to_str())
    part(tokenizer.chat_template)
    for shard in data_files(path):
        part(os.path.abspath(shard))  # the report lines replayed from the cache name it
        with open(shard, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        part(b"")
    return digest.hexdigest()[:32]


def _read_cache(cache_dir: str, key: str, log) -> list[Example] | None:
    path = os.path.join(os.path.expanduser(cache_dir), key + CACHE_SUFFIX)
    if not os.path.exists(path):
        return None
    try:
        saved = torch.load(path, weights_only=True)
        lengths = saved["lengths"].tolist()
        ids, masks, prompts = saved["ids"].tolist(), saved["mask"].tolist(), saved["prompts"]
        if len(prompts) != len(lengths) or sum(lengths) != len(ids) or len(ids) != len(masks):
            raise ValueError("inconsistent lengths")
        lines = [str(line) for line in saved["log"]]
        os.utime(path)  # last use: pruning keeps what is used
    except Exception as exc:  # noqa: BLE001 - a damaged entry is tokenized again and replaced
        if log:
            log(f"tokenized cache {path}: unreadable ({type(exc).__name__}: {exc}); tokenizing again")
        return None
    examples, start = [], 0
    for length, prompt in zip(lengths, prompts, strict=True):
        examples.append(Example(ids[start:start + length], masks[start:start + length], prompt))
        start += length
    for line in lines:
        if log:
            log(line)
    if log:
        log(f"{len(examples)} tokenized conversations from the cache ({path})")
    return examples


def _write_cache(cache_dir: str, key: str, examples: list[Example], lines: list[str], log) -> None:
    where = os.path.expanduser(cache_dir)
    saved = {"ids": torch.tensor([t for e in examples for t in e.input_ids], dtype=torch.int64),
             "mask": torch.tensor([m for e in examples for m in e.loss_mask], dtype=torch.uint8),
             "lengths": torch.tensor([len(e.input_ids) for e in examples], dtype=torch.int64),
             "prompts": [e.prompt for e in examples], "log": lines}
    tmp = None
    try:
        os.makedirs(where, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where, prefix=".tmp-", suffix=CACHE_SUFFIX)
        with os.fdopen(fd, "wb") as f:
            torch.save(saved, f)
        os.replace(tmp, os.path.join(where, key + CACHE_SUFFIX))
        tmp = None
        entries = sorted((e for e in os.scandir(where) if e.name.endswith(CACHE_SUFFIX)),
                         key=lambda e: e.stat().st_mtime, reverse=True)
        written = [e for e in entries if not e.name.startswith(".")]
        # what a killed write left (a write in progress is seconds old)
        stale = [e for e in entries if e.name.startswith(".") and e.stat().st_mtime < time.time() - 86400]
        for old in written[CACHE_KEEP:] + stale:
            os.remove(old.path)
    except OSError as exc:
        if log:
            log(f"tokenized cache {where}: not written ({exc.strerror or exc}); the run goes on")
    finally:
        if tmp:
            with contextlib.suppress(OSError):
                os.remove(tmp)


def data_report(paths: list[str], target_path: str, train: list[Example], heldout: list[Example],
                require_target_answers: bool = False) -> dict:
    """What training says about its data at start: whose answers it holds (provenance.py) and how
    many held-out prompts also appear in training. Raises DataError when the answers are not this
    target's and require_target_answers is set."""
    target_print = provenance.fingerprint(target_path)
    reasons = [r for p in paths if (r := provenance.answers_not_from(p, target_path, target_print))]
    report = {"target_answers": not reasons, "warnings": []}
    if reasons:
        line = f"{provenance.NOT_THIS_TARGET} ({'; '.join(reasons)})"
        if require_target_answers:
            raise DataError(f"{line}; data.require_target_answers is set: regenerate the data with "
                            f"this target (`invoke regenerate`)")
        report["warnings"].append(line)
    if heldout:
        seen = {e.prompt for e in train}
        common = sum(e.prompt in seen for e in heldout)
        report["heldout_overlap"] = {"in_train": common, "heldout": len(heldout)}
        if common > OVERLAP_WARN_FRACTION * len(heldout):
            report["warnings"].append(
                f"{common} of {len(heldout)} held-out prompts ({common / len(heldout):.0%}) also "
                f"appear in data.train: held-out metrics flatter the drafter")
    return report


def collate(examples: list[Example], max_length: int, pad_id: int):
    """Fixed-shape tensors [B, max_length]: input_ids, attention_mask, loss_mask."""
    batch = len(examples)
    input_ids = torch.full((batch, max_length), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, max_length), dtype=torch.long)
    loss_mask = torch.zeros((batch, max_length), dtype=torch.float32)
    for row, ex in enumerate(examples):
        n = len(ex.input_ids)
        input_ids[row, :n] = torch.tensor(ex.input_ids)
        attention[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(ex.loss_mask, dtype=torch.float32)
    return input_ids, attention, loss_mask


class Sampler:
    """Shuffled epochs, deterministic from (seed, epoch); the state is two integers."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def take(self, count: int) -> list[int]:
        picked = []
        while len(picked) < count:
            if self.position >= self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            picked.append(self._order[self.position])
            self.position += 1
        return picked

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation()
