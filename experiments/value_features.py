"""How much of a number's value reaches the value head through the frozen backbone, as a function of w_num's scale?

The value head reads loc_U, a linear map of the frozen backbone's last hidden state. A number enters that state only
through its input embedding, `embed(<NUM>) + d_num + symlog(v)·w_num`, which every layer first passes through an
RMSNorm. When `symlog(v)·w_num` dominates the embedding, the norm keeps its direction and loses most of its size.

For each scale s, this script multiplies the converted model's w_num by s (nothing trains), fits the value head
with the library's `fit_value_head` on the training texts, and reads the target of each validation text
(teacher-forced, as in `run_experiment.py`): the median relative error overall and per template. s = 0 removes
every value from the input, so its row is what the words alone tell; `measurement_noise` repeats a stated number.

    python experiments/value_features.py --scales 0 0.1 0.3 1 3
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
from causal_qwen.data.collator import CausalQwenDataCollator  # noqa: E402
from causal_qwen.starts import fit_value_head  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scales", type=float, nargs="+", default=[0.0, 0.1, 0.3, 1.0, 3.0])
    parser.add_argument("--profile", default="cpu", choices=sorted(experiment.PROFILES))
    parser.add_argument("--num-train", type=int, default=256, help="training texts the value head is fitted on")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    profile = experiment.PROFILES[args.profile]
    data = experiment.load_data(profile, args.seed)
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    collator = CausalQwenDataCollator.from_tokenizer(tokenizer)
    features = experiment.tokenize_examples(tokenizer, [ex.text for ex in data["train"][:args.num_train]])
    rows = []
    for scale in args.scales:
        t0 = time.perf_counter()
        model = experiment.new_causal(profile, tokenizer, args.seed).eval()
        with torch.no_grad():
            model.numeric_embedding.w_num.mul_(scale)
        batches = experiment.collated(collator, features, profile.eval_batch)
        fit = fit_value_head(model, batches)
        targets = experiment.causal_targets(model, tokenizer, data["validation"], profile.eval_batch)
        point = experiment.point_metrics(targets["median"], targets["true"])
        templates = experiment.per_template(targets["median"], targets["examples"])
        coverage = experiment.interval_metrics(targets)
        rows.append((scale, fit, point, templates, coverage))
        print(f"scale {scale:g}: fit LOO {fit.loo_median_abs_error:.3f} (penalty {fit.penalty:g}, {fit.positions} "
              f"rows); validation median rel. error {point['reg_rel_err_median']:.3f}, mean over templates "
              f"{templates['mean over templates']:.3f}, coverage 50% {coverage['reg_coverage_50']:.2f}; "
              f"{time.perf_counter() - t0:.0f}s", flush=True)
        del model
    names = [k for k in rows[0][3] if k != "mean over templates"] + ["mean over templates"]
    print("\n| w_num scale | LOO residual (symlog) | median rel. err. | cov. 50% | " + " | ".join(names) + " |")
    print("|---" * (4 + len(names)) + "|")
    for scale, fit, point, templates, coverage in rows:
        cells = [f"{templates.get(n, float('nan')):.3g}" for n in names]
        print(f"| {scale:g} | {fit.loo_median_abs_error:.3f} | {point['reg_rel_err_median']:.3f} | "
              f"{coverage['reg_coverage_50']:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
