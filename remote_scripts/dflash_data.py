"""Conversations -> token ids + assistant loss mask, and a resumable batch sampler.

Rows are read by chat_formats (ShareGPT, OpenAI messages, ours; several file types). Conversations
are rendered with the target tokenizer's chat template; the loss mask covers the assistant turns
(from just after `assistant_header` up to and including `end_of_turn`), found in the rendered
text and mapped to tokens through the tokenizer's offsets. Batches are padded to the fixed
max_length so that every step has the same shapes (one compiled graph, no recompiles).
"""

from __future__ import annotations

from dataclasses import dataclass

import provenance
import torch
from chat_formats import DataError, Row, prompt_key, read_dataset

__all__ = ["DataError", "Row", "read_conversations", "load_examples", "data_report", "collate",
           "Sampler"]
OVERLAP_WARN_FRACTION = 0.01


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
    mask = [int(any(a <= s < b for a, b in spans) and e > s) for s, e in encoded["offset_mapping"]]
    return encoded["input_ids"][:max_length], mask[:max_length]


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]
    prompt: str = ""  # chat_formats.prompt_key: the held-out overlap check


def load_examples(path: str, tokenizer, header: str, end: str, max_length: int,
                  max_bad_fraction: float = 0.05, log=None) -> list[Example]:
    examples = []
    for turns in read_conversations(path, max_bad_fraction, log):
        ids, mask = tokenize_conversation(tokenizer, turns, header, end, max_length)
        if sum(mask[:-1]) > 0:  # an anchor needs a masked token with one after it
            examples.append(Example(ids, mask, prompt_key(turns)))
    if not examples:
        raise DataError(f"{path}: no conversation has assistant tokens (assistant_header "
                        f"{header!r} not found in the rendered chat template?)")
    return examples


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
