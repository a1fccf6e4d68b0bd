"""How far can a start from data of the whole `<NUM>` row (not only its bias) take standard mode's `<NUM>` decisions?

On a fresh `from_qwen` conversion this script reads, at every labelled position of the first training texts,
loc_U and the `<NUM>` column, and fits a change (Δw, δ) of the `<NUM>` row `W_cls[<NUM>]` and bias, every other
weight held, in two ways:

- **own loss**: minimise the `<NUM>` class's OvR binary cross-entropy (its term of the training loss) plus a ridge
  penalty on Δw in standardised features (L-BFGS, float64);
- **argmax**: logistic regression of "the next token is `<NUM>`" on loc_U and the margin by which `<NUM>` must
  rise to have the largest P_k, which targets standard mode's decision directly: the library's start
  (`causal_qwen.starts.num_decision_start`).

It prints precision, recall and F1 of "`<NUM>` has the largest P_k" (at the changed row, whose |w| also changes the
`<NUM>` scale) on the evaluation splits for the bias-only start (the offset of least `<NUM>` loss, what the start
did before it fitted the row) and for both row fits.

    python experiments/num_row.py --num-fit 256
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import num_decision  # noqa: E402
import run_experiment as experiment  # noqa: E402

from causal_qwen import CausalQwenTokenizer  # noqa: E402
from causal_qwen.cauchy import linear, ovr_log_probs  # noqa: E402
from causal_qwen.starts import num_decision_start  # noqa: E402


def fit_own_loss(r: dict, row: torch.Tensor, bias: float, threshold: float, penalty: float):
    mean, std = r["u"].mean(0), r["u"].std(0).clamp(min=1e-6)
    a = torch.zeros_like(mean, requires_grad=True)
    c = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([a, c], max_iter=200, line_search_fn="strong_wolfe")
    u_std = (r["u"] - mean) / std

    def closure():
        optimizer.zero_grad()
        loc = r["u"] @ row + bias + u_std @ a + c
        scale = linear(r["u"], r["u_scale"], row + a / std)[1].clamp(min=1e-6)
        log_p, log_not_p = ovr_log_probs(loc, scale, threshold)
        loss = -torch.where(r["is_num"], log_p, log_not_p).mean() + penalty * a.square().sum() / len(loc)
        loss.backward()
        return loss

    optimizer.step(closure)
    delta_w = (a / std).detach()
    return delta_w, float(c - (a / std * mean).sum())


def fit_argmax(r: dict, row: torch.Tensor, bias: float, threshold: float, penalty: float):
    """The library's start (`num_decision_start`), on the same positions."""
    rival = (r["tie"] - threshold) / r["scale"]
    delta_w, delta_b, _, _ = num_decision_start(r["u"], r["u_scale"], row, bias, threshold, rival, r["is_num"],
                                                penalty=penalty)
    return delta_w, delta_b


def chosen(r: dict, row: torch.Tensor, delta_w: torch.Tensor, delta_b: float, threshold: float) -> torch.Tensor:
    """Standard mode's decision at the changed row, whose |w| sets the `<NUM>` scale: its margin against the best
    other class's."""
    rival = (r["tie"] - threshold) / r["scale"]
    loc = r["loc"] + r["u"] @ delta_w + delta_b
    scale = linear(r["u"], r["u_scale"], row + delta_w)[1].clamp(min=1e-6)
    return (loc - threshold) / scale > rival


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="cpu", choices=sorted(experiment.PROFILES))
    parser.add_argument("--num-fit", type=int, default=256)
    parser.add_argument("--penalty", type=float, action="append")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    profile = experiment.PROFILES[args.profile]
    data = experiment.load_data(profile, args.seed)
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    model = experiment.new_causal(profile, tokenizer, args.seed).eval()
    num = model.config.num_token_id
    row = model.action.cls_head.weight[num].detach().double()
    bias = float(model.action.cls_head.bias[num].detach())
    threshold = float(model.action.threshold[num])
    train = num_decision.num_columns(model, tokenizer, data["train"][:args.num_fit], profile.eval_batch, inputs=True)
    splits = {name: num_decision.num_columns(model, tokenizer, data[name], profile.eval_batch, inputs=True)
              for name in ("validation", "test", "real_test")}
    offset, _, _ = num_decision.num_bias_offset(train["loc"], train["scale"], train["is_num"], threshold)
    fits = {"bias only": (torch.zeros_like(row), offset)}
    for penalty in args.penalty or [1.0, 10.0, 100.0]:
        fits[f"own loss λ={penalty:g}"] = fit_own_loss(train, row, bias, threshold, penalty)
        fits[f"argmax λ={penalty:g}"] = fit_argmax(train, row, bias, threshold, penalty)
    print(f"{len(train['loc'])} training positions, {int(train['is_num'].sum())} of them <NUM>", flush=True)
    for name, (delta_w, delta_b) in fits.items():
        line = [f"{name:18s} |Δw|/|w| {float(delta_w.norm() / row.norm()):.3f} δ {delta_b:+.2f}"]
        for split, r in {"train": train, **splits}.items():
            line.append(f"{split} {num_decision.decisions(chosen(r, row, delta_w, delta_b, threshold), r['is_num'])}")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
