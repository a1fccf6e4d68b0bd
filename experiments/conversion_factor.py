"""Can the start learn the factor a unit conversion states in words, if it is told which rows are conversions?

`unit_conversion` ("5 km is about 3.11 miles") is the corpus template the start misses most often: no candidate of
the path writes a factor the words state. The raw-space combination could, r_t = c_t1·v_1 with c_t1 = 0.621371, read
from the unit words (§1b); in the library's fit it never starts (its share stays ≤ 0.03). This script asks whether
a labelled fit of that weight would generalise, given the best labels there are: the template itself. On the
unit-conversion rows of the start's training set (every fifth held out, as the start holds them out) it fits the
weight by least absolute relative error of r_t (convex: iteratively reweighted least squares with a ridge), in two
forms, on the features the start reads (`path_fit.py --read` saves them):

- `bilinear d`: the raw combination's own form, c_tj = [c_t; 1]ᵀ·M·[c'_j; 1], with c_t the query's and c'_j the
  words before number j (its role key) in the leading d standardised principal coordinates of the start;
- `query d`: a factor read from the query alone, c_t = w·[c_t; 1] (d = 896: all of z, standardised), which is also
  what a log-space intercept, ln(target) = ln v + ln factor, would have to learn.

It prints the median relative error of r_t at the held-out training rows, the test and the extrapolation split,
without and with °C → °F (whose offset of 32 no weight writes), against a copy of the stated value and the
template's training median.

    python experiments/path_fit.py --read --rows runs/path_fit/rows.pt    # once
    python experiments/conversion_factor.py --rows runs/path_fit/rows.pt
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import path_fit  # noqa: E402
import run_experiment as experiment  # noqa: E402

from causal_qwen import CausalQwenConfig, CausalQwenTokenizer  # noqa: E402
from causal_qwen.cauchy import untransform_values  # noqa: E402
from causal_qwen.starts.path import _DIMS, _HELD_OUT_EVERY, _coordinates  # noqa: E402

TEMPLATE = "unit_conversion"
FORMS = [("bilinear", d) for d in (4, 16, 32, 64)] + [("query", d) for d in (16, 64, 896)]
# Fitted on every row with one earlier number, whatever its template: the same fit without the labels.
UNLABELLED = [("bilinear", 16), ("query", 896)]
RIDGES = (1e-2, 1.0)
_RATIO_TOLERANCE = 5e-3
_RECURS = 3
_IRLS_STEPS = 60
_IRLS_FLOOR = 1e-3  # residuals below this weigh as this (relative error)


def stacked(part: dict) -> list[torch.Tensor]:
    """A split's path rows `(queries, keys, values, present)`, float64."""
    return [t.double() for t in path_fit.context_rows(part).stacked(len(part["y"]))]


class Features:
    """The rows' features of each form and split, `(features, one)`: r_t = features @ weights, and which rows have
    exactly one earlier number."""

    def __init__(self, saved: dict):
        self.saved, self.cache = saved, {}
        queries, keys, _, present = stacked(saved["train"])
        own, _ = keys.chunk(2, dim=-1)
        self.mean, self.to_coords = _coordinates(queries, own, present.bool(), _DIMS)
        centred = queries - self.mean
        self.spread = centred.std(0).clamp(min=1e-6)

    def __call__(self, split: str, form: str, dims: int) -> tuple[torch.Tensor, torch.Tensor]:
        if (split, form, dims) not in self.cache:
            self.cache[split, form, dims] = self._features(split, form, dims)
        return self.cache[split, form, dims]

    def _features(self, split: str, form: str, dims: int) -> tuple[torch.Tensor, torch.Tensor]:
        queries, keys, values, present = stacked(self.saved[split])
        _, before = keys.chunk(2, dim=-1)
        if dims > self.to_coords.shape[1]:
            query = (queries - self.mean) / self.spread
        else:
            query = ((queries - self.mean) @ self.to_coords)[:, :dims]
        query = torch.cat((query, torch.ones(len(query), 1, dtype=torch.float64)), -1)
        if form == "query":
            role = present[..., None]
        else:
            role = ((before - self.mean) @ self.to_coords)[..., :dims] * present[..., None]
            role = torch.cat((role, present[..., None]), -1)
        weighted = (values[..., None] * role * present[..., None]).sum(1)  # Σ_j v_j·[c'_j; 1]
        return (query[:, :, None] * weighted[:, None, :]).flatten(1), present.sum(-1) == 1


def least_relative_error(features: torch.Tensor, target: torch.Tensor, ridge: float) -> torch.Tensor:
    """The weights of least mean |features @ w − target| / |target| (plus `ridge`·|w|²), by reweighted least
    squares."""
    scale = target.abs().clamp(min=1e-9)[:, None]
    a, b = features / scale, target / scale[:, 0]
    weights = torch.ones(len(b), dtype=torch.float64)
    eye = torch.eye(a.shape[1], dtype=torch.float64)
    for _ in range(_IRLS_STEPS):
        weighted = a.T * weights
        solution = torch.linalg.solve(weighted @ a + ridge * len(b) * eye, weighted @ b)
        weights = 1.0 / (a @ solution - b).abs().clamp(min=_IRLS_FLOOR)
    return solution


def median_error(predicted: torch.Tensor, target: torch.Tensor, keep: torch.Tensor) -> str:
    errors = ((predicted - target).abs() / target.abs())[keep]
    return f"{float(errors.median()):.3f} ({int(keep.sum())})" if bool(keep.any()) else "—"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="runs/path_fit/rows.pt")
    parser.add_argument("--seed", type=int, default=0, help="the data's (as the rows were read)")
    args = parser.parse_args()
    saved = torch.load(args.rows, weights_only=False)
    profile = experiment.PROFILES["cpu"]
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    data = experiment.load_data(profile, args.seed)
    templates, texts = path_fit.train_templates(profile, tokenizer, args.seed)
    # Which rows are conversions, and which of them convert °C (the offset no weight writes).
    rows = {"train": (templates, [data["train"][k].variant for k in texts])}
    for split in ("test", "extrapolation"):
        _, kept = path_fit.target_batches(tokenizer, data[split], profile.eval_batch)
        rows[split] = ([ex.template for ex in kept], [ex.variant for ex in kept])
    # The training targets in the head's space of the default transform, with which the rows were read.
    targets = {"train": untransform_values(saved["train"]["y"].double(), CausalQwenConfig().value_transform)}
    for split in ("test", "extrapolation"):
        targets[split] = torch.tensor(saved[split]["true"], dtype=torch.float64)
    held = torch.arange(len(templates)) % _HELD_OUT_EVERY == 0
    features = Features(saved)
    median = saved["medians"][TEMPLATE]  # the training median's value, the baseline of bar 3
    splits = {"held-out": ("train", held), "test": ("test", None), "extrapolation": ("extrapolation", None)}

    def kept(split: str, one_number: torch.Tensor, celsius: bool) -> torch.Tensor:
        names, variants = rows[split]
        return torch.tensor([n == TEMPLATE and (celsius or v != "celsius_to_fahrenheit")
                             for n, v in zip(names, variants, strict=True)]) & one_number

    one = {split: features(split, "query", 0)[1] for split in ("train", "test", "extrapolation")}
    # The copy of the one stated number: r_t = v_1.
    copies = {split: torch.stack([values[0] for values in saved[split]["context"]["values"]]).double()
              for split in ("train", "test", "extrapolation")}
    print(f"{TEMPLATE}: median relative error of r_t (rows)")
    for celsius in (False, True):
        print(f"\n{'with' if celsius else 'without'} °C → °F")
        print(f"| form | fitted on | ridge | {' | '.join(splits)} |")
        print("|---|---|---|" + "---|" * len(splits))

        def cells(predict, celsius=celsius) -> str:
            out = []
            for split, mask in splits.values():
                keep = kept(split, one[split], celsius) & (mask if mask is not None else True)
                out.append(median_error(predict(split), targets[split], keep))
            return " | ".join(out)

        at_median = cells(lambda split: torch.full_like(copies[split], median))
        print(f"| the training median ({median:.2f}) | | | {at_median} |")
        print(f"| copy of v_1 | | | {cells(lambda split: copies[split])} |")
        conversions = kept("train", one["train"], celsius) & ~held
        arms = [(form, "conversions") for form in FORMS] + [(form, "every row") for form in UNLABELLED]
        for (form, dims), on in arms:
            fitted = conversions if on == "conversions" else one["train"] & ~held
            for ridge in RIDGES:
                train_x = features("train", form, dims)[0]
                weights = least_relative_error(train_x[fitted], targets["train"][fitted], ridge)

                def predict(split, form=form, dims=dims, weights=weights):
                    return features(split, form, dims)[0] @ weights

                print(f"| {form} {dims} | {on} | {ridge:g} | {cells(predict)} |", flush=True)
    recurring_multiples(saved, templates, targets["train"])


def recurring_multiples(saved: dict, templates: list[str], target: torch.Tensor) -> None:
    """Per template, the training rows whose target is a multiple of an earlier number (not a copy) by a factor that
    at least `_RECURS` other rows share within `_RATIO_TOLERANCE`: the label the data could give a factor, as a
    repeat gives the pointer's."""
    values = torch.stack(saved["train"]["context"]["values"]).double()
    present = torch.stack(saved["train"]["context"]["present"]) & (values != 0)
    ratio = target[:, None] / torch.where(present, values, 1.0)
    usable = present & ((ratio - 1).abs() > _RATIO_TOLERANCE) & (ratio != 0)
    owners = torch.arange(len(target))[:, None].expand_as(ratio)[usable]
    ratio = ratio[usable]
    order = torch.argsort(ratio)
    ratio, owners = ratio[order], owners[order]
    low = torch.searchsorted(ratio, torch.minimum(ratio * (1 - _RATIO_TOLERANCE), ratio * (1 + _RATIO_TOLERANCE)))
    high = torch.searchsorted(ratio, torch.maximum(ratio * (1 - _RATIO_TOLERANCE), ratio * (1 + _RATIO_TOLERANCE)),
                              right=True)
    labelled = set()
    for k in range(len(ratio)):
        if len(set(owners[low[k]:high[k]].tolist()) - {int(owners[k])}) >= _RECURS:
            labelled.add(int(owners[k]))
    counts = Counter(templates[k] for k in labelled)
    totals = Counter(name for name, any_number in zip(templates, present.any(-1).tolist(), strict=True) if any_number)
    print(f"\ntraining rows with an earlier nonzero number whose target is a recurring multiple of one (at least "
          f"{_RECURS} other rows "
          f"within {_RATIO_TOLERANCE:g}): " + ", ".join(f"{name} {counts[name]}/{totals[name]}"
                                                       for name in sorted(totals)))


if __name__ == "__main__":
    main()
