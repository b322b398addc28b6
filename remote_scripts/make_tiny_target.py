"""Make a tiny Qwen3 target checkpoint directory locally (nothing downloaded).

A word-level tokenizer over the synthetic data's vocabulary with a ChatML chat template and a
`<|mask|>` token for DFlash, and a small random Qwen3ForCausalLM (tied embeddings), saved with
save_pretrained so that training loads it exactly like a real checkpoint (AutoConfig,
AutoModelForCausalLM, AutoTokenizer from the directory).

--fit-steps N trains the random model for N steps on the synthetic train split, so that its
greedy answers follow the data's patterns (useful when the data is regenerated with the target's
own outputs: a purely random target answers with noise). Default 0: purely random.

--hidden-size/--layers/--vocab-size scale it up (the tokenizer stays the same; the vocabulary is
padded): `--hidden-size 4096 --vocab-size 151936` has Qwen3-8B's layer and LM-head shapes (head_dim
128, 32 heads, 8 KV heads, MLP 12288), for a GPU run of the real scripts at a real drafter shape.
`--device cuda --dtype bfloat16` builds it there.

    python remote_scripts/make_tiny_target.py --out DIR [--fit-steps 0] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data.make_synthetic import vocabulary  # noqa: E402

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<unk>"]
ROLES = ["system", "user", "assistant"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
EMBED_ROW_NORM = 2.0  # std 0.25 at hidden 64
MODEL_SIZE = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def model_size(hidden_size: int | None = None, layers: int | None = None) -> dict:
    """MODEL_SIZE, or scaled to `hidden_size` (MLP 3x, head_dim 128 from 1024 on, KV heads a
    quarter of the heads) and `layers`."""
    size = dict(MODEL_SIZE)
    if hidden_size and hidden_size != size["hidden_size"]:
        head_dim = 128 if hidden_size >= 1024 else 16
        heads = hidden_size // head_dim
        size.update(hidden_size=hidden_size, intermediate_size=3 * hidden_size, head_dim=head_dim,
                    num_attention_heads=heads, num_key_value_heads=max(1, heads // 4))
    if layers:
        size["num_hidden_layers"] = layers
    return size


def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL_TOKENS + ROLES + vocabulary()
    vocab = {word: index for index, word in enumerate(dict.fromkeys(words))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<unk>", mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer, seed: int, size: dict | None = None, vocab_size: int | None = None,
                device: str = "cpu", dtype: torch.dtype = torch.float32):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    size = size or MODEL_SIZE
    torch.manual_seed(seed)
    padded = -(-len(tokenizer) // 64) * 64  # rounded up, as real checkpoints pad the vocab
    config = Qwen3Config(
        vocab_size=max(padded, vocab_size or 0), max_position_embeddings=2048,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **size,
    )
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        # Tied head: with the default 0.02 init every logit is ~0 and the softmax is flat, unlike
        # a trained model's head; rows of norm ~2 give logits of a realistic range.
        model.get_input_embeddings().weight.normal_(0.0, EMBED_ROW_NORM / size["hidden_size"] ** 0.5)
    return model


def fit(model, tokenizer, data_path: str, steps: int, seed: int, batch_size: int = 32):
    """A short next-token fit on the synthetic conversations (whole rendered text)."""
    rows = [json.loads(line) for line in open(data_path)]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        picks = torch.randint(len(rows), (batch_size,), generator=generator).tolist()
        texts = [tokenizer.apply_chat_template(rows[i]["conversations"], tokenize=False)
                 for i in picks]
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            print(f"fit step {step}: loss {loss.item():.3f}", flush=True)
    model.eval()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fit-steps", type=int, default=0,
                        help="train on the synthetic data this many steps (0: purely random)")
    parser.add_argument("--fit-data", default=os.path.join(os.path.dirname(
        os.path.abspath(__file__)), "data", "train.jsonl"))
    parser.add_argument("--hidden-size", type=int, help="scale up (default 64)")
    parser.add_argument("--layers", type=int, help="number of layers (default 6)")
    parser.add_argument("--vocab-size", type=int, help="pad the vocabulary to this size")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.seed, model_size(args.hidden_size, args.layers),
                        args.vocab_size, args.device, getattr(torch, args.dtype))
    if args.fit_steps > 0:
        fit(model, tokenizer, args.fit_data, args.fit_steps, args.seed)
    # Written beside the destination and renamed into place: a full /dev/shm must not leave a
    # config.json without weights, which deploy would take for a finished model and never redo.
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    temp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=os.path.dirname(out))
    try:
        model.save_pretrained(temp)
        tokenizer.save_pretrained(temp)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)  # a partial leftover of an older, non-atomic write
    os.rename(temp, out)
    params = sum(p.numel() for p in model.parameters())
    print(f"tiny target: {params} parameters, vocab {model.config.vocab_size}, "
          f"{model.config.num_hidden_layers} layers -> {args.out}")


if __name__ == "__main__":
    main()
