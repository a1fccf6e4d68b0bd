"""The list arithmetic of `<NUM>` ids and values, on hand-built examples with a character-level stand-in for BPE."""

import ast
import math
from pathlib import Path

import pytest

import causal_qwen.number_splicing as splicing
from causal_qwen.number_splicing import (
    decode_numbers,
    encode_numbers,
    pad_sequence,
    pad_values,
    padded_length,
    splice_numbers,
    splice_values,
    split_num_tokens,
    split_numbers,
    truncate,
    truncate_and_wrap,
)

NUM = 1000  # the id of <NUM> in these examples: above every character code used here
LITERAL = [60, 78, 85, 77, 62]  # the ids of the string "<NUM>" read as text: its five characters


def char_ids(texts):
    """One id per character: a BPE model whose ids are easy to write by hand."""
    return [[ord(char) for char in text] for text in texts]


def char_texts(runs):
    return ["".join(map(chr, run)) for run in runs]


def ids_of(text):
    return [ord(char) for char in text]


def encode(texts, encode_segments=char_ids):
    return encode_numbers(texts, encode_segments, "<NUM>", NUM, LITERAL)


def decode(token_ids, numeric_values=None):
    return decode_numbers(token_ids, numeric_values, char_texts, "<NUM>", NUM)


def test_the_module_needs_no_tokenizer_library():
    tree = ast.parse(Path(splicing.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert imported <= {"__future__", "collections", "typing"}


# ------------------------------------------------------------------------------------------------------------------
# Encoding
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "pieces", "values"),
    [
        ("价格是99.9元", ["价格是", "元"], [99.9]),
        ("pages 3-5", ["pages ", "-", ""], [3.0, 5.0]),
        ("-5 and 1,234,567.89", ["", " and ", ""], [-5.0, 1234567.89]),
        ("Qwen2 on 2024-01-15", ["Qwen2 on 2024-01-15"], []),
        ("", [""], []),
    ],
)
def test_split_numbers(text, pieces, values):
    assert split_numbers(text) == (pieces, values)


def test_splice_numbers_aligns_each_value_with_its_num():
    ids, values = splice_numbers([[1, 2], [], [3]], [7.5, -1.0], NUM)
    assert ids == [1, 2, NUM, NUM, 3]
    assert values == [0.0, 0.0, 7.5, -1.0, 0.0]
    assert splice_numbers([[4, 5]], [], NUM) == ([4, 5], [0.0, 0.0])
    with pytest.raises(ValueError, match="2 numbers need 3 text pieces"):
        splice_numbers([[1], [2]], [1.0, 2.0], NUM)


def test_encode_numbers_by_hand():
    ids, values = encode(["a 1 b", "x 0.5"])
    assert ids == [[97, 32, NUM, 32, 98], [120, 32, NUM]]
    assert values == [[0.0, 0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.5]]


def test_encode_numbers_encodes_each_distinct_segment_once_in_one_call():
    calls = []

    def recording(segments):
        calls.append(list(segments))
        return char_ids(segments)

    encode(["a 1 a 2", "a 3", "4"], recording)
    assert len(calls) == 1
    assert sorted(calls[0]) == [" a ", "a "]  # no repeats, no empty segment


def test_literal_num_string_is_encoded_as_text():
    ids, values = encode(["x<NUM>y 3", "<NUM>"])
    assert ids[0] == [120, *LITERAL, 121, 32, NUM]
    assert values[0] == [0.0] * 8 + [3.0]
    assert ids[1] == LITERAL and values[1] == [0.0] * 5


# ------------------------------------------------------------------------------------------------------------------
# Decoding
# ------------------------------------------------------------------------------------------------------------------


def test_split_num_tokens():
    assert split_num_tokens([5, NUM, 6, 7, NUM], NUM) == ([[5], [6, 7], []], [1, 4])
    assert split_num_tokens([5, 6], NUM) == ([[5, 6]], [])
    assert split_num_tokens([], NUM) == ([[]], [])


def test_splice_values_writes_the_canonical_digits():
    assert splice_values(["x ", " y"], [1e-5], [2]) == "x 1e-5 y"
    assert splice_values(["", "-", ""], [3.0, 5.0], [0, 2]) == "3-5"
    assert splice_values(["only text"], [], []) == "only text"
    with pytest.raises(TypeError, match="in row 2 at position 4 must be a number"):
        splice_values(["a", "b"], ["7"], [4], row=2)
    with pytest.raises(ValueError, match="at position 1 is nan"):
        splice_values(["a", "b"], [math.nan], [1])


def test_decode_numbers_one_sequence_and_a_batch():
    ids = ids_of("x ") + [NUM] + ids_of("!")
    assert decode(ids, [0.0, 0.0, 2.5, 0.0]) == "x 2.5!"
    assert decode([ids, ids_of("no")], [[0.0, 0.0, -4.0, 0.0], [9.0, 9.0]]) == ["x -4!", "no"]
    assert decode(NUM, 3.0) == "3"
    assert decode(ids_of("plain")) == "plain"
    assert decode([]) == ""


def test_decode_numbers_errors_name_the_argument_and_the_place():
    ids = ids_of("ab") + [NUM]
    with pytest.raises(ValueError, match="contain <NUM> at position 2 but no `numeric_values`"):
        decode(ids)
    with pytest.raises(ValueError, match="`numeric_values` has 2 entries but `token_ids` has 3"):
        decode(ids, [0.0, 1.0])
    with pytest.raises(ValueError, match="`numeric_values` in row 1 has 1 entries"):
        decode([ids, ids], [[0.0, 0.0, 1.0], [0.0]])
    with pytest.raises(ValueError, match="1 rows but `token_ids` has 2"):
        decode([ids, ids], [[0.0, 0.0, 1.0]])
    with pytest.raises(TypeError, match="shaped like `token_ids`"):
        decode(ids, "001")
    with pytest.raises(TypeError, match="one row of values per sequence"):
        decode([ids, ids], [1.0, 2.0])


@pytest.mark.parametrize(
    ("text", "decoded"),
    [
        ("pages 3-5, 1/2 and 99.9%", "pages 3-5, 1/2 and 99.9%"),
        ("total 1,234,567.89 USD", "total 1234567.89 USD"),  # one canonical form per value
        ("rate 1E-05 and 2.50", "rate 1e-5 and 2.5"),
        ("write <NUM> then 7", "write <NUM> then 7"),
    ],
)
def test_encode_then_decode(text, decoded):
    [ids], [values] = encode([text])
    assert decode(ids, values) == decoded


# ------------------------------------------------------------------------------------------------------------------
# Truncation and padding
# ------------------------------------------------------------------------------------------------------------------


def test_truncate():
    assert truncate([1, 2, 3, 4], 2) == [1, 2]
    assert truncate([1, 2, 3, 4], 2, "left") == [3, 4]
    assert truncate([1, 2, 3, 4], 0, "left") == []
    assert truncate((1, 2), 5) == [1, 2]
    with pytest.raises(ValueError, match="side"):
        truncate([1], 0, "middle")


def test_truncate_and_wrap_keeps_the_special_tokens():
    ids, values, bos, eos = [1, NUM, 3], [0.0, 5.0, 0.0], [100], [101]
    assert truncate_and_wrap(ids, values, bos, eos) == ([100, 1, NUM, 3, 101], [0.0, 0.0, 5.0, 0.0, 0.0])
    assert truncate_and_wrap(ids, values, bos, eos, 4) == ([100, 1, NUM, 101], [0.0, 0.0, 5.0, 0.0])
    assert truncate_and_wrap(ids, values, bos, eos, 4, "left") == ([100, NUM, 3, 101], [0.0, 5.0, 0.0, 0.0])
    assert truncate_and_wrap(ids, values, bos, eos, 1) == ([100, 101], [0.0, 0.0])
    assert truncate_and_wrap(ids, values, [], [], 2) == ([1, NUM], [0.0, 5.0])


@pytest.mark.parametrize(("longest", "multiple", "length"), [(5, None, 5), (5, 8, 8), (8, 8, 8), (9, 4, 12), (0, 4, 0)])
def test_padded_length(longest, multiple, length):
    assert padded_length(longest, multiple) == length


def test_pad_sequence():
    assert pad_sequence([1, 2], 4, 0) == [1, 2, 0, 0]
    assert pad_sequence([1, 2], 4, -100, "left") == [-100, -100, 1, 2]
    assert pad_sequence((1.5,), 1, 0.0) == [1.5]
    with pytest.raises(ValueError, match="side"):
        pad_sequence([1], 2, 0, "up")


def test_pad_values_checks_the_alignment():
    assert pad_values([0.0, 2.5], [7, NUM], 4, "left") == [0.0, 0.0, 0.0, 2.5]
    with pytest.raises(ValueError, match="`numeric_values` has 1 entries but `input_ids` has 2"):
        pad_values([2.5], [7, NUM], 4)
