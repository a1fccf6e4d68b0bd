"""Can a weight that is linear in a number's features pick its role exactly? A ratio of two stated values on Qwen.

The path's log-space combination (docs/math.md) writes ℓ_t = Σ_j (q_ℓ·k_ℓ,j)·L(v_j): each earlier number's weight is
linear in its key, a map of the backbone's features z_{j−1} before it. A ratio asks for weights of exactly +1 and −1
on two numbers and 0 on the others, and with L(v) = ln|v| of about 8 (a car's weight in lbs), a weight off by 0.01
moves the answer by 8%. This script measures, on Qwen2.5-0.5B's own features, how close each form of weight can get
once fitted as well as it can be, so that the fit is not what limits it.

The task is the cars rows of `experiments/keep_start.py --task ratio` (each car's year, cylinders, horsepower and
weight stated, then its pounds per horsepower, weight / horsepower to 2 decimals), 128 training rows and the test rows.
The converted model (`from_qwen(folder, context_values=False)`) reads each text once; every earlier number j gives the
features z_{j−1} (`--key before`, the path's combination key) or z_j (`--key own`), in the leading d principal
coordinates of the training rows' keys (standardised, as the path's start works). One template, so the query is the
same on every row and each weight is a function of the key alone. Measured on the test rows (median relative error
of the ratio):

  training median      the baseline;
  roles given          the least-squares weights of L(v_j) with the slot j itself as the role (an upper bound: the
                       one template puts each role in the same slot);
  linear, d            the least-squares weights a·c_j + a_0 of the key's coordinates c_j, the best the combination
                       form can do on these rows for a fixed query (ridge 1e-3, in closed form);
  two pointers, d      ℓ = L(v_a) − L(v_b) with a and b each chosen by a softmax over the earlier numbers of scores
                       linear in c_j, the selection the copies already make; fitted by cross-entropy to the pair
                       (a, b) that writes the target within 0.02 in log units on each training row, as the copies'
                       rows are found (LBFGS, convex);
  two pointers by the value's error, d
                       the same form fitted by the absolute error of ℓ alone from random starts (Adam, 3 seeds), as
                       the path's start fits the locations.

    python experiments/combination_roles.py             # about 3 minutes on 2 cores
    python experiments/combination_roles.py --key own   # keys of the numbers' own features
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import keep_start  # noqa: E402
import run_experiment as experiment  # noqa: E402

from causal_qwen import CausalQwenForCausalLM, CausalQwenTokenizer  # noqa: E402
from causal_qwen.data import NumericExample, tokenize_examples  # noqa: E402

_MATCH = 0.02  # a pair writes the target where |L(v_a) − L(v_b) − L(y)| is at most this


def rows(model, tokenizer, examples: list[NumericExample], shift: int) -> list[tuple[torch.Tensor, ...]]:
    """For each text: the earlier numbers' key features `[J, H]` (z at j + shift), their values `[J]` and the
    target's value, float64."""
    features = tokenize_examples(tokenizer, [ex.text for ex in examples], max_length=128)
    out = []
    for feature in features:
        ids = torch.tensor([feature["input_ids"]])
        values = torch.tensor([feature["numeric_values"]], dtype=torch.float64)
        with torch.no_grad():
            hidden = model(input_ids=ids, numeric_values=values, output_hidden_states=True).hidden_states[-1]
        numbers = (ids[0] == model.config.num_token_id).nonzero()[:, 0]
        earlier = numbers[:-1]
        out.append((hidden[0, earlier + shift].double(), values[0, earlier], float(values[0, numbers[-1]])))
    return out


def median_error(logs: torch.Tensor, data: list) -> float:
    return statistics.median(abs(math.exp(float(p)) - r[2]) / abs(r[2]) for p, r in zip(logs, data, strict=True))


def packed(data: list, mean: torch.Tensor, to_coords: torch.Tensor):
    """Coordinates `[N, J, d + 1]` (a 1 appended), L(v) `[N, J]` and presence `[N, J]`."""
    slots = max(len(r[1]) for r in data)
    coords = torch.zeros(len(data), slots, to_coords.shape[1] + 1, dtype=torch.float64)
    logs = torch.zeros(len(data), slots, dtype=torch.float64)
    present = torch.zeros(len(data), slots, dtype=torch.bool)
    for i, (keys, values, _) in enumerate(data):
        coords[i, :len(values), :-1] = (keys - mean) @ to_coords
        coords[i, :len(values), -1] = 1.0
        logs[i, :len(values)] = values.abs().log()
        present[i, :len(values)] = True
    return coords, logs, present


def pointers(weights: torch.Tensor, coords: torch.Tensor, logs: torch.Tensor, present: torch.Tensor):
    """Two softmax selections over the earlier numbers: the chosen L(v) of each `[N, 2]` and the selections."""
    scores = torch.einsum("njd,pd->npj", coords, weights).masked_fill(~present[:, None], -torch.inf)
    chosen = torch.softmax(scores, -1)
    return (chosen * logs[:, None]).sum(-1), chosen


def matching_pairs(data: list) -> list[tuple[int, int] | None]:
    """The first pair (a, b) of earlier numbers with L(v_a) − L(v_b) within `_MATCH` of L(y), per row."""
    found = []
    for _, values, target in data:
        logs = values.abs().log().tolist()
        found.append(next(((a, b) for a, b in itertools.permutations(range(len(logs)), 2)
                           if abs(logs[a] - logs[b] - math.log(abs(target))) <= _MATCH), None))
    return found


def labelled_pointers(coords: torch.Tensor, present: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """The two selections' score weights `[2, d + 1]` fitted by cross-entropy to `pairs` `[N, 2]` (LBFGS)."""
    weights = torch.zeros(2, coords.shape[-1], dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weights], max_iter=500, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        scores = torch.einsum("njd,pd->npj", coords, weights).masked_fill(~present[:, None], -torch.inf)
        loss = (torch.nn.functional.cross_entropy(scores[:, 0], pairs[:, 0])
                + torch.nn.functional.cross_entropy(scores[:, 1], pairs[:, 1]) + 1e-4 * weights.pow(2).sum())
        loss.backward()
        return loss
    optimizer.step(closure)
    return weights.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-rows", type=int, default=128)
    parser.add_argument("--key", choices=("before", "own"), default="before")
    parser.add_argument("--dims", default="4,16,64,128")
    args = parser.parse_args()
    torch.manual_seed(0)
    splits = keep_start.task_splits("ratio", 160, 0)
    train = splits["train"]
    random.Random(0).shuffle(train)
    train, test = train[:args.train_rows], splits["test"]
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    model = CausalQwenForCausalLM.from_qwen(experiment.QWEN_DIR, context_values=False).eval()
    shift = -1 if args.key == "before" else 0
    fit_rows, test_rows = rows(model, tokenizer, train, shift), rows(model, tokenizer, test, shift)
    target = torch.tensor([math.log(abs(r[2])) for r in fit_rows], dtype=torch.float64)
    print(f"{len(fit_rows)} training rows, {len(test_rows)} test rows; keys z at j{shift:+d}")
    print("| weights | d | train | test |")
    print("|---|---|---|---|")
    median = statistics.median(r[2] for r in fit_rows)
    print(f"| training median | | | {statistics.median(abs(median - r[2]) / abs(r[2]) for r in test_rows):.4f} |")

    def by_slot(data):
        slots = torch.zeros(len(data), 8, dtype=torch.float64)
        for i, (_, values, _) in enumerate(data):
            slots[i, :len(values)] = values.abs().log()
        return slots
    solution = torch.linalg.lstsq(by_slot(fit_rows), target[:, None]).solution[:, 0]
    print(f"| roles given (weights {[round(float(w), 4) for w in solution[:4]]}) | | "
          f"{median_error(by_slot(fit_rows) @ solution, fit_rows):.5f} | "
          f"{median_error(by_slot(test_rows) @ solution, test_rows):.5f} |")

    every_key = torch.cat([r[0] for r in fit_rows])
    mean = every_key.mean(0)
    _, spread, directions = torch.linalg.svd(every_key - mean, full_matrices=False)
    pairs = matching_pairs(fit_rows)
    labelled = [i for i, p in enumerate(pairs) if p is not None]
    for dims in (int(d) for d in args.dims.split(",")):
        to_coords = directions[:dims].T / (spread[:dims] / (len(every_key) - 1) ** 0.5)
        coords, logs, present = packed(fit_rows, mean, to_coords)
        test_coords, test_logs, test_present = packed(test_rows, mean, to_coords)

        features = (coords * logs[..., None]).sum(1)
        gram = features.T @ features + 1e-3 * torch.eye(features.shape[1], dtype=torch.float64)
        linear = torch.linalg.solve(gram, features.T @ target)
        test_features = (test_coords * test_logs[..., None]).sum(1)
        print(f"| linear | {dims} | {median_error(features @ linear, fit_rows):.4f} | "
              f"{median_error(test_features @ linear, test_rows):.4f} |")

        weights = labelled_pointers(coords[labelled], present[labelled],
                                    torch.tensor([pairs[i] for i in labelled]))
        with torch.no_grad():
            chosen, _ = pointers(weights, coords, logs, present)
            test_chosen, selection = pointers(weights, test_coords, test_logs, test_present)
        decisive = float((selection.max(-1).values > 0.99).all(-1).double().mean())
        print(f"| two pointers ({len(labelled)} rows labelled; {decisive:.2f} of test rows picked at > 0.99) | "
              f"{dims} | {median_error(chosen[:, 0] - chosen[:, 1], fit_rows):.4f} | "
              f"{median_error(test_chosen[:, 0] - test_chosen[:, 1], test_rows):.4f} |")

        for seed in range(3):
            generator = torch.Generator().manual_seed(seed)
            weights = (0.1 * torch.randn(2, dims + 1, generator=generator, dtype=torch.float64)).requires_grad_()
            signs = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64, requires_grad=True)
            adam = torch.optim.Adam([weights, signs], lr=3e-2)
            for _ in range(3000):
                adam.zero_grad()
                chosen, _ = pointers(weights, coords, logs, present)
                (chosen @ signs[:2] + signs[2] - target).abs().mean().backward()
                adam.step()
            with torch.no_grad():
                fitted = pointers(weights, coords, logs, present)[0] @ signs[:2] + signs[2]
                tested = pointers(weights, test_coords, test_logs, test_present)[0] @ signs[:2] + signs[2]
            print(f"| two pointers by the value's error, seed {seed} (coefficients "
                  f"{[round(float(s), 3) for s in signs.detach()]}) | {dims} | {median_error(fitted, fit_rows):.4f} | "
                  f"{median_error(tested, test_rows):.4f} |", flush=True)


if __name__ == "__main__":
    main()
