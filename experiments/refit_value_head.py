"""Refit the value head of a trained arm (a) on its training texts: is the read-out, or are the features, behind
the value errors?

`run_experiment.py` saves arm (a) after training in `OUTPUT/a/final`. This script evaluates that model on the
validation, test and real-data test splits (median relative error of the target, its mean over templates, 50% and
90% coverage, teacher-forced as in the experiment), then fits the value head again with `fit_value_head` on the
same training texts, from the trained loc_U, and evaluates it again, in the same process.

    python experiments/refit_value_head.py --model /tmp/runs/exp/a/final
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_experiment as experiment  # noqa: E402

from causal_qwen import CausalQwenForCausalLM, CausalQwenTokenizer  # noqa: E402
from causal_qwen.data.collator import CausalQwenDataCollator  # noqa: E402
from causal_qwen.starts import fit_value_head  # noqa: E402


def report(tag: str, model, tokenizer, data: dict, batch_size: int) -> None:
    for split in ("validation", "test", "real_test"):
        targets = experiment.causal_targets(model, tokenizer, data[split], batch_size)
        point = experiment.point_metrics(targets["median"], targets["true"])
        templates = experiment.per_template(targets["median"], targets["examples"])
        coverage = experiment.interval_metrics(targets)
        print(f"{tag:8s} {split:11s} median rel. error {point['reg_rel_err_median']:.3f}  mean over templates "
              f"{templates['mean over templates']:.3f}  coverage 50% {coverage['reg_coverage_50']:.2f}  "
              f"90% {coverage['reg_coverage_90']:.2f}  gamma_Y {model.action.reg_log_noise.exp().item():.3f}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="arm (a)'s folder, OUTPUT/a/final of run_experiment.py")
    parser.add_argument("--profile", default="cpu", choices=sorted(experiment.PROFILES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    profile = experiment.PROFILES[args.profile]
    data = experiment.load_data(profile, args.seed)
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    model = CausalQwenForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    report("trained", model, tokenizer, data, profile.eval_batch)
    collator = CausalQwenDataCollator.from_tokenizer(tokenizer)
    features = experiment.tokenize_examples(tokenizer, [ex.text for ex in data["train"]])
    batches = experiment.collated(collator, features, profile.eval_batch)
    print(fit_value_head(model, batches), flush=True)
    report("refitted", model, tokenizer, data, profile.eval_batch)


if __name__ == "__main__":
    main()
