"""What the value side's learning costs a training step, and the start: CausalQwen's default step (forward +
backward, the value side held out of the optimizer as `CausalQwenTrainer` holds it) against the same step followed
by the learner's step (`ValueHeadStartCallback.on_step_end`: both read-outs' Adam steps on their rows, the held-out
error, and where the state is the best the read-out's and the widths' write), in one process, steps alternating.

The learner reads 4,096 rows (the start's default `max_positions`) of loc_U of the model's width; its construction
(the whitening of both read-outs, the kinds of the held-out rows) is what learning adds to the start, reported in
seconds beside the step.

    python benchmarks/bench_value_learning.py              # 24 layers of Qwen2.5-0.5B's shape, B=1, S=1024
    python benchmarks/bench_value_learning.py --layers 4   # quick
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from bench_training_step import build_models, make_batch

from causal_qwen.starts import FOLDS, LearningRows, ValueLearner, ValueLearning, value_side_parameters


def learning_rows(rows: int, width: int) -> LearningRows:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(rows, width, generator=g, dtype=torch.float64)
    y = x[:, :8].sum(1) + torch.randn(rows, generator=g, dtype=torch.float64)
    ones = torch.ones(rows, dtype=torch.float64)
    return LearningRows(x, torch.rand(rows, width, generator=g, dtype=torch.float64) * 1e-3, ones,
                        torch.zeros(rows, dtype=torch.float64), ones, y, torch.arange(rows) % FOLDS)


def train_step(model, batch: dict[str, torch.Tensor]) -> None:
    model.zero_grad(set_to_none=True)
    model(batch["input_ids"], numeric_values=batch["numeric_values"], labels=batch["input_ids"]).loss.backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    _, model = build_models(args.layers)
    for param in value_side_parameters(model):  # as the trainer holds them by default
        param.requires_grad_(False)
    batch = make_batch(1, args.seq, with_numbers=True)  # a number every 16th token: 64 at S = 1024
    numbers = int((batch["input_ids"] == model.config.num_token_id).sum())
    rows = learning_rows(args.rows, model.config.causal_size)

    start = time.perf_counter()
    learner = ValueLearner(model.action, rows, ValueLearning(), penalty=1.0, fitted_on_rows=True,
                           abduction=model.abduction)
    built = time.perf_counter() - start

    train_step(model, batch)  # warm-up
    learner.step()
    plain, learning, learner_alone = [], [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        train_step(model, batch)
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        train_step(model, batch)
        middle = time.perf_counter()
        learner.step()
        learning.append(time.perf_counter() - start)
        learner_alone.append(time.perf_counter() - middle)

    print(f"training step, {args.layers} layers, B=1, S={args.seq} with {numbers} numbers, learner on {args.rows} "
          f"rows, torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}")
    step_s, with_s = statistics.median(plain), statistics.median(learning)
    print(f"default step {step_s:.3f} s, with the value side learning {with_s:.3f} s: {with_s / step_s:.3f}x "
          f"(the learner's step alone {statistics.median(learner_alone) * 1e3:.1f} ms)")
    print(f"the learner's construction on {args.rows} rows (added to the start): {built:.2f} s")
    print("goal: step ratio <= 1.5x")


if __name__ == "__main__":
    main()
