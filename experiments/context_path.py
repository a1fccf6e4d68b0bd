"""The context-value path in the model (docs/design.md §1b): with it off and on, right after the start from data, and
after training with the defaults.

One converted Qwen2.5-0.5B per arm (`from_qwen(folder, context_values=...)`, every other default), started by
`fit_value_head` on the training texts of `run_experiment.py`'s profile (the corpus templates and the real tables
mixed; for the path this is `context_start.fit_context_values`), then trained `--steps` steps by
`CausalQwenTrainer` at its defaults on the same texts in the same order (0: the start only). Measured on the test
splits: the target's median relative error per template (teacher-forced median at the position before the target's
`<NUM>`), their mean, and the 50% / 90% interval coverage; on the test texts, next-token accuracy, num_f1 and OvR
perplexity over every position; and each template's training median as the baseline. `--scales` changes the
per-module learning rates of the training, and `--train-value-features` trains the features the value reads (arms
of the mechanism that keeps the start). `--fit-starts` and `--fit-seed` fit the path from other random starts than the
library's, and `--no-key-before` holds the keys' read of the position before each number at 0 (the path's earlier
form): the arms of "Keys that read the words before the number" in docs/experiments.md. The arm `log` is the path
on with the log-space combination summing ln|v| (`context_values_log="log"`): "The log of the values" there. The arm
`pointer-by-error` is the path on with its pointer fitted only by the value's error with the rest of the path: no
start with it fitted to the copied numbers first (`context_start._fit_pointer`), "A pointer fitted to the copied
number" there. `--save DIR` keeps each arm's model right after its start, to be read again without a new start.

    python experiments/context_path.py --output runs/context_path                 # the start only
    python experiments/context_path.py --steps 12 --output runs/context_path      # and after 12 steps
    python experiments/context_path.py --profile tiny --output /tmp/context_path  # the pipeline only
    python experiments/context_path.py --arms on --fit-starts 1 --fit-seed 2 --no-key-before   # one start, old key
    python experiments/context_path.py --arms on,log                              # the log of the values
    python experiments/context_path.py --arms on,pointer-by-error                 # the pointer by the value's error
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_experiment as experiment  # noqa: E402

from causal_qwen import CausalQwenTokenizer  # noqa
from causal_qwen.context_values import CausalQwenContextValues  # noqa: E402
from causal_qwen.data import CausalQwenDataCollator, template_baselines, tokenize_examples  # noqa: E402
from causal_qwen.starts import fit_value_head  # noqa: E402
from causal_qwen.starts import path as context_start  # noqa: E402
from causal_qwen.starts import readout as starts_module  # noqa: E402

SPLITS = ("test", "real_test", "extrapolation")


def pooled_error(predicted: list[float], true: list[float]) -> float:
    """Median relative error over every target of a split."""
    errors = [experiment.relative_error(p, t) for p, t in zip(predicted, true, strict=True)]
    return statistics.median(errors) if errors else float("nan")


def measure(model, tokenizer, data: dict, batch: int) -> dict:
    results = {}
    for split in SPLITS:
        targets = experiment.causal_targets(model, tokenizer, data[split], batch)
        results[split] = {"per_template": experiment.per_template(targets["median"], targets["examples"]),
                          "pooled": pooled_error(targets["median"], targets["true"]),
                          **experiment.interval_metrics(targets),
                          "coverage_50_per_template": coverage_per_template(targets)}
    results["test"]["choice"] = choices(model, tokenizer, data["test"], batch)
    results["real_test"]["choice"] = choices(model, tokenizer, data["real_test"], batch)
    # num_f1, next-token accuracy and OvR perplexity on the test texts (docs/design.md §6).
    results["test"]["positions"] = experiment.causal_positions(model, tokenizer, data["test"], batch, 0)
    return results


def coverage_per_template(targets: dict) -> dict[str, float]:
    """The share of each template's targets inside their 50% interval: where a pooled coverage comes from."""
    inside: dict[str, list[bool]] = {}
    for ex, true, low, high in zip(targets["examples"], targets["true"], targets["low50"], targets["high50"],
                                   strict=True):
        inside.setdefault(ex.template, []).append(low <= true <= high)
    return {name: sum(v) / len(v) for name, v in sorted(inside.items())}


@torch.no_grad()
def choices(model, tokenizer, examples: list, batch: int) -> dict:
    """The path's choice π̄ = (π_0, Σ_j π_j, π_ℓ, π_r, π_μ) at the position before each target, averaged per template."""
    path = model.abduction.context_values
    if path is None:
        return {}
    read, seen = path.read, []
    path.read = lambda *args, **kwargs: seen.append(read(*args, **kwargs)) or seen[-1]
    try:
        collator = CausalQwenDataCollator.from_tokenizer(tokenizer)
        per_template: dict[str, list] = {}
        examples = experiment.with_target(examples)
        for k in range(0, len(examples), batch):
            chunk = examples[k:k + batch]
            inputs = collator(tokenize_examples(tokenizer, [ex.text for ex in chunk]))
            seen.clear()
            model(inputs["input_ids"], numeric_values=inputs["numeric_values"], attention_mask=inputs["attention_mask"])
            for b, ex in enumerate(chunk):
                where = (inputs["input_ids"][b] == tokenizer.num_token_id).nonzero().flatten()
                if len(where):
                    per_template.setdefault(ex.template, []).append(seen[-1].choice[b, int(where[-1]) - 1].tolist())
    finally:
        del path.read
    return {name: [round(statistics.fmean(column), 4) for column in zip(*rows, strict=True)]
            for name, rows in per_template.items()}


def median_baseline(data: dict) -> dict:
    """Each template's training median as the prediction of its test targets: the baseline of bar 3."""
    medians = {name: median for name, (_, median) in template_baselines(data["train"]).items()}
    results = {}
    for split in SPLITS:
        examples = experiment.with_target(data[split])
        predicted = [medians[ex.template] for ex in examples]
        results[split] = {"per_template": experiment.per_template(predicted, examples),
                          "pooled": pooled_error(predicted, [ex.target_value for ex in examples])}
    return results


def ablate_path_fit(fit_starts: int | None, fit_seed: int, no_key_before: bool) -> None:
    """The path's fit with other starts, or with K' held at 0 (its gradient is then 0, so it stays at its start, 0)."""
    if fit_starts is not None:
        context_start._STARTS = fit_starts
    if fit_seed:
        fit = starts_module.fit_context_values
        starts_module.fit_context_values = lambda *a, **k: fit(*a, **{**k, "seed": fit_seed})
    if no_key_before:
        keys = CausalQwenContextValues.keys
        CausalQwenContextValues.keys = lambda self, own, before: keys(self, own, before * 0.0)


# The config of each arm beyond `from_qwen`'s defaults.
ARMS = {"off": {"context_values": False}, "on": {"context_values": True},
        "log": {"context_values": True, "context_values_log": "log"},
        "pointer-by-error": {"context_values": True}}
# The arms whose start's fit is the library's with one part left out: the starts whose pointer is fitted to the copied
# numbers first ("A pointer fitted to the copied number" in docs/experiments.md).
FIT_ABLATIONS = {"pointer-by-error": ("_copies_told", lambda *args: False)}


def run_arm(name: str, profile, tokenizer, data: dict, args) -> dict:
    if name in FIT_ABLATIONS:
        with mock.patch.object(context_start, *FIT_ABLATIONS[name]):
            return _run_arm(name, profile, tokenizer, data, args)
    return _run_arm(name, profile, tokenizer, data, args)


def _run_arm(name: str, profile, tokenizer, data: dict, args) -> dict:
    t0 = time.perf_counter()
    model = experiment.new_causal(profile, tokenizer, args.seed, **ARMS[name]).eval()
    collator = CausalQwenDataCollator.from_tokenizer(tokenizer)
    features = tokenize_examples(tokenizer, [ex.text for ex in data["train"]])
    # The start a user gets (as `CausalQwenTrainer` makes it), the <NUM> decision's included: num_f1 is measured.
    fit = fit_value_head(model, experiment.collated(collator, features, profile.eval_batch),
                         max_positions=args.max_positions)
    arm = {"fit": fit.to_dict(), "start": measure(model, tokenizer, data, profile.eval_batch),
           "start_seconds": time.perf_counter() - t0}
    print(f"{name}: start measured, {arm['start_seconds']:.0f}s", flush=True)
    if args.save:
        model.save_pretrained(Path(args.save) / name)
    if args.steps:
        trainer = experiment.train_causal(model, tokenizer, data["train"], profile, Path(args.output) / name,
                                          args.seed, steps=args.steps, scales=json.loads(args.scales),
                                          train_value_features=args.train_value_features)
        arm["refits"] = [(step, fit.to_dict()) for step, fit in trainer.value_head_start.refits]
        arm["trained"] = measure(model, tokenizer, data, profile.eval_batch)
        print(f"{name}: trained {args.steps} steps, {time.perf_counter() - t0:.0f}s", flush=True)
        if args.restart:
            # The start's own procedure again on the trained features: tells a loss of features from a loss of fit.
            features = tokenize_examples(tokenizer, [ex.text for ex in data["train"]])
            arm["restart_fit"] = fit_value_head(
                model, experiment.collated(collator, features, profile.eval_batch), num_row=False).to_dict()
            arm["restarted"] = measure(model, tokenizer, data, profile.eval_batch)
    return arm


def table(results: dict) -> str:
    lines = []
    for split in SPLITS:
        rows = [(f"{name}, {stage}", arm[stage][split]) for name, arm in results["arms"].items()
                for stage in ("start", "trained", "restarted") if stage in arm]
        rows.append(("training median of each template", results["median_baseline"][split]))
        templates = list(rows[0][1]["per_template"])
        lines += [f"\n{split}: median relative error of the target; coverage of the 50% / 90% intervals",
                  "| arm | " + " | ".join(templates) + " | pooled | coverage 50% / 90% |",
                  "|---" * (len(templates) + 3) + "|"]
        for name, cell in rows:
            errors = " | ".join(f"{cell['per_template'][t]:.3g}" for t in templates)
            coverage = (f"{cell['reg_coverage_50']:.2f} / {cell['reg_coverage_90']:.2f}"
                        if "reg_coverage_50" in cell else "")
            lines.append(f"| {name} | {errors} | {cell['pooled']:.3g} | {coverage} |")
        covered = [(name, cell["coverage_50_per_template"]) for name, cell in rows
                   if "coverage_50_per_template" in cell]
        if covered:
            lines += [f"\n{split}: coverage of the 50% interval per template",
                      "| arm | " + " | ".join(templates[:-1]) + " |", "|---" * len(templates) + "|"]
            lines += [f"| {name} | " + " | ".join(f"{cell.get(t, float('nan')):.2f}" for t in templates[:-1]) + " |"
                      for name, cell in covered]
    lines += ["\ntest texts, every position: next-token accuracy, num_f1, OvR perplexity",
              "| arm | accuracy | num_f1 | ppl_ovr |", "|---|---|---|---|"]
    for name, arm in results["arms"].items():
        for stage in ("start", "trained", "restarted"):
            if stage in arm and "positions" in arm[stage]["test"]:
                cell = arm[stage]["test"]["positions"]
                lines.append(f"| {name}, {stage} | {cell['eval/accuracy']:.4f} | "
                             f"{cell['eval/num_f1']:.3f} | {cell['eval/ppl_ovr']:.4g} |")
    lines += ["\nthe path's choice at the targets, mean per template: read-out, copies, log-space, raw-space, mean",
              "| arm | template | π_0 | Σ π_j | π_ℓ | π_r | π_μ |", "|---|---|---|---|---|---|---|"]
    for name, arm in results["arms"].items():
        for split in ("test", "real_test"):
            for template, mean in arm["start"][split].get("choice", {}).items():
                lines.append(f"| {name} | {template} | " + " | ".join(f"{v:.3f}" for v in mean) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="cpu", choices=sorted(experiment.PROFILES))
    parser.add_argument("--steps", type=int, default=0, help="training steps after the start (0: the start only)")
    parser.add_argument("--arms", default="off,on", help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--restart", action="store_true",
                        help="after training, also fit the value head from scratch (the start's procedure) and measure")
    parser.add_argument("--scales", default="{}",
                        help='learning-rate multiples over the defaults, JSON (e.g. \'{"numeric_embedding": 1e-9}\')')
    parser.add_argument("--train-value-features", action="store_true",
                        help="train the numeric embedding and the abduction network (default: held, as the library)")
    parser.add_argument("--fit-starts", type=int, help="random starts of the path's fit (the library's: 3)")
    parser.add_argument("--fit-seed", type=int, default=0, help="the seed of the path fit's first start")
    parser.add_argument("--no-key-before", action="store_true",
                        help="hold K' (the keys' read of the position before each number) at 0 in the path's fit")
    parser.add_argument("--num-train", type=int, help="override the profile's corpus training texts")
    parser.add_argument("--max-positions", type=int, default=4096,
                        help="value rows the start reads at most (fit_value_head's max_positions; the library's: 4096)")
    parser.add_argument("--save", help="save each arm's model right after its start under this folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="runs/context_path")
    args = parser.parse_args()
    ablate_path_fit(args.fit_starts, args.fit_seed, args.no_key_before)
    profile = experiment.PROFILES[args.profile]
    if args.num_train is not None:
        profile = replace(profile, n_train=args.num_train)
    data = experiment.load_data(profile, args.seed)
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    results = {"profile": args.profile, "steps": args.steps, "arms": {}, "median_baseline": median_baseline(data)}
    for name in args.arms.split(","):
        results["arms"][name] = run_arm(name, profile, tokenizer, data, args)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    text = table(results)
    (out / "results.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
