"""Generation speed: CausalQwen in standard mode against Qwen2ForCausalLM's greedy search, tokens per second.

Both models are built in one process from the same random Qwen2.5-0.5B-shaped weights (CausalQwen with
`from_qwen`), take the same prompts, and generate exactly `--new-tokens` tokens with the KV cache; runs
alternate between the two and the median is kept. CausalQwen computes its heads at the last position only, and
reads the classification matrix twice per token (W_cls for loc_S and |W_cls| for scale_S) where Qwen2 reads its
lm_head once: that extra read is the floor of the gap. CausalQwen runs twice, with the context-value path of design
§1b (on for new conversions) and without it (`context_values=False`), so that the path's own cost per token shows.

    python benchmarks/bench_generation.py              # 24 layers
    python benchmarks/bench_generation.py --layers 4   # quick
    python benchmarks/bench_generation.py --device cuda --dtype bfloat16 --batches 1 8 64
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from bench_training_step import qwen25_config
from transformers import Qwen2ForCausalLM

from causal_qwen import CausalQwenForCausalLM


def timed(fn, device: str) -> float:
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()

    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(qwen25_config(args.layers)).eval()
    causal = CausalQwenForCausalLM.from_qwen(qwen, num_token_id=151_665).eval()
    plain = CausalQwenForCausalLM.from_qwen(qwen, num_token_id=151_665, context_values=False).eval()
    dtype = getattr(torch, args.dtype)
    qwen, causal, plain = (m.to(args.device, dtype) for m in (qwen, causal, plain))
    common = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens, "pad_token_id": 0,
              "eos_token_id": None}
    print(f"generation, {args.layers} layers, prompt {args.prompt_length}, {args.new_tokens} new tokens, "
          f"{args.dtype}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if args.device.startswith('cuda') else platform.machine()}")
    header = (f"{'batch':>5}{'Qwen2 tok/s':>13}{'Causal tok/s':>14}{'ratio':>8}{'no path tok/s':>15}{'ratio':>8}"
              f"{'path cost':>11}")
    print(header)
    print("-" * len(header))
    for batch in args.batches:
        ids = torch.randint(0, 151_000, (batch, args.prompt_length), generator=torch.Generator().manual_seed(batch))
        ids = ids.to(args.device)
        mask = torch.ones_like(ids)

        def run_qwen(ids=ids, mask=mask):
            qwen.generate(ids, attention_mask=mask, do_sample=False, **common)

        def run_causal(ids=ids, mask=mask):
            causal.generate(ids, attention_mask=mask, mode="standard", **common)

        def run_plain(ids=ids, mask=mask):
            plain.generate(ids, attention_mask=mask, mode="standard", **common)

        run_qwen(), run_causal(), run_plain()  # warm-up
        qwen_s, causal_s, plain_s = [], [], []
        for _ in range(args.repeats):
            qwen_s.append(timed(run_qwen, args.device))
            causal_s.append(timed(run_causal, args.device))
            plain_s.append(timed(run_plain, args.device))
        tokens = batch * args.new_tokens
        q, c, p = (tokens / statistics.median(t) for t in (qwen_s, causal_s, plain_s))
        print(f"{batch:>5}{q:>13.1f}{c:>14.1f}{c / q:>7.2f}x{p:>15.1f}{p / q:>7.2f}x{p / c:>10.3f}x")
    print("goal: ratio >= 0.8x; path cost = time per token with the path over without it")


if __name__ == "__main__":
    main()
