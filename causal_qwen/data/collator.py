"""Batching text with numbers for causal language modelling."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..loss import IGNORE_INDEX
from ..number_splicing import SIDES, pad_sequence, padded_length

__all__ = ["CausalQwenDataCollator"]


@dataclass
class CausalQwenDataCollator:
    """Pad `input_ids`, `attention_mask`, `labels`, `numeric_values` and `numeric_labels` into one batch.

    Each feature is a dict as the tokenizer returns it for one text (lists or 1-D tensors). Missing
    `labels` default to the ids (the model shifts them), missing `numeric_labels` to `numeric_values`;
    padding gets label −100 and value 0. Prompt/completion data: features from `tokenize_examples` carry their
    `labels` (−100 on the prompt); a feature with a `completion_mask` (TRL's form: 1 on the completion) gets
    label −100 wherever the mask is 0. `numeric_labels` is always returned, because `Trainer` treats
    every forward argument whose name contains "label" as a label and computes the evaluation loss
    only when all of them are present.

    Args:
        pad_token_id: id written at padded positions (masked out by `attention_mask`).
        padding_side: `"right"` or `"left"`; defaults to the tokenizer's when built `from_tokenizer`.
        pad_to_multiple_of: round the padded length up to a multiple of this.
    """

    pad_token_id: int
    padding_side: str = "right"
    pad_to_multiple_of: int | None = None

    def __post_init__(self) -> None:
        if self.padding_side not in SIDES:
            raise ValueError(f"padding_side must be 'right' or 'left', got {self.padding_side!r}")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be a positive integer, got {self.pad_to_multiple_of}")

    @classmethod
    def from_tokenizer(cls, tokenizer, **kwargs) -> CausalQwenDataCollator:
        """Take the pad id and the padding side from a tokenizer."""
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("tokenizer has neither a pad_token_id nor an eos_token_id to pad with")
        kwargs.setdefault("padding_side", tokenizer.padding_side)
        return cls(pad_token_id=pad, **kwargs)

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("features must hold at least one example")
        ids = [_as_list(f["input_ids"], "input_ids") for f in features]
        length = padded_length(max(len(x) for x in ids), self.pad_to_multiple_of)
        batch: dict[str, list] = {k: [] for k in ("input_ids", "attention_mask", "labels", "numeric_values",
                                                  "numeric_labels")}
        for feature, row in zip(features, ids, strict=True):
            n = len(row)
            mask = _as_list(feature.get("attention_mask", [1] * n), "attention_mask")
            values = [float(v) for v in _as_list(feature.get("numeric_values", [0.0] * n), "numeric_values")]
            labels = _as_list(feature.get("labels", row), "labels")
            numeric_labels = [float(v) for v in _as_list(feature.get("numeric_labels", values), "numeric_labels")]
            for name, seq in (("attention_mask", mask), ("numeric_values", values), ("labels", labels),
                              ("numeric_labels", numeric_labels)):
                if len(seq) != n:
                    raise ValueError(f"{name} has length {len(seq)} but input_ids has {n}")
            completion = _as_list(feature.get("completion_mask", [1] * n), "completion_mask")
            if len(completion) != n:
                raise ValueError(f"completion_mask has length {len(completion)} but input_ids has {n}")
            labels = [lab if m and c else IGNORE_INDEX for lab, m, c in zip(labels, mask, completion, strict=True)]
            side = self.padding_side
            batch["input_ids"].append(pad_sequence(row, length, self.pad_token_id, side))
            batch["attention_mask"].append(pad_sequence(mask, length, 0, side))
            batch["labels"].append(pad_sequence(labels, length, IGNORE_INDEX, side))
            batch["numeric_values"].append(pad_sequence(values, length, 0.0, side))
            batch["numeric_labels"].append(pad_sequence(numeric_labels, length, 0.0, side))
        return {
            "input_ids": torch.tensor(batch["input_ids"], dtype=torch.long),
            "attention_mask": torch.tensor(batch["attention_mask"], dtype=torch.long),
            "labels": torch.tensor(batch["labels"], dtype=torch.long),
            "numeric_values": torch.tensor(batch["numeric_values"], dtype=torch.float64),
            "numeric_labels": torch.tensor(batch["numeric_labels"], dtype=torch.float64),
        }


def _as_list(x, name: str) -> list:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ValueError(f"{name} of one feature must be 1-D, got shape {tuple(x.shape)}")
        return x.tolist()
    if isinstance(x, (list, tuple)):
        return list(x)
    raise TypeError(f"{name} must be a list or a 1-D tensor, got {type(x).__name__}")
