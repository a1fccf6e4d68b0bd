"""The data collator pads every field consistently on either side, and padding never enters the loss."""

import pytest
import torch

from causal_qwen import CausalQwenForCausalLM
from causal_qwen.data.collator import CausalQwenDataCollator

NUM = 120

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
    # The first real token's label is scored from a padded position's output: it gets −100 too.
    assert batch["labels"][0].tolist() == [-100, -100, -100, -100, 6, 7]
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


def test_num_ids_without_numeric_values_are_refused(tiny_qwen):
    collator = CausalQwenDataCollator(pad_token_id=0, num_token_id=NUM)
    with pytest.raises(ValueError, match=r"features\[1\] has <NUM> ids \(id 120\) but no numeric_values"):
        collator([{"input_ids": [5, NUM], "numeric_values": [0, 2.5]}, {"input_ids": [3, NUM, 4]}])
    batch = collator([{"input_ids": [5, NUM], "numeric_values": [0, 2.5]}, {"input_ids": [3, 4, 4]}])
    assert batch["numeric_values"].tolist() == [[0, 2.5, 0], [0, 0, 0]]
    # Without the <NUM> id the collator cannot look: the batch then has no numeric_values, and the model refuses
    # <NUM> ids without them (rather than reading 0); a batch where only some features have values is refused.
    plain = CausalQwenDataCollator(pad_token_id=0)
    batch = plain([{"input_ids": [3, NUM, 4]}])
    assert "numeric_values" not in batch and batch["numeric_labels"].tolist() == [[0, 0, 0]]
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM)
    with pytest.raises(ValueError, match="no numeric_values were given"):
        model(**batch)
    with pytest.raises(ValueError, match=r"features\[1\] has no numeric_values but features\[0\] has"):
        plain([{"input_ids": [5, NUM], "numeric_values": [0, 2.5]}, {"input_ids": [3, 4]}])
    with pytest.raises(ValueError, match="num_token_id"):
        CausalQwenDataCollator(pad_token_id=0, num_token_id=-1)


@pytest.mark.slow
def test_from_tokenizer_takes_the_num_id(qwen25_dir):
    from transformers import AutoTokenizer

    from causal_qwen import CausalQwenTokenizer

    assert CausalQwenDataCollator.from_tokenizer(CausalQwenTokenizer.from_pretrained(qwen25_dir)).num_token_id == (
        CausalQwenTokenizer.from_pretrained(qwen25_dir).num_token_id)
    assert CausalQwenDataCollator.from_tokenizer(AutoTokenizer.from_pretrained(qwen25_dir)).num_token_id is None


def _loss(model, features, side="right"):
    with torch.no_grad():
        return model(**CausalQwenDataCollator(0, padding_side=side, num_token_id=NUM)(features)).loss.item()


def test_padding_never_enters_the_loss(tiny_qwen):
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, ovr_threshold=1.0,
                                            abduction_scale_init=0.1).eval()
    a = {"input_ids": [5, NUM, 7, 8, NUM, 9], "numeric_values": [0, 2.5, 0, 0, 7.0, 0]}
    b = {"input_ids": [3, NUM, 4], "numeric_values": [0, 4.0, 0]}
    # b with masked positions holding a <NUM> and a value, at its end and in its middle.
    b_end = {"input_ids": [3, NUM, 4, NUM], "numeric_values": [0, 4.0, 0, 1e6], "attention_mask": [1, 1, 1, 0]}
    b_mid = {"input_ids": [3, NUM, NUM, 4, 5], "numeric_values": [0, 4.0, 1e6, 0, 0], "attention_mask": [1, 1, 0, 1, 1]}
    b_mid_other = {**b_mid, "input_ids": [3, NUM, 9, 4, 5], "numeric_values": [0, 4.0, 0, 0, 0]}
    batch = CausalQwenDataCollator(0, num_token_id=NUM)([b_end, b_mid])
    assert batch["numeric_values"].tolist() == [[0, 4, 0, 0, 0], [0, 4, 0, 0, 0]]
    assert batch["numeric_labels"].tolist() == [[0, 4, 0, 0, 0], [0, 4, 0, 0, 0]]
    assert batch["labels"].tolist() == [[3, NUM, 4, -100, -100], [3, NUM, -100, -100, 5]]
    reference = _loss(model, [a, b])
    for side in ("right", "left"):
        # Left padding puts pads before a's and b's first tokens; what a padded position holds changes nothing.
        assert _loss(model, [a, b], side) == pytest.approx(reference, rel=1e-5), side
        assert _loss(model, [a, b_end], side) == pytest.approx(reference, rel=1e-5), side
        assert _loss(model, [a, b_mid], side) == pytest.approx(_loss(model, [a, b_mid_other], side), rel=1e-6), side
