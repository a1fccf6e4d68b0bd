"""The CausalQwen loss (docs/design.md §4): One-vs-Rest Cauchy BCE over the vocabulary + gated Cauchy NLL.

Two paths give the same loss and gradients from plain tensors:

- `causal_qwen_loss` from the `[B, S, V]` decision scores (`loc_S`, `scale_S`), written as the formulas read;
- `fused_causal_qwen_loss` from `loc_U` and the head's weights, through the tiled kernel of
  `causal_qwen.chunked_loss`, without any `[B, S, V]` tensor (the path of a training step).

Both shift the labels with `labels.next_token_targets`, score the value at positions whose target is `<NUM>` with
`regression_nll`, and reduce with `combine_losses`. `LossOptions` carries the config fields that shape the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cauchy import nll, ovr_log_probs, ovr_probability, transform_values
from .chunked_loss import chunked_ovr_loss, class_threshold, ovr_class_probability
from .labels import IGNORE_INDEX, next_token_targets

__all__ = [
    "IGNORE_INDEX", "CausalLoss", "LossOptions", "causal_qwen_loss", "fused_causal_qwen_loss",
    "ovr_classification_loss", "regression_nll", "combine_losses", "safe_mean",
]


@dataclass
class CausalLoss:
    """The three numbers the model reports: `loss = cls_loss + λ·reg_loss`."""

    loss: torch.Tensor
    cls_loss: torch.Tensor
    reg_loss: torch.Tensor


@dataclass(frozen=True)
class LossOptions:
    """The config fields that shape the loss (docs/design.md §4); `from_config` is the one place that reads them.

    Args:
        num_token_id: id of `<NUM>`; None turns regression off (the text-only model).
        gate_alpha: floor α of the gate α + (1 − α)·P_<NUM> on the regression NLL.
        reg_loss_weight: λ in `loss = cls_loss + λ·reg_loss`.
        detach_gate: no gradient flows through the gate.
        value_transform: the space of the regression head, `"identity"` or `"symlog"`.
    """

    num_token_id: int | None
    gate_alpha: float = 0.0
    reg_loss_weight: float = 1.0
    detach_gate: bool = True
    value_transform: str = "identity"

    @classmethod
    def from_config(cls, config) -> LossOptions:
        return cls(
            num_token_id=config.num_token_id if config.use_numeric else None, gate_alpha=config.gate_alpha,
            reg_loss_weight=config.reg_loss_weight, detach_gate=config.detach_gate,
            value_transform=config.value_transform,
        )


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
    shift_labels: torch.Tensor | None = None,
    shift_numeric_labels: torch.Tensor | None = None,
    num_numbers_in_batch: int | torch.Tensor | None = None,
) -> CausalLoss:
    """The total loss of docs/design.md §4 from unshifted head outputs and labels.

    Args:
        loc_s, scale_s: `[B, S, V]` decision scores.
        loc_y, scale_y: `[B, S]` regression distribution, or None for the text-only model.
        labels: `[B, S]` token ids, `IGNORE_INDEX` where no loss is wanted.
        numeric_labels: `[B, S]` true values (read where the label is `<NUM>`), or None.
        threshold: the OvR threshold C, scalar or `[V]`.
        num_token_id, gate_alpha, reg_loss_weight, detach_gate, value_transform: see `LossOptions`.
        num_items_in_batch: when given (`Trainer` with gradient accumulation or several devices), the count
            of valid positions over all micro-batches and devices. The classification sum is divided by it
            instead of by this batch's count, and the regression mean enters the total weighted by this
            batch's share of valid positions, so that summing micro-batch losses (as `Trainer` does) gives
            the valid-position-weighted average of their regression means instead of multiplying it.
        shift_labels, shift_numeric_labels: targets (and their values) already shifted, which replace the shift of
            `labels` (context-parallel training); see `labels.next_token_targets`.
        num_numbers_in_batch: when given (`CausalQwenTrainer` counts it), the count of `<NUM>` targets over all
            micro-batches and devices. The regression sum is divided by it, so that the summed micro-batch losses
            give the mean over all the step's numbers, however they are split; it replaces the share weighting.

    Returns:
        `CausalLoss` with `loss = cls_loss + reg_loss_weight · reg_loss`, fp32 scalars.
    """
    targets, target_values = next_token_targets(labels, numeric_labels, shift_labels=shift_labels,
                                                shift_numeric_labels=shift_numeric_labels)
    valid = (targets != IGNORE_INDEX).reshape(-1)
    vocab = loc_s.shape[-1]
    cls_per_position = ovr_classification_loss(
        loc_s.reshape(-1, vocab)[valid], scale_s.reshape(-1, vocab)[valid], targets.reshape(-1)[valid], threshold
    )
    num_mask, nll_values = _value_terms(targets, target_values, loc_y, scale_y, num_token_id, value_transform)
    p_num = None
    if nll_values is not None:
        p_num = ovr_probability(loc_s[..., num_token_id][num_mask].float(),
                                scale_s[..., num_token_id][num_mask].float(), class_threshold(threshold, num_token_id))
    return combine_losses(cls_per_position.sum(), valid.sum(), nll_values, p_num, gate_alpha=gate_alpha,
                          reg_loss_weight=reg_loss_weight, detach_gate=detach_gate,
                          num_items_in_batch=num_items_in_batch, num_numbers_in_batch=num_numbers_in_batch)


def fused_causal_qwen_loss(
    loc_u: torch.Tensor,
    scale_u_noisy: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    threshold: torch.Tensor | float,
    loc_y: torch.Tensor | None,
    scale_y: torch.Tensor | None,
    labels: torch.Tensor,
    numeric_labels: torch.Tensor | None,
    *,
    scale_min: float,
    num_token_id: int | None,
    gate_alpha: float = 0.0,
    reg_loss_weight: float = 1.0,
    detach_gate: bool = True,
    value_transform: str = "identity",
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    memory_budget: int | None = None,
    shift_labels: torch.Tensor | None = None,
    shift_numeric_labels: torch.Tensor | None = None,
    num_numbers_in_batch: int | torch.Tensor | None = None,
) -> CausalLoss:
    """`causal_qwen_loss` of the head `loc_S = loc_U·Wᵀ + b`, `scale_S = max(scale_U'·|W|ᵀ, scale_min)`, fused.

    The classification part runs through `chunked_loss.chunked_ovr_loss`, tile by tile; the gate needs only the
    `<NUM>` column of the head, computed at the positions whose target is `<NUM>`.

    Args:
        loc_u, scale_u_noisy: `[B, S, C]` loc_U and scale_U' = scale_U + |b_noise| (not floored).
        weight, bias, threshold: W_cls `[V, C]`, b_cls `[V]` (or None), C (`[V]`, scalar or float).
        loc_y, scale_y: `[B, S]` regression distribution, or None for the text-only model.
        labels, numeric_labels, num_token_id, gate_alpha, reg_loss_weight, detach_gate, value_transform,
            num_items_in_batch, shift_labels, shift_numeric_labels, num_numbers_in_batch: as in `causal_qwen_loss`.
        scale_min: the floor on scale_S.
        chunk_size, vocab_chunk_size, memory_budget: tiling, as in `chunked_ovr_loss`.
    """
    # Targets keep the [B, S] shape (the last position unlabelled), so loc_u and scale_u are used whole and
    # flattening them is a view, not a copy.
    targets, target_values = next_token_targets(labels, numeric_labels, shift_labels=shift_labels,
                                                shift_numeric_labels=shift_numeric_labels)
    loss_sum, valid_count, _ = chunked_ovr_loss(
        loc_u, scale_u_noisy, weight, bias, threshold, targets, scale_min=scale_min, chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size, memory_budget=memory_budget,
    )
    num_mask, nll_values = _value_terms(targets, target_values, loc_y, scale_y, num_token_id, value_transform)
    p_num = None
    if nll_values is not None:
        # Without a gradient unless the gate has one: then only the <NUM> row of W enters the graph.
        with torch.set_grad_enabled(torch.is_grad_enabled() and not detach_gate):
            p_num = ovr_class_probability(loc_u[num_mask], scale_u_noisy[num_mask], weight, bias, threshold,
                                          num_token_id, scale_min=scale_min)
    return combine_losses(loss_sum, valid_count, nll_values, p_num, gate_alpha=gate_alpha,
                          reg_loss_weight=reg_loss_weight, detach_gate=detach_gate,
                          num_items_in_batch=num_items_in_batch, num_numbers_in_batch=num_numbers_in_batch)


def _value_terms(
    targets: torch.Tensor,
    target_values: torch.Tensor | None,
    loc_y: torch.Tensor | None,
    scale_y: torch.Tensor | None,
    num_token_id: int | None,
    value_transform: str,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`(num_mask, nll)`: the positions whose target is `<NUM>` `[B, S]` and the value's NLL there `[n]` (or Nones)."""
    if num_token_id is None or loc_y is None or target_values is None:
        return None, None
    num_mask = targets == num_token_id
    return num_mask, regression_nll(loc_y[num_mask], scale_y[num_mask], target_values[num_mask], value_transform)


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
    num_numbers_in_batch: int | torch.Tensor | None = None,
) -> CausalLoss:
    """The reductions of docs/design.md §4, shared by the straightforward and the fused path.

    Args:
        cls_sum: OvR loss summed over the valid positions (fp32 scalar); valid_count: their number.
        nll, p_num: `[n]` Cauchy NLL and `<NUM>` probability at the positions whose target is `<NUM>`, or None.
        num_items_in_batch, num_numbers_in_batch: see `causal_qwen_loss`.
    """
    cls_loss = safe_mean(cls_sum, num_items_in_batch if num_items_in_batch is not None else valid_count)
    reg_loss = reg_in_total = cls_loss.new_zeros(())
    if nll is not None:
        if detach_gate:
            p_num = p_num.detach()
        gate = gate_alpha + (1.0 - gate_alpha) * p_num
        # Summed even when no position is a number: the value head then stays in the graph with a zero gradient,
        # so every data-parallel rank runs the same backward whatever its batch holds.
        reg_sum = (gate * nll).sum()
        reg_loss = reg_sum / max(nll.numel(), 1)
        if num_numbers_in_batch is not None:
            reg_in_total = safe_mean(reg_sum, num_numbers_in_batch)
        elif num_items_in_batch is not None:
            reg_in_total = reg_loss * safe_mean(valid_count.to(reg_loss.dtype), num_items_in_batch)
        else:
            reg_in_total = reg_loss
    return CausalLoss(loss=cls_loss + reg_loss_weight * reg_in_total, cls_loss=cls_loss, reg_loss=reg_loss)


def safe_mean(total: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """`total / count`, with an empty denominator giving 0 rather than NaN."""
    if isinstance(count, torch.Tensor):
        count = count.to(total.device)
        return torch.where(count > 0, total / count.clamp(min=1), total.new_zeros(()))
    return total / count if count > 0 else total.new_zeros(())


def _as_float(threshold: torch.Tensor | float) -> torch.Tensor | float:
    return threshold.float() if isinstance(threshold, torch.Tensor) else threshold
