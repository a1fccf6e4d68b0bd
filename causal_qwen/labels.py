"""The label convention, shared by data, loss, metrics and the value-head start.

Labels follow Hugging Face: `labels` has the shape of `input_ids`, −100 marks a position without loss, and
position i is scored against label i + 1. `next_token_targets` does that shift once for everyone, keeping the
`[B, S]` shape (the last position has no target), so that targets line up with the model's per-position outputs.
"""

from __future__ import annotations

import torch

__all__ = ["IGNORE_INDEX", "next_token_targets"]

IGNORE_INDEX = -100


def next_token_targets(
    labels: torch.Tensor, numeric_labels: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target of every position: `labels` `[B, S]` shifted left, `IGNORE_INDEX` at the last position.

    Args:
        labels: `[B, S]` unshifted token ids, `IGNORE_INDEX` where no loss is wanted.
        numeric_labels: `[B, S]` true values (read where the target is `<NUM>`), or None.

    Returns:
        `(targets, values)`, each `[B, S]`: `targets[:, i] = labels[:, i + 1]`, and the values likewise (0 at the last
        position); `values` is None when `numeric_labels` is.
    """
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    values = None if numeric_labels is None else torch.nn.functional.pad(numeric_labels[:, 1:], (0, 1))
    return targets, values
