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
    `labels` default to the ids (the model shifts them), missing `numeric_labels` to `numeric_values`.
    Padding never enters the loss: a position with attention mask 0 (padding, or a mask the feature gives) gets value 0
    and label −100, and so does the label after it, which the model would score from that position's output. Prompt/
    completion data: features from `tokenize_examples` carry their `labels` (−100 on the prompt); a feature with a
    `completion_mask` (TRL's form: 1 on the completion) gets label −100 wherever the mask is 0. `numeric_labels` is
    always returned, because `Trainer` treats every forward argument whose name contains "label" as a label and
    computes the evaluation loss only when all of them are present.

    A feature without `numeric_values` holds no number: one whose ids hold `<NUM>` (`num_token_id`) is refused, as
    the model refuses `<NUM>` ids without values (they would all read as 0). Without `num_token_id` the collator
    cannot tell, so a batch of such features has no `numeric_values` (the model's own check then applies), and a
    batch mixing features with and without them is refused.

    Args:
        pad_token_id: id written at padded positions (masked out by `attention_mask`).
        padding_side: `"right"` or `"left"`; defaults to the tokenizer's when built `from_tokenizer`.
        pad_to_multiple_of: round the padded length up to a multiple of this.
        num_token_id: the id of `<NUM>`; `from_tokenizer` takes it from a tokenizer that has one.
    """

    pad_token_id: int
    padding_side: str = "right"
    pad_to_multiple_of: int | None = None
    num_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.padding_side not in SIDES:
            raise ValueError(f"padding_side must be 'right' or 'left', got {self.padding_side!r}")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be a positive integer, got {self.pad_to_multiple_of}")
        if self.num_token_id is not None and (isinstance(self.num_token_id, bool) or not isinstance(
                self.num_token_id, int) or self.num_token_id < 0):
            raise ValueError(f"num_token_id must be None or a non-negative int, got {self.num_token_id!r}")

    @classmethod
    def from_tokenizer(cls, tokenizer, **kwargs) -> CausalQwenDataCollator:
        """Take the pad id, the padding side and the `<NUM>` id (if it has one) from a tokenizer."""
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("tokenizer has neither a pad_token_id nor an eos_token_id to pad with")
        kwargs.setdefault("padding_side", tokenizer.padding_side)
        if getattr(tokenizer, "use_numeric", False):
            kwargs.setdefault("num_token_id", tokenizer.num_token_id)
        return cls(pad_token_id=pad, **kwargs)

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("features must hold at least one example")
        ids = [_as_list(f["input_ids"], "input_ids") for f in features]
        has_values = self._check_values_given(features, ids)
        length = padded_length(max(len(x) for x in ids), self.pad_to_multiple_of)
        batch: dict[str, list] = {k: [] for k in ("input_ids", "attention_mask", "labels", "numeric_values",
                                                  "numeric_labels")}
        for feature, row in zip(features, ids, strict=True):
            n = len(row)
            mask = _as_list(feature.get("attention_mask", [1] * n), "attention_mask")
            values = [float(v) for v in _as_list(feature.get("numeric_values", [0.0] * n), "numeric_values")]
            labels = _as_list(feature.get("labels", row), "labels")
            numeric_labels = [float(v) for v in _as_list(feature.get("numeric_labels", values), "numeric_labels")]
            completion = _as_list(feature.get("completion_mask", [1] * n), "completion_mask")
            for name, seq in (("attention_mask", mask), ("numeric_values", values), ("labels", labels),
                              ("numeric_labels", numeric_labels), ("completion_mask", completion)):
                if len(seq) != n:
                    raise ValueError(f"{name} has length {len(seq)} but input_ids has {n}")
            side = self.padding_side
            mask = pad_sequence(mask, length, 0, side)
            # Label i is scored from position i - 1's output: both must be real tokens (with left padding, the
            # first token's label would be scored from a pad).
            scored = [bool(m) and (i == 0 or bool(mask[i - 1])) for i, m in enumerate(mask)]
            labels = pad_sequence(labels, length, IGNORE_INDEX, side)
            completion = pad_sequence(completion, length, 0, side)
            batch["input_ids"].append(pad_sequence(row, length, self.pad_token_id, side))
            batch["attention_mask"].append(mask)
            batch["labels"].append([lab if s and c else IGNORE_INDEX
                                    for lab, s, c in zip(labels, scored, completion, strict=True)])
            for name, seq in (("numeric_values", values), ("numeric_labels", numeric_labels)):
                batch[name].append([v if m else 0.0 for v, m in zip(pad_sequence(seq, length, 0.0, side), mask,
                                                                    strict=True)])
        out = {
            "input_ids": torch.tensor(batch["input_ids"], dtype=torch.long),
            "attention_mask": torch.tensor(batch["attention_mask"], dtype=torch.long),
            "labels": torch.tensor(batch["labels"], dtype=torch.long),
            "numeric_values": torch.tensor(batch["numeric_values"], dtype=torch.float64),
            "numeric_labels": torch.tensor(batch["numeric_labels"], dtype=torch.float64),
        }
        if not has_values:
            del out["numeric_values"]  # the model refuses <NUM> ids without values, rather than reading 0
        return out

    def _check_values_given(self, features: Sequence[dict[str, Any]], ids: list[list]) -> bool:
        """Whether the batch carries `numeric_values`; raise where a feature lacks the values of its numbers."""
        missing = [i for i, f in enumerate(features) if f.get("numeric_values") is None]
        if not missing:
            return True
        if self.num_token_id is not None:
            for i in missing:
                if self.num_token_id in ids[i]:
                    raise ValueError(
                        f"features[{i}] has <NUM> ids (id {self.num_token_id}) but no numeric_values, so every "
                        "number would be read, and trained, as 0: keep the numeric_values the CausalQwenTokenizer "
                        "returns with the ids (a dataset column dropped on the way?)")
            return True
        if len(missing) < len(features):
            given = next(i for i in range(len(features)) if i not in missing)
            raise ValueError(
                f"features[{missing[0]}] has no numeric_values but features[{given}] has: without num_token_id the "
                "collator cannot tell whether its ids hold <NUM> (read as 0); give every feature numeric_values, or "
                "build the collator with num_token_id (CausalQwenDataCollator.from_tokenizer)")
        return False


def _as_list(x, name: str) -> list:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ValueError(f"{name} of one feature must be 1-D, got shape {tuple(x.shape)}")
        return x.tolist()
    if isinstance(x, (list, tuple)):
        return list(x)
    raise TypeError(f"{name} must be a list or a 1-D tensor, got {type(x).__name__}")
