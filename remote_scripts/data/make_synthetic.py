"""Write the synthetic chat dataset: train.jsonl and heldout.jsonl next to this file.

Every answer is a deterministic function of its prompt (counting, sequences, repetition,
templated facts), so "what comes next" is learnable even against a random target, and a target
fitted on it (make_tiny_target.py --fit-steps) answers it greedily, which is what regeneration
with the target's own outputs needs. Rows: {"id", "conversations": [{"role", "content"}]}.

    python remote_scripts/data/make_synthetic.py [--train 4000] [--heldout 200] [--seed 0]
        [--out DIR] [--format dflash|sharegpt|openai]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random

NUMBERS = [str(n) for n in range(100)]
DAYS = "monday tuesday wednesday thursday friday saturday sunday".split()
MONTHS = ("january february march april may june july august september october november "
          "december").split()
LETTERS = list("abcdefghijklmnopqrstuvwxyz")
WORDS = ("red blue green yellow fox dog cat bird tree river stone cloud apple bread light "
         "music small quick happy silver").split()
FACTS = {  # subject -> (relation, value)
    "sky": ("color", "blue"), "grass": ("color", "green"), "banana": ("color", "yellow"),
    "snow": ("color", "white"), "coal": ("color", "black"), "cherry": ("color", "red"),
    "dog": ("sound", "woof"), "cat": ("sound", "meow"), "cow": ("sound", "moo"),
    "duck": ("sound", "quack"), "owl": ("sound", "hoot"), "sheep": ("sound", "baa"),
}
TEMPLATE_WORDS = ("count from to down list the days after months letters say times repeat me "
                  "what is of a color sound makes it spell and then : . , ? ok here are "
                  "sure".split())


def vocabulary() -> list[str]:
    """Every word the generator can emit, in a fixed order (the tiny tokenizer's vocabulary)."""
    words = NUMBERS + DAYS + MONTHS + LETTERS + WORDS + TEMPLATE_WORDS
    for subject, (relation, value) in FACTS.items():
        words += [subject, relation, value]
    return list(dict.fromkeys(words))


def _count(rng):
    start = rng.randrange(0, 80)
    end = start + rng.randrange(4, 16)
    return f"count from {start} to {end}", " ".join(NUMBERS[start:end + 1])


def _count_down(rng):
    start = rng.randrange(20, 100)
    end = start - rng.randrange(4, 16)
    return f"count down from {start} to {end}", " ".join(NUMBERS[end:start + 1][::-1])


def _cycle(rng, items, name):
    first = rng.randrange(len(items))
    n = rng.randrange(3, 10)
    after = [items[(first + i) % len(items)] for i in range(1, n + 1)]
    return f"list {n} {name} after {items[first]}", " ".join(after)


def _letters(rng):
    start = rng.randrange(0, 18)
    end = start + rng.randrange(3, 8)
    return f"spell the letters from {LETTERS[start]} to {LETTERS[end]}", " ".join(LETTERS[start:end + 1])


def _say_times(rng):
    phrase = " ".join(rng.sample(WORDS, rng.randrange(1, 4)))
    n = rng.randrange(2, 5)
    return f"say {phrase} {n} times", " , ".join([phrase] * n) + " ."


def _repeat(rng):
    words = " ".join(rng.choice(WORDS + DAYS) for _ in range(rng.randrange(3, 9)))
    return f"repeat after me : {words}", f"ok : {words} ."


def _fact(rng):
    subject = rng.choice(sorted(FACTS))
    relation, value = FACTS[subject]
    if relation == "color":
        return f"what color is the {subject} ?", f"the color of the {subject} is {value} ."
    return f"what sound does the {subject} make ?", f"the {subject} makes {value} , {value} ."


HELDOUT_SHARE = 0.15  # of the prompt space; held-out conversations use only those prompts
TASKS = [_count, _count_down, lambda r: _cycle(r, DAYS, "days"),
         lambda r: _cycle(r, MONTHS, "months"), _letters, _say_times, _repeat, _fact]


def split_of(prompt: str) -> str:
    """Every prompt belongs to one split, by a hash of its normalised text: no held-out prompt is
    ever asked in training, in any turn (a leaked prompt flatters the held-out metrics)."""
    digest = hashlib.sha256(" ".join(prompt.lower().split()).encode()).digest()
    return "heldout" if digest[0] < 256 * HELDOUT_SHARE else "train"


def conversation(rng: random.Random, index: int, split: str) -> dict:
    turns = []
    for _ in range(rng.choice([1, 1, 2])):
        while True:
            prompt, answer = rng.choice(TASKS)(rng)
            if split_of(prompt) == split:
                break
        turns += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return {"id": f"{split}-{index}", "conversations": turns}


def in_format(row: dict, fmt: str) -> dict:
    """Our row as a ShareGPT or OpenAI-messages row (what users bring from a datasets hub)."""
    if fmt == "sharegpt":
        names = {"user": "human", "assistant": "gpt", "system": "system"}
        return {"id": row["id"], "conversations": [{"from": names[t["role"]], "value": t["content"]}
                                                   for t in row["conversations"]]}
    if fmt == "openai":
        return {"messages": row["conversations"]}
    return row


def write_split(path: str, count: int, seed: int, split: str, fmt: str = "dflash") -> None:
    rng = random.Random(seed)
    seen = set()
    with open(path, "w") as f:
        index = 0
        while index < count:
            row = conversation(rng, index, split)
            key = json.dumps(row["conversations"])
            if key in seen:
                continue  # no repeated conversations
            seen.add(key)
            f.write(json.dumps(in_format(row, fmt)) + "\n")
            index += 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--heldout", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", default="dflash", choices=["dflash", "sharegpt", "openai"],
                        help="row format (the same conversations either way)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    write_split(os.path.join(args.out, "heldout.jsonl"), args.heldout, args.seed + 1, "heldout",
                args.format)
    write_split(os.path.join(args.out, "train.jsonl"), args.train, args.seed, "train", args.format)
    print(f"wrote {args.train} train and {args.heldout} held-out conversations to {args.out}")


if __name__ == "__main__":
    main()
