"""Every generation mode of CausalQwen on one prompt, side by side, numbers written as digits.

    python examples/generation_modes.py                          # the real Qwen2.5-0.5B, converted on the fly
    python examples/generation_modes.py --model ./trained        # a CausalQwen checkpoint (e.g. from train.py)
    python examples/generation_modes.py --tiny                   # a tiny random model: shows the API only

A freshly converted model has never seen `<NUM>` as a target, so it writes numbers as digit text; a trained one
writes `<NUM>` tokens whose values come from the regression head (their 90% interval is printed below).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from causal_qwen import CausalQwenForCausalLM, CausalQwenTokenizer

QWEN25_DIR = Path.home() / ".cache" / "causal_qwen" / "qwen2.5-0.5b"
MODES = [
    ("standard", dict(mode="standard")),
    ("standard, shared noise", dict(mode="standard", shared_noise=True)),
    ("causal", dict(mode="causal")),
    ("causal, shared individual", dict(mode="causal", shared_individual=True)),
    ("traditional, greedy", dict(mode="traditional", do_sample=False)),
    ("traditional, sampled", dict(mode="traditional", do_sample=True, temperature=0.8, top_p=0.95)),
]


def load(args) -> tuple[CausalQwenForCausalLM, CausalQwenTokenizer]:
    if args.model:
        return CausalQwenForCausalLM.from_pretrained(args.model).eval(), CausalQwenTokenizer.from_pretrained(args.model)
    tokenizer = CausalQwenTokenizer.from_pretrained(args.tokenizer)
    if args.tiny:
        torch.manual_seed(0)
        qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=151_936, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        return CausalQwenForCausalLM.from_qwen(qwen, tokenizer=tokenizer).eval(), tokenizer
    return CausalQwenForCausalLM.from_qwen(args.tokenizer).eval(), tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a saved CausalQwen folder (model and tokenizer)")
    parser.add_argument("--tokenizer", default=str(QWEN25_DIR), help="Qwen2 folder to convert, or its tokenizer")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead of the real one")
    parser.add_argument("--prompt", default="A kilo of apples costs 3.5 dollars, so 4 kilos cost")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model, tokenizer = load(args)
    batch = tokenizer(args.prompt, return_tensors="pt")
    start = batch["input_ids"].shape[1]
    print(f"prompt: {args.prompt!r}\n")
    width = max(len(name) for name, _ in MODES)
    for name, options in MODES:
        out = model.generate(**batch, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True,
                             output_value_scores=True, generator=torch.Generator().manual_seed(args.seed),
                             pad_token_id=tokenizer.pad_token_id, **options)
        new_ids, new_values = out.sequences[0, start:], out.numeric_values[0, start:]
        text = tokenizer.decode(new_ids, numeric_values=new_values, skip_special_tokens=True)
        print(f"{name:<{width}} | {text!r}")
        for step in (new_ids == tokenizer.num_token_id).nonzero().flatten().tolist():
            median, low, high = model.value_interval(out.loc_Y[0, step], out.scale_Y[0, step], coverage=0.9)
            print(f"{'':<{width}} |   number {median.item():.6g}, 90% interval [{low.item():.6g}, {high.item():.6g}]")


if __name__ == "__main__":
    main()
