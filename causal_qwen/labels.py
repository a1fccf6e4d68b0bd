"""The label convention, shared by data, loss, metrics and the value-head start.

Labels follow Hugging Face: `labels` has the shape of `input_ids`, −100 marks a position without loss, and
position i is scored against label i + 1. `next_token_targets` does that shift once for everyone, keeping the
`[B, S]` shape (the last position has no target), so that targets line up with the model's per-position outputs.

Context-parallel training (Trainer, accelerate) splits each sequence across devices after shifting, and passes the
already-shifted targets as `shift_labels`, as transformers' `ForCausalLMLoss` takes them: they then replace the shift
of `labels`. `shift_numeric_labels` are their values, where a shard's last target lies beyond the shard.
"""

from __future__ import annotations

import torch

__all__ = ["IGNORE_INDEX", "next_token_targets"]

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
