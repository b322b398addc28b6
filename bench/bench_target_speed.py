"""What a target's precision does to the two target costs of making drafter training data.

    python bench/bench_target_speed.py [--target DIR] [--device cuda:0] [--prompts 2048]
        [--new-tokens 64] [--batch 32] [--length 320]

The model is built from DIR's config.json with random weights (the speed is the shape's, and no
checkpoint is needed). For float32 (full-precision matmuls), float32 with TF32 matmuls and
bfloat16, then float32 and bfloat16 with regenerate_data.py's attention
(target_model.use_grouped_attention: no key/value head copied per query head), then float32 with
that attention and regenerate_data.py's KV cache reserved up front (greedy_generate's `reserve`: no
cache copied per step), it times:
- answering: target_model.greedy_generate (what regenerate_data.py runs) over --prompts random
  prompts of 20-100 tokens in one batch, --new-tokens each (random weights never stop early);
- features: one target forward with every hidden state (what training runs for a row not in the
  feature cache) over --batch rows of --length tokens, the mean of 10 after 3.
Each line gives the rate and its ratio to float32's, measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))

from common import sync  # noqa: E402  (puts remote_scripts on the path)
from target_model import greedy_generate, use_grouped_attention  # noqa: E402

CASES = (("float32", torch.float32, "highest", False, False),
         ("float32, TF32 matmuls", torch.float32, "high", False, False),
         ("bfloat16", torch.bfloat16, "highest", False, False),
         ("float32, grouped attention", torch.float32, "highest", True, False),
         ("bfloat16, grouped attention", torch.bfloat16, "highest", True, False),
         ("float32, grouped attention, reserved cache", torch.float32, "highest", True, True))


def measure(model, device: str, prompts: list[list[int]], new_tokens: int, rows,
            reserve: bool) -> tuple[float, float]:
    """(answer tokens per second, seconds per feature forward)."""
    with torch.no_grad():
        greedy_generate(model, prompts[:8], 2, stop_ids=[-1], reserve=reserve)
        sync(device)
        started = time.perf_counter()
        answers = greedy_generate(model, prompts, new_tokens, stop_ids=[-1], reserve=reserve)
        sync(device)
        generate_s = time.perf_counter() - started
        for _ in range(3):
            model(rows, output_hidden_states=True, use_cache=False, logits_to_keep=1)
        sync(device)
        started = time.perf_counter()
        for _ in range(10):
            model(rows, output_hidden_states=True, use_cache=False, logits_to_keep=1)
        sync(device)
        feature_s = (time.perf_counter() - started) / 10
    return sum(len(a) for a in answers) / generate_s, feature_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="/dev/shm/SmolLM2-135M-Instruct",
                        help="a model directory; only its config.json is read")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--prompts", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=320)
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.target)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    prompts = [torch.randint(1, vocab, (int(n),), generator=generator).tolist()
               for n in torch.randint(20, 100, (args.prompts,), generator=generator)]
    rows = torch.randint(1, vocab, (args.batch, args.length), generator=generator).to(args.device)
    print(f"{config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"random weights, on {args.device}"
          + (f" ({torch.cuda.get_device_name(args.device)})" if args.device.startswith("cuda") else ""))
    baseline = None
    for name, dtype, precision, grouped, reserve in CASES:
        torch.set_float32_matmul_precision(precision)
        if grouped:
            use_grouped_attention(base)  # the rows after this one keep it
        tokens_per_s, feature_s = measure(base.to(args.device, dtype), args.device, prompts,
                                          args.new_tokens, rows, reserve)
        baseline = baseline or (tokens_per_s, feature_s)
        print(f"{name}: answering {tokens_per_s:,.0f} tokens/s ({tokens_per_s / baseline[0]:.2f}x), "
              f"features {feature_s * 1000:.1f} ms per {args.batch} x {args.length} "
              f"({baseline[1] / feature_s:.2f}x)", flush=True)
    torch.set_float32_matmul_precision("highest")
    return 0


if __name__ == "__main__":
    sys.exit(main())
