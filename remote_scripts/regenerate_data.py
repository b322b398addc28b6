"""Rewrite a chat dataset's assistant turns with the target's own greedy answers.

    python regenerate_data.py --target DIR --in DATA --out JSONL [--in DATA --out JSONL ...]
        [--max-new-tokens 256] [--batch-size 32] [--device cpu] [--dtype float32] [--limit N]
        [--max-bad-fraction 0.05] [--samples K --temperature T --seed S] [--self-prompts N
        [--lead-words K]] [--extend]

A drafter is scored by how often it predicts what the target says, so it must be trained on what the
target says (SpecForge's regenerate_train_data.py does the same). Turn by turn: each assistant turn
is replaced by the target's greedy continuation of the conversation so far (earlier assistant turns
already regenerated), stopped at the end-of-turn token or after --max-new-tokens. System and user
turns are kept. With --samples K, each row of the first --in/--out pair (the training split) is also
written K more times (ids `<id>~s1`..`<id>~sK`), each answered turn by turn with tokens drawn at
--temperature from the target (seeded by --seed): more of the target's own distribution from few
prompts; the pairs after the first (held-out) stay greedy only. With --self-prompts N the first pair
also gains N user prompts the target writes itself (Magpie: the chat template rendered up to where a
user's words begin, sampled from there at temperature 1 until the end of the turn), each distinct
from every prompt of every --in (held-out ones included) and from each other, ids `self-<seed>-<n>`;
they are then answered like the rest. A small instruction-tuned target given a thousand human
prompts over-fits them; its own prompts are many more from the same model. They open the way
the model likes to open (SmolLM2: "Can you" begins 29% of 31,035, then "I'm planning", "I'm
considering"), not the way the human prompts do ("What is", "can you", "you are", "How do");
with --lead-words K each one starts instead from the first 1 to K words (uniformly) of a
human-written prompt of the first --in (drawn uniformly, seeded by --seed; never a self prompt's,
never the held-out split's), and the target writes the rest. --extend grows a set made before
instead of remaking it: every --in must be this script's output for this target, with
the same --max-new-tokens and --dtype (its provenance record says so; else one line and nothing
written). Its rows are kept as they are and only the new self prompts are answered (a new --seed:
one already used is refused), and the record adds them to the old one's settings and counts.
The input is any format chat_formats reads (ShareGPT, OpenAI messages, ours; .jsonl, .jsonl.gz,
.json, .parquet, a directory of shards; malformed rows counted and skipped); the output is our
JSONL. Rows keep their id; the output is written to a temp file and renamed, so a crash never leaves
a half-written dataset. Beside it, `<out>.provenance.json` records the target (fingerprint), the
settings and the counts: training checks it (provenance.py). Several --in/--out pairs share one
model load (train and held-out splits). On one device with a plain decoding loop: right for the tiny
pipeline and small sets; for millions of rows on a 27B target an inference server (SGLang, vLLM) is
the tool.
Decoding (`greedy_generate`, the plain decoding eval_dflash.py measures speculative decoding against) is
target_model.py's; here with its grouped attention (`use_grouped_attention`: with a padding mask
and fewer key/value heads than query heads, transformers' sdpa copies every key/value head per
query head on each step; this path reads the KV cache as it is, with the same answers) and its KV
cache reserved up front (`reserve`: each step writes one position where transformers' cache
concatenates the whole cache; finished answers leave the batch a quarter at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import provenance
import torch
from chat_formats import DataError, prompt_key, read_dataset
from target_model import (
    DTYPES,
    TargetLoadError,
    chat_prompt_ids,
    greedy_generate,
    load_target,
    stop_token_ids,
    use_grouped_attention,
)

# ----------------------------------------------------------------------------- dataset

def read_rows(path: str, limit: int | None = None, max_bad_fraction: float = 0.05,
              log=None) -> list[dict]:
    """Chat rows in any supported format -> {"id", "conversations": [{"role", "content"}]}."""
    return [{"id": row.id, "conversations": row.turns}
            for row in read_dataset(path, max_bad_fraction, limit=limit, log=log)]


def _stops_and_pad(tokenizer, model) -> tuple[list[int], int]:
    """What greedy_generate takes to end an answer and to pad a batch."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return stop_token_ids(tokenizer, model), pad


def regenerate(rows: list[dict], tokenizer, model, max_new_tokens: int, batch_size: int,
               log=print, temperature: float = 0.0, generator=None) -> dict:
    """Replace every assistant turn in `rows` (in place); returns counts for the summary.
    Greedy, or sampled at `temperature` > 0 (target_model.greedy_generate)."""
    stops, pad = _stops_and_pad(tokenizer, model)
    stats = {"rows": len(rows), "turns": 0, "changed": 0, "truncated": 0, "tokens": 0}
    rounds = max((sum(t["role"] == "assistant" for t in r["conversations"]) for r in rows),
                 default=0)
    for round_index in range(rounds):
        # (row, turn index) of each row's round_index-th assistant turn
        work = []
        for row in rows:
            spots = [i for i, t in enumerate(row["conversations"]) if t["role"] == "assistant"]
            if round_index < len(spots):
                turn = spots[round_index]
                work.append((row, turn, chat_prompt_ids(tokenizer, row["conversations"][:turn])))
        work.sort(key=lambda item: len(item[2]))  # similar lengths together: less padding
        for start in range(0, len(work), batch_size):
            chunk = work[start:start + batch_size]
            answers = greedy_generate(model, [prompt for _, _, prompt in chunk], max_new_tokens,
                                      stops, pad, temperature, generator, reserve=True)
            for (row, turn, _), answer in zip(chunk, answers, strict=True):
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


COUNTS = ("rows", "turns", "changed", "truncated", "tokens")  # regenerate()'s, in the record

SELF_PROMPT_TOKENS = 96        # a prompt still open after this many tokens is dropped
SELF_PROMPT_TEMPERATURE = 1.0


def user_turn_prefix(tokenizer) -> list[int]:
    """The chat template rendered up to where the first user's words begin (its default system
    turn included): the target continues it with a user prompt of its own."""
    marker = "\u2063SELF-PROMPT\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    if marker not in text:
        raise TargetLoadError("the chat template does not show a user turn's words: no self prompts")
    return tokenizer(text[:text.index(marker)], add_special_tokens=False)["input_ids"]


def self_id(seed: int | None = None) -> str:
    """The id prefix of the self prompts --seed `seed` writes (`self-<seed>-<n>`); of any seed's
    when None: how a row the target wrote is told from a human-written one."""
    return "self-" if seed is None else f"self-{seed}-"


def lead_texts(rows: list[dict]) -> list[str]:
    """The first user turn of each human-written row (not one of our self prompts), stripped:
    what --lead-words takes its openings from."""
    texts = []
    for row in rows:
        first = next((t["content"] for t in row["conversations"] if t["role"] == "user"), "")
        if not row["id"].startswith(self_id()) and first.strip():
            texts.append(first.strip())
    return texts


def self_prompts(tokenizer, model, count: int, batch_size: int, known: list[dict], seed: int,
                 log=print, leads: list[str] | None = None, lead_words: int = 0) -> list[dict]:
    """`count` user prompts sampled from the target (user_turn_prefix), each new: its prompt_key
    is in none of `known` rows nor among the others. Rows with an empty assistant turn to
    answer. Stops early (fewer rows, said in the log) once a whole batch brings nothing new.
    With `lead_words` > 0 each draw begins with the first 1 to `lead_words` words (uniformly) of
    one of `leads` (drawn uniformly, seeded by `seed`) and the target writes the rest: prompts
    that open like the human ones (their questions, their length) rather than like the target's
    favourite few openings."""
    if lead_words and not leads:
        raise DataError("--lead-words: the training input has no human-written prompt to lead with")
    stops, pad = _stops_and_pad(tokenizer, model)
    prefix = user_turn_prefix(tokenizer)
    generator = torch.Generator(device=model.device).manual_seed(seed)
    chooser = random.Random(seed)
    seen = {prompt_key(row["conversations"]) for row in known}
    rows: list[dict] = []
    drawn = 0
    while len(rows) < count:
        size = min(batch_size, 2 * (count - len(rows)))
        openings = [""] * size
        if lead_words:
            openings = [" ".join(chooser.choice(leads).split()[:chooser.randint(1, lead_words)])
                        for _ in range(size)]
        prompts = [prefix + (tokenizer(opening, add_special_tokens=False)["input_ids"]
                             if opening else []) for opening in openings]
        batch = greedy_generate(model, prompts, SELF_PROMPT_TOKENS, stops, pad,
                                SELF_PROMPT_TEMPERATURE, generator, reserve=True)
        drawn += len(batch)
        before = len(rows)
        for opening, answer in zip(openings, batch, strict=True):
            if not answer or answer[-1] not in stops or len(rows) == count:
                continue
            text = (opening + tokenizer.decode(answer[:-1], skip_special_tokens=True)).strip()
            turns = [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
            if text and (key := prompt_key(turns)) not in seen:
                seen.add(key)
                rows.append({"id": f"{self_id(seed)}{len(rows)}", "conversations": turns})
        if len(rows) == before:
            break
    log(f"self prompts: {len(rows)} new of {drawn} drawn")
    return rows


def sampled_copies(rows: list[dict], samples: int) -> list[dict]:
    """`samples` copies of each row (ids `<id>~s1`..), their turns copied: answered by sampling."""
    return [{"id": f"{row['id']}~s{k}",
             "conversations": [dict(turn) for turn in row["conversations"]]}
            for k in range(1, samples + 1) for row in rows]


def extended_record(source: str, rows: list[dict], args) -> dict:
    """What --extend keeps of an input: {"record": its provenance record, "rows": how many}.
    DataError in one line unless the record says this target answered it with the same
    --max-new-tokens and --dtype, or when --seed already made self prompts in it."""
    name = os.path.basename(source)
    try:
        record = provenance.read_record(source)
    except ValueError as exc:
        raise DataError(f"--extend: {exc}") from None
    if reason := provenance.answers_not_from(source, args.target):
        raise DataError(f"--extend: {reason}")
    for key, value in (("max_new_tokens", args.max_new_tokens), ("dtype", args.dtype)):
        if record["settings"].get(key) != value:
            raise DataError(f"--extend: {name} was answered with {key.replace('_', '-')} "
                            f"{record['settings'].get(key)}, not {value}")
    if record["counts"].get("rows") != len(rows):
        raise DataError(f"--extend: {name} has {len(rows)} rows, its record "
                        f"{record['counts'].get('rows')}: not the file the record describes")
    if args.self_prompts and any(row["id"].startswith(self_id(args.seed)) for row in rows):
        raise DataError(f"--extend: {name} has self prompts of --seed {args.seed} already: "
                        "give another seed")
    return {"record": record, "rows": len(rows)}


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
    parser.add_argument("--max-bad-fraction", type=float, default=0.05,
                        help="stop if more of the rows than this are malformed (default 0.05)")
    parser.add_argument("--samples", type=int, default=0,
                        help="the first pair's rows also K times more, sampled (default 0)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature of --samples (default 0.8)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of --samples and --self-prompts (default 0)")
    parser.add_argument("--self-prompts", type=int, default=0, metavar="N",
                        help="the first pair also gains N prompts the target writes (default 0)")
    parser.add_argument("--lead-words", type=int, default=0, metavar="K",
                        help="each self prompt opens with the first 1..K words of a human-written "
                             "training prompt (default 0: the template alone)")
    parser.add_argument("--extend", action="store_true",
                        help="the inputs are this target's answers already: keep them, answer only "
                             "the new self prompts")
    args = parser.parse_args()
    if len(args.sources) != len(args.outputs):
        parser.error(f"{len(args.sources)} --in but {len(args.outputs)} --out: give them in pairs")
    if args.samples < 0 or (args.samples and args.temperature <= 0):
        parser.error("--samples must be >= 0, and --temperature > 0 with it")
    if args.self_prompts < 0:
        parser.error("--self-prompts must be >= 0")
    if args.lead_words < 0 or (args.lead_words and not args.self_prompts):
        parser.error("--lead-words must be >= 0, and goes with --self-prompts")
    if args.extend and (args.samples or args.limit):
        parser.error("--extend keeps its inputs whole and answered: not with --samples or --limit")
    try:
        inputs = [read_rows(source, args.limit, args.max_bad_fraction,
                            log=lambda line: print(f"read {line}", flush=True))
                  for source in args.sources]
        kept = [extended_record(source, rows, args) if args.extend else None
                for source, rows in zip(args.sources, inputs, strict=True)]
        tokenizer, model = load_target(args.target, args.device, args.dtype)
        use_grouped_attention(model)  # the KV cache read once per step, not copied per head
        if args.self_prompts:
            inputs[0] += self_prompts(tokenizer, model, args.self_prompts, args.batch_size,
                                      [row for rows in inputs for row in rows], args.seed,
                                      log=lambda line: print(line, flush=True),
                                      leads=lead_texts(inputs[0]), lead_words=args.lead_words)
    except (DataError, TargetLoadError) as exc:
        print(f"regenerate_data: error: {exc}", file=sys.stderr)
        return 2
    for pair, (rows, source, out) in enumerate(zip(inputs, args.sources, args.outputs, strict=True)):
        samples = args.samples if pair == 0 else 0
        settings = {"max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
                    "device": args.device, "limit": args.limit, "decoding": "greedy"}
        if samples:
            settings.update(decoding="greedy + sampled", samples=samples,
                            temperature=args.temperature, seed=args.seed)
        if pair == 0 and args.self_prompts:
            settings.update(self_prompts=args.self_prompts, seed=args.seed,
                            self_prompt_temperature=SELF_PROMPT_TEMPERATURE)
            if args.lead_words:
                settings.update(lead_words=args.lead_words)
        started = time.perf_counter()
        fresh = rows[kept[pair]["rows"]:] if kept[pair] else rows
        stats = regenerate(fresh, tokenizer, model, args.max_new_tokens, args.batch_size,
                           log=lambda line: print(line, flush=True))
        if samples:
            generator = torch.Generator(device=model.device).manual_seed(args.seed)
            copies = sampled_copies(rows, samples)
            sampled = regenerate(copies, tokenizer, model, args.max_new_tokens, args.batch_size,
                                 lambda line: print(f"sampled: {line}", flush=True),
                                 args.temperature, generator)
            rows += copies
            for key in COUNTS:
                stats[key] += sampled[key]
        counts = {k: stats[k] for k in COUNTS}
        if kept[pair]:
            record = kept[pair]["record"]
            settings = {**record["settings"], "extensions": [
                *record["settings"].get("extensions", []),
                {"self_prompts": args.self_prompts if pair == 0 else 0, "seed": args.seed,
                 "rows": len(fresh), "device": args.device,
                 **({"lead_words": args.lead_words} if pair == 0 and args.lead_words else {})}]}
            source = record.get("source", source)
            counts = {k: int(record["counts"].get(k, 0)) + counts[k] for k in counts}
        write_rows(rows, out)
        stats.update(out=out, seconds=round(time.perf_counter() - started, 1))
        stats["provenance"] = provenance.write_record(
            out, os.path.abspath(args.target), os.path.abspath(source), settings, counts)
        kept_line = f"kept {len(rows) - len(fresh)} rows; " if kept[pair] else ""
        print(f"{kept_line}regenerated {stats['turns']} assistant turns in {stats['rows']} rows "
              f"({stats['changed']} changed, {stats['truncated']} cut at {args.max_new_tokens} "
              f"tokens) -> {out} in {stats['seconds']} s", flush=True)
        print("RESULT " + json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
