"""The label convention, shared by data, loss, metrics and the value-head start.

Labels follow Hugging Face: `labels` has the shape of `input_ids`, −100 marks a position without loss, and
position i is scored against label i + 1. `next_token_targets` does that shift once for everyone, keeping the
`[B, S]` shape (the last position has no target), so that targets line up with the model's per-position outputs.

Context-parallel training (Trainer, accelerate) splits each sequence across devices after shifting, and passes the
already-shifted targets as `shift_labels`, as transformers' `ForCausalLMLoss` takes them: they then replace the shift
of `labels`. `shift_numeric_labels` are their values, where a shard's last target lies beyond the shard.

`LossTargets` holds what the loss reads of a batch once shifted: the targets, their values, which positions count,
and the counts of the whole optimizer step that `Trainer` passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["IGNORE_INDEX", "LossTargets", "next_token_targets"]

IGNORE_INDEX = -100


def next_token_targets(
    labels: torch.Tensor | None,
    numeric_labels: torch.Tensor | None = None,
    *,
    shift_labels: torch.Tensor | None = None,
    shift_numeric_labels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target of every position: `labels` `[B, S]` shifted left, `IGNORE_INDEX` at the last position.

    Args:
        labels: `[B, S]` unshifted token ids, `IGNORE_INDEX` where no loss is wanted (unused, and may be None, when
            `shift_labels` is given).
        numeric_labels: `[B, S]` true values (read where the target is `<NUM>`), or None; unshifted, like `labels`.
        shift_labels: `[B, S]` targets already shifted (`shift_labels[:, i]` is the target of position i), or None.
        shift_numeric_labels: `[B, S]` the values of `shift_labels`, already shifted; by default `numeric_labels`
            shifted left (0 at the last position).

    Returns:
        `(targets, values)`, each `[B, S]`: `targets[:, i] = labels[:, i + 1]`, and the values likewise (0 at the last
        position), or `shift_labels` and its values; `values` is None when no values are given.
    """
    if shift_labels is not None:
        values = shift_numeric_labels
        if values is None and numeric_labels is not None:
            values = torch.nn.functional.pad(numeric_labels[:, 1:], (0, 1))
        return shift_labels, values
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    values = None if numeric_labels is None else torch.nn.functional.pad(numeric_labels[:, 1:], (0, 1))
    return targets, values


@dataclass(frozen=True)
class LossTargets:
    """The shifted targets of a batch, as the loss reads them (docs/design.md §4).

    Args:
        labels: `[B, S]` the target of every position (`labels[:, i]` is scored at position i), `IGNORE_INDEX`
            where no loss is wanted.
        values: `[B, S]` the true values of the targets (read where the target is `<NUM>`), or None.
        num_items_in_batch: when given (`Trainer` with gradient accumulation or several devices), the count of
            labelled positions over all micro-batches and devices. The classification sum (and the anchor term) is
            divided by it instead of by this batch's count, and the regression mean enters the total weighted by
            this batch's share of labelled positions, so that summing micro-batch losses (as `Trainer` does) gives
            the labelled-position-weighted average of their regression means instead of multiplying it.
        num_numbers_in_batch: when given (`CausalQwenTrainer` counts it), the count of `<NUM>` targets over all
            micro-batches and devices. The regression sum is divided by it, so that the summed micro-batch losses
            give the mean over all the step's numbers, however they are split; it replaces the share weighting.

    `valid` `[B, S]` marks the labelled positions.
    """

    labels: torch.Tensor
    values: torch.Tensor | None = None
    num_items_in_batch: int | torch.Tensor | None = None
    num_numbers_in_batch: int | torch.Tensor | None = None
    valid: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "valid", self.labels != IGNORE_INDEX)

    @classmethod
    def from_labels(
        cls,
        labels: torch.Tensor | None,
        numeric_labels: torch.Tensor | None = None,
        *,
        shift_labels: torch.Tensor | None = None,
        shift_numeric_labels: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        num_numbers_in_batch: int | torch.Tensor | None = None,
    ) -> LossTargets:
        """The targets of a batch: its labels shifted once (`next_token_targets`), with the step's counts.

        Args:
            labels, numeric_labels: `[B, S]` unshifted, as the model's forward takes them.
            shift_labels: `[B, S]` targets already shifted (`shift_labels[:, i]` is the target of position i), as
                context-parallel training passes them (Trainer, accelerate; transformers' `ForCausalLMLoss` takes
                them alike): the targets are them instead of the shift of `labels`.
            shift_numeric_labels: `[B, S]` the values of `shift_labels`, already shifted. By default `numeric_labels`
                is shifted like the labels, which cannot give the value of the last position's target: a `<NUM>`
                target there needs `shift_numeric_labels`.
            num_items_in_batch, num_numbers_in_batch: the counts of labelled positions and of `<NUM>` targets over
                the optimizer step's micro-batches and devices, which `Trainer` (the first) and
                `CausalQwenTrainer` (both) pass; see the class.
        """
        targets, values = next_token_targets(labels, numeric_labels, shift_labels=shift_labels,
                                             shift_numeric_labels=shift_numeric_labels)
        return cls(targets, values, num_items_in_batch, num_numbers_in_batch)
