"""Write the synthetic chat dataset: train.jsonl and heldout.jsonl next to this file.

Every answer is a deterministic function of its prompt (counting, sequences, repetition,
templated facts), so "what comes next" is learnable even against a random target, and a target
fitted on it (make_tiny_target.py --fit-steps) answers it greedily, which is what regeneration
with the target's own outputs needs. Rows: {"id", "conversations": [{"role", "content"}]}.

    python remote_scripts/data/make_synthetic.py [--train 4000] [--heldout 200] [--seed 0]
"""

from __future__ import annotations

import argparse
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


TASKS = [_count, _count_down, lambda r: _cycle(r, DAYS, "days"),
         lambda r: _cycle(r, MONTHS, "months"), _letters, _say_times, _repeat, _fact]


def conversation(rng: random.Random, index: int, split: str) -> dict:
    turns = []
    for _ in range(rng.choice([1, 1, 2])):
        prompt, answer = rng.choice(TASKS)(rng)
        turns += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return {"id": f"{split}-{index}", "conversations": turns}


def write_split(path: str, count: int, seed: int, split: str, exclude: set | None = None) -> set:
    rng = random.Random(seed)
    seen = set()
    with open(path, "w") as f:
        index = 0
        while index < count:
            row = conversation(rng, index, split)
            key = json.dumps(row["conversations"])
            if key in seen or (exclude and key in exclude):
                continue  # no repeats; held-out conversations never appear in training
            seen.add(key)
            f.write(json.dumps(row) + "\n")
            index += 1
    return seen


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--heldout", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    held = write_split(os.path.join(args.out, "heldout.jsonl"), args.heldout, args.seed + 1,
                       "heldout")
    write_split(os.path.join(args.out, "train.jsonl"), args.train, args.seed, "train",
                exclude=held)
    print(f"wrote {args.train} train and {args.heldout} held-out conversations to {args.out}")


if __name__ == "__main__":
    main()
