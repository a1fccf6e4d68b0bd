"""The CausalQwen loss (DESIGN.md §4): One-vs-Rest Cauchy BCE over the vocabulary + gated Cauchy NLL.

Labels follow the Hugging Face convention: `labels` has the shape of `input_ids`, −100 marks
positions without loss, and the shift happens here (position i predicts token i + 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cauchy import nll, ovr_log_probs, ovr_probability, symlog

IGNORE_INDEX = -100


@dataclass
class CausalLoss:
    """The three numbers the model reports: `loss = cls_loss + λ·reg_loss`."""

    loss: torch.Tensor
    cls_loss: torch.Tensor
    reg_loss: torch.Tensor


def shift_targets(
    labels: torch.Tensor, numeric_labels: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Targets for positions 0..S−2 are the labels at 1..S−1; the last position has none."""
    shifted = labels[:, 1:]
    shifted_values = numeric_labels[:, 1:] if numeric_labels is not None else None
    return shifted, shifted_values


def ovr_classification_loss(
    loc_s: torch.Tensor, scale_s: torch.Tensor, targets: torch.Tensor, threshold: torch.Tensor | float
) -> torch.Tensor:
    """Per-position OvR loss −Σ_k [y_k log P_k + (1 − y_k) log(1 − P_k)] over the whole vocabulary.

    Args:
        loc_s, scale_s: `[N, V]` decision-score distributions.
        targets: `[N]` class ids; entries that are `IGNORE_INDEX` yield an arbitrary (finite) value
            that the caller masks out.
        threshold: scalar or `[V]`.

    Returns:
        `[N]` losses, in fp32.
    """
    log_p, log_q = ovr_log_probs(loc_s.float(), scale_s.float(), _as_float(threshold))
    safe_targets = targets.clamp(min=0).unsqueeze(-1)
    # All classes are negatives except the target, whose negative term is swapped for its positive one.
    return -(log_q.sum(-1) + log_p.gather(-1, safe_targets).squeeze(-1) - log_q.gather(-1, safe_targets).squeeze(-1))


def transform_values(values: torch.Tensor, value_transform: str) -> torch.Tensor:
    """Map true values into the space the regression head models."""
    if value_transform == "symlog":
        return symlog(values)
    return values


def regression_nll(
    loc_y: torch.Tensor, scale_y: torch.Tensor, values: torch.Tensor, value_transform: str
) -> torch.Tensor:
    """Cauchy NLL of the true values under the head's distribution, in fp32, in the head's space."""
    target = transform_values(values.to(torch.float64), value_transform).to(torch.float32)
    if not torch.isfinite(target).all():
        raise ValueError(
            "numeric_labels holds values beyond the float32 range; use value_transform='symlog' for them"
        )
    return nll(target, loc_y.float(), scale_y.float())


def causal_qwen_loss(
    loc_s: torch.Tensor,
    scale_s: torch.Tensor,
    loc_y: torch.Tensor | None,
    scale_y: torch.Tensor | None,
    labels: torch.Tensor,
    numeric_labels: torch.Tensor | None,
    *,
    threshold: torch.Tensor | float,
    num_token_id: int | None,
    gate_alpha: float = 0.0,
    reg_loss_weight: float = 1.0,
    detach_gate: bool = True,
    value_transform: str = "identity",
    num_items_in_batch: int | torch.Tensor | None = None,
) -> CausalLoss:
    """The total loss of DESIGN.md §4 from unshifted head outputs and labels.

    Args:
        loc_s, scale_s: `[B, S, V]` decision scores.
        loc_y, scale_y: `[B, S]` regression distribution, or None for the text-only model.
        labels: `[B, S]` token ids, `IGNORE_INDEX` where no loss is wanted.
        numeric_labels: `[B, S]` true values (read where the label is `<NUM>`), or None.
        threshold: the OvR threshold C, scalar or `[V]`.
        num_token_id: id of `<NUM>`; None turns regression off.
        num_items_in_batch: when given (`Trainer` with gradient accumulation or several devices), the count
            of valid positions over all micro-batches and devices. The classification sum is divided by it
            instead of by this batch's count, and the regression mean enters the total weighted by this
            batch's share of valid positions, so that summing micro-batch losses (as `Trainer` does) gives
            the valid-position-weighted average of their regression means instead of multiplying it.

    Returns:
        `CausalLoss` with `loss = cls_loss + reg_loss_weight · reg_loss`, fp32 scalars.
    """
    targets, target_values = shift_targets(labels, numeric_labels)
    loc_s, scale_s = loc_s[:, :-1], scale_s[:, :-1]
    valid = targets != IGNORE_INDEX
    flat_valid = valid.reshape(-1)
    vocab = loc_s.shape[-1]

    cls_per_position = ovr_classification_loss(
        loc_s.reshape(-1, vocab)[flat_valid], scale_s.reshape(-1, vocab)[flat_valid],
        targets.reshape(-1)[flat_valid], threshold,
    )
    nll_values = p_num = None
    if num_token_id is not None and loc_y is not None and target_values is not None:
        num_mask = valid & (targets == num_token_id)
        nll_values = regression_nll(loc_y[:, :-1][num_mask], scale_y[:, :-1][num_mask], target_values[num_mask],
                                    value_transform)
        p_num = ovr_probability(
            loc_s[..., num_token_id][num_mask].float(), scale_s[..., num_token_id][num_mask].float(),
            _threshold_of(threshold, num_token_id),
        )
    return combine_losses(cls_per_position.sum(), flat_valid.sum(), nll_values, p_num, gate_alpha=gate_alpha,
                          reg_loss_weight=reg_loss_weight, detach_gate=detach_gate,
                          num_items_in_batch=num_items_in_batch)


def combine_losses(
    cls_sum: torch.Tensor,
    valid_count: torch.Tensor,
    nll: torch.Tensor | None,
    p_num: torch.Tensor | None,
    *,
    gate_alpha: float,
    reg_loss_weight: float,
    detach_gate: bool,
    num_items_in_batch: int | torch.Tensor | None,
) -> CausalLoss:
    """The reductions of DESIGN.md §4, shared by the straightforward and the fused path.

    Args:
        cls_sum: OvR loss summed over the valid positions (fp32 scalar); valid_count: their number.
        nll, p_num: `[n]` Cauchy NLL and `<NUM>` probability at the positions whose target is `<NUM>`, or None.
        num_items_in_batch: see `causal_qwen_loss`.
    """
    cls_loss = safe_mean(cls_sum, num_items_in_batch if num_items_in_batch is not None else valid_count)
    reg_loss = cls_loss.new_zeros(())
    if nll is not None and nll.numel():
        if detach_gate:
            p_num = p_num.detach()
        gate = gate_alpha + (1.0 - gate_alpha) * p_num
        reg_loss = (gate * nll).sum() / nll.numel()
    reg_in_total = reg_loss
    if num_items_in_batch is not None:
        reg_in_total = reg_loss * safe_mean(valid_count.to(reg_loss.dtype), num_items_in_batch)
    return CausalLoss(loss=cls_loss + reg_loss_weight * reg_in_total, cls_loss=cls_loss, reg_loss=reg_loss)


def safe_mean(total: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """`total / count`, with an empty denominator giving 0 rather than NaN."""
    if isinstance(count, torch.Tensor):
        count = count.to(total.device)
        return torch.where(count > 0, total / count.clamp(min=1), total.new_zeros(()))
    return total / count if count > 0 else total.new_zeros(())


def _as_float(threshold: torch.Tensor | float) -> torch.Tensor | float:
    return threshold.float() if isinstance(threshold, torch.Tensor) else threshold


def _threshold_of(threshold: torch.Tensor | float, token_id: int) -> torch.Tensor | float:
    if isinstance(threshold, torch.Tensor) and threshold.dim() > 0:
        return threshold[token_id].float()
    return _as_float(threshold)
