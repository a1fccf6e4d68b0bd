"""The data collator pads every field consistently on either side."""

import pytest
import torch

from causal_qwen.data.collator import CausalQwenDataCollator

FEATURES = [
    {"input_ids": [5, 6, 7], "numeric_values": [0.0, 2.5, 0.0]},
    {"input_ids": [8], "numeric_values": [0.0], "labels": [-100]},
    {"input_ids": torch.tensor([1, 2, 3, 4]), "attention_mask": [1, 1, 1, 1], "numeric_values": [0, 0, 0, 9.75],
     "numeric_labels": [0, 0, 0, 1.5]},
]


def test_right_padding():
    batch = CausalQwenDataCollator(pad_token_id=0)(FEATURES)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0], [1, 2, 3, 4]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[5, 6, 7, -100], [-100, -100, -100, -100], [1, 2, 3, 4]]
    assert batch["numeric_values"].dtype == torch.float64
    assert batch["numeric_values"].tolist() == [[0, 2.5, 0, 0], [0, 0, 0, 0], [0, 0, 0, 9.75]]
    assert batch["numeric_labels"].tolist() == [[0, 2.5, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1.5]]


def test_left_padding_and_multiple():
    batch = CausalQwenDataCollator(pad_token_id=0, padding_side="left", pad_to_multiple_of=3)(FEATURES)
    assert batch["input_ids"].tolist() == [[0, 0, 0, 5, 6, 7], [0, 0, 0, 0, 0, 8], [0, 0, 1, 2, 3, 4]]
    assert batch["labels"][0].tolist() == [-100, -100, -100, 5, 6, 7]
    assert batch["numeric_values"][0].tolist() == [0, 0, 0, 0, 2.5, 0]


def test_bad_features():
    collator = CausalQwenDataCollator(pad_token_id=0)
    with pytest.raises(ValueError, match="numeric_values"):
        collator([{"input_ids": [1, 2], "numeric_values": [0.0]}])
    with pytest.raises(TypeError, match="input_ids"):
        collator([{"input_ids": "12"}])
    with pytest.raises(ValueError, match="padding_side"):
        CausalQwenDataCollator(pad_token_id=0, padding_side="middle")
    with pytest.raises(ValueError, match="features"):
        collator([])
