"""The class loss in the first steps of `causal-qwen train`: with and without a learning-rate warmup.

One converted Qwen2.5-0.5B (`from_qwen(folder)`, every default), started by `fit_value_head` on the training texts of
`run_experiment.py`'s profile (as `causal-qwen train` does before its first step), then trained `--steps` steps from
that same state for each arm by `CausalQwenTrainer` with the command's settings (batch 8, learning rate 1e-4, linear
decay, AdamW), the arms differing only in `warmup_steps` (0: the command's). Recorded: the class loss and the
gradient norm at every step, the class loss of the first `--validation` validation texts every `--every` steps, and
after training, on the test texts, next-token accuracy, num_f1 and OvR perplexity
(docs/design.md §6), against the model right after its start (no step).

    python experiments/warmup.py --output runs/warmup
    python experiments/warmup.py --profile tiny --output /tmp/warmup     # the pipeline only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_experiment as experiment  # noqa: E402

from causal_qwen import CausalQwenTokenizer  # noqa: E402
from causal_qwen.data import CausalQwenDataCollator, generate_corpus, tokenize_examples  # noqa: E402
from causal_qwen.labels import IGNORE_INDEX  # noqa: E402
from causal_qwen.starts import fit_value_head  # noqa: E402
from causal_qwen.training import CausalQwenTrainer  # noqa: E402


@torch.no_grad()
def held_out_class_loss(model, batches: list[dict]) -> dict:
    """The class loss (OvR, every labelled position) on held-out batches, in eval mode, weighted by positions."""
    was_training = model.training
    model.eval()
    total = count = 0.0
    for batch in batches:
        out = model(**batch)
        n = float((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        total, count = total + float(out.cls_loss) * n, count + n
    model.train(was_training)
    return {"held_out_cls_loss": total / count}


def train_arm(model, tokenizer, features: list[dict], out: Path, warmup: float, steps: int, seed: int,
              curve: experiment.CurveCallback) -> list[dict]:
    """Train as `causal-qwen train` does, with `warmup_steps=warmup`; the log of every step."""
    args = TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=8,
                             learning_rate=1e-4, warmup_steps=warmup, seed=seed, logging_steps=1, save_strategy="no",
                             report_to=[], disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
                             dataloader_pin_memory=torch.cuda.is_available())
    trainer = CausalQwenTrainer(model=model, args=args, train_dataset=features,
                                data_collator=CausalQwenDataCollator.from_tokenizer(tokenizer), callbacks=[curve])
    model.train()
    trainer.train()
    model.eval()
    return [entry for entry in trainer.state.log_history if "cls_loss_mean" in entry]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, arm in results["arms"].items():
        steps = [entry["step"] for entry in arm["log"]]
        left.plot(steps, [entry["cls_loss_mean"] for entry in arm["log"]], marker="o", label=name)
        right.plot(steps, [entry["grad_norm"] for entry in arm["log"]], marker="o", label=name)
        left.plot([p["step"] for p in arm["curve"]], [p["held_out_cls_loss"] for p in arm["curve"]], ls="--",
                  color=left.lines[-1].get_color(), label=f"{name}, validation texts")
    left.set(xlabel="step", ylabel="class loss", title="class loss (solid: training batch)")
    right.set(xlabel="step", ylabel="gradient norm", yscale="log", title="gradient norm (before clipping)")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="cpu", choices=sorted(experiment.PROFILES))
    parser.add_argument("--steps", type=int, default=20, help="training steps of each arm")
    parser.add_argument("--warmups", default="0,0.1", help="warmup_steps of each arm (a float below 1: a ratio)")
    parser.add_argument("--data", default="profile", choices=("profile", "cli"),
                        help="profile: run_experiment.py's training texts; cli: causal-qwen train's default data "
                             "(2,000 corpus texts, at most 128 tokens)")
    parser.add_argument("--every", type=int, default=2, help="steps between measures of the validation class loss")
    parser.add_argument("--validation", type=int, default=32, help="validation texts of that measure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="runs/warmup")
    args = parser.parse_args()
    profile = experiment.PROFILES[args.profile]
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    data = experiment.load_data(profile, args.seed)
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    t0 = time.perf_counter()
    model = experiment.new_causal(profile, tokenizer, args.seed).eval()
    collator = CausalQwenDataCollator.from_tokenizer(tokenizer)
    if args.data == "cli":
        data["train"] = generate_corpus(2000, split="train", seed=args.seed)
        data["validation"] = generate_corpus(200, split="validation", seed=args.seed)
    features = tokenize_examples(tokenizer, [ex.text for ex in data["train"]], 128 if args.data == "cli" else None)
    fit = fit_value_head(model, experiment.collated(collator, features, profile.eval_batch))
    start_state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    start = experiment.causal_positions(model, tokenizer, data["test"], profile.eval_batch, args.seed)
    texts = [ex.text for ex in data["validation"][:args.validation]]
    validation = list(experiment.collated(collator, tokenize_examples(tokenizer, texts), profile.eval_batch))
    results = {"fit": fit.to_dict(), "start": start, "arms": {}, "start_seconds": time.perf_counter() - t0}
    print(f"start: {results['start_seconds']:.0f}s {start}", flush=True)
    for warmup in (float(w) for w in args.warmups.split(",")):
        warmup = int(warmup) if warmup >= 1 or warmup == 0 else warmup
        model.load_state_dict(start_state)
        t1 = time.perf_counter()
        curve = experiment.CurveCallback(args.every, lambda m: held_out_class_loss(m, validation))
        log = train_arm(model, tokenizer, features, out / f"warmup={warmup}", warmup, args.steps, args.seed, curve)
        trained = experiment.causal_positions(model, tokenizer, data["test"], profile.eval_batch, args.seed)
        results["arms"][f"warmup_steps={warmup}"] = {"log": log, "curve": curve.points, "trained": trained,
                                                     "seconds": time.perf_counter() - t1}
        print(f"warmup_steps={warmup}: {time.perf_counter() - t1:.0f}s; class loss by step "
              f"{[round(entry['cls_loss_mean'], 1) for entry in log]}; {trained}", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    plot(results, out / "warmup_class_loss.png")
    lines = ["| arm | class loss, steps 1-5 | max | last | validation class loss: start, max, last | accuracy | "
             "num_f1 | ppl_ovr |", "|---|---|---|---|---|---|---|---|",
             f"| the start, no step | | | | | {start['eval/accuracy']:.4f} | {start['eval/num_f1']:.3f} | "
             f"{start['eval/ppl_ovr']:.4g} |"]
    for name, arm in results["arms"].items():
        losses = [entry["cls_loss_mean"] for entry in arm["log"]]
        held = [point["held_out_cls_loss"] for point in arm["curve"]]
        first = ", ".join(f"{x:.1f}" for x in losses[:5])
        cell = arm["trained"]
        lines.append(f"| {name} | {first} | {max(losses):.1f} | {losses[-1]:.1f} | {held[0]:.2f}, {max(held):.2f}, "
                     f"{held[-1]:.2f} | {cell['eval/accuracy']:.4f} | {cell['eval/num_f1']:.3f} | "
                     f"{cell['eval/ppl_ovr']:.4g} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
