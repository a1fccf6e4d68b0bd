"""Throughput of CausalQwenTokenizer against the Qwen2 fast tokenizer it wraps, on text full of numbers.

Both tokenizers are loaded from the same folder and run in the same process on the same batches. The corpus is
generated here, deterministically: English and Chinese sentences with prices, quantities, measurements, dates,
percentages and counts (about one number every 20 bytes). The script prints seconds, MB/s and tokens/s of
each tokenizer (best of `--repeats`) and the ratio CausalQwen / Qwen2 (the goal is at least 0.7); then both
tokenizers, and the number scanner alone, on one string of 1 MB made only of digits and separators: random
characters (the worst case, most runs are rejected and stay digits) and well-formed numbers, with the speed ratio
Qwen2 time / CausalQwen time on each (tests/test_tokenization.py checks what the first encodes to, not its time).

Usage:
    python benchmarks/bench_tokenizer.py [--tokenizer-dir DIR] [--megabytes 2] [--batch-size 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import timeit
from collections.abc import Callable
from pathlib import Path

from transformers import AutoTokenizer

from causal_qwen.numbers import find_numbers, scan_numbers
from causal_qwen.tokenization import CausalQwenTokenizer

DEFAULT_DIR = Path.home() / ".cache" / "causal_qwen" / "qwen2.5-0.5b"

ENGLISH = [
    "The price of {item} rose from ${p} to ${p} in {year}, a change of {pct}%.",
    "We shipped {n} units weighing {w} kg each, {n} of which arrived after {d} days.",
    "Revenue was {big} dollars, up {pct}% from {big} the year before.",
    "The sample measured {w} mm by {w} mm and was heated to {t} degrees for {d} minutes.",
    "Order #{n}: {n} x {item} at {p} each, total {p}; tax {pct}% and a discount of -{p}.",
    "Between {year} and {year} the population grew from {big} to {big} people.",
    "A ratio of {small} means roughly {n} errors per {big} requests, or {sci} per request.",
]
CHINESE = [
    "{item}的价格是{p}元，比去年上涨了{pct}%。",
    "本次共采购{n}件商品，总重{w}公斤，运费{p}元。",
    "{year}年全国产量为{big}吨，同比增长{pct}%，其中第{n}季度占{pct}%。",
    "实验温度为{t}摄氏度，持续{d}分钟，误差约为{small}。",
    "第{n}章共有{n}页，每页约{n}字，阅读需要{d}小时。",
]
ITEMS = ["coffee", "steel", "rice", "paper", "copper", "cotton", "咖啡", "钢材", "大米", "纸张"]


def generate_corpus(megabytes: float, seed: int = 0) -> list[str]:
    """Deterministic documents of mixed English and Chinese sentences with many numbers, about `megabytes` MB."""
    rng = random.Random(seed)
    fields = {
        "p": lambda: f"{rng.randint(1, 9999)}.{rng.randint(0, 99):02d}",
        "pct": lambda: f"{rng.uniform(0, 100):.1f}",
        "n": lambda: str(rng.randint(1, 5000)),
        "w": lambda: f"{rng.uniform(0.1, 500):.2f}",
        "d": lambda: str(rng.randint(1, 90)),
        "t": lambda: str(rng.randint(-40, 1200)),
        "year": lambda: str(rng.randint(1950, 2030)),
        "big": lambda: f"{rng.randint(1, 999)},{rng.randint(0, 999):03d},{rng.randint(0, 999):03d}",
        "small": lambda: f"{rng.random():.4f}",
        "sci": lambda: f"{rng.uniform(1, 9):.2f}e-{rng.randint(3, 9)}",
        "item": lambda: rng.choice(ITEMS),
    }
    target = int(megabytes * 1_000_000)
    documents, size = [], 0
    while size < target:
        sentences = []
        for _ in range(rng.randint(5, 40)):
            template = rng.choice(ENGLISH if rng.random() < 0.6 else CHINESE)
            sentences.append(template.format_map(_Fields(fields)))
        document = " ".join(sentences)
        documents.append(document)
        size += len(document.encode("utf-8"))
    return documents


class _Fields(dict):
    """A `format_map` mapping that draws a fresh value for every placeholder."""

    def __init__(self, fields: dict[str, Callable[[], str]]):
        super().__init__()
        self.fields = fields

    def __missing__(self, key: str) -> str:
        return self.fields[key]()


def digits_and_separators(megabytes: float, seed: int = 0) -> str:
    """Random digits and separators (`.,-+/:eE %` and spaces): the worst case, mostly runs that stay text."""
    rng = random.Random(seed)
    alphabet = "0123456789" * 4 + ".,-+/:eE %" + "  "
    return "".join(rng.choices(alphabet, k=int(megabytes * 1_000_000)))


def numbers_and_separators(megabytes: float, seed: int = 0) -> str:
    """Well-formed numbers of every form (integers, decimals, thousands, exponents, signs) between separators."""
    rng = random.Random(seed)
    forms = [
        lambda: str(rng.randint(0, 10**6)),
        lambda: f"{rng.uniform(-1000, 1000):.3f}",
        lambda: f"{rng.randint(1000, 10**9):,}",
        lambda: f"{rng.uniform(1, 10):.2f}e{rng.randint(-20, 20)}",
        lambda: f"-{rng.randint(1, 999)}",
    ]
    pieces, size = [], 0
    while size < megabytes * 1_000_000:
        piece = rng.choice(forms)() + rng.choice([" ", ", ", "; ", " / ", "\n"])
        pieces.append(piece)
        size += len(piece)
    return "".join(pieces)


def best_time(function: Callable[[], object], repeats: int) -> float:
    return min(timeit.repeat(function, number=1, repeat=repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer-dir", type=Path, default=DEFAULT_DIR, help="Qwen2 or CausalQwen tokenizer folder")
    parser.add_argument("--megabytes", type=float, default=2.0, help="size of the numeric corpus")
    parser.add_argument("--batch-size", type=int, default=256, help="documents per tokenizer call")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement, the best is reported")
    args = parser.parse_args()

    base = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    causal = CausalQwenTokenizer.from_pretrained(args.tokenizer_dir)
    documents = generate_corpus(args.megabytes)
    batches = [documents[i : i + args.batch_size] for i in range(0, len(documents), args.batch_size)]
    megabytes = sum(len(document.encode("utf-8")) for document in documents) / 1e6
    numbers = sum(len(find_numbers(document)) for document in documents)

    def run(tokenizer: Callable) -> int:
        return sum(len(ids) for batch in batches for ids in tokenizer(batch)["input_ids"])

    base_tokens, causal_tokens = run(base), run(causal)  # warm-up, and the token counts
    base_seconds = best_time(lambda: run(base), args.repeats)
    causal_seconds = best_time(lambda: run(causal), args.repeats)

    # One string of 1 MB, the worst case for the number scanner; the scanner alone also on 2 MB (linear time:
    # twice the time for twice the text).
    stress_rows = []
    for name, build in [("random digits and separators", digits_and_separators), ("numbers and separators",
                                                                                   numbers_and_separators)]:
        text, double = build(1.0), build(2.0)
        stress_rows.append((
            name,
            len(find_numbers(text)),
            best_time(lambda text=text: causal(text, verbose=False), args.repeats),
            best_time(lambda text=text: base(text, verbose=False), args.repeats),
            best_time(lambda text=text: scan_numbers(text), args.repeats),
            best_time(lambda double=double: scan_numbers(double), args.repeats),
        ))

    print(
        f"corpus: {len(documents)} documents, {megabytes:.2f} MB, {numbers} numbers, "
        f"batches of {args.batch_size}, best of {args.repeats}"
    )
    print("| tokenizer | seconds | MB/s | tokens | tokens/s |")
    print("|---|---|---|---|---|")
    for name, seconds, tokens in [
        ("Qwen2 (base)", base_seconds, base_tokens),
        ("CausalQwen", causal_seconds, causal_tokens),
    ]:
        print(f"| {name} | {seconds:.3f} | {megabytes / seconds:.2f} | {tokens} | {tokens / seconds:,.0f} |")
    print(f"throughput ratio CausalQwen / Qwen2 (MB/s): {base_seconds / causal_seconds:.2f}x (goal >= 0.7x)")
    print()
    print("| one string of 1 MB | numbers | CausalQwen s | Qwen2 s | ratio Qwen2 / CausalQwen | scanner s | "
          "scanner s, 2 MB |")
    print("|---|---|---|---|---|---|---|")
    for name, count, causal_s, base_s, scan_s, scan_double_s in stress_rows:
        print(f"| {name} | {count} | {causal_s:.3f} | {base_s:.3f} | {base_s / causal_s:.2f}x | {scan_s:.3f} | "
              f"{scan_double_s:.3f} |")

if __name__ == "__main__":
    main()
