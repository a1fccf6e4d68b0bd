"""The CausalQwen loss (docs/design.md §4): One-vs-Rest Cauchy BCE over the vocabulary + gated Cauchy NLL.

`causal_qwen_loss` is the one entry. It takes the classification head in one of two forms, which give the same
loss and gradients from plain tensors:

- `DecisionScores`: the `[B, S, V]` decision scores (`loc_S`, `scale_S`), scored as the formulas read;
- `FusedHead`: `loc_U` and the head's weights, scored through the tiled kernel of `causal_qwen.chunked_loss`
  without any `[B, S, V]` tensor (the path of a training step);

the targets of `labels.LossTargets` (shifted once), the options of `LossOptions` (the config's fields), and
optionally the abduction anchor's KL term (`AnchorTerm`). It scores the value at positions whose target is `<NUM>`
with `regression_nll` and reduces with `combine_losses`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cauchy import kl_divergence, nll, ovr_log_probs, ovr_probability, transform_values
from .chunked_loss import chunked_ovr_loss, class_threshold, ovr_class_probability
from .configuration import CausalQwenConfig
from .labels import IGNORE_INDEX, LossTargets

__all__ = [
    "IGNORE_INDEX", "AnchorTerm", "CausalLoss", "DecisionScores", "FusedHead", "LossOptions", "LossTargets", "Tiling",
    "causal_qwen_loss", "ovr_classification_loss", "regression_nll", "combine_losses", "safe_mean",
]


@dataclass
class CausalLoss:
    """The three numbers the model reports: `loss = cls_loss + λ·reg_loss` (+ β·KL with an anchor)."""

    loss: torch.Tensor
    cls_loss: torch.Tensor
    reg_loss: torch.Tensor


@dataclass(frozen=True)
class LossOptions:
    """The config fields that shape the loss (docs/design.md §4), with the config's defaults.

    `from_config` is the one place that reads them from a config.

    Args:
        num_token_id: id of `<NUM>`; None turns regression off (the text-only model).
        gate_alpha: floor α of the gate α + (1 − α)·P_<NUM> on the regression NLL.
        reg_loss_weight: λ in `loss = cls_loss + λ·reg_loss`.
        detach_gate: no gradient flows through the gate.
        value_transform: the space of the regression head, `"identity"` or `"symlog"`.
        anchor_weight: β, the weight of the abduction anchor's KL term (`abduction_anchor_weight`).
    """

    num_token_id: int | None
    gate_alpha: float = CausalQwenConfig.gate_alpha
    reg_loss_weight: float = CausalQwenConfig.reg_loss_weight
    detach_gate: bool = CausalQwenConfig.detach_gate
    value_transform: str = CausalQwenConfig.value_transform
    anchor_weight: float = CausalQwenConfig.abduction_anchor_weight

    @classmethod
    def from_config(cls, config: CausalQwenConfig) -> LossOptions:
        return cls(
            num_token_id=config.num_token_id if config.use_numeric else None, gate_alpha=config.gate_alpha,
            reg_loss_weight=config.reg_loss_weight, detach_gate=config.detach_gate,
            value_transform=config.value_transform, anchor_weight=config.abduction_anchor_weight,
        )


@dataclass(frozen=True)
class Tiling:
    """Tile shape and scratch space of the fused loss, as in `chunked_loss.chunked_ovr_loss` (None: chosen)."""

    chunk_size: int | None = None
    vocab_chunk_size: int | None = None
    memory_budget: int | None = None


@dataclass
class DecisionScores:
    """The classification head as `[B, S, V]` decision scores `loc_s`, `scale_s`, and its threshold C."""

    loc_s: torch.Tensor
    scale_s: torch.Tensor
    threshold: torch.Tensor | float

    def classification_sum(self, targets: LossTargets) -> tuple[torch.Tensor, torch.Tensor]:
        """`(Σ of the OvR loss over labelled positions, their count)`."""
        vocab = self.loc_s.shape[-1]
        valid = targets.valid.reshape(-1)
        per_position = ovr_classification_loss(self.loc_s.reshape(-1, vocab)[valid],
                                               self.scale_s.reshape(-1, vocab)[valid],
                                               targets.labels.reshape(-1)[valid], self.threshold)
        return per_position.sum(), valid.sum()

    def class_probability(self, mask: torch.Tensor, class_id: int) -> torch.Tensor:
        """P(S_k > C_k) of class `class_id` at the positions of `mask` `[B, S]`: `[n]` fp32."""
        return ovr_probability(self.loc_s[..., class_id][mask].float(), self.scale_s[..., class_id][mask].float(),
                               class_threshold(self.threshold, class_id))


@dataclass
class FusedHead:
    """The classification head `loc_S = loc_U·Wᵀ + b`, `scale_S = max(scale_U'·|W|ᵀ, scale_min)`, not yet computed.

    Scored with its loss tile by tile (`chunked_loss.chunked_ovr_loss`); the gate needs only the `<NUM>` column of
    the head, computed at the positions whose target is `<NUM>`.

    Args:
        loc_u, scale_u_noisy: `[B, S, C]` loc_U and scale_U' = scale_U + |b_noise| (not floored).
        weight, bias, threshold: W_cls `[V, C]`, b_cls `[V]` (or None), C (`[V]`, scalar or float).
        scale_min: the floor on scale_S.
        tiling: tile shape and scratch space.
    """

    loc_u: torch.Tensor
    scale_u_noisy: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    threshold: torch.Tensor | float
    scale_min: float
    tiling: Tiling = Tiling()

    def classification_sum(self, targets: LossTargets) -> tuple[torch.Tensor, torch.Tensor]:
        """As `DecisionScores.classification_sum`, without any `[B, S, V]` tensor."""
        # Targets keep the [B, S] shape (the last position unlabelled), so loc_u and scale_u are used whole and
        # flattening them is a view, not a copy.
        loss_sum, valid_count = chunked_ovr_loss(
            self.loc_u, self.scale_u_noisy, self.weight, self.bias, self.threshold, targets.labels,
            scale_min=self.scale_min, chunk_size=self.tiling.chunk_size,
            vocab_chunk_size=self.tiling.vocab_chunk_size, memory_budget=self.tiling.memory_budget,
        )
        return loss_sum, valid_count

    def class_probability(self, mask: torch.Tensor, class_id: int) -> torch.Tensor:
        """As `DecisionScores.class_probability`, from the head's row of `class_id` only."""
        return ovr_class_probability(self.loc_u[mask], self.scale_u_noisy[mask], self.weight, self.bias,
                                     self.threshold, class_id, scale_min=self.scale_min)


@dataclass
class AnchorTerm:
    """U ~ Cauchy(`loc_u`, `scale_u`) and the frozen anchor's U⁰ ~ Cauchy(`anchor_loc`, `anchor_scale`), `[B, S, C]`.

    The loss gains β times the mean over labelled positions of Σ_c KL(U ‖ U⁰) (docs/design.md §7).
    """

    loc_u: torch.Tensor
    scale_u: torch.Tensor
    anchor_loc: torch.Tensor
    anchor_scale: torch.Tensor

    def kl(self) -> torch.Tensor:
        """Σ_c KL(U ‖ U⁰) `[B, S]`, in fp32."""
        return kl_divergence(self.loc_u.float(), self.scale_u.float(), self.anchor_loc.float(),
                             self.anchor_scale.float()).sum(-1)


def causal_qwen_loss(
    head: DecisionScores | FusedHead,
    loc_y: torch.Tensor | None,
    scale_y: torch.Tensor | None,
    targets: LossTargets,
    options: LossOptions,
    anchor: AnchorTerm | None = None,
) -> CausalLoss:
    """The total loss of docs/design.md §4.

    Args:
        head: the classification head, as decision scores or fused with its loss.
        loc_y, scale_y: `[B, S]` regression distribution, or None for the text-only model.
        targets: the shifted targets, their values and the step's counts (`LossTargets.from_labels`).
        options: the loss's options (`LossOptions.from_config`).
        anchor: the abduction anchor, or None: the mean of its KL over labelled positions (divided by
            `num_items_in_batch` instead when given) enters the loss weighted by `options.anchor_weight`.

    Returns:
        `CausalLoss` with `loss = cls_loss + reg_loss_weight · reg_loss (+ anchor_weight · KL)`, fp32 scalars.
    """
    cls_sum, valid_count = head.classification_sum(targets)
    num_mask, nll_values = _value_terms(targets, loc_y, scale_y, options)
    p_num = None
    if nll_values is not None:
        # Without a gradient unless the gate has one: then only the <NUM> row of W enters the fused graph.
        with torch.set_grad_enabled(torch.is_grad_enabled() and not options.detach_gate):
            p_num = head.class_probability(num_mask, options.num_token_id)
    losses = combine_losses(cls_sum, valid_count, nll_values, p_num, targets, options)
    if anchor is not None:
        count = targets.num_items_in_batch if targets.num_items_in_batch is not None else targets.valid.sum()
        losses.loss = losses.loss + options.anchor_weight * safe_mean(anchor.kl()[targets.valid].sum(), count)
    return losses


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


def _value_terms(
    targets: LossTargets, loc_y: torch.Tensor | None, scale_y: torch.Tensor | None, options: LossOptions
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`(num_mask, nll)`: the positions whose target is `<NUM>` `[B, S]` and the value's NLL there `[n]` (or Nones)."""
    if options.num_token_id is None or loc_y is None or targets.values is None:
        return None, None
    num_mask = targets.labels == options.num_token_id
    return num_mask, regression_nll(loc_y[num_mask], scale_y[num_mask], targets.values[num_mask],
                                    options.value_transform)


def combine_losses(
    cls_sum: torch.Tensor,
    valid_count: torch.Tensor,
    nll: torch.Tensor | None,
    p_num: torch.Tensor | None,
    targets: LossTargets,
    options: LossOptions,
) -> CausalLoss:
    """The reductions of docs/design.md §4, shared by both forms of the head.

    Args:
        cls_sum: OvR loss summed over the valid positions (fp32 scalar); valid_count: their number.
        nll, p_num: `[n]` Cauchy NLL and `<NUM>` probability at the positions whose target is `<NUM>`, or None.
        targets: for the step's counts, `num_items_in_batch` and `num_numbers_in_batch` (see `LossTargets`).
        options: for the gate (`gate_alpha`, `detach_gate`) and λ (`reg_loss_weight`).
    """
    num_items, num_numbers = targets.num_items_in_batch, targets.num_numbers_in_batch
    cls_loss = safe_mean(cls_sum, num_items if num_items is not None else valid_count)
    reg_loss = reg_in_total = cls_loss.new_zeros(())
    if nll is not None:
        if options.detach_gate:
            p_num = p_num.detach()
        gate = options.gate_alpha + (1.0 - options.gate_alpha) * p_num
        # Summed even when no position is a number: the value head then stays in the graph with a zero gradient,
        # so every data-parallel rank runs the same backward whatever its batch holds.
        reg_sum = (gate * nll).sum()
        reg_loss = reg_sum / max(nll.numel(), 1)
        if num_numbers is not None:
            reg_in_total = safe_mean(reg_sum, num_numbers)
        elif num_items is not None:
            reg_in_total = reg_loss * safe_mean(valid_count.to(reg_loss.dtype), num_items)
        else:
            reg_in_total = reg_loss
    return CausalLoss(loss=cls_loss + options.reg_loss_weight * reg_in_total, cls_loss=cls_loss, reg_loss=reg_loss)


def safe_mean(total: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """`total / count`, with an empty denominator giving 0 rather than NaN."""
    if isinstance(count, torch.Tensor):
        count = count.to(total.device)
        return torch.where(count > 0, total / count.clamp(min=1), total.new_zeros(()))
    return total / count if count > 0 else total.new_zeros(())


def _as_float(threshold: torch.Tensor | float) -> torch.Tensor | float:
    return threshold.float() if isinstance(threshold, torch.Tensor) else threshold
