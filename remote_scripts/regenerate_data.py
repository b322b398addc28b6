"""Rewrite a chat dataset's assistant turns with the target's own greedy answers.

    python regenerate_data.py --target DIR --in JSONL --out JSONL [--in JSONL --out JSONL ...]
        [--max-new-tokens 256] [--batch-size 32] [--device cpu] [--dtype float32] [--limit N]

A drafter is scored by how often it predicts what the target says, so it must be trained on what
the target says (SpecForge's regenerate_train_data.py does the same). Turn by turn: each assistant
turn is replaced by the target's greedy continuation of the conversation so far (earlier assistant
turns already regenerated), stopped at the end-of-turn token or after --max-new-tokens. System and
user turns are kept. Rows keep their id; the output is written to a temp file and renamed, so a
crash never leaves a half-written dataset. Several --in/--out pairs share one model load (train and
held-out splits). On one device with a plain decoding loop: right for the tiny pipeline and small
sets; for millions of rows on a 27B target an inference server (SGLang, vLLM) is the tool. Also home of `greedy_generate`, the plain decoding that
eval_dflash.py measures speculative decoding against.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from dflash_data import DataError, read_conversations

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------- decoding

def stop_token_ids(tokenizer, model) -> list[int]:
    """End-of-turn ids: the tokenizer's eos and the generation config's (a list in Qwen3)."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return sorted(i for i in ids if i is not None)


def chat_prompt_ids(tokenizer, turns: list[dict]) -> list[int]:
    """The conversation so far, rendered with the chat template, ready for the assistant's answer."""
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
                    pad_id: int = 0) -> list[list[int]]:
    """Plain greedy decoding with a KV cache: one target forward per new token.

    Prompts are left-padded into one batch (explicit position ids, so padding changes nothing).
    Each answer ends with its first stop token (included) or after max_new_tokens.
    """
    from transformers import DynamicCache

    device = model.device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention[row, width - len(prompt):] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    stops = torch.tensor(stop_ids, device=device)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids, attention_mask=attention, position_ids=positions,
                   past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    answers = torch.empty((len(prompts), 0), dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        token = logits[:, -1].argmax(-1)
        answers = torch.cat([answers, token[:, None]], dim=1)
        done |= torch.isin(token, stops)
        if bool(done.all()) or answers.shape[1] == max_new_tokens:
            break
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        logits = model(token[:, None], attention_mask=attention, position_ids=positions,
                       past_key_values=cache, use_cache=True).logits
    out = []
    for row in answers.tolist():
        ends = [i for i, t in enumerate(row) if t in stop_ids]
        out.append(row[: ends[0] + 1] if ends else row)
    return out


def load_target(path: str, device: str, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(path):
        raise DataError(f"target checkpoint directory not found: {path}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()
    return tokenizer, model


# ----------------------------------------------------------------------------- dataset

def read_rows(path: str, limit: int | None = None) -> list[dict]:
    """JSONL chat rows -> {"id", "conversations": [{"role", "content"}]} (roles normalised)."""
    conversations = read_conversations(path)  # validates every row, says which line is bad
    with open(path) as f:
        ids = [json.loads(line).get("id") for line in f if line.strip()]
    rows = [{"id": row_id if row_id is not None else f"row-{index}", "conversations": turns}
            for index, (row_id, turns) in enumerate(zip(ids, conversations))]
    return rows[:limit] if limit is not None else rows


def regenerate(rows: list[dict], tokenizer, model, max_new_tokens: int, batch_size: int,
               log=print) -> dict:
    """Replace every assistant turn in `rows` (in place); returns counts for the summary."""
    stops = stop_token_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    stats = {"rows": len(rows), "turns": 0, "changed": 0, "truncated": 0, "tokens": 0}
    rounds = max(sum(t["role"] == "assistant" for t in r["conversations"]) for r in rows)
    for round_index in range(rounds):
        # (row, turn index) of each row's round_index-th assistant turn
        work = []
        for row in rows:
            spots = [i for i, t in enumerate(row["conversations"]) if t["role"] == "assistant"]
            if round_index < len(spots):
                work.append((row, spots[round_index]))
        work.sort(key=lambda item: item[1])  # similar lengths together: less padding
        for start in range(0, len(work), batch_size):
            chunk = work[start:start + batch_size]
            prompts = [chat_prompt_ids(tokenizer, row["conversations"][:turn]) for row, turn in chunk]
            answers = greedy_generate(model, prompts, max_new_tokens, stops, pad)
            for (row, turn), answer in zip(chunk, answers):
                finished = bool(answer) and answer[-1] in stops
                text = tokenizer.decode(answer[:-1] if finished else answer,
                                        skip_special_tokens=True).strip()
                stats["turns"] += 1
                stats["tokens"] += len(answer)
                stats["truncated"] += not finished
                stats["changed"] += text != row["conversations"][turn]["content"]
                row["conversations"][turn]["content"] = text
            if (start // batch_size) % 25 == 24:
                log(f"round {round_index + 1}/{rounds}: {start + len(chunk)}/{len(work)} turns")
        log(f"round {round_index + 1}/{rounds}: {len(work)} assistant turns regenerated")
    return stats


def write_rows(rows: list[dict], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temp = f"{path}.tmp-{os.getpid()}"
    with open(temp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="target checkpoint directory")
    parser.add_argument("--in", dest="sources", action="append", required=True,
                        help="chat JSONL to read (repeatable, paired with --out in order)")
    parser.add_argument("--out", dest="outputs", action="append", required=True,
                        help="chat JSONL to write, atomically (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="cpu", help="e.g. cuda:0 or cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--limit", type=int, help="only the first N rows of each input")
    args = parser.parse_args()
    if len(args.sources) != len(args.outputs):
        parser.error(f"{len(args.sources)} --in but {len(args.outputs)} --out: give them in pairs")
    try:
        inputs = [read_rows(source, args.limit) for source in args.sources]
        tokenizer, model = load_target(args.target, args.device, args.dtype)
    except DataError as exc:
        print(f"regenerate_data: error: {exc}", file=sys.stderr)
        return 2
    for rows, out in zip(inputs, args.outputs):
        started = time.perf_counter()
        stats = regenerate(rows, tokenizer, model, args.max_new_tokens, args.batch_size,
                           log=lambda line: print(line, flush=True))
        write_rows(rows, out)
        stats.update(out=out, seconds=round(time.perf_counter() - started, 1))
        print(f"regenerated {stats['turns']} assistant turns in {stats['rows']} rows "
              f"({stats['changed']} changed, {stats['truncated']} cut at {args.max_new_tokens} "
              f"tokens) -> {out} in {stats['seconds']} s", flush=True)
        print("RESULT " + json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
