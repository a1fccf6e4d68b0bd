"""The context-value path's fit alone, on rows read once: its held-out error per corpus template and real table.

The start from data (`fit_value_head`) reads the backbone's features at every value row, fits the ridge read-out,
then fits the path (`context_start.fit_context_values`). With the features frozen, the path's fit alone decides how
each template's target is predicted, and on Qwen2.5-0.5B reading the rows is most of the ten minutes a start of
`experiments/context_path.py` takes. This script reads the training rows of context_path.py's CPU profile and the
rows of each test split's targets once (`--read`, about 6 minutes on 2 cores), saves them, and then fits the path on
them by the library's procedure or a variant of it and reports what context_path.py reports at the start, in about a
minute per arm.

`--orders` fits the path on the same rows in other orders (a random permutation per seed, 0: as read, `trainer`: the
texts in the order `CausalQwenTrainer`'s start reads them in run_experiment.py), which hold out other rows: the
trainer reads its training set in a random order, so its start holds out other rows than this script's.
`--candidates` then reports every fit the library chose between (each random start, with and without its pointer
fitted first), each finished as the library finishes the one it keeps, with its held-out NLL with the scaled copies
and on the rows as read, and which one the library kept.

    python experiments/path_fit.py --read --rows runs/path_fit/rows.pt       # once
    python experiments/path_fit.py --rows runs/path_fit/rows.pt --arms library,guided
    python experiments/path_fit.py --show unit_conversion    # each of its targets, as the library's fit predicts it
    python experiments/path_fit.py --orders 0,1,2,3,4,5 --candidates --output runs/path_fit/candidates.json
    python experiments/path_fit.py --orders trainer --candidates    # in CausalQwenTrainer's order

`--kept` (with `--orders`) fits the path as the library does in each order and measures the fit it keeps. The
profile's test splits hold 9 to 15 targets per template and 16 per table; `--read-tests` reads larger draws of them
(the corpus's: the profile's are their first examples; the tables': the profile's test rows and rows it does not use),
and `--tests` measures the kept fits on those too, where a median is not the draw of a dozen rows.

    python experiments/path_fit.py --read-tests runs/path_fit/tests480.pt --test-size 480     # once, ~3 minutes
    python experiments/path_fit.py --orders 0,1,2,3,4,5,6,7,8,9,trainer --kept --tests runs/path_fit/tests480.pt
    python experiments/path_fit.py --orders 0,1,2,3,4,5,6,7,8,9,trainer --kept --tests runs/path_fit/tests480.pt \
        --arms median-width       # a variant of the fit (one), in every study
    python experiments/path_fit.py --kept-report runs/path_fit/kept.json --tests runs/path_fit/tests480.pt

`--kept` also prints the coverage at each fit's held-out rows as its calibration read them (`held_coverage`): the
texts' targets and their earlier numbers apart. `--measure-model` measures a model `run_experiment.py` saved (its
read-out and path on the saved rows: the frozen backbone reads them as it did) on the splits and the larger draws;
`--undo-shift ORDER` also takes off a common shift of its widths beyond the calibration's optimum on the held-out
rows in that order (`common_width_shift`: a run of the widths' shift to the held-out median, not the library's).

    python experiments/path_fit.py --measure-model runs/experiment/a/final --tests runs/path_fit/tests480.pt

`--pooled` (with `--orders`) tries one path for several fits: the fits that beat the read-out, their scores
averaged (`pooled_state`), finished as the library finishes the fit it keeps (tried, not kept: docs/experiments.md).

`--analyse` reads such reports again: per template and table, whether the held-out rows rank the fits as the test
split does, and what other rules for keeping a fit would have kept.

    python experiments/path_fit.py --analyse runs/path_fit/candidates.json,runs/path_fit/candidates_trainer.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_experiment as experiment  # noqa: E402

from causal_qwen import CausalQwenForCausalLM, CausalQwenTokenizer, cauchy  # noqa: E402
from causal_qwen.context_values import MAX_LOG_WIDTH, entry_values  # noqa: E402
from causal_qwen.data import (  # noqa: E402
    CausalQwenDataCollator,
    make_splits,
    real_splits,
    template_baselines,
    tokenize_examples,
)
from causal_qwen.starts import path as context_start  # noqa: E402
from causal_qwen.starts import path_pointer, path_rows, path_widths  # noqa: E402
from causal_qwen.starts.path import ContextRows  # noqa: E402
from causal_qwen.starts.readout import PENALTIES, _read_rows_in_eval, _ridge, _write_readout  # noqa: E402

SPLITS = ("test", "real_test", "extrapolation")


def target_batches(tokenizer, examples: list, batch: int):
    """Batches whose only labelled `<NUM>` is each example's target (its text's last number, as context_path.py
    measures it), and the examples kept, in row order."""
    collator = CausalQwenDataCollator.from_tokenizer(tokenizer)
    kept, batches = [], []
    examples = experiment.with_target(examples)
    for k in range(0, len(examples), batch):
        chunk = examples[k:k + batch]
        inputs = collator(tokenize_examples(tokenizer, [ex.text for ex in chunk]))
        labels = torch.full_like(inputs["input_ids"], -100)
        for b, ex in enumerate(chunk):
            where = (inputs["input_ids"][b] == tokenizer.num_token_id).nonzero().flatten()
            if len(where) and float(inputs["numeric_values"][b, where[-1]]) == ex.target_value:
                labels[b, where[-1]] = tokenizer.num_token_id
                kept.append(ex)
        inputs["labels"] = labels
        batches.append(inputs)
    return batches, kept


def read_targets(model, tokenizer, examples: list, batch: int) -> dict:
    """The rows of each example's target (`target_batches`), with their templates and true values."""
    batches, kept = target_batches(tokenizer, examples, batch)
    rows = _read_rows_in_eval(model, batches, 10 ** 9, 0, "read")
    assert len(rows.y) == len(kept), (len(rows.y), len(kept))
    return {**rows_dict(rows), "templates": [ex.template for ex in kept], "true": [ex.target_value for ex in kept]}


def read(args) -> None:
    profile = experiment.PROFILES[args.profile]
    data = experiment.load_data(profile, args.seed)
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    model = experiment.new_causal(profile, tokenizer, args.seed, context_values=True).eval()
    collator = CausalQwenDataCollator.from_tokenizer(tokenizer)
    features = tokenize_examples(tokenizer, [ex.text for ex in data["train"]])
    t0 = time.perf_counter()
    train = _read_rows_in_eval(model, experiment.collated(collator, features, profile.eval_batch), 4096, 0, "read")
    saved = {"train": rows_dict(train), "medians": {name: median for name, (_, median)
                                                     in template_baselines(data["train"]).items()}}
    print(f"training rows: {len(train.y)}, {time.perf_counter() - t0:.0f}s", flush=True)
    for split in SPLITS:
        saved[split] = read_targets(model, tokenizer, data[split], profile.eval_batch)
        print(f"{split}: {len(saved[split]['true'])} rows, {time.perf_counter() - t0:.0f}s", flush=True)
    Path(args.rows).parent.mkdir(parents=True, exist_ok=True)
    torch.save(saved, args.rows)


def read_tests(args) -> None:
    """Read the corpus's test and extrapolation splits with `--test-size` examples each (the profile's splits are
    their first examples: each split is its own random stream) and the real tables' test split with rows the profile
    does not use, and save their target rows to `--read-tests`."""
    profile = experiment.PROFILES[args.profile]
    corpus = make_splits(profile.n_train, 0, args.test_size, args.test_size, seed=args.seed)
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    model = experiment.new_causal(profile, tokenizer, args.seed, context_values=True).eval()
    data = experiment.load_data(profile, args.seed)
    for split in ("test", "extrapolation"):
        own = [ex.text for ex in data[split]]
        assert [ex.text for ex in corpus[split][:len(own)]] == own, f"the profile's {split} split is not a prefix"
    # The tables: the profile's test rows, then rows of the same tables the profile does not use, up to
    # `test_size // 6` per table (the corpus's test split holds about that many targets per template).
    seen = {ex.text for split in ("train", "validation", "real_test") for ex in data[split]}
    every = [ex for part in real_splits(seed=args.seed).values() for ex in part]
    tables = list(data["real_test"])
    for name in dict.fromkeys(ex.template for ex in data["real_test"]):
        own = sum(ex.template == name for ex in data["real_test"])
        tables += [ex for ex in every if ex.template == name and ex.text not in seen][:args.test_size // 6 - own]
    corpus["real_test"] = tables
    saved = {}
    t0 = time.perf_counter()
    for split in SPLITS:
        saved[split] = read_targets(model, tokenizer, corpus[split], profile.eval_batch)
        print(f"{split}: {len(saved[split]['true'])} rows, {time.perf_counter() - t0:.0f}s", flush=True)
    Path(args.read_tests).parent.mkdir(parents=True, exist_ok=True)
    torch.save(saved, args.read_tests)


def rows_dict(rows) -> dict:
    return {"x": rows.x, "y": rows.y, "x_scale": rows.x_scale,
            "context": {name: getattr(rows.context, name) for name in ("queries", "keys", "values", "present")}}


def context_rows(saved: dict) -> ContextRows:
    return ContextRows(**{name: list(part) for name, part in saved["context"].items()})


@torch.no_grad()
def read_saved(model, saved: dict, loc_linear: torch.Tensor | None = None):
    """The model's path read at each saved row (float64), the read-out's locations (or `loc_linear` `[N]`), its
    spread |w|·scale_U' `[N]` and γ_Y: what `ContextRead.apply` combines into `(loc_Y, scale_Y)`."""
    action, config = model.action, model.config
    path = copy.deepcopy(model.abduction.context_values).double()
    queries, keys, values, present = context_rows(saved).stacked(len(saved["y"]))
    w = action.reg_head.weight.double()[0]
    if loc_linear is None:
        loc_linear = saved["x"].double() @ w + float(action.reg_head.bias)
    spread = (saved["x_scale"].double() + action.b_noise.double().abs()) @ w.abs()
    own, before = keys.double().chunk(2, dim=-1)
    entries = entry_values(present, values, config.value_transform)
    read = path.read(queries.double()[:, None], path.keys(own, before), entries, present[:, None],
                     config.value_transform)
    return read, loc_linear, spread, float(action.reg_log_noise.exp())


def predict(model, saved: dict, loc_linear: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The value's `(median, loc_Y, scale_Y)` at each saved row, through the model's read-out (or its locations
    `loc_linear` `[N]`) and path (float64), and the path's choice π̄ = (π_0, Σ_j π_j, π_ℓ, π_r, π_μ) `[N, 5]`."""
    read, loc_linear, spread, noise = read_saved(model, saved, loc_linear)
    loc, scale = read.apply(loc_linear[:, None], spread[:, None], noise)
    loc, scale = loc[:, 0], scale[:, 0].clamp(min=model.config.scale_min)
    median, _, _ = model.value_interval(loc, scale, 0.5)
    return median, loc, scale, read.choice[:, 0]


def measure(model, saved: dict, split: str) -> dict:
    rows = saved[split]
    median, loc, scale, choice = predict(model, rows)
    per: dict[str, list] = {}
    chosen: dict[str, list] = {}
    covered = {0.5: [], 0.9: []}
    by_template: dict[str, dict[float, list]] = {}
    for k, (template, true) in enumerate(zip(rows["templates"], rows["true"], strict=True)):
        per.setdefault(template, []).append(experiment.relative_error(float(median[k]), true))
        chosen.setdefault(template, []).append(choice[k])
        for level in covered:
            _, low, high = model.value_interval(loc[k], scale[k], level)
            covered[level].append(float(low) <= true <= float(high))
            by_template.setdefault(template, {0.5: [], 0.9: []})[level].append(covered[level][-1])
    errors = [e for values in per.values() for e in values]
    return {"per_template": {name: statistics.median(values) for name, values in sorted(per.items())},
            "pooled": statistics.median(errors),
            "choice": {name: torch.stack(values).mean(0).tolist() for name, values in sorted(chosen.items())},
            "coverage": [statistics.fmean(covered[0.5]), statistics.fmean(covered[0.9])],
            "coverage_by_template": {name: [statistics.fmean(c[0.5]), statistics.fmean(c[0.9]), len(c[0.5])]
                                     for name, c in sorted(by_template.items())}}


def _coverage_by_template(measured: dict) -> str:
    """Each template's or table's 50% / 90% coverage (its targets) in one line."""
    return ", ".join(f"{name} {c50:.2f}/{c90:.2f} ({n})" for name, (c50, c90, n)
                     in measured["coverage_by_template"].items())


def median_baseline(saved: dict, split: str) -> dict:
    rows = saved[split]
    per: dict[str, list] = {}
    for template, true in zip(rows["templates"], rows["true"], strict=True):
        per.setdefault(template, []).append(experiment.relative_error(saved["medians"][template], true))
    return {name: statistics.median(values) for name, values in sorted(per.items())}


def train_templates(profile, tokenizer, seed: int) -> tuple[list[str], list[int]]:
    """The template of each training row and the index of its text, in the order the start read them (each text's
    numbers in turn)."""
    from causal_qwen.labels import next_token_targets

    data = experiment.load_data(profile, seed)
    collator = CausalQwenDataCollator.from_tokenizer(tokenizer)
    features = tokenize_examples(tokenizer, [ex.text for ex in data["train"]])
    templates, texts = [], []
    for index, (ex, feature) in enumerate(zip(data["train"], features, strict=True)):
        targets, _ = next_token_targets(collator([feature])["labels"])
        count = int((targets == tokenizer.num_token_id).sum())
        templates += [ex.template] * count
        texts += [index] * count
    return templates, texts


def subset(train: dict, keep: torch.Tensor) -> dict:
    """The training rows where `keep` `[N]` holds."""
    context = {name: [part[i] for i in keep.nonzero().flatten().tolist()] for name, part in train["context"].items()}
    return {"x": train["x"][keep], "y": train["y"][keep], "x_scale": train["x_scale"][keep], "context": context}


@torch.no_grad()
def fit(model, saved: dict, seed: int, starts: int | None, only: str | None = None) -> dict:
    train = saved["train"]
    if only is not None:  # the rows of one template alone
        train = subset(train, torch.tensor([template == only for template in saved["train_templates"]]))
    _, _, _, loo = _write_readout(model, train["x"], train["y"], PENALTIES)
    return context_start.fit_context_values(model, context_rows(train), train["x"], train["x_scale"], train["y"],
                                            seed=seed, starts=starts, loo_residuals=loo)


_LIBRARY = {(module, name): getattr(module, name) for module, names in (
    (context_start, ("_DIMS", "_SCALES", "_NLL_READS_UNSEEN", "_LOCATIONS_READ_UNSEEN", "_WIDTHS_READ_UNSEEN",
                     "_LOCATION_SMOOTHING")),
    (path_rows, ("_PATIENCE", "_LEARNING_RATE")), (path_pointer, ("_COPY_TOLERANCE",)),
    (path_widths, ("_CALIBRATION_DIMS",))) for name in names}
_ADAM = torch.optim.Adam
_SYMLOG = cauchy.symlog
_FIT_FROM = context_start._fit_from
_FIT_CHOICE = context_start._fit_choice
_CALIBRATE_WIDTH = context_start._calibrate_width
_REFIT_WIDTHS = context_start._refit_widths
_SIDE_BY_SIDE = context_start._side_by_side


def _one_after_another(fits: list) -> list:
    with torch.no_grad():
        return [fit() for fit in fits]


def _middle_widths(small, unseen_nll) -> None:
    """`_refit_widths`, then the widths' parameters halfway between the fit's and the refit's (log ρ halfway)."""
    before = {name: tensor.clone() for name, tensor in small.state_dict().items()}
    _REFIT_WIDTHS(small, unseen_nll)
    small.load_state_dict({name: (before[name] + tensor) / 2 for name, tensor in small.state_dict().items()})


def _median_width(small, transform, held_out, noise: float, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`_calibrate_width`, then one more shift of log ρ, common to every entry of π̄ and at least 0, the least that
    puts half the held-out targets inside their 50% interval (a Cauchy's 50% half-width is its scale): the NLL's
    width where the residuals are not Cauchy-shaped is a compromise between the levels. Never narrower than the
    NLL's, so that held-out rows most of which are exact copies (any width holds them) do not shrink it to the
    floor."""
    shift, reading = _CALIBRATE_WIDTH(small, transform, held_out, noise, floor)
    with torch.no_grad():
        read = path_rows._read(small, transform, held_out)
    loc = (read.linear_weight * held_out.loc_linear[:, None] + read.offset)[:, 0]
    fixed = (read.linear_weight * held_out.spread[:, None])[:, 0]
    log_width = read.width[:, 0].log() + read.choice[:, 0] @ shift + held_out.queries[:, :len(reading)] @ reading
    residual = (held_out.target - loc).abs()

    def coverage(delta: float) -> float:
        width = (log_width + delta).clamp(-MAX_LOG_WIDTH, MAX_LOG_WIDTH).exp()
        return float((residual <= (fixed + noise * width).clamp(min=floor)).double().mean())

    low, high = -20.0, 20.0  # coverage rises with the shift
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if coverage(middle) < 0.5 else (low, middle)
    return shift + max(high, 0.0), reading


def _combinations_read_roles(small, *args, **kwargs):
    """`_fit_from` with the combinations' keys held to the words before each number (K'·z_{j−1} + b_K): the rows of
    K·z_j for the log- and raw-space weights start at 0 and get no gradient."""
    r = small.rank
    hook = small.key.weight.register_hook(lambda grad: torch.cat((grad[:r], torch.zeros_like(grad[r:]))))
    try:
        return _FIT_FROM(small, *args, **kwargs)
    finally:
        hook.remove()


def _sign_times_log(value: torch.Tensor) -> torch.Tensor:
    """symlog as sign(v)·ln(1 + |v|), whose autograd derivative at 0 is 0 (the library's before it was fixed)."""
    return torch.sign(value) * torch.log1p(value.abs())


def arm(name: str) -> None:
    """Set `context_start` to the library's fit, then to arm `name`'s variant of it: `library`, or `+`-joined
    `dims=D` (principal coordinates), `patience=P`, `lr=R`, `smooth=δ` (the locations' loss √(r² + δ²) − δ),
    `wd=W` (AdamW's decoupled weight decay), or
    `zero-gradient` (symlog as it was, whose derivative at 0 autograd gave as 0), or `roles` (the combinations'
    keys read the words before each number, not its own features), or `no-choice` (no fit of the mean's score), or
    `median-width` (the widths then widened to cover half the held-out targets at 50%: `_median_width`), or
    `nll-unseen` (every NLL of the fit reads the read-out's leave-one-out locations, not the calibration's alone), or
    `locations-unseen` (the locations' descent reads the leave-one-out ones too), or `widths-unseen` /
    `widths-as-fitted` (the kept fit's widths fitted again on the leave-one-out locations before the calibration, its
    choice and locations as kept: `context_start._refit_widths`; or not), or `widths-middle` (their parameters
    halfway between the fit's and the refit's: `_middle_widths`)."""
    for (module, key), value in _LIBRARY.items():
        setattr(module, key, value)
    context_start.torch.optim.Adam = _ADAM
    cauchy.symlog = _SYMLOG
    context_start._fit_from = _FIT_FROM
    context_start._fit_choice = _FIT_CHOICE
    context_start._calibrate_width = _CALIBRATE_WIDTH
    context_start._refit_widths = _REFIT_WIDTHS
    if name == "library":
        return
    for part in name.split("+"):
        if part == "roles":
            context_start._fit_from = _combinations_read_roles
            continue
        if part == "median-width":  # the widths shifted to cover half the held-out targets at 50%
            context_start._calibrate_width = _median_width
            continue
        if part == "no-choice":  # the mean's score as the locations' fit leaves it
            context_start._fit_choice = lambda *args, **kwargs: None
            continue
        if part.startswith("scales="):
            context_start._SCALES = tuple(float(x) for x in part.split("=")[1].split("/"))
            continue
        if part == "nll-unseen":  # every NLL reads the read-out's leave-one-out locations, not only the calibration
            context_start._NLL_READS_UNSEEN = True
            continue
        if part in ("widths-unseen", "widths-as-fitted"):  # the kept fit's widths refitted on them, or not
            context_start._WIDTHS_READ_UNSEEN = part == "widths-unseen"
            continue
        if part == "widths-middle":  # the refit's widths halfway back to the fit's
            context_start._refit_widths = _middle_widths
            continue
        if part == "locations-unseen":  # the locations' descent reads the read-out's leave-one-out locations too
            context_start._LOCATIONS_READ_UNSEEN = True
            continue
        if part.startswith("width-dims="):
            path_widths._CALIBRATION_DIMS = int(part.split("=")[1])
            continue
        if part.startswith("copy-tol="):
            path_pointer._COPY_TOLERANCE = float(part.split("=")[1])
            continue
        if part == "zero-gradient":  # the raw-space combination as it was: no gradient at its start
            cauchy.symlog = _sign_times_log
            continue
        key, value = part.split("=")
        if key == "dims":
            context_start._DIMS = int(value)
        elif key == "patience":
            path_rows._PATIENCE = int(value)
        elif key == "smooth":  # the locations' loss √(r² + δ²) − δ, δ = value
            context_start._LOCATION_SMOOTHING = float(value)
        elif key == "lr":
            path_rows._LEARNING_RATE = float(value)
        elif key == "wd":
            context_start.torch.optim.Adam = lambda params, lr, decay=float(value): torch.optim.AdamW(
                params, lr=lr, weight_decay=decay)
        else:
            raise ValueError(f"unknown arm part {part!r}")


class Candidates:
    """Every fit `fit_context_values` chooses between, each finished as the one it keeps.

    `context_start._fit_from` is wrapped: its results are kept by call (the fit calls it in the same order on the
    same rows, and is deterministic), and with `forced` set every other call returns no state, so that the library's
    choice, its switch-off and its calibration run on that fit alone."""

    def __init__(self):
        self.results: list = []
        self.calls: list = []
        self.forced: int | None = None

    def __enter__(self):
        def fit_from(small, loss, split, transform, noise, pointer=False):
            index = len(self.calls)
            self.calls.append((split, pointer))
            if index == len(self.results):
                self.results.append(_FIT_FROM(small, loss, split, transform, noise, pointer))
            held_out, state, step = self.results[index]
            if self.forced is not None and index != self.forced:
                state = None
            return held_out, state, step
        context_start._fit_from = fit_from
        # The results are kept by call: the fits run one after another, in the plan's order (the same fits, each on
        # one thread as side by side).
        context_start._side_by_side = _one_after_another
        return self

    def __exit__(self, *exc):
        context_start._fit_from = _FIT_FROM
        context_start._side_by_side = _SIDE_BY_SIDE

    def fit(self, model, train: dict, loo: torch.Tensor, seed: int, forced: int | None) -> dict:
        self.calls, self.forced = [], forced
        return context_start.fit_context_values(model, context_rows(train), train["x"], train["x_scale"],
                                                train["y"], seed=seed, loo_residuals=loo)


@torch.no_grad()
def held_out_as_read(model, split: dict, state: dict | None, as_read: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The value's NLL and location `[as_read]` at the held-out rows as read (the first `as_read`; their scaled
    copies follow them) through the small path `state` (None: the read-out alone), as the fit scores them."""
    rows = split[True]
    small = context_start.CausalQwenContextValues(rows.queries.shape[1], model.abduction.context_values.rank,
                                                  model.abduction.context_values.log_values).double().eval()
    if state is None:
        small.choice.bias[0] = context_start.LINEAR_ONLY_SCORE
    else:
        small.load_state_dict(state)
    noise = float(model.action.reg_log_noise.exp())
    loc, scale = path_rows._value(small, model.config.value_transform, rows, noise)
    nll = cauchy.nll(rows.target, loc, scale.clamp(min=model.config.scale_min))
    return nll[:as_read], loc[:as_read]


def permuted(saved: dict, order: int | str, seed: int) -> tuple[dict, torch.Tensor]:
    """The training rows in the order of seed `order` (0: as read; "trainer": the texts in the order
    `CausalQwenTrainer`'s start reads them in `run_experiment.py` with `seed`), and the permutation."""
    train = saved["train"]
    n = len(train["y"])
    if order == "trainer":  # training._start_order: a permutation of the texts from a generator of its own
        texts = torch.tensor(saved["train_texts"])
        text_order = torch.randperm(int(texts.max()) + 1, generator=torch.Generator().manual_seed(seed))
        perm = torch.cat([(texts == text).nonzero().flatten() for text in text_order.tolist()])
    else:
        perm = torch.arange(n) if order == 0 else torch.randperm(n, generator=torch.Generator().manual_seed(order))
    context = {name: [part[i] for i in perm.tolist()] for name, part in train["context"].items()}
    return {"x": train["x"][perm], "y": train["y"][perm], "x_scale": train["x_scale"][perm],
            "context": context}, perm


def candidates(model, saved: dict, orders: list, seed: int, pristine: dict, output: str | None,
               data_seed: int = 0) -> None:
    """For each order of the training rows, every fit the library chose between, and the one it kept."""
    report = []
    for order in orders:
        train, perm = permuted(saved, order, data_seed)
        held = [saved["train_templates"][i] for i in perm.tolist()][::context_start._HELD_OUT_EVERY]
        with torch.no_grad():
            _, _, _, loo = _write_readout(model, train["x"], train["y"], PENALTIES)
        with Candidates() as study:
            model.abduction.context_values.load_state_dict(pristine)
            kept = study.fit(model, train, loo, seed, None)
            calls = list(study.calls)
            read_out = held_out_as_read(model, calls[0][0], None, len(held))[0]
            print(f"\norder {order}: kept seed {kept['context_seed']}, pointer {kept['context_pointer']}, held-out "
                  f"NLL {kept['context_nll']:.4f} (read-out {kept['context_nll_linear']:.4f})", flush=True)
            pointers = len({pointer for _, pointer in calls})
            kept_index = None if kept["context_seed"] is None else \
                (kept["context_seed"] - seed) * pointers + int(bool(kept["context_pointer"]) and pointers == 2)
            for index, (split, pointer) in enumerate(calls):
                held_out, state, _ = study.results[index]
                model.abduction.context_values.load_state_dict(pristine)
                record = study.fit(model, train, loo, seed, index)
                entry = {"order": order, "draw": index // pointers, "pointer": pointer,
                         "kept_by_library": index == kept_index, "passes": record["context_seed"] is not None,
                         "held_out_nll": held_out}
                if state is not None:
                    nll, loc = held_out_as_read(model, split, state, len(held))
                    entry["held_out_nll_as_read"] = float(nll.mean())
                    entry["held_out_nll_by_template"] = _by_template(held, (nll - read_out).tolist())
                    entry["held_out_loc"] = loc.tolist()
                for split_name in SPLITS:
                    m = measure(model, saved, split_name)
                    entry[split_name] = {"per_template": m["per_template"], "coverage": m["coverage"]}
                report.append(entry)
                test, real = entry["test"], entry["real_test"]
                print(f"  start {entry['draw']}{' pointer' if pointer else ''}: "
                      f"{'kept, ' if entry['kept_by_library'] else ''}"
                      f"{'' if entry['passes'] else 'does not beat the read-out, '}held-out NLL {held_out:.3f}"
                      + (f" (as read {entry['held_out_nll_as_read']:.3f})" if state is not None else "")
                      + f"; test mean {statistics.fmean(test['per_template'].values()):.3f}, coverage "
                      f"{test['coverage'][0]:.2f} / {test['coverage'][1]:.2f}; tables "
                      + ", ".join(f"{k} {v:.3f}" for k, v in real["per_template"].items())
                      + f"; above the median: {', '.join(_above_median(saved, entry)) or 'none'}", flush=True)
    print("\nThe fit each rule keeps, of those that beat the read-out:")
    for order in orders:
        passing = [entry for entry in report if entry["order"] == order and entry["passes"]]
        if not passing:
            continue
        for rule, chosen in choices(passing).items():
            if chosen is None:
                continue
            test = chosen["test"]
            print(f"  order {order}, {rule}: start {chosen['draw']}{' pointer' if chosen['pointer'] else ''}, test "
                  f"mean {statistics.fmean(test['per_template'].values()):.3f}, coverage {test['coverage'][0]:.2f} / "
                  f"{test['coverage'][1]:.2f}, above the median: {', '.join(_above_median(saved, chosen)) or 'none'}")
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(report, indent=1))


def kept_fits(model, saved: dict, orders: list, seed: int, pristine: dict, output: str | None,
              data_seed: int = 0) -> None:
    """For each order of the training rows, the fit the library keeps, measured on the saved splits and, where
    `saved["tests"]` holds larger draws of the test splits (`--tests`), on those too: which templates and tables are
    at or above their training median (bar 3) on each (`summarise_kept`: per template over the orders)."""
    larger = {**saved, **saved["tests"]} if "tests" in saved else None
    report = []
    for order in orders:
        train, _ = permuted(saved, order, data_seed)
        model.abduction.context_values.load_state_dict(pristine)
        t0 = time.perf_counter()
        with torch.no_grad():
            _, _, _, loo = _write_readout(model, train["x"], train["y"], PENALTIES)
        record = context_start.fit_context_values(model, context_rows(train), train["x"], train["x_scale"],
                                                  train["y"], seed=seed, loo_residuals=loo)
        entry = {"order": order, "seed": record["context_seed"], "pointer": record["context_pointer"],
                 **{split: measure(model, saved, split) for split in SPLITS}}
        entry["above"] = _above_median(saved, entry)
        entry["held"] = held_coverage(model, saved, train, loo, order, data_seed)
        print("  held-out rows, coverage 50% / 90% (rows): " + "; ".join(
            f"{kind} {c50:.2f} / {c90:.2f} ({n})" for kind, (c50, c90, n) in entry["held"].items()), flush=True)
        line = (f"order {order} ({time.perf_counter() - t0:.0f}s): kept seed {record['context_seed']}, pointer "
                f"{record['context_pointer']}; test mean {statistics.fmean(entry['test']['per_template'].values()):.3f}"
                f"; at or above the median: {', '.join(entry['above']) or 'none'}")
        if larger is not None:
            entry["larger"] = {split: measure(model, larger, split) for split in SPLITS}
            entry["larger_above"] = _above_median(larger, entry["larger"])
            line += (f" | larger splits: test mean "
                     f"{statistics.fmean(entry['larger']['test']['per_template'].values()):.3f}; at or above: "
                     f"{', '.join(entry['larger_above']) or 'none'}")
        print(line, flush=True)
        for split in ("test", "real_test"):
            print(f"  {split}, coverage {entry[split]['coverage'][0]:.3f} / {entry[split]['coverage'][1]:.3f}: "
                  + _coverage_by_template(entry[split]), flush=True)
            if larger is not None:
                print(f"  larger {split}, coverage {entry['larger'][split]['coverage'][0]:.3f} / "
                      f"{entry['larger'][split]['coverage'][1]:.3f}: " + _coverage_by_template(entry["larger"][split]),
                      flush=True)
        report.append(entry)
    for key in ("above", "larger_above") if larger is not None else ("above",):
        misses = Counter(name for entry in report for name in entry[key])
        held = sum(not entry[key] for entry in report)
        print(f"{'larger splits' if key == 'larger_above' else 'the profile splits'}: bar 3 held in {held} of "
              f"{len(report)} orders; misses " + ", ".join(f"{name} {count}" for name, count in misses.most_common()))
    if larger is not None:
        summarise_kept(report, larger)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(report, indent=1, default=lambda t: t.tolist()))


def held_coverage(model, saved: dict, train: dict, loo: torch.Tensor, order, data_seed: int) -> dict:
    """The 50% / 90% coverage at the fit's held-out rows as its calibration read them (the read-out's locations
    leave-one-out), `{kind: [50%, 90%, rows]}`: the texts' targets (their last numbers, what the test splits
    measure) and their earlier numbers, of the corpus and of the tables."""
    held = torch.arange(len(train["y"])) % context_start._HELD_OUT_EVERY == 0
    templates, last, _ = held_out_targets(saved, order, data_seed)
    rows = subset(train, held)
    _, loc, scale, _ = predict(model, rows, (train["y"].double() - loo.double())[held])
    miss = (rows["y"].double() - loc).abs() / scale
    tables = set(saved["real_test"]["templates"])
    kinds = {}
    for k, (template, is_last) in enumerate(zip(templates, last.tolist(), strict=True)):
        kind = f"{'tables' if template in tables else 'corpus'} {'targets' if is_last else 'earlier numbers'}"
        kinds.setdefault(kind, []).append(float(miss[k]))
    half_widths = (1.0, math.tan(0.45 * math.pi))  # a Cauchy's central 50% and 90% intervals, in scales
    return {kind: [statistics.fmean(m <= w for m in misses) for w in half_widths] + [len(misses)]
            for kind, misses in sorted(kinds.items())}


def _coverage_line(coverage: list) -> str:
    """The range and mean over the orders of `coverage` (`[50%, 90%]` per order), and the orders outside bar 1's
    band at 50%."""
    at_50, at_90 = [c[0] for c in coverage], [c[1] for c in coverage]
    return (f"coverage 50% {min(at_50):.2f}-{max(at_50):.2f} (mean {statistics.fmean(at_50):.3f}), 90% "
            f"{min(at_90):.2f}-{max(at_90):.2f} (mean {statistics.fmean(at_90):.3f}); orders below 0.40 at 50%: "
            f"{sum(c < 0.40 for c in at_50)}, above 0.60: {sum(c > 0.60 for c in at_50)}")


def summarise_kept(report: list[dict], larger: dict) -> None:
    """Per split of the larger draws: each template's and table's rows, training median, the error of a copy of the
    last number stated, and the range over the orders of the kept fits' error; and the coverage's range, also on the
    profile's splits."""
    for split in SPLITS:
        rows = larger[split]
        copies: dict[str, list] = {}
        for name, true, values, present in zip(rows["templates"], rows["true"], rows["context"]["values"],
                                               rows["context"]["present"], strict=True):
            last = float(values[int(present.sum()) - 1]) if bool(present.any()) else 0.0
            copies.setdefault(name, []).append(experiment.relative_error(last, true))
        medians = median_baseline(larger, split)
        print(f"larger {split}: template rows, training median, copy of the last number, kept fits over the orders")
        for name in sorted(medians):
            errors = [entry["larger"][split]["per_template"][name] for entry in report]
            print(f"  {name}: {len(copies[name])}, {medians[name]:.3f}, {statistics.median(copies[name]):.3f}, "
                  f"{min(errors):.3f}-{max(errors):.3f}")
        means = [statistics.fmean(entry["larger"][split]["per_template"].values()) for entry in report]
        print(f"  mean over templates {min(means):.3f}-{max(means):.3f}; "
              + _coverage_line([entry["larger"][split]["coverage"] for entry in report]))
        print(f"  the profile's {split} split: " + _coverage_line([entry[split]["coverage"] for entry in report]))


def common_width_shift(model, rows: dict, loc_linear: torch.Tensor) -> float:
    """The shift δ ≥ 0 of every entry of the path's β (so of log ρ at every row) that the widths' calibration on the
    held-out `rows` (the read-out's locations there leave-one-out, `loc_linear`) left out of its optimum: where the
    saved widths less δ make the calibration's objective (their NLL plus its ridge on the read-out's and the path's
    shifts, `context_width_shift` of the saved fit) stationary along a common shift. A model saved with the widths
    shifted to the held-out median after that calibration (not the library's) has its δ recovered so."""
    read, loc_linear, spread, noise = read_saved(model, rows, loc_linear)
    loc = read.linear_weight[:, 0] * loc_linear + read.offset[:, 0]
    fixed, width = read.linear_weight[:, 0] * spread, read.width[:, 0] * noise
    a_s, b_s = model.config.value_head_fit["context_width_shift"][:2]

    def slope(delta: float) -> float:
        c = torch.zeros((), dtype=torch.float64, requires_grad=True)
        with torch.enable_grad():
            scale = (fixed + width * torch.exp(c - delta)).clamp(min=model.config.scale_min)
            cauchy.nll(rows["y"].double(), loc, scale).mean().backward()
        return float(c.grad) + 2 * path_widths._CALIBRATION_RIDGE * (a_s + b_s - 2 * delta)

    if slope(0.0) <= 0:  # the saved widths are at the optimum or narrower: no shift beyond it
        return 0.0
    low, high = 0.0, 10.0
    for _ in range(60):  # the slope falls with δ (wider than the optimum, a wider shift costs)
        middle = (low + high) / 2
        low, high = (middle, high) if slope(middle) > 0 else (low, middle)
    return (low + high) / 2


def measure_saved(folder: str, saved: dict, undo_shift_order=None, data_seed: int = 0) -> None:
    """The value of the model saved in `folder` on the saved splits and, with `--tests`, the larger draws: each
    template's and table's error against its training median, the mean over templates and the coverage. With
    `undo_shift_order`, also with the common shift of its widths that the calibration on the held-out rows in that
    order left out (`common_width_shift`) taken off, and those rows' coverage (`held_coverage`)."""
    model = CausalQwenForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    _measure_saved(model, saved)
    if undo_shift_order is None:
        return
    train, _ = permuted(saved, undo_shift_order, data_seed)
    loo = _ridge(train["x"].double(), train["y"].double(), PENALTIES)[-1]
    held = torch.arange(len(train["y"])) % context_start._HELD_OUT_EVERY == 0
    delta = common_width_shift(model, subset(train, held), (train["y"].double() - loo)[held])
    with torch.no_grad():
        path = model.abduction.context_values
        path.width_by_choice -= delta
        path.mean_width -= delta
    print(f"the widths less the common shift δ = {delta:.5f} left out of the calibration's optimum:")
    _measure_saved(model, saved)
    print("  its held-out rows in that order, coverage 50% / 90% (rows): " + "; ".join(
        f"{kind} {c50:.2f} / {c90:.2f} ({n})" for kind, (c50, c90, n)
        in held_coverage(model, saved, train, loo, undo_shift_order, data_seed).items()))


def _measure_saved(model, saved: dict) -> None:
    draws = {"the profile's splits": saved}
    if "tests" in saved:
        draws["the larger splits"] = {**saved, **saved["tests"]}
    for name, rows in draws.items():
        entry = {split: measure(model, rows, split) for split in SPLITS}
        print(f"{name}: at or above the median: {', '.join(_above_median(rows, entry)) or 'none'}")
        for split in SPLITS:
            medians = median_baseline(rows, split)
            per = entry[split]["per_template"]
            c50, c90 = entry[split]["coverage"]
            print(f"  {split} ({len(rows[split]['true'])} targets): "
                  + ", ".join(f"{t} {e:.3f} ({medians[t]:.3f})" for t, e in per.items())
                  + f"; mean over templates {statistics.fmean(per.values()):.3f}; coverage {c50:.3f} / {c90:.3f}")


def pooled_state(states: list[dict], rank: int) -> dict:
    """One path whose scores are the mean of those of the fits `states` (small paths on the same coordinates): the
    linear maps (the choice's and the mean's scores, the width) averaged, and each rank-r bilinear form (the copies'
    scores, the two combinations' weights), the mean of the fits' forms in the augmented coordinates [c, 1] of the
    query and [c_j, c_(j-1), 1] of the key, cut to its best rank r by its SVD. So the choice of the pooled path is the
    softmax of the fits' mean scores (a normalised geometric mean of their choices) where the cut loses nothing."""
    out = {name: torch.stack([state[name] for state in states]).mean(0)
           for name in ("choice.weight", "choice.bias", "mean_score.weight", "mean_score.bias", "width.weight",
                        "width.bias", "width_by_choice", "mean_width")}
    for name in ("query.weight", "query.bias", "key.weight", "key.bias", "key_before.weight"):
        out[name] = states[0][name].clone()
    d = states[0]["query.weight"].shape[1]
    for part in range(3):  # the copies' scores, the log-space and the raw-space weights
        rows = slice(part * rank, (part + 1) * rank)
        form = sum(torch.cat((state["query.weight"][rows], state["query.bias"][rows, None]), 1).T
                   @ torch.cat((state["key.weight"][rows], state["key_before.weight"][rows],
                                state["key.bias"][rows, None]), 1) for state in states) / len(states)
        u, singular, vh = torch.linalg.svd(form, full_matrices=False)
        query = (u[:, :rank] * singular[:rank].sqrt()).T
        key = singular[:rank].sqrt()[:, None] * vh[:rank]
        out["query.weight"][rows], out["query.bias"][rows] = query[:, :d], query[:, d]
        out["key.weight"][rows], out["key_before.weight"][rows] = key[:, :d], key[:, d:2 * d]
        out["key.bias"][rows] = key[:, 2 * d]
    return out


def pooled(model, saved: dict, orders: list, seed: int, pristine: dict, output: str | None,
           data_seed: int = 0) -> None:
    """For each order of the training rows, the library's fit, and the fits that beat the read-out pooled into one
    path (`pooled_state`) and finished as the library finishes the one it keeps: all of them, those without the
    pointer fitted first, and the best two by the held-out NLL as read."""
    report = []
    rank = model.abduction.context_values.rank
    for order in orders:
        train, _ = permuted(saved, order, data_seed)
        with torch.no_grad():
            _, _, _, loo = _write_readout(model, train["x"], train["y"], PENALTIES)
        with Candidates() as study:
            model.abduction.context_values.load_state_dict(pristine)
            kept = study.fit(model, train, loo, seed, None)
            report.append(_pooled_entry(model, saved, order, "library", kept, kept))
            held = context_start.held_out_rows(len(train["y"]))
            fits = []
            for index, (split, pointer) in enumerate(study.calls):
                held_out, state, _ = study.results[index]
                if state is None or held_out >= kept["context_nll_linear"]:
                    continue
                as_read = float(held_out_as_read(model, split, state, held)[0].mean())
                if as_read < float(held_out_as_read(model, split, None, held)[0].mean()):
                    fits.append((as_read, pointer, state))
            fits.sort(key=lambda fit: fit[0])
            arms = {"pooled, all": [fit[2] for fit in fits],
                    "pooled, without the pointer fitted first": [fit[2] for fit in fits if not fit[1]],
                    "pooled, the best two": [fit[2] for fit in fits[:2]]}
            done: list[list] = []
            for name, states in arms.items():
                if len(states) < 2 or states in done:
                    continue
                done.append(states)
                state, calls = pooled_state(states, rank), []

                def fit_from(small, loss, split, transform, noise, pointer=False, state=state, calls=calls):
                    calls.append(pointer)  # the pooled state as the first fit, no other
                    if len(calls) > 1:
                        return 0.0, None, 0
                    small.load_state_dict(state)
                    return float(loss(small, True)), state, 0

                context_start._fit_from = fit_from
                model.abduction.context_values.load_state_dict(pristine)
                record = context_start.fit_context_values(model, context_rows(train), train["x"], train["x_scale"],
                                                          train["y"], seed=seed, loo_residuals=loo)
                report.append(_pooled_entry(model, saved, order, f"{name} ({len(states)})", record, kept))
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(report, indent=1))


def _pooled_entry(model, saved: dict, order, arm: str, record: dict, kept: dict) -> dict:
    if record["context_seed"] is None:
        print(f"  order {order}, {arm}: does not beat the read-out", flush=True)
        return {"order": order, "arm": arm, "passes": False}
    entry = {"order": order, "arm": arm, "passes": True, "held_out_nll_as_read": record["context_nll_as_read"]}
    for split in SPLITS:
        m = measure(model, saved, split)
        entry[split] = {"per_template": m["per_template"], "coverage": m["coverage"]}
    test, real = entry["test"], entry["real_test"]
    print(f"  order {order}, {arm}: held-out NLL as read {record['context_nll_as_read']:.3f} (the library's "
          f"{kept['context_nll_as_read']:.3f}); test mean {statistics.fmean(test['per_template'].values()):.3f}, "
          f"coverage {test['coverage'][0]:.2f} / {test['coverage'][1]:.2f}; tables "
          + ", ".join(f"{k} {v:.3f}" for k, v in real["per_template"].items())
          + f", coverage {real['coverage'][0]:.2f} / {real['coverage'][1]:.2f}; repeat "
          f"{test['per_template']['measurement_noise']:.4f} / "
          f"{entry['extrapolation']['per_template']['measurement_noise']:.3f}; above the median: "
          f"{', '.join(_above_median(saved, entry)) or 'none'}", flush=True)
    return entry


def choices(passing: list[dict]) -> dict[str, dict]:
    """The fit each rule keeps: the library's (least held-out NLL with the scaled copies, a fit with its pointer
    fitted first preferred), the least held-out NLL on the rows as read, and the medoid (the least mean absolute
    distance of its held-out locations from their median over the fits)."""
    kept = [entry for entry in passing if entry["kept_by_library"]]
    locs = torch.tensor([entry["held_out_loc"] for entry in passing], dtype=torch.float64)
    distance = (locs - locs.median(0).values).abs().mean(1)
    return {"library": kept[0] if kept else None,
            "as read": min(passing, key=lambda entry: entry["held_out_nll_as_read"]),
            "medoid": passing[int(distance.argmin())]}


def _by_template(templates: list[str], values: list[float]) -> dict[str, float]:
    groups: dict[str, list[float]] = {}
    for template, value in zip(templates, values, strict=True):
        groups.setdefault(template, []).append(value)
    return {name: statistics.fmean(v) for name, v in sorted(groups.items())}


def _above_median(saved: dict, entry: dict) -> list[str]:
    """The templates and tables whose error is not below their training median (bar 3)."""
    return [f"{split}:{name}" for split in SPLITS for name, error in entry[split]["per_template"].items()
            if error >= median_baseline(saved, split)[name]]


def _ranks(values: list[float]) -> torch.Tensor:
    """Ranks from 1, ties given their mean rank."""
    x = torch.tensor(values, dtype=torch.float64)
    ranks = torch.empty_like(x)
    order = x.argsort()
    ranks[order] = torch.arange(1, len(x) + 1, dtype=torch.float64)
    for value in x.unique():
        ties = x == value
        ranks[ties] = ranks[ties].mean()
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of `a` and `b`."""
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def held_out_targets(saved: dict, order: int | str, data_seed: int) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """The fit's held-out rows in `order` (every fifth, as `fit_context_values` holds them out): their templates,
    whether each is its text's last number (the target the test splits measure) `[N]` and its value `[N]`."""
    _, perm = permuted(saved, order, data_seed)
    held = perm[::context_start._HELD_OUT_EVERY]
    texts = torch.tensor(saved["train_texts"])
    last = torch.ones(len(texts), dtype=torch.bool)
    last[:-1] = texts[1:] != texts[:-1]
    true = cauchy.untransform_values(saved["train"]["y"].double(), "symlog")
    return [saved["train_templates"][i] for i in held.tolist()], last[held], true[held]


def analyse(saved: dict, paths: str, data_seed: int) -> None:
    """What the held-out rows can tell between the fits of `--candidates` reports (comma-separated): per template
    and table, the Spearman correlation, over the fits that beat the read-out, of the median relative error at the
    held-out target rows (each text's last number, as the test splits measure) with the test split's."""
    report = [entry for path in paths.split(",") for entry in json.loads(Path(path).read_text())
              if entry["passes"] and "held_out_loc" in entry]
    held = {order: held_out_targets(saved, order, data_seed) for order in {entry["order"] for entry in report}}
    pairs: dict[str, tuple[list, list, list]] = {}
    for entry in report:
        templates, last, true = held[entry["order"]]
        predicted = cauchy.untransform_values(torch.tensor(entry["held_out_loc"], dtype=torch.float64), "symlog")
        errors: dict[str, list] = {}
        for k in last.nonzero().flatten().tolist():
            errors.setdefault(templates[k], []).append(experiment.relative_error(float(predicted[k]), float(true[k])))
        for name, values in errors.items():
            test = entry["test"]["per_template"].get(name, entry["real_test"]["per_template"].get(name))
            held_out, tested, rows = pairs.setdefault(name, ([], [], []))
            held_out.append(statistics.median(values))
            tested.append(test)
            rows.append(len(values))
    test_rows = Counter(saved["test"]["templates"] + saved["real_test"]["templates"])
    print(f"{len(report)} fits that beat the read-out, {len(held)} orders")
    print("| template or table | held-out target rows per order | test rows | median error over the fits: held-out "
          "targets / test | Spearman |")
    for name, (held_out, tested, rows) in sorted(pairs.items()):
        print(f"| {name} | {min(rows)}-{max(rows)} | {test_rows[name]} | {min(held_out):.3f}-{max(held_out):.3f} / "
              f"{min(tested):.3f}-{max(tested):.3f} | {spearman(held_out, tested):.2f} |")
    rules(saved, report, held)


def rules(saved: dict, report: list[dict], held: dict) -> None:
    """Rules that keep the fit of least held-out value of a criterion: each criterion's Spearman correlation over
    the fits with their count of templates and tables at or above the training median (bar 3), and what the fit each
    keeps per order scores, summed over the orders (the trainer's apart)."""
    criteria = {"NLL with the scaled copies": lambda entry, _: entry["held_out_nll"],
                "NLL on the rows as read": lambda entry, _: entry["held_out_nll_as_read"]}
    transformed = {"mean absolute error in the head's space": lambda loc, true, error: (loc - true).abs().mean(),
                   "mean log relative error": lambda loc, true, error: error.clamp(min=1e-6).log().mean(),
                   "pooled median relative error": lambda loc, true, error: error.median()}
    for name, measure_of in transformed.items():
        def criterion(entry, held_rows, measure_of=measure_of):
            _, _, true = held_rows
            loc = torch.tensor(entry["held_out_loc"], dtype=torch.float64)
            error = (cauchy.untransform_values(loc, "symlog") - true).abs() / true.abs().clamp(min=1e-12)
            return float(measure_of(loc, cauchy.transform_values(true, "symlog"), error))
        criteria[name] = criterion
    counts = [len(_above_median(saved, entry)) for entry in report]
    print("\n| rule: the least held-out ... | Spearman with the count | count over the orders (trainer's order) | "
          "corpus test mean |")
    for name, criterion in criteria.items():
        values = [criterion(entry, held[entry["order"]]) for entry in report]
        kept = {}
        for entry, value in zip(report, values, strict=True):
            if entry["order"] not in kept or value < kept[entry["order"]][0]:
                kept[entry["order"]] = (value, entry)
        count = {order: len(_above_median(saved, entry)) for order, (_, entry) in kept.items()}
        means = [statistics.fmean(entry["test"]["per_template"].values()) for order, (_, entry) in kept.items()
                 if order != "trainer"]
        print(f"| {name} | {spearman(values, counts):.2f} | "
              f"{sum(c for order, c in count.items() if order != 'trainer')} ({count.get('trainer', '-')}) | "
              f"{statistics.fmean(means):.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--read", action="store_true", help="read and save the rows (once)")
    parser.add_argument("--rows", default="runs/path_fit/rows.pt")
    parser.add_argument("--profile", default="cpu", choices=sorted(experiment.PROFILES))
    parser.add_argument("--arms", default="library")
    parser.add_argument("--starts", type=int)
    parser.add_argument("--choices", action="store_true", help="also print each template's mean choice π̄")
    parser.add_argument("--only", help="fit on this template's training rows alone")
    parser.add_argument("--show", metavar="TEMPLATE", help="also print each target of this template or table")
    parser.add_argument("--seed", type=int, default=0, help="the data's and the conversion's (as the rows were read)")
    parser.add_argument("--fit-seeds", default="0", help="comma-separated: each arm is fitted from each of these "
                        "seeds of the path's random starts (the library's: 0)")
    parser.add_argument("--orders", help="comma-separated seeds of the training rows' order (0: as read; "
                        "trainer: as CausalQwenTrainer reads them in run_experiment.py with --seed)")
    parser.add_argument("--candidates", action="store_true",
                        help="with --orders: report every fit the library chooses between (the library's fit only)")
    parser.add_argument("--pooled", action="store_true",
                        help="with --orders: the library's fit against the fits pooled into one path")
    parser.add_argument("--kept", action="store_true",
                        help="with --orders: the fit the library keeps in each order, on the splits and --tests")
    parser.add_argument("--output", help="with --candidates, --pooled or --kept: write the report as JSON here")
    parser.add_argument("--read-tests", metavar="PATH", help="read larger draws of the corpus's test splits "
                        "(--test-size examples each) and save them here")
    parser.add_argument("--test-size", type=int, default=480)
    parser.add_argument("--tests", metavar="PATH", help="with --kept: also measure on the splits --read-tests saved")
    parser.add_argument("--kept-report", metavar="PATH", help="with --tests: summarise a --kept report again")
    parser.add_argument("--measure-model", metavar="DIR", help="measure a saved CausalQwen model's value (its "
                        "read-out and path on the saved rows, which its frozen backbone reads as the rows' did) on "
                        "the splits and --tests")
    parser.add_argument("--undo-shift", metavar="ORDER", help="with --measure-model: also with the common shift of "
                        "the widths beyond the calibration's optimum on the held-out rows in this order taken off")
    parser.add_argument("--analyse", metavar="REPORTS", help="read --candidates reports (comma-separated): how "
                        "well the held-out rows rank the fits' test error, per template and table")
    args = parser.parse_args()
    if args.read:
        read(args)
        return
    if args.read_tests:
        read_tests(args)
        return
    saved = torch.load(args.rows, weights_only=False)
    if args.tests:
        saved["tests"] = torch.load(args.tests, weights_only=False)
    if args.measure_model:
        if args.undo_shift:
            saved["train_templates"], saved["train_texts"] = train_templates(
                experiment.PROFILES[args.profile], CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR),
                args.seed)
        order = None if args.undo_shift is None else (args.undo_shift if args.undo_shift == "trainer"
                                                      else int(args.undo_shift))
        measure_saved(args.measure_model, saved, order, args.seed)
        return
    profile = experiment.PROFILES[args.profile]
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    model = experiment.new_causal(profile, tokenizer, args.seed, context_values=True).eval()
    saved["train_templates"], saved["train_texts"] = train_templates(profile, tokenizer, args.seed)
    assert len(saved["train_templates"]) == len(saved["train"]["y"]), len(saved["train_templates"])
    pristine = copy.deepcopy(model.abduction.context_values.state_dict())
    if args.analyse:
        analyse(saved, args.analyse, args.seed)
        return
    if args.kept_report:
        if not args.tests:
            parser.error("--kept-report goes with --tests")
        summarise_kept(json.loads(Path(args.kept_report).read_text()), {**saved, **saved["tests"]})
        return
    for split in SPLITS:
        medians = median_baseline(saved, split)
        print(f"{split} training median: " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()))
    study = pooled if args.pooled else candidates if args.candidates else kept_fits if args.kept else None
    if bool(args.orders) != (study is not None):
        parser.error("--orders goes with --candidates, --pooled or --kept, and each of them with --orders")
    if study is not None:
        if "," in args.arms:
            parser.error("a study fits one arm: --arms without commas")
        arm(args.arms)
        orders = [order if order == "trainer" else int(order) for order in args.orders.split(",")]
        study(model, saved, orders, int(args.fit_seeds.split(",")[0]), pristine, args.output, args.seed)
        return
    for name, fit_seed in [(name, int(s)) for name in args.arms.split(",") for s in args.fit_seeds.split(",")]:
        model.abduction.context_values.load_state_dict(pristine)
        arm(name)
        t0 = time.perf_counter()
        record = fit(model, saved, fit_seed, args.starts, args.only)
        print(f"\n{name}, fit seed {fit_seed}: fit {time.perf_counter() - t0:.0f}s, "
              f"held-out NLL {record['context_nll']:.4f} "
              f"(read-out {record['context_nll_linear']:.4f}), step {record['context_step']}, "
              f"seed {record['context_seed']}", flush=True)
        for split in SPLITS:
            m = measure(model, saved, split)
            cells = ", ".join(f"{k} {v:.3f}" for k, v in m["per_template"].items())
            print(f"  {split}: {cells}; mean {statistics.fmean(m['per_template'].values()):.3f}, pooled "
                  f"{m['pooled']:.3f}, coverage {m['coverage'][0]:.2f} / {m['coverage'][1]:.2f}", flush=True)
            if args.choices:
                print("    mean choice (read-out, copies, log, raw, mean): " + "; ".join(
                    f"{k} " + "/".join(f"{p:.2f}" for p in v) for k, v in m["choice"].items()), flush=True)
            if args.show:
                show_rows(model, saved, split, args.show)


def show_rows(model, saved: dict, split: str, template: str) -> None:
    """Each target of `template` on `split`: its value, the predicted median, the relative error and the choice."""
    rows = saved[split]
    median, _, _, choice = predict(model, rows)
    for k, (name, true) in enumerate(zip(rows["templates"], rows["true"], strict=True)):
        if name == template:
            print(f"    {true:12.2f}: median {float(median[k]):12.2f}, relative error "
                  f"{experiment.relative_error(float(median[k]), true):.3f}, choice (read-out, copies, log, raw, "
                  f"mean) " + "/".join(f"{float(p):.2f}" for p in choice[k]), flush=True)


if __name__ == "__main__":
    main()
