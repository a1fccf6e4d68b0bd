"""Learning curves of arm (a) on validation under different learning-rate scales, in one process.

Each variant trains a fresh `from_qwen` model with `CausalQwenTrainer` (every default, the value-head start
included) on the experiment's training texts, with `LEARNING_RATE_SCALES` changed as the variant says, and
measures the target's median relative error and the 50% / 90% coverage on the validation split after the start
and every `--every` steps, plus how far w_num moved.

    python experiments/rate_curves.py --steps 12 --every 6 \\
        --variant defaults= --variant "frozen read-out=action.reg_head:1e-6,action.reg_log_noise:1e-6" \\
        --variant "value-led=config.reg_loss_weight:10"
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_experiment as experiment  # noqa: E402

from causal_qwen import CausalQwenTokenizer  # noqa: E402


def parse_variant(text: str) -> tuple[str, dict[str, float], dict[str, float]]:
    """`name=module:scale,config.field:value,...` (an empty list keeps the defaults).

    `module:scale` changes a learning-rate scale; `config.field:value` a field of `from_qwen`'s configuration;
    `num_bias:value` adds value to the classification bias of `<NUM>` after conversion; `lora:r` adapts the
    backbone's attention and MLP projections with PEFT LoRA of rank r (alpha 2r) and trains the three causal modules
    fully, as docs/training.md's LoRA recipe does.
    """
    name, _, changes = text.partition("=")
    scales, config = {}, {}
    for item in filter(None, changes.split(",")):
        key, _, value = item.partition(":")
        key = key.strip()
        if key.startswith("config.") or key in ("num_bias", "lora"):
            config[key.removeprefix("config.")] = float(value)
        else:
            scales[key] = float(value)
    return name.strip(), scales, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", action="append", type=parse_variant, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=6)
    parser.add_argument("--profile", default="cpu", choices=sorted(experiment.PROFILES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="runs/rate_curves")
    parser.add_argument("--positions", action="store_true", help="also measure num_f1 and accuracy on validation")
    args = parser.parse_args()
    profile = experiment.PROFILES[args.profile]
    data = experiment.load_data(profile, args.seed)
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    validation = data["validation"]

    def measure(model) -> dict:
        targets = experiment.causal_targets(model, tokenizer, validation, profile.eval_batch)
        point = {"error": experiment.point_metrics(targets["median"], targets["true"])["reg_rel_err_median"],
                 "repeat": experiment.per_template(targets["median"], targets["examples"]).get("measurement_noise"),
                 **experiment.interval_metrics(targets)}
        if args.positions:
            positions = experiment.causal_positions(model, tokenizer, validation, profile.eval_batch, args.seed)
            point.update(num_f1=positions["eval/num_f1"], accuracy=positions["eval/accuracy"])
        model.train()
        return point

    for name, scales, config in args.variant:
        started = time.perf_counter()
        num_bias = config.pop("num_bias", 0.0)
        rank = int(config.pop("lora", 0))
        model = experiment.new_causal(profile, tokenizer, args.seed, **config)
        with torch.no_grad():
            model.action.cls_head.bias[model.config.num_token_id] += num_bias
        if rank:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(
                r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"],
                modules_to_save=["numeric_embedding", "abduction", "action"]))
        w_num = experiment.w_num_of(model).detach().clone()
        curve = experiment.CurveCallback(args.every, measure)
        experiment.train_causal(model, tokenizer, data["train"], profile, Path(args.output) / "run", args.seed,
                                steps=args.steps, scales=scales, curve=curve)
        moved = ((experiment.w_num_of(model) - w_num).norm() / w_num.norm()).item()
        points = "  ".join(f"step {p['step']}: {p['error']:.3f} repeat {p['repeat'] or float('nan'):.3f} "
                           f"({p['reg_coverage_50']:.2f} / "
                           f"{p['reg_coverage_90']:.2f})" + (f" num_f1 {p['num_f1']:.3f} acc {p['accuracy']:.3f}"
                                                             if args.positions else "") for p in curve.points)
        print(f"{name}: {points}  w_num moved {100 * moved:.1f}%  [{time.perf_counter() - started:.0f} s]",
              flush=True)


if __name__ == "__main__":
    main()
