"""Which loss moves the numeric embedding? The gradient of each loss term on w_num, d_num and the value head.

After the value-head start (`fit_value_head` on the first training texts, as `CausalQwenTrainer` does), one
training batch of the experiment goes forward twice, once backpropagating the classification loss and once the
value term (`loss − cls_loss`, i.e. `reg_loss_weight` times the gated regression NLL). Adam normalises the sum of
the two per coordinate, so where one gradient is several times the other, it sets the direction of the step.

    python experiments/gradient_split.py --reg-loss-weight 1 --reg-loss-weight 10 [--no-num-bias]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_experiment as experiment  # noqa: E402

from causal_qwen import CausalQwenTokenizer  # noqa: E402
from causal_qwen.data.collator import CausalQwenDataCollator  # noqa: E402
from causal_qwen.starts import fit_value_head  # noqa: E402

PARAMETERS = ("numeric_embedding.w_num", "numeric_embedding.d_num", "action.reg_head.weight")


def gradients(model, batch: dict, term) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=False)
    term(model(**batch)).backward()
    named = dict(model.named_parameters())
    return {name: named[name].grad.detach().clone().flatten() for name in PARAMETERS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reg-loss-weight", type=float, action="append", default=None)
    parser.add_argument("--profile", default="cpu", choices=sorted(experiment.PROFILES))
    parser.add_argument("--num-fit", type=int, default=128, help="training texts the value head is fitted on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-num-bias", action="store_true", help="start the value head only")
    args = parser.parse_args()
    profile = experiment.PROFILES[args.profile]
    data = experiment.load_data(profile, args.seed)
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    collator = CausalQwenDataCollator.from_tokenizer(tokenizer)
    features = experiment.tokenize_examples(tokenizer, [ex.text for ex in data["train"][:args.num_fit]])
    batch = collator(features[:profile.batch_size])
    for weight in args.reg_loss_weight or [1.0]:
        model = experiment.new_causal(profile, tokenizer, args.seed, reg_loss_weight=weight)
        fit_value_head(model, experiment.collated(collator, features, profile.eval_batch),
                       num_row=not args.no_num_bias)
        model.train()
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        cls = gradients(model, batch, lambda out: out.cls_loss)
        value = gradients(model, batch, lambda out: out.loss - out.cls_loss)
        for name in PARAMETERS:
            cosine = torch.nn.functional.cosine_similarity(cls[name], value[name], dim=0).item()
            print(f"reg_loss_weight {weight:g}  {name:26s} |grad cls| {cls[name].norm():9.3g}  "
                  f"|grad value| {value[name].norm():9.3g}  cosine {cosine:+.3f}", flush=True)
        del model


if __name__ == "__main__":
    main()
