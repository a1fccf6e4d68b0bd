"""Start the value head from data: a least-squares read-out of loc_U, fitted before the first optimizer step.

With a frozen backbone the regression head is a linear read-out of loc_U, whose few dimensions of huge variance
(|z| above 100 in Qwen2.5) dominate every Adam step: at rates that keep Qwen's logits intact the head needs
hundreds of steps to find the level of the targets (symlog values near 8), and its median misses by ~100% until
then. Least squares finds the read-out at once, so training starts from it (a linear probe, then fine-tuning):

- the rows are the positions whose label is `<NUM>` (exactly where the regression loss reads the head), x = loc_U
  there, y = the true value in the head's space (`value_transform`);
- ridge regression on standardised features, in float64: `w_reg`, `b_reg`; the penalty is chosen among
  `penalties` by the median absolute leave-one-out residual (exact for ridge, from one SVD);
- γ_Y, the value's own noise scale, starts at the median absolute leave-one-out residual: the median |Y − m| of a
  Cauchy(m, γ) is γ, and out-of-sample residuals do not shrink with the number of features as in-sample ones do.

The same pass starts the decision for `<NUM>`. Its classification row is new (docs/design.md §3: the mean of the
digit rows), and its bias `b_cls[<NUM>]` is where that row is furthest from what the data asks: on the Qwen2.5-0.5B
experiment the `<NUM>` decision's own loss on the training texts falls from 0.90 to 0.34 when its bias moves by 4.3,
and after 40 training steps without this start the optimum still lay 3.6 away (docs/experiments.md). Adam moves a
bias by about the learning rate per step, so the start moves it there at once: the offset minimising the `<NUM>`
class's OvR binary cross-entropy (its term of the training loss, exactly) over every labelled position of the
same batches, every other weight held.

`CausalQwenTrainer` calls [`fit_value_head`] before its first step; for `Trainer` or a custom loop call it
yourself. The fit is recorded in `config.value_head_fit`, so a saved and reloaded model does not redo it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from .cauchy import linear, ovr_log_probs
from .checks import check_positive_finite
from .labels import IGNORE_INDEX, next_token_targets
from .loss import transform_values

__all__ = ["ValueHeadFit", "fit_value_head", "num_bias_offset", "ridge_readout", "value_head_rows"]

PENALTIES = (0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0)
"""Ridge penalties tried, on features standardised to unit variance (the penalty is in units of positions)."""


@dataclass
class ValueHeadFit:
    """What [`fit_value_head`] did: the rows it used, the penalty it chose and the residual scale it measured; and
    the offset added to the `<NUM>` bias with the `<NUM>` class's mean OvR loss before and after (None when off).
    """

    positions: int
    penalty: float
    loo_median_abs_error: float
    regression_noise: float | None
    num_bias_offset: float | None = None
    num_loss_before: float | None = None
    num_loss_after: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _StartRows:
    """What one pass over the start batches reads, in float64 on the CPU.

    `x` `[N, C]`, `y` `[N]`: loc_U and the true value (head space) where the next label is `<NUM>`. `num_loc`,
    `num_scale`, `is_num` `[M]`: the `<NUM>` decision's `(loc_S, scale_S)` and whether the label is `<NUM>`, at
    every labelled position of the same batches.
    """

    x: torch.Tensor
    y: torch.Tensor
    num_loc: torch.Tensor
    num_scale: torch.Tensor
    is_num: torch.Tensor


@torch.no_grad()
def _read_rows(model, batches: Iterable[Mapping[str, torch.Tensor]], max_positions: int) -> _StartRows:
    num_id = model.config.num_token_id
    action = model.action
    device = next(model.parameters()).device
    # The `<NUM>` row of the classification head alone, in float64 (a [V]-wide head is not needed for one class).
    row_weight = action.cls_head.weight[num_id:num_id + 1].double()
    row_bias = action.cls_head.bias[num_id:num_id + 1].double()
    xs, ys, locs, scales, labels = [], [], [], [], []
    count = 0
    for batch in batches:
        values = batch.get("numeric_labels")
        targets, next_values = next_token_targets(batch["labels"],
                                                  values if values is not None else batch["numeric_values"])
        where = targets == num_id
        if not bool(where.any()):
            continue
        inputs = {k: batch[k].to(device) for k in ("input_ids", "numeric_values", "attention_mask", "position_ids")
                  if batch.get(k) is not None}
        out = model(**inputs, logits_to_keep=0, output_distributions=False)
        xs.append(out.loc_U[where.to(device)].double().cpu())
        ys.append(next_values[where].double().cpu())
        labelled = (targets != IGNORE_INDEX).to(device)
        loc, scale = action.head_inputs(out.loc_U[labelled], out.scale_U[labelled])
        loc_s, scale_s = linear(loc.double(), scale.double(), row_weight, row_bias)
        locs.append(loc_s[:, 0].cpu())
        scales.append(scale_s[:, 0].clamp(min=action.scale_min).cpu())
        labels.append(where[labelled.cpu()].cpu())
        count += int(where.sum())
        if count >= max_positions:
            break
    if not xs:
        raise ValueError("batches hold no position whose label is <NUM>: there is nothing to fit the value head on")
    x, y = torch.cat(xs)[:max_positions], torch.cat(ys)[:max_positions]
    return _StartRows(x, transform_values(y, model.config.value_transform),
                      torch.cat(locs), torch.cat(scales), torch.cat(labels))


def value_head_rows(
    model, batches: Iterable[Mapping[str, torch.Tensor]], max_positions: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x, y)` float64 on the CPU: loc_U `[N, C]` at the positions whose next label is `<NUM>`, and the true values
    `[N]` in the head's space. Batches are what the model's forward takes (`input_ids`, `numeric_values`,
    `labels`, optional `numeric_labels`, `attention_mask`); reading stops once `max_positions` rows are in.
    """
    rows = _read_rows(model, batches, max_positions)
    return rows.x, rows.y


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
    check_positive_finite("span", span)
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


def ridge_readout(
    x: torch.Tensor, y: torch.Tensor, penalties: Sequence[float] = PENALTIES
) -> tuple[torch.Tensor, float, float, float]:
    """Ridge regression of `y` `[N]` on `x` `[N, C]` with the penalty of least median |leave-one-out residual|.

    Features are centred and scaled to unit variance (the penalty then weighs every dimension alike, whatever its
    raw scale); the intercept is not penalised. Leave-one-out residuals (refitting without row i, features
    standardised once with every row) are exact in closed form for ridge: e_i / (1 − h_ii) with h the hat matrix,
    here from one SVD of the standardised features.

    Returns:
        `(weight [C], bias, penalty, median |LOO residual|)`, in float64.
    """
    if x.dim() != 2 or y.dim() != 1 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x must be [N, C] and y [N], got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape[0] < 3:
        raise ValueError(f"the value head needs at least 3 <NUM> positions to fit, got {x.shape[0]}")
    if not penalties:
        raise ValueError("penalties must be a non-empty sequence of positive finite numbers")
    for i, penalty in enumerate(penalties):
        check_positive_finite(f"penalties[{i}]", penalty)
    x, y = x.double(), y.double()
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
    a = (x - mean) / std
    centred = y - y.mean()
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    uty = u.T @ centred
    n = x.shape[0]
    best = None
    for penalty in penalties:
        shrink = s.square() / (s.square() + penalty)
        fitted = u @ (shrink * uty)
        # The intercept is a free parameter too: its leverage is 1/n.
        leverage = (u.square() * shrink).sum(1) + 1.0 / n
        loo = (centred - fitted) / (1.0 - leverage).clamp(min=1e-12)
        error = loo.abs().quantile(0.5).item()
        if best is None or error < best[1]:
            best = (penalty, error, shrink)
    penalty, error, shrink = best
    coef = vh.T @ (shrink / s.clamp(min=1e-12) * uty)
    weight = coef / std
    bias = (y.mean() - (weight * mean).sum()).item()
    return weight, bias, float(penalty), float(error)


@torch.no_grad()
def fit_value_head(
    model,
    batches: Iterable[Mapping[str, torch.Tensor]],
    *,
    penalties: Sequence[float] = PENALTIES,
    max_positions: int = 4096,
    num_bias: bool = True,
) -> ValueHeadFit:
    """Set `w_reg`, `b_reg` (and γ_Y when the model has one) from a ridge read-out of loc_U on `batches`, and move
    the `<NUM>` bias `b_cls[<NUM>]` to where the `<NUM>` decision's loss on them is least ([`num_bias_offset`]).

    Args:
        model: a [`CausalQwenForCausalLM`] with `use_numeric=True`.
        batches: batches as the collator gives them, with `labels` (the rows are the positions whose next label is
            `<NUM>`, so prompt positions labelled −100 are left out) and the numbers in `numeric_labels` or
            `numeric_values`. The training batches, before the first step, are the intended input.
        penalties: ridge penalties to choose from (on standardised features).
        max_positions: read batches until this many rows are in.
        num_bias: also start the `<NUM>` bias from the data (False leaves the classification head as it is).

    Returns:
        A [`ValueHeadFit`], also stored as a dict in `model.config.value_head_fit` (saved with the config).

        >>> fit = fit_value_head(model, trainer.get_eval_dataloader(train_dataset))   # plain Trainer
    """
    if not getattr(model.config, "use_numeric", False) or getattr(model, "action", None) is None:
        raise ValueError("fit_value_head needs a CausalQwen model with use_numeric=True (it has a value head)")
    if not isinstance(num_bias, bool):
        raise TypeError(f"num_bias must be a bool, got {type(num_bias).__name__}")
    head = model.action.reg_head
    was_training = model.training
    model.eval()
    try:
        rows = _read_rows(model, batches, max_positions)
    finally:
        model.train(was_training)
    weight, bias, penalty, error = ridge_readout(rows.x, rows.y, penalties)
    head.weight.copy_(weight.to(head.weight)[None])
    head.bias.fill_(bias)
    noise = None
    if model.action.reg_log_noise is not None:
        noise = max(error, model.config.scale_min)
        model.action.reg_log_noise.fill_(math.log(noise))
    offset = loss_before = loss_after = None
    if num_bias:
        num_id = model.config.num_token_id
        threshold = float(model.action.threshold[num_id])
        offset, loss_before, loss_after = num_bias_offset(rows.num_loc, rows.num_scale, rows.is_num, threshold)
        model.action.cls_head.bias[num_id] += offset
    fit = ValueHeadFit(positions=int(rows.x.shape[0]), penalty=penalty, loo_median_abs_error=error,
                       regression_noise=noise, num_bias_offset=offset, num_loss_before=loss_before,
                       num_loss_after=loss_after)
    model.config.value_head_fit = fit.to_dict()
    return fit
