"""Time of the number scanner (`find_numbers`) on pathological runs, against its own time on half the text.

Each text is one string of digits and separators that a backtracking grammar could read in quadratic time: long
digit runs, dots, commas, dashes, colons, exponents, signs, leading zeros, a long exponent, digit groups, numbers
glued to letters, and short numbers between spaces. The script times `find_numbers` on `--megabytes` MB and on
twice that (best of `--repeats`) and prints both, the throughput, and the ratio of the two times, which is 2 for a
linear scanner and 4 for a quadratic one (a quadratic scanner needs minutes on 1 MB, a linear one well under a
second). tests/test_numbers.py checks what the scanner finds in the same texts; their speed is measured here only.

Usage:
    python benchmarks/bench_number_scanner.py [--megabytes 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable

from causal_qwen.numbers import find_numbers

# The pathological texts of `n` characters (about), by name.
PATHOLOGICAL: dict[str, Callable[[int], str]] = {
    "digits": lambda n: "1" * n,
    "dots": lambda n: "1." * (n // 2),
    "commas": lambda n: "1," * (n // 2),
    "dashes": lambda n: "1-" * (n // 2),
    "colons": lambda n: "12:" * (n // 3),
    "exponents": lambda n: "1e" * (n // 2),
    "signs": lambda n: "-." * (n // 2),
    "zeros": lambda n: "0." + "0" * n + "1",
    "exponent": lambda n: "1e" + "9" * n,
    "groups": lambda n: "9,999" * (n // 5),
    "glued": lambda n: "a1" * (n // 2),
    "spaced": lambda n: "1.5 " * (n // 4),
}


def best_time(function: Callable[[], object], repeats: int) -> float:
    return min(timeit.repeat(function, number=1, repeat=repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=1.0, help="size of the smaller text of each kind")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement, the best is reported")
    args = parser.parse_args()
    size = int(args.megabytes * 1_000_000)

    print(f"find_numbers on {args.megabytes:g} MB and {2 * args.megabytes:g} MB, best of {args.repeats}")
    print(f"| text | numbers | s, {args.megabytes:g} MB | s, {2 * args.megabytes:g} MB | MB/s | ratio (linear 2, "
          "quadratic 4) |")
    print("|---|---|---|---|---|---|")
    for name, build in PATHOLOGICAL.items():
        text, double = build(size), build(2 * size)
        count = len(find_numbers(text))  # also the warm-up
        single_s = best_time(lambda text=text: find_numbers(text), args.repeats)
        double_s = best_time(lambda double=double: find_numbers(double), args.repeats)
        print(f"| {name} | {count} | {single_s:.3f} | {double_s:.3f} | {len(text) / 1e6 / single_s:.1f} | "
              f"{double_s / single_s:.2f} |")


if __name__ == "__main__":
    main()
