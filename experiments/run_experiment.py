"""Does CausalQwen learn numbers better than Qwen? Every arm trains through a public training path.

One Qwen2.5-0.5B, one training set (the numeric corpus of `causal_qwen.data.make_splits` and the real-data tables of
`causal_qwen.data.real_splits`), the same texts and the same number of optimizer steps for every arm:

  (a)  CausalQwen as a user gets it: `CausalQwenForCausalLM.from_qwen(folder)` with every default (the
       context-value path of docs/design.md §1b on), trained by `CausalQwenTrainer` with its defaults (the value
       side started from the data and held, per-module learning rates), and measured also right after its start
       from data, before any step (`a_start`), and with the path off (`from_qwen(folder, context_values=False)`,
       `a_off`, the same training);
  (b)  Qwen2 with a trainable untied lm_head (a copy of the tied embedding), cross-entropy on numbers as digits,
       trained by transformers' `Trainer`;
  (b2) as (b), plus the Number Token Loss of the `ntloss` package (CE + 0.3 · NTL, the authors' recommendation),
       through `Trainer(compute_loss_func=...)`;
  (c)  the trivial baseline: the training mean / median of each template's target (`template_baselines`).

Nothing is cached: every arm goes through the public path as a user's run does.

Targets: (a) predicts the target number by the median loc_Y at the position before the target's `<NUM>` (standard
mode, with its 50% / 90% Cauchy intervals), and also by `model.generate` in standard mode from the text before the
target; (b)/(b2) by greedy decoding of digits after the text before the target, parsed with
`causal_qwen.numbers.find_numbers`.

Then the real tables as prompt/completion pairs whose completion is the target number alone (labels only on it),
the default arm of `experiments/keep_start.py` (`--no-prompt-completion` leaves it out): the value right after the
start and after training, and the share of test prompts where standard-mode `generate` writes `<NUM>` first.

Optionally (`--sweep`) short runs of (a) read on the validation split compare the choices the defaults rest on.

Run `python experiments/run_experiment.py --profile cpu --output runs/experiment` (docs/experiments.md has the
numbers it produced); `--profile tiny` runs the whole pipeline on a tiny random backbone in a few minutes.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Qwen2ForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.cache_utils import DynamicCache

from causal_qwen import CausalQwenTokenizer
from causal_qwen.data import (
    CausalQwenDataCollator,
    NumericExample,
    make_splits,
    real_splits,
    template_baselines,
    tokenize_examples,
)
from causal_qwen.labels import IGNORE_INDEX
from causal_qwen.metrics import FIELDS, evaluate, point_errors
from causal_qwen.numbers import find_numbers
from causal_qwen.plots import plot_loss_curves, plot_predictions
from causal_qwen.starts import fit_value_head
from causal_qwen.training import LEARNING_RATE_SCALES, CausalQwenTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measures import (  # noqa: E402  (the profiles and the measures keep_start.py shares)
    PROFILES,
    QWEN_DIR,
    Profile,
    causal_generated,
    causal_targets,
    collated,
    interval_metrics,
    load_qwen,
    new_causal,
    relative_error,
    with_target,
)

NTL_WEIGHT = 0.3  # CE + 0.3·NTL, as the ntloss authors recommend
MAX_NEW_DIGITS = 20  # the longest target (extrapolation, up to 1e14) has 15 digits
# Short runs of (a) on validation: each changes one choice the defaults rest on. `scales` overrides entries of
# LEARNING_RATE_SCALES, `config` fields of from_qwen, `start` turns the value-head start off.
SWEEP = {
    "defaults": {},
    "numeric_embedding 0.1x": {"scales": {"numeric_embedding": 0.1}},
    "numeric_embedding 10x": {"scales": {"numeric_embedding": 10.0}},
    "reg_head 1x": {"scales": {"action.reg_head": 1.0}},
    "gate_alpha=0.5": {"config": {"gate_alpha": 0.5}},
    "no value-head start": {"start": False},
}


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------


def load_data(profile: Profile, seed: int) -> dict[str, list[NumericExample]]:
    """Corpus and real-data splits; the training set and validation mix both, the tests stay apart."""
    corpus = make_splits(profile.n_train, profile.n_validation, profile.n_test, profile.n_extrapolation, seed=seed)
    real = real_splits(n_per_dataset=profile.n_real, seed=seed)
    train = corpus["train"] + real["train"]
    random.Random(seed).shuffle(train)
    return {"train": train, "validation": corpus["validation"] + real["validation"], "test": corpus["test"],
            "real_test": real["test"], "extrapolation": corpus["extrapolation"]}


def training_args(out: Path, profile: Profile, seed: int, steps: int | None = None) -> TrainingArguments:
    """The same schedule for every arm: AdamW without weight decay, linear decay, `steps` steps."""
    return TrainingArguments(
        output_dir=str(out), max_steps=steps or profile.steps, per_device_train_batch_size=profile.batch_size,
        per_device_eval_batch_size=profile.eval_batch, learning_rate=profile.learning_rate, weight_decay=0.0,
        logging_steps=1, save_strategy="no", report_to=[], seed=seed, disable_tqdm=True,
        dataloader_pin_memory=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(),
    )


class CurveCallback(TrainerCallback):
    """Evaluate a function of the model before the first step (after the value-head start) and every `every`
    steps (the learning curves)."""

    def __init__(self, every: int, measure, at_start=None):
        self.every, self.measure, self.at_start, self.points = every, measure, at_start, []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0 and not self.points:
            if self.at_start is not None:  # a fuller measurement of the start
                self.at_start(model)
            self.points.append({"step": 0, **self.measure(model)})

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every and state.global_step % self.every == 0:
            self.points.append({"step": state.global_step, **self.measure(model)})


# ----------------------------------------------------------------------------------------------------------------
# Arm (a): CausalQwen through CausalQwenTrainer
# ----------------------------------------------------------------------------------------------------------------


def w_num_of(model) -> torch.Tensor:
    """w_num of a CausalQwen model, or of the trained copy inside a PEFT wrapping."""
    return next(param for name, param in model.named_parameters() if name.endswith("w_num")
                and ("modules_to_save" in name or "numeric_embedding.w_num" == name))


def train_causal(model, tokenizer, train: list[NumericExample], profile: Profile, out: Path, seed: int,
                 steps: int | None = None, scales: dict | None = None, start: bool = True,
                 curve: CurveCallback | None = None, train_value_features: bool = False) -> CausalQwenTrainer:
    """`CausalQwenTrainer` on the texts, as docs/training.md shows it."""
    features = tokenize_examples(tokenizer, [ex.text for ex in train])
    trainer = CausalQwenTrainer(
        model=model, args=training_args(out, profile, seed, steps), train_dataset=features,
        data_collator=CausalQwenDataCollator.from_tokenizer(tokenizer), value_head_start=start,
        learning_rate_scales={**LEARNING_RATE_SCALES, **(scales or {})}, callbacks=[curve] if curve else None,
        train_value_features=train_value_features,
    )
    model.train()
    trainer.train()
    model.eval()
    return trainer


def causal_positions(model, tokenizer, examples: list[NumericExample], batch_size: int, seed: int) -> dict:
    """Next-token metrics of docs/design.md §6 over every position (`causal_qwen.metrics.evaluate`)."""
    collator = CausalQwenDataCollator.from_tokenizer(tokenizer)
    features = tokenize_examples(tokenizer, [ex.text for ex in examples])
    batches = collated(collator, features, batch_size)
    return evaluate(model, batches, generator=torch.Generator().manual_seed(seed))


def calibrated_band(targets: int, nominal: float, mass: float = 0.95) -> tuple[float, float]:
    """The coverage a calibrated interval of `nominal` coverage reaches over `targets` targets in `mass` of the draws
    (the central binomial interval): over the profile's 88 corpus targets a calibrated 50% interval covers 0.40-0.60,
    so a coverage just outside ±0.10 there is one draw in about fifteen, not a miscalibration."""
    from scipy.stats import binom  # with scikit-learn, in the experiments extra

    low, high = binom.interval(mass, targets, nominal)
    return float(low) / targets, float(high) / targets


# ----------------------------------------------------------------------------------------------------------------
# Arms (b) and (b2): Qwen2 through transformers' Trainer
# ----------------------------------------------------------------------------------------------------------------


def new_qwen_with_head(profile: Profile, seed: int) -> Qwen2ForCausalLM:
    """Qwen2.5 with its backbone frozen and an untied, trainable lm_head that starts as the tied embedding."""
    qwen = load_qwen(profile.tiny, seed)
    head = nn.Linear(qwen.config.hidden_size, qwen.config.vocab_size, bias=False)
    head.weight.data.copy_(qwen.lm_head.weight.data)
    qwen.lm_head = head
    qwen.config.tie_word_embeddings = False
    qwen.model.requires_grad_(False)
    return qwen


def ntl_loss_function(ntl):
    """`Trainer(compute_loss_func=...)`: CE + 0.3·NTL over the shifted, labelled positions."""

    def loss(outputs, labels, num_items_in_batch=None):
        logits, targets = outputs.logits[:, :-1], labels[:, 1:]
        valid = targets != IGNORE_INDEX
        logits, targets = logits[valid], targets[valid]
        ce = nn.functional.cross_entropy(logits.float(), targets)
        # ntloss takes [B, T, V] logits and [B, T] labels that are already aligned (no shift inside).
        return ce + NTL_WEIGHT * ntl(logits[None], targets[None])

    return loss


def train_digits(model, tokenizer, train: list[NumericExample], profile: Profile, out: Path, seed: int,
                 ntl=None) -> Trainer:
    features = [{**f, "labels": f["input_ids"]} for f in tokenize_examples(tokenizer, [ex.text for ex in train])]
    trainer = Trainer(model=model, args=training_args(out, profile, seed), train_dataset=features,
                      data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX),
                      compute_loss_func=ntl_loss_function(ntl) if ntl is not None else None)
    model.train()
    trainer.train()
    model.eval()
    return trainer


@torch.no_grad()
def digit_positions(model, tokenizer, examples: list[NumericExample], batch_size: int) -> dict:
    """Next-token accuracy, softmax perplexity and the F1 of predicting a digit, over all labelled positions."""
    digit_ids = torch.tensor(tokenizer.convert_tokens_to_ids([str(d) for d in range(10)]))
    correct = nll = n = tp = predicted = actual = 0.0
    tokenizer.padding_side = "right"
    for k in range(0, len(examples), batch_size):
        batch = tokenizer([ex.text for ex in examples[k:k + batch_size]], return_tensors="pt", padding=True)
        logits = model(**batch).logits[:, :-1]
        targets = batch["input_ids"][:, 1:]
        valid = batch["attention_mask"][:, 1:].bool()
        logits, targets = logits[valid], targets[valid]
        pred = logits.argmax(-1)
        correct += (pred == targets).sum().item()
        nll += nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        n += targets.numel()
        pred_digit, true_digit = torch.isin(pred, digit_ids), torch.isin(targets, digit_ids)
        tp += (pred_digit & true_digit).sum().item()
        predicted += pred_digit.sum().item()
        actual += true_digit.sum().item()
    precision = tp / predicted if predicted else 0.0
    recall = tp / actual if actual else 0.0
    return {"eval/accuracy": correct / n, "eval/ppl_softmax": math.exp(min(nll / n, 700.0)),
            "eval/num_f1": 2 * precision * recall / (precision + recall) if precision + recall else 0.0}


@torch.no_grad()
def greedy_numbers(model, tokenizer, examples: list[NumericExample], batch_size: int) -> list[float | None]:
    """Greedy continuation of the text before each target, parsed as a number (None when it does not start with
    one). A row stops at its first token that cannot continue a number."""
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    number_piece = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    for i, token in enumerate(vocab):
        number_piece[i] = token is not None and token != "" and all(ch.isdigit() or ch in ".,-" for ch in token)
    examples = with_target(examples)
    prompts = [ex.text[:ex.target_char_span[0]] for ex in examples]
    results: list[float | None] = []
    for k in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[k:k + batch_size], padding=True, padding_side="left", return_tensors="pt")
        mask = enc["attention_mask"]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = model(input_ids=enc["input_ids"], attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        position = positions[:, -1:]
        generated = [[] for _ in range(len(mask))]
        done = torch.zeros(len(mask), dtype=torch.bool)
        for _ in range(MAX_NEW_DIGITS):
            token = out.logits[:, -1].argmax(-1)
            done |= ~number_piece[token]
            for b in (~done).nonzero().flatten().tolist():
                generated[b].append(int(token[b]))
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones(len(mask), 1, dtype=mask.dtype)], -1)
            position = position + 1
            out = model(input_ids=token[:, None], attention_mask=mask, position_ids=position,
                        past_key_values=cache, use_cache=True)
        for ids in generated:
            spans = find_numbers(tokenizer.decode(ids))
            results.append(spans[0].value if spans and spans[0].start == 0 else None)
    return results


# ----------------------------------------------------------------------------------------------------------------
# Metrics of point predictions
# ----------------------------------------------------------------------------------------------------------------


def point_metrics(predicted: list[float | None], true: list[float]) -> dict:
    """Regression metrics of point predictions; an unparseable prediction counts as 0 (`parse_rate` says how
    often a number was written)."""
    pred = torch.tensor([p if p is not None and math.isfinite(p) else 0.0 for p in predicted], dtype=torch.float64)
    y = torch.tensor(true, dtype=torch.float64)
    return {**point_errors(pred, y),
            "parse_rate": sum(p is not None for p in predicted) / max(len(predicted), 1), "n_targets": len(true)}


def per_template(predicted: list[float | None], examples: list[NumericExample]) -> dict[str, float]:
    """Median relative error of the target per template, and their average."""
    errors: dict[str, list[float]] = {}
    for p, ex in zip(predicted, examples, strict=True):
        errors.setdefault(ex.template, []).append(relative_error(p, ex.target_value))
    table = {name: statistics.median(v) for name, v in sorted(errors.items())}
    table["mean over templates"] = statistics.mean(table.values()) if table else float("nan")
    return table


# ----------------------------------------------------------------------------------------------------------------
# The experiment
# ----------------------------------------------------------------------------------------------------------------


def hardware() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()[:20]
    except (OSError, subprocess.CalledProcessError):
        lines = [platform.processor()]
    return "\n".join(lines)


def fitted_start(profile: Profile, tokenizer, train: list[NumericExample], seed: int) -> dict:
    """The value-head start of a fresh model on the training texts (`fit_value_head`, as a custom loop calls it)."""
    model = new_causal(profile, tokenizer, seed)
    collator = CausalQwenDataCollator.from_tokenizer(tokenizer)
    features = tokenize_examples(tokenizer, [ex.text for ex in train])
    batches = collated(collator, features, profile.eval_batch)
    fit_value_head(model, batches)
    return {"head": copy.deepcopy(model.action.reg_head.state_dict()), "fit": model.config.value_head_fit,
            "log_noise": model.action.reg_log_noise.detach().clone(),
            "num_bias": model.action.cls_head.bias[model.config.num_token_id].item()}


def run_sweep(profile: Profile, tokenizer, data: dict, out: Path, seed: int, lap) -> list[dict]:
    """Short runs of (a) from the same start, one choice changed at a time, read on validation.

    The value head is fitted once (`fit_value_head` through the trainer of the first run) and every later run starts
    from that fit: a model whose config records a fit is not fitted again, as for a reloaded checkpoint.
    """
    rows, fitted = [], fitted_start(profile, tokenizer, data["train"], seed)
    lap("sweep: value-head start")
    for name, change in SWEEP.items():
        t0 = time.perf_counter()
        model = new_causal(profile, tokenizer, seed, **change.get("config", {}))
        start = change.get("start", True)
        if start:
            model.action.reg_head.load_state_dict(fitted["head"])
            model.action.reg_log_noise.data.copy_(fitted["log_noise"])
            model.action.cls_head.bias.data[model.config.num_token_id] = fitted["num_bias"]
            model.config.value_head_fit = fitted["fit"]
        trainer = train_causal(model, tokenizer, data["train"], profile, out / "sweep", seed,
                               steps=profile.sweep_steps, scales=change.get("scales"), start=start)
        targets = causal_targets(model, tokenizer, data["validation"], profile.eval_batch)
        positions = causal_positions(model, tokenizer, data["validation"], profile.eval_batch, seed)
        rows.append({"name": name, "change": change, "positions": positions,
                     "target": {**point_metrics(targets["median"], targets["true"]), **interval_metrics(targets)},
                     "per_template": per_template(targets["median"], targets["examples"]),
                     "final_loss": [e["loss"] for e in trainer.state.log_history if "loss" in e][-1],
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(f"sweep {name}: rel err {rows[-1]['target']['reg_rel_err_median']:.4g}, "
              f"acc {positions['eval/accuracy']:.4f}, num_f1 {positions['eval/num_f1']:.3f}", flush=True)
        lap(f"sweep {name}")
        del model, trainer
    return rows


# The arms of CausalQwen: the config beyond `from_qwen`'s defaults.
CAUSAL_ARMS = {"a": {}, "a_off": {"context_values": False}}


def run_causal_arm(name: str, config: dict, profile: Profile, tokenizer, data: dict, out: Path, seed: int,
                   results: dict, lap) -> list[dict]:
    """Train one CausalQwen arm with `CausalQwenTrainer`, measure it right after its start from data (arm
    `{name}_start`) and after training on every split, and return the trainer's log history."""
    eval_splits = tuple(results["per_template"])
    model = new_causal(profile, tokenizer, seed, **config)

    def value_curve(m) -> dict:
        targets = causal_targets(m, tokenizer, data["validation"], profile.eval_batch)
        m.train()
        return {"reg_rel_err_median": point_metrics(targets["median"], targets["true"])["reg_rel_err_median"],
                **interval_metrics(targets), "w_num_norm": m.numeric_embedding.w_num.norm().item(),
                "b_reg": m.action.reg_head.bias.item(), "gamma_y": m.action.reg_log_noise.exp().item()}

    def measured(m, generate: bool) -> dict:
        # Every split of the test data, as a user's evaluation reads it; the learning curve reads validation.
        was_training = m.training
        m.eval()
        arm = {}
        for split in eval_splits:
            targets = causal_targets(m, tokenizer, data[split], profile.eval_batch)
            arm[split] = {"positions": causal_positions(m, tokenizer, data[split], profile.eval_batch, seed),
                          "target": {**point_metrics(targets["median"], targets["true"]), **interval_metrics(targets)},
                          "per_template": per_template(targets["median"], targets["examples"]), "targets": targets}
            if generate:
                values, examples = causal_generated(m, tokenizer, data[split], profile.decode_batch), with_target(
                    data[split])
                arm[split]["generated"] = point_metrics(values, [ex.target_value for ex in examples])
                arm[split]["per_template_generated"] = per_template(values, examples)
        m.train(was_training)
        return arm

    start: dict = {}
    curve = CurveCallback(max(1, profile.steps // 8), value_curve,
                          at_start=lambda m: start.update(measured(m, generate=False)))
    w_num_start = model.numeric_embedding.w_num.detach().clone()
    trainer = train_causal(model, tokenizer, data["train"], profile, out / name, seed, curve=curve)
    results.setdefault("value_head_fit", {})[name] = model.config.value_head_fit
    results["curves"][name] = curve.points
    results.setdefault("w_num_relative_change", {})[name] = (
        (model.numeric_embedding.w_num - w_num_start).norm() / w_num_start.norm()).item()
    lap(f"train ({name}), its start measured")
    for arm, measurement in ((f"{name}_start", start), (name, measured(model, generate=True))):
        results["arms"][arm] = {}
        for split in eval_splits:
            cell = measurement[split]
            results["per_template"][split][arm] = cell.pop("per_template")
            targets = cell.pop("targets")
            if "per_template_generated" in cell:
                results["per_template"][split][f"{arm} (generate)"] = cell.pop("per_template_generated")
            results["arms"][arm][split] = cell
            if arm == name:
                plot_predictions(model, _stats_for_plot(targets), out / f"{arm}_predictions_{split}.png")
    lap(f"eval ({name})")
    model.save_pretrained(out / name / "final")
    tokenizer.save_pretrained(out / name / "final")
    return trainer.state.log_history


def run(args: argparse.Namespace) -> dict:
    profile = replace(PROFILES[args.profile], **{k: v for k, v in (
        ("n_train", args.num_train), ("steps", args.steps), ("batch_size", args.batch_size),
        ("sweep_steps", args.sweep_steps)) if v is not None})
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    started = last = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal last
        timings[name] = round(time.perf_counter() - last, 1)
        last = time.perf_counter()
        print(f"[{last - started:7.1f}s] {name}: {timings[name]}s", flush=True)
        # What is measured so far, should a long run stop before its end.
        (out / "results.partial.json").write_text(json.dumps({**results, "timings_s": timings}, default=str))

    data = load_data(profile, args.seed)
    num_tokenizer = CausalQwenTokenizer.from_pretrained(QWEN_DIR)
    digit_tokenizer = AutoTokenizer.from_pretrained(QWEN_DIR)
    eval_splits = ("test", "real_test", "extrapolation")
    results: dict = {"arms": {}, "per_template": {s: {} for s in eval_splits}, "curves": {}}
    lap("load")

    if args.sweep:
        results["sweep"] = run_sweep(profile, num_tokenizer, data, out, args.seed, lap)
        timings["total"] = round(time.perf_counter() - started, 1)
        results.update({"command": args.command_line, "profile": asdict(profile), "timings_s": timings,
                        "learning_rate_scales": LEARNING_RATE_SCALES, "hardware": hardware()})
        (out / "sweep.json").write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
        (out / "sweep.md").write_text(markdown(results), encoding="utf-8")
        print(markdown(results))
        return results
    results["sweep"] = []

    # (a) CausalQwen, every default (the context-value path on), and with the path off; each measured right after
    # its start from data too.
    histories = {}
    for name, config in CAUSAL_ARMS.items():
        histories[name] = run_causal_arm(name, config, profile, num_tokenizer, data, out, args.seed, results, lap)
    # Real tables as prompt/completion pairs, the completion one number (experiments/keep_start.py, its default arm).
    if not args.no_prompt_completion:
        import keep_start

        completion = keep_start.prompt_completion(out / "prompt_completion", ["default"], profile=profile,
                                                  tokenizer=num_tokenizer, seed=args.seed)
        results["prompt_completion"] = completion
        (out / "prompt_completion.md").write_text(keep_start.table(completion) + "\n", encoding="utf-8")
        lap("prompt/completion (a)")

    # (b) and (b2): Qwen + CE, Qwen + CE + NTL.
    try:
        from ntloss import NTLoss
    except ImportError:
        NTLoss = None
        print("ntloss is not installed: arm (b2) is skipped (pip install ntloss)")
    for name in ("b", "b2"):
        if name == "b2" and NTLoss is None:
            continue
        model = new_qwen_with_head(profile, args.seed)
        ntl = NTLoss(tokenizer=digit_tokenizer, vocab_size=model.config.vocab_size) if name == "b2" else None
        trainer = train_digits(model, digit_tokenizer, data["train"], profile, out / name, args.seed, ntl)
        histories[name] = trainer.state.log_history
        lap(f"train ({name})")
        results["arms"][name] = {}
        for split in eval_splits:
            decoded = greedy_numbers(model, digit_tokenizer, data[split], profile.decode_batch)
            results["arms"][name][split] = {
                "positions": digit_positions(model, digit_tokenizer, data[split], profile.eval_batch),
                "target": point_metrics(decoded, [ex.target_value for ex in with_target(data[split])]),
            }
            results["per_template"][split][name] = per_template(decoded, with_target(data[split]))
        lap(f"eval ({name})")
        del model, trainer

    # (c) the trivial baseline.
    baselines = template_baselines(data["train"])
    for which, k in (("c_mean", 0), ("c_median", 1)):
        for split in eval_splits:
            examples = with_target(data[split])
            predicted = [baselines[ex.template][k] for ex in examples]
            results["arms"].setdefault(which, {})[split] = {
                "target": point_metrics(predicted, [ex.target_value for ex in examples])}
            results["per_template"][split][which] = per_template(predicted, examples)

    for name, history in histories.items():
        plot_loss_curves(history, out / f"loss_{name}.png")
    _plot_curves(results["curves"], out / "a_value_curve.png")
    timings["total"] = round(time.perf_counter() - started, 1)
    results.update({
        "command": args.command_line, "profile": asdict(profile), "seed": args.seed, "timings_s": timings,
        "learning_rate_scales": LEARNING_RATE_SCALES, "trained_texts_per_arm": profile.steps * profile.batch_size,
        "n_train_texts": len(data["train"]), "hardware": hardware(), "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    })
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
    (out / "results.md").write_text(markdown(results), encoding="utf-8")
    print(markdown(results))
    return results


def _stats_for_plot(targets: dict) -> torch.Tensor:
    """The packed statistics (`causal_qwen.metrics.FIELDS`) that `plot_predictions` reads, for the target rows."""
    stats = torch.zeros(len(targets["true"]), len(FIELDS), dtype=torch.float64)
    stats[:, FIELDS.index("valid")] = 1.0
    stats[:, FIELDS.index("target_is_num")] = 1.0
    for field, key in (("loc_y", "loc_y"), ("scale_y", "scale_y"), ("true_value", "true")):
        stats[:, FIELDS.index(field)] = torch.tensor(targets[key], dtype=torch.float64)
    return stats


def _plot_curves(curves: dict[str, list[dict]], path: Path) -> None:
    """The learning curves of the CausalQwen arms on the validation split, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {arm: points for arm, points in curves.items() if points}
    if not curves:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for arm, points in curves.items():
        steps, label = [p["step"] for p in points], ARM_NAMES.get(arm, arm)
        axes[0].plot(steps, [p["reg_rel_err_median"] for p in points], marker="o", label=label)
        axes[1].plot(steps, [p["reg_coverage_50"] for p in points], marker="o", label=f"{label}, 50%")
        axes[1].plot(steps, [p["reg_coverage_90"] for p in points], marker="s", label=f"{label}, 90%")
        axes[2].plot(steps, [p["gamma_y"] for p in points], marker="o", label=f"{label}, γ_Y")
    axes[0].set(title="value: median relative error (validation)", xlabel="step")
    axes[0].legend()
    axes[1].axhline(0.5, color="grey", linewidth=0.8, linestyle="--")
    axes[1].axhline(0.9, color="grey", linewidth=0.8, linestyle="--")
    axes[1].set(title="interval coverage (validation)", xlabel="step", ylim=(0, 1.05))
    axes[1].legend(fontsize=7)
    axes[2].set(title="the value's own noise scale", xlabel="step")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------------------------

ARM_NAMES = {"a": "(a) CausalQwen", "a_start": "(a) right after its start, no step",
             "a_off": "(a) with the path off", "a_off_start": "(a) with the path off, after its start",
             "a (generate)": "(a) by `generate`", "a_off (generate)": "(a) with the path off, by `generate`",
             "b": "(b) Qwen + CE", "b2": "(b2) Qwen + CE + 0.3·NTL",
             "c_mean": "(c) template mean", "c_median": "(c) template median"}
SPLIT_NAMES = {"test": "corpus test split", "real_test": "real-data test split",
               "extrapolation": "extrapolation split"}


def _fmt(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    if isinstance(x, int):
        return f"{x}"
    return f"{x:.4g}"


def markdown(results: dict) -> str:
    lines = []
    for split, title in (SPLIT_NAMES.items() if results["arms"] else ()):
        lines += [f"### Target number, {title}", "",
                  "| arm | reg_mdae | reg_mae | R² | R² symlog10 | median rel. err. | coverage 50% | coverage 90% "
                  "| writes a number |", "|---|---|---|---|---|---|---|---|---|"]
        for arm, name in ARM_NAMES.items():
            if arm not in results["arms"]:
                continue
            m = results["arms"][arm][split]["target"]
            # A start is measured teacher-forced only: what `generate` writes is the trained arm's.
            written = results["arms"][arm][split].get("generated", {} if arm.endswith("_start") else m).get(
                "parse_rate")
            lines.append(f"| {name} | {_fmt(m['reg_mdae'])} | {_fmt(m['reg_mae'])} | {_fmt(m['reg_r2'])} | "
                         f"{_fmt(m['reg_r2_symlog'])} | {_fmt(m['reg_rel_err_median'])} | "
                         f"{_fmt(m.get('reg_coverage_50'))} | {_fmt(m.get('reg_coverage_90'))} | {_fmt(written)} |")
        counts = {results["arms"][arm][split]["target"].get("reg_coverage_targets") for arm in CAUSAL_ARMS
                  if arm in results["arms"]} - {None}
        for arm in CAUSAL_ARMS:
            if arm not in results["arms"]:
                continue
            g = results["arms"][arm][split]["generated"]
            lines.append(f"| {ARM_NAMES[arm]} by `generate` (standard mode) | {_fmt(g['reg_mdae'])} | "
                         f"{_fmt(g['reg_mae'])} | {_fmt(g['reg_r2'])} | {_fmt(g['reg_r2_symlog'])} | "
                         f"{_fmt(g['reg_rel_err_median'])} | — | — | {_fmt(g['parse_rate'])} |")
        if len(counts) == 1 and (count := counts.pop()) > 0:
            bands = [calibrated_band(count, nominal) for nominal in (0.5, 0.9)]
            lines += ["", f"Coverage is over {count} targets: a calibrated model's 50% coverage lands in "
                          f"{bands[0][0]:.3f}-{bands[0][1]:.3f} and its 90% in {bands[1][0]:.3f}-{bands[1][1]:.3f} "
                          "in 95% of draws (binomial)."]
        lines += ["", f"### All positions, {title}", "",
                  "| arm | accuracy | num_f1 | ppl_softmax | ppl_ovr | ovr_prob_sum_median |", "|---" * 6 + "|"]
        for arm in ARM_NAMES:
            if "positions" not in results["arms"].get(arm, {}).get(split, {}):
                continue
            m = results["arms"][arm][split]["positions"]
            lines.append(f"| {ARM_NAMES[arm]} | {_fmt(m['eval/accuracy'])} | {_fmt(m['eval/num_f1'])} | "
                         f"{_fmt(m['eval/ppl_softmax'])} | {_fmt(m.get('eval/ppl_ovr'))} | "
                         f"{_fmt(m.get('dist/ovr_prob_sum_median'))} |")
        table = results["per_template"][split]
        arms = list(table)
        templates = sorted({t for arm in table.values() for t in arm if t != "mean over templates"})
        lines += ["", f"### Median relative error of the target per template, {title}", "",
                  "| template | " + " | ".join(ARM_NAMES.get(a, a) for a in arms) + " |",
                  "|---" * (len(arms) + 1) + "|"]
        for template in [*templates, "mean over templates"]:
            lines.append(f"| {template} | " + " | ".join(_fmt(table[a].get(template)) for a in arms) + " |")
        lines.append("")
    for arm, points in results.get("curves", {}).items():
        if not points:
            continue
        lines += [f"### Learning curve of {ARM_NAMES.get(arm, arm)} on the validation split", "",
                  "| step | median rel. err. | coverage 50% | coverage 90% | ‖w_num‖ | b_reg | γ_Y |",
                  "|---|---|---|---|---|---|---|"]
        for p in points:
            lines.append(f"| {p['step']} | {_fmt(p['reg_rel_err_median'])} | {_fmt(p['reg_coverage_50'])} | "
                         f"{_fmt(p['reg_coverage_90'])} | {_fmt(p['w_num_norm'])} | {_fmt(p['b_reg'])} | "
                         f"{_fmt(p['gamma_y'])} |")
        lines += ["", f"Value-head start: `{results.get('value_head_fit', {}).get(arm)}`; w_num moved by "
                      f"{_fmt(results.get('w_num_relative_change', {}).get(arm))} of its norm.", ""]
    if results.get("prompt_completion"):
        import keep_start

        lines += ["### Real tables as prompt/completion, the completion one number (the default arm)", "",
                  keep_start.table(results["prompt_completion"]), ""]
    if results.get("sweep"):
        lines += ["### Sweep of (a) on the validation split", "",
                  "| run | median rel. err. | mean over templates | coverage 50% | coverage 90% | accuracy | num_f1 "
                  "| ppl_ovr | final train loss | seconds |", "|---" * 10 + "|"]
        for row in results["sweep"]:
            p, t = row["positions"], row["target"]
            lines.append(f"| {row['name']} | {_fmt(t['reg_rel_err_median'])} | "
                         f"{_fmt(row['per_template']['mean over templates'])} | {_fmt(t['reg_coverage_50'])} | "
                         f"{_fmt(t['reg_coverage_90'])} | {_fmt(p['eval/accuracy'])} | {_fmt(p['eval/num_f1'])} | "
                         f"{_fmt(p['eval/ppl_ovr'])} | {_fmt(row['final_loss'])} | {_fmt(row['seconds'])} |")
        lines.append("")
    lines += ["### Wall time (seconds)", "", "| phase | seconds |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in results["timings_s"].items()]
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    parser.add_argument("--output", default="runs/experiment")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-train", type=int, help="override the profile's corpus training texts")
    parser.add_argument("--steps", type=int, help="optimizer steps per arm")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--sweep", action="store_true",
                        help="run the short runs of SWEEP on validation instead of the arms")
    parser.add_argument("--sweep-steps", type=int)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: all cores)")
    parser.add_argument("--no-prompt-completion", action="store_true",
                        help="leave out the real tables as prompt/completion pairs (experiments/keep_start.py)")
    args = parser.parse_args()
    args.command_line = "python experiments/run_experiment.py " + " ".join(sys.argv[1:])
    if args.threads:
        torch.set_num_threads(args.threads)
    run(args)


if __name__ == "__main__":
    main()
