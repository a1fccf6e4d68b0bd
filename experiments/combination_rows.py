"""Which rows a combination of the context's values can be fitted on: a least-squares probe on `path_fit.py`'s rows.

The path's log- and raw-space combinations (docs/design.md §1b) weigh each earlier number j at position t by a
bilinear form of the query z_t and the key z_{j−1}. With both reduced to their leading principal coordinates
(a_t with a constant, b_j with a constant), the combination is linear in the coefficients M of a_t ⊗ b_j:
r_t = Σ_j a_tᵀ M b_j · v_j (raw) or ln|v*_t| ≈ Σ_j a_tᵀ M b_j · ln|v_j| + cᵀa_t (log, with a constant in log space
for unit factors), a ridge regression. This script fits it on a chosen set of training rows and prints the median
relative error of each template's test and extrapolation targets:

- `--rows all`: every training row with an earlier number (what the start fits on);
- `--rows targets`: only each text's last number (its target), every template together;
- `--rows targets --template T`: only the targets of template T;
- `--rows detected`: the rows whose target is, within `--tolerance`, a product or ratio (log) or a sum or difference
  (raw) of two earlier numbers of its text: what a start could find in the data without knowing the templates;
- `--no-constant`: the log-space fit without its constant, as the path's combination has none.

    python experiments/combination_rows.py --space log --rows targets --template price_total
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import path_fit  # noqa: E402
import run_experiment as experiment  # noqa: E402

from causal_qwen import CausalQwenTokenizer  # noqa: E402
from causal_qwen.cauchy import untransform_values  # noqa: E402
from causal_qwen.context_values import log_of_values  # noqa: E402
from causal_qwen.starts.path import _coordinates  # noqa: E402


def principal(points: torch.Tensor, dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The start's standardised principal coordinates of `points` `[N, H]` alone: `(mean, map)`."""
    no_keys = points.new_zeros(len(points), 0, points.shape[1])
    return _coordinates(points, no_keys, torch.zeros(len(points), 0, dtype=torch.bool), dims)


def stacked(rows: dict) -> tuple[torch.Tensor, ...]:
    queries, keys, values, present = path_fit.context_rows(rows).stacked(len(rows["y"]))
    _, before = keys.double().chunk(2, dim=-1)
    return queries.double(), before, values.double(), present


def features(part, query_basis, key_basis, space: str, constant: bool = True) -> torch.Tensor:
    queries, before, values, present = part
    ones = torch.ones(len(queries), 1, dtype=torch.float64)
    a = torch.cat((ones, (queries - query_basis[0]) @ query_basis[1]), -1)
    b = torch.cat((torch.ones(*before.shape[:2], 1, dtype=torch.float64),
                   (before - key_basis[0]) @ key_basis[1]), -1) * present[..., None]
    v = values if space == "raw" else log_of_values(values, "log")
    summed = (b * v[..., None]).sum(1)
    f = (a[:, :, None] * summed[:, None, :]).flatten(1)
    return f if space == "raw" or not constant else torch.cat((f, a), -1)


def detected(values: torch.Tensor, present: torch.Tensor, target: torch.Tensor, space: str,
             tolerance: float) -> torch.Tensor:
    """`[N]`: whether the target is, within `tolerance`, v_i·v_j or v_i/v_j (log) or v_i ± v_j (raw) for two earlier
    numbers i ≠ j."""
    first, second = values[:, :, None], values[:, None, :]
    pair = present[:, :, None] & present[:, None, :] & ~torch.eye(values.shape[1], dtype=torch.bool)
    if space == "log":
        candidates = (first * second, first / torch.where(second != 0, second, torch.inf))
    else:
        candidates = (first + second, first - second)
    t = target[:, None, None]
    hit = torch.zeros(len(values), dtype=torch.bool)
    for candidate in candidates:
        hit |= ((candidate - t).abs() <= tolerance * t.abs()).logical_and(pair).flatten(1).any(-1)
    return hit & (target != 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows-file", default="runs/path_fit/rows.pt")
    parser.add_argument("--space", choices=("raw", "log"), default="log")
    parser.add_argument("--rows", choices=("all", "targets", "detected"), default="targets")
    parser.add_argument("--tolerance", type=float, default=0.002)
    parser.add_argument("--no-constant", action="store_true")
    parser.add_argument("--template")
    parser.add_argument("--dims", default="4,4", help="principal coordinates of the query and of the key")
    parser.add_argument("--penalty", type=float, default=1e-3)
    args = parser.parse_args()
    saved = torch.load(args.rows_file, weights_only=False)
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    templates = path_fit.train_templates(experiment.PROFILES["cpu"], tokenizer, 0)
    train = stacked(saved["train"])
    queries, before, _, present = train
    dq, dk = (int(d) for d in args.dims.split(","))
    query_basis, key_basis = principal(queries, dq), principal(before[present], dk)
    target = untransform_values(saved["train"]["y"].double(), "symlog")
    count = present.sum(-1)
    last = torch.cat((count[1:] <= count[:-1], torch.tensor([True])))  # a text's numbers are consecutive rows
    keep = present.any(-1) & (target != 0)
    if args.rows == "targets":
        keep &= last
    if args.rows == "detected":
        keep &= detected(train[2], present, target, args.space, args.tolerance)
    if args.template:
        keep &= torch.tensor([name == args.template for name in templates])
    x = features(train, query_basis, key_basis, args.space, not args.no_constant)
    if args.space == "raw":  # relative errors: every row weighs alike whatever its size
        weight = 1 / target.abs()
        x, y = x * weight[:, None], target * weight
    else:
        y = target.abs().log()
    x, y = x[keep], y[keep]
    gram = x.T @ x + args.penalty * len(x) * torch.eye(x.shape[1], dtype=torch.float64)
    m = torch.linalg.solve(gram, x.T @ y)
    chosen = [name for name, kept in zip(templates, keep.tolist(), strict=True) if kept]
    print(f"{args.space}, rows {args.rows}{' of ' + args.template if args.template else ''}: {len(y)} rows "
          f"({', '.join(f'{name} {chosen.count(name)}' for name in sorted(set(chosen)))}), {len(m)} coefficients")
    for split in ("test", "extrapolation"):
        rows = saved[split]
        predicted = features(stacked(rows), query_basis, key_basis, args.space, not args.no_constant) @ m
        predicted = predicted if args.space == "raw" else predicted.exp()
        per: dict[str, list] = {}
        for name, true, guess in zip(rows["templates"], rows["true"], predicted.tolist(), strict=True):
            per.setdefault(name, []).append(experiment.relative_error(guess, true))
        print(f"  {split}: " + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in sorted(per.items())))


if __name__ == "__main__":
    main()
