"""Where does the `<NUM>` decision want its bias? Its own loss and num_f1 by the offset of b_cls[<NUM>].

For a model (a fresh `from_qwen` conversion, or a saved arm (a) of `run_experiment.py`), this script reads the
`<NUM>` column of the heads at every labelled position of the first training texts, finds the offset of the `<NUM>`
bias that minimises that class's OvR binary cross-entropy there (`num_bias_offset`, what the value-head start
applied before it fitted the whole row) and, for comparison, the offset of best F1 on the same positions; it
reports standard mode's `<NUM>` decisions on the evaluation splits at 0 and at both offsets: precision, recall
and F1 of "`<NUM>` has the largest P_k" against "the next token is `<NUM>`", as `causal_qwen.metrics.evaluate`
counts them.

    python experiments/num_decision.py --model fresh
    python experiments/num_decision.py --model /tmp/runs/exp/a/final
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_experiment as experiment  # noqa: E402

from causal_qwen import CausalQwenForCausalLM, CausalQwenTokenizer  # noqa: E402
from causal_qwen.cauchy import ovr_log_probs, quantile  # noqa: E402
from causal_qwen.data.collator import CausalQwenDataCollator  # noqa: E402
from causal_qwen.labels import IGNORE_INDEX  # noqa: E402


def num_bias_offset(
    loc: torch.Tensor,
    scale: torch.Tensor,
    is_num: torch.Tensor,
    threshold: float,
    *,
    span: float = 10.0,
) -> tuple[float, float, float]:
    """The offset δ of the `<NUM>` bias that minimises the mean OvR binary cross-entropy of the `<NUM>` class,
    −[y log P + (1 − y) log(1 − P)] with P = P(S > C), S ~ Cauchy(loc + δ, scale), over positions `[M]`.

    The loss is not convex in δ (a Cauchy CDF is not log-concave), so δ is searched on a grid over [−span, span]
    (steps of 0.02), then refined on a grid of steps of 0.0005 around the best point.

    Returns:
        `(offset, mean loss at 0, mean loss at offset)`.
    """
    if loc.dim() != 1 or loc.shape != scale.shape or loc.shape != is_num.shape:
        raise ValueError(f"loc, scale and is_num must be [M] of one shape, got {tuple(loc.shape)}, "
                         f"{tuple(scale.shape)} and {tuple(is_num.shape)}")
    if loc.numel() == 0:
        raise ValueError("num_bias_offset needs at least one labelled position")
    if not span > 0:
        raise ValueError(f"span must be positive, got {span}")
    loc, scale, positive = loc.double(), scale.double(), is_num.bool()

    def mean_loss(offsets: torch.Tensor) -> torch.Tensor:
        losses = []
        for chunk in offsets.split(64):
            log_p, log_not_p = ovr_log_probs(loc[None] + chunk[:, None], scale[None].expand(len(chunk), -1),
                                             threshold)
            losses.append(-torch.where(positive[None], log_p, log_not_p).mean(1))
        return torch.cat(losses)

    coarse = torch.arange(-span, span + 1e-9, 0.02, dtype=torch.float64)
    best = coarse[int(mean_loss(coarse).argmin())]
    fine = (best + torch.arange(-0.02, 0.02 + 1e-9, 0.0005, dtype=torch.float64)).clamp(-span, span)
    losses = mean_loss(fine)
    index = int(losses.argmin())
    before = float(mean_loss(torch.zeros(1, dtype=torch.float64))[0])
    return float(fine[index]), before, float(losses[index])


@torch.no_grad()
def num_columns(model, tokenizer, examples, batch_size: int, inputs: bool = False) -> dict[str, torch.Tensor]:
    """At every labelled position: the `<NUM>` column's (loc_S, scale_S), the loc at which `<NUM>`'s P_k would equal
    the largest other P_k, and whether the next token is `<NUM>`; with `inputs`, also the heads' Cauchy input
    `u`, `u_scale` `[M, C]`."""
    num, action = model.config.num_token_id, model.action
    threshold = float(action.threshold[num])
    collator = CausalQwenDataCollator.from_tokenizer(tokenizer)
    features = experiment.tokenize_examples(tokenizer, [ex.text for ex in examples])
    out: dict[str, list[torch.Tensor]] = {"loc": [], "scale": [], "tie": [], "is_num": [], "u": [], "u_scale": []}
    for batch in experiment.collated(collator, features, batch_size):
        result = model(batch["input_ids"], numeric_values=batch["numeric_values"],
                       attention_mask=batch["attention_mask"])
        labelled = batch["labels"][:, 1:] != IGNORE_INDEX
        loc, scale = result.loc_S[:, :-1], result.scale_S[:, :-1]
        p = model.ovr_probabilities(loc, scale)
        p[..., num] = -1.0
        best = p.max(-1).values.double().clamp(max=1 - 1e-12)
        # P = 1/2 + atan((loc − C)/scale)/π solved for loc at P = best: the best-quantile of Cauchy(C, scale).
        tie = quantile(torch.tensor(threshold, dtype=torch.float64), scale[..., num].double(), best)
        out["loc"].append(loc[..., num][labelled].double())
        out["scale"].append(scale[..., num][labelled].double())
        out["tie"].append(tie[labelled])
        out["is_num"].append((batch["labels"][:, 1:] == num)[labelled])
        if inputs:
            loc_in, scale_in = action.head_inputs(result.loc_U[:, :-1], result.scale_U[:, :-1])
            out["u"].append(loc_in[labelled].double())
            out["u_scale"].append(scale_in[labelled].double())
    return {name: torch.cat(parts) for name, parts in out.items() if parts}


def scores(chosen: torch.Tensor, truth: torch.Tensor) -> tuple[float, float, float]:
    """Precision, recall and F1 of "`<NUM>` is chosen" against "the next token is `<NUM>`"."""
    hits = int((chosen & truth).sum())
    precision = hits / max(int(chosen.sum()), 1)
    recall = hits / max(int(truth.sum()), 1)
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def decisions(chosen: torch.Tensor, truth: torch.Tensor) -> str:
    precision, recall, f1 = scores(chosen, truth)
    return f"P {precision:.3f} R {recall:.3f} F1 {f1:.3f}"


def at_offset(columns: dict[str, torch.Tensor], offset: float) -> torch.Tensor:
    """Standard mode's `<NUM>` decisions with `offset` added to the `<NUM>` bias."""
    return columns["loc"] + offset > columns["tie"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="'fresh' (from_qwen with every default) or a saved folder")
    parser.add_argument("--profile", default="cpu", choices=sorted(experiment.PROFILES))
    parser.add_argument("--num-fit", type=int, default=96, help="training texts the offset is fitted on")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    profile = experiment.PROFILES[args.profile]
    data = experiment.load_data(profile, args.seed)
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    if args.model == "fresh":
        model = experiment.new_causal(profile, tokenizer, args.seed)
    else:
        model = CausalQwenForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    train = num_columns(model, tokenizer, data["train"][:args.num_fit], profile.eval_batch)
    threshold = float(model.action.threshold[model.config.num_token_id])
    offset, before, after = num_bias_offset(train["loc"], train["scale"], train["is_num"], threshold)
    grid = [k / 20 for k in range(-200, 201)]
    best_f1 = max(grid, key=lambda d: scores(at_offset(train, d), train["is_num"])[2])
    print(f"{args.model}: <NUM> loss on {len(train['loc'])} training positions {before:.4f} at 0, {after:.4f} at the "
          f"offset {offset:+.3f}; the offset of best F1 there is {best_f1:+.2f}", flush=True)
    for split in ("train", "validation", "test", "real_test"):
        columns = train if split == "train" else num_columns(model, tokenizer, data[split], profile.eval_batch)
        truth = columns["is_num"]
        print(f"  {split:10s} at 0: {decisions(at_offset(columns, 0.0), truth)} | loss offset {offset:+.2f}: "
              f"{decisions(at_offset(columns, offset), truth)} | F1 offset {best_f1:+.2f}: "
              f"{decisions(at_offset(columns, best_f1), truth)}", flush=True)


if __name__ == "__main__":
    main()
