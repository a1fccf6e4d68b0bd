"""Numbers spliced into token sequences and back, on plain lists and strings.

CausalQwen reads each number of a text as one `<NUM>` token whose value travels in a parallel list, 0.0 at every
other position. This module is that list arithmetic, apart from any tokenizer:

- encoding splits a text at its numbers ([`split_numbers`]) and puts one `<NUM>` id per number between the ids
  of the text pieces ([`splice_numbers`]); [`encode_numbers`] does both for a batch;
- decoding cuts ids at the `<NUM>` tokens ([`split_num_tokens`]) and writes each value back between the decoded
  runs ([`splice_values`]); [`decode_numbers`] does both for one sequence or a batch;
- [`truncate`], [`truncate_and_wrap`], [`pad_sequence`], [`pad_values`] and [`padded_length`] keep ids, values
  and masks aligned when sequences are cut, framed by special tokens and padded.

A tokenizer brings only its BPE model, as a function from texts to ids and one from runs of ids to texts. Which
character runs are numbers and how values are written is [`causal_qwen.numbers`]'s decision.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .numbers import format_number, scan_numbers

__all__ = [
    "decode_numbers",
    "encode_numbers",
    "pad_sequence",
    "pad_values",
    "padded_length",
    "splice_numbers",
    "splice_values",
    "split_num_tokens",
    "split_numbers",
    "truncate",
    "truncate_and_wrap",
]

T = TypeVar("T")

SIDES = ("right", "left")


# ----------------------------------------------------------------------------------------------------------------
# Encoding
# ----------------------------------------------------------------------------------------------------------------


def split_numbers(text: str) -> tuple[list[str], list[float]]:
    """
    Split a text at its numbers.

    Args:
        text (`str`): Any string.

    Returns:
        `tuple[list[str], list[float]]`: The text pieces and the values of the numbers between them: the text is
        `pieces[0]`, the number `values[0]`, `pieces[1]`, ..., `pieces[-1]`, so there is one piece more than values
        (pieces may be empty).
    """
    pieces, values, position = [], [], 0
    for start, end, value in scan_numbers(text):
        pieces.append(text[position:start])
        values.append(value)
        position = end
    pieces.append(text[position:])
    return pieces, values


def splice_numbers(
    piece_ids: Sequence[Sequence[int]], values: Sequence[float], num_token_id: int
) -> tuple[list[int], list[float]]:
    """
    Put one `<NUM>` id between the ids of two text pieces, and align the values with the ids.

    Args:
        piece_ids (`Sequence[Sequence[int]]`): The ids of each text piece, one more than `values`.
        values (`Sequence[float]`): The value of each number, in order.
        num_token_id (`int`): The id of `<NUM>`.

    Returns:
        `tuple[list[int], list[float]]`: The ids, and a list as long holding each value at its `<NUM>` and 0.0
        everywhere else.
    """
    if len(piece_ids) != len(values) + 1:
        raise ValueError(f"{len(values)} numbers need {len(values) + 1} text pieces around them, got {len(piece_ids)}")
    ids = list(piece_ids[0])
    aligned = [0.0] * len(ids)
    for value, following in zip(values, piece_ids[1:], strict=True):
        ids.append(num_token_id)
        aligned.append(value)
        ids += following
        aligned += [0.0] * len(following)
    return ids, aligned


def encode_numbers(
    texts: Sequence[str],
    encode_segments: Callable[[list[str]], Sequence[Sequence[int]]],
    num_token: str,
    num_token_id: int,
    literal_num_ids: Sequence[int],
) -> tuple[list[list[int]], list[list[float]]]:
    """
    Ids and aligned values of a batch of texts: each number becomes `<NUM>`, the text between numbers is encoded.

    Args:
        texts (`Sequence[str]`): The texts.
        encode_segments (`Callable[[list[str]], Sequence[Sequence[int]]]`):
            The ids of each of a list of non-empty text segments, each encoded on its own. It is called once for
            the whole batch, with every distinct segment once.
        num_token (`str`): The string of `<NUM>`.
        num_token_id (`int`): The id of `<NUM>`.
        literal_num_ids (`Sequence[int]`): The ids of the string `num_token` read as ordinary text.

    Returns:
        `tuple[list[list[int]], list[list[float]]]`: The ids of each text and its values (see [`splice_numbers`]).
    """
    splits = [split_numbers(text) for text in texts]
    # The string "<NUM>" written in a text is text, not a number without a value: the text on its two sides is
    # encoded apart, around the ordinary BPE pieces of "<NUM>", so no id of the special token comes from text.
    parts = [[piece.split(num_token) for piece in pieces] for pieces, _ in splits]
    segments = list(dict.fromkeys(part for row in parts for piece in row for part in piece if part))
    segment_ids = dict(zip(segments, encode_segments(segments), strict=True))
    segment_ids[""] = []
    input_ids, numeric_values = [], []
    for row, (_, values) in zip(parts, splits, strict=True):
        piece_ids = [_join([segment_ids[part] for part in piece], literal_num_ids) for piece in row]
        ids, aligned = splice_numbers(piece_ids, values, num_token_id)
        input_ids.append(ids)
        numeric_values.append(aligned)
    return input_ids, numeric_values


def _join(runs: list[Sequence[int]], separator: Sequence[int]) -> Sequence[int]:
    """The runs one after the other with `separator` between two of them."""
    if len(runs) == 1:
        return runs[0]
    joined = list(runs[0])
    for run in runs[1:]:
        joined += separator
        joined += run
    return joined


# ----------------------------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------------------------


def split_num_tokens(token_ids: Sequence[int], num_token_id: int) -> tuple[list[list[int]], list[int]]:
    """
    Cut a sequence of ids at its `<NUM>` tokens, the inverse of [`splice_numbers`].

    Args:
        token_ids (`Sequence[int]`): The ids.
        num_token_id (`int`): The id of `<NUM>`.

    Returns:
        `tuple[list[list[int]], list[int]]`: The runs of ids between the `<NUM>` tokens (one more than there are
        `<NUM>` tokens, runs may be empty) and the positions of the `<NUM>` tokens.
    """
    runs, positions, start = [], [], 0
    for position, token_id in enumerate(token_ids):
        if token_id == num_token_id:
            runs.append(list(token_ids[start:position]))
            positions.append(position)
            start = position + 1
    runs.append(list(token_ids[start:]))
    return runs, positions


def splice_values(
    texts: Sequence[str], values: Sequence[Any], positions: Sequence[int], row: int | None = None
) -> str:
    """
    Write each value with [`causal_qwen.numbers.format_number`] between two decoded runs, the inverse of
    [`split_numbers`].

    Args:
        texts (`Sequence[str]`): The decoded runs, one more than `values`.
        values (`Sequence[Any]`): The value of each number.
        positions (`Sequence[int]`): The position of each number in its sequence of ids, named by the errors.
        row (`int`, *optional*): The row of that sequence in a batch, named by the errors.

    Returns:
        `str`: The text.

    Raises:
        `TypeError`: A value is not a real number.
        `ValueError`: A value is NaN or infinite.
    """
    where = _where(row)
    pieces = [texts[0]]
    for value, position, text in zip(values, positions, texts[1:], strict=True):
        try:
            pieces.append(format_number(value))
        except TypeError as error:
            raise TypeError(
                f"`numeric_values`{where} at position {position} must be a number, got {type(value).__name__}"
            ) from error
        except ValueError as error:
            raise ValueError(
                f"`numeric_values`{where} at position {position} is {value}, which cannot be written as digits"
            ) from error
        pieces.append(text)
    return "".join(pieces)


def decode_numbers(
    token_ids: int | Sequence[int] | Sequence[Sequence[int]],
    numeric_values: float | Sequence[Any] | Sequence[Sequence[Any]] | None,
    decode_runs: Callable[[list[list[int]]], Sequence[str]],
    num_token: str,
    num_token_id: int,
) -> str | list[str]:
    """
    Decode one sequence or a batch of ids, writing the value of each `<NUM>` as digits.

    Args:
        token_ids (`int`, `Sequence[int]` or `Sequence[Sequence[int]]`): One id, one sequence or a batch, as Python
            objects.
        numeric_values (shaped like `token_ids`, *optional*): The value of each position; only the positions of
            `<NUM>` are read. Required when the ids contain `<NUM>`.
        decode_runs (`Callable[[list[list[int]]], Sequence[str]]`): The text of each of a list of runs of ids
            (none of them `<NUM>`), called once per sequence.
        num_token (`str`): The string of `<NUM>`, named by the errors.
        num_token_id (`int`): The id of `<NUM>`.

    Returns:
        `str` for one sequence, `list[str]` for a batch.

    Raises:
        `ValueError`: A `<NUM>` without `numeric_values`, `numeric_values` of another length than the ids, or a NaN
        or infinite value at a `<NUM>`.
        `TypeError`: `numeric_values` or a value at a `<NUM>` is not numeric.
    """
    if isinstance(token_ids, int):
        token_ids = [token_ids]
        if isinstance(numeric_values, (int, float)):
            numeric_values = [numeric_values]
    if numeric_values is not None and not isinstance(numeric_values, (list, tuple)):
        raise TypeError(
            "`numeric_values` must be a sequence of numbers (list, array or tensor) shaped like `token_ids`, "
            f"got {type(numeric_values).__name__}"
        )
    if not (token_ids and isinstance(token_ids[0], (list, tuple))):
        return _decode_sequence(token_ids, numeric_values, decode_runs, num_token, num_token_id)
    if numeric_values is not None:
        if len(numeric_values) != len(token_ids):
            raise ValueError(f"`numeric_values` has {len(numeric_values)} rows but `token_ids` has {len(token_ids)}")
        if not all(isinstance(values, (list, tuple)) for values in numeric_values):
            raise TypeError("`numeric_values` must have one row of values per sequence of `token_ids`")
    return [
        _decode_sequence(
            ids, None if numeric_values is None else numeric_values[row], decode_runs, num_token, num_token_id, row
        )
        for row, ids in enumerate(token_ids)
    ]


def _decode_sequence(
    token_ids: Sequence[int],
    numeric_values: Sequence[Any] | None,
    decode_runs: Callable[[list[list[int]]], Sequence[str]],
    num_token: str,
    num_token_id: int,
    row: int | None = None,
) -> str:
    """One sequence of [`decode_numbers`]: runs of ordinary ids decoded together, each `<NUM>` as its value."""
    if numeric_values is not None and len(numeric_values) != len(token_ids):
        raise ValueError(
            f"`numeric_values`{_where(row)} has {len(numeric_values)} entries but `token_ids` has {len(token_ids)}"
        )
    runs, positions = split_num_tokens(token_ids, num_token_id)
    if numeric_values is None:
        if positions:
            raise ValueError(
                f"`token_ids`{_where(row)} contain {num_token} at position {positions[0]} but no `numeric_values` "
                "were given: pass the values returned with the ids to write the numbers"
            )
        numeric_values = []
    values = [numeric_values[position] for position in positions]
    return splice_values(decode_runs(runs), values, positions, row)


def _where(row: int | None) -> str:
    return "" if row is None else f" in row {row}"


# ----------------------------------------------------------------------------------------------------------------
# Truncation and padding
# ----------------------------------------------------------------------------------------------------------------


def truncate(sequence: Sequence[T], length: int, side: str = "right") -> list[T]:
    """
    Keep at most `length` items of a sequence.

    Args:
        sequence (`Sequence`): Ids, values or a mask.
        length (`int`): How many items to keep at most.
        side (`str`, *optional*, defaults to `"right"`): The end that is cut, `"right"` or `"left"`.

    Returns:
        `list`: The first `length` items (`side="right"`) or the last ones (`side="left"`).
    """
    _check_side(side)
    if len(sequence) <= length:
        return list(sequence)
    return list(sequence[:length]) if side == "right" else list(sequence[len(sequence) - length :])


def truncate_and_wrap(
    ids: Sequence[int],
    values: Sequence[float],
    prefix: Sequence[int],
    suffix: Sequence[int],
    max_length: int | None = None,
    side: str = "right",
) -> tuple[list[int], list[float]]:
    """
    Put special tokens around a sequence of ids and values, after cutting it to fit `max_length` with them.

    A number is one `<NUM>` token, so a cut never splits one; the special tokens are always kept.

    Args:
        ids (`Sequence[int]`): The ids of a text.
        values (`Sequence[float]`): The values aligned with them.
        prefix (`Sequence[int]`): The special ids that go before the text.
        suffix (`Sequence[int]`): The special ids that go after the text.
        max_length (`int`, *optional*): The most ids of the result; no truncation when `None`.
        side (`str`, *optional*, defaults to `"right"`): The end of the text that is cut, `"right"` or `"left"`.

    Returns:
        `tuple[list[int], list[float]]`: The ids and the values, 0.0 at the special tokens.
    """
    if max_length is not None:
        budget = max(max_length - len(prefix) - len(suffix), 0)
        ids, values = truncate(ids, budget, side), truncate(values, budget, side)
    return [*prefix, *ids, *suffix], [0.0] * len(prefix) + list(values) + [0.0] * len(suffix)


def padded_length(longest: int, multiple: int | None = None) -> int:
    """
    The length a batch is padded to.

    Args:
        longest (`int`): The length of its longest sequence.
        multiple (`int`, *optional*): Round up to a multiple of this.

    Returns:
        `int`: `longest`, rounded up to a multiple of `multiple` when given.
    """
    return -(-longest // multiple) * multiple if multiple else longest


def pad_sequence(sequence: Sequence[T], length: int, value: T, side: str = "right") -> list[T]:
    """
    Pad a sequence to a length.

    Args:
        sequence (`Sequence`): Ids, values, labels or a mask.
        length (`int`): The length to reach; a sequence already that long is returned as it is.
        value: What padded positions hold (the pad id, 0.0, 0 or the ignored label).
        side (`str`, *optional*, defaults to `"right"`): Where the padding goes, `"right"` or `"left"`.

    Returns:
        `list`: The padded sequence.
    """
    _check_side(side)
    padding = [value] * (length - len(sequence))
    return list(sequence) + padding if side == "right" else padding + list(sequence)


def pad_values(values: Sequence[float], ids: Sequence[int], length: int, side: str = "right") -> list[float]:
    """
    Pad the values of one sequence of ids with 0.0, after checking that they are aligned with the ids.

    Args:
        values (`Sequence[float]`): The values, one per id.
        ids (`Sequence[int]`): The ids before padding.
        length (`int`): The length of the padded ids.
        side (`str`, *optional*, defaults to `"right"`): Where the padding goes, `"right"` or `"left"`.

    Returns:
        `list[float]`: The values, as long as the padded ids.

    Raises:
        `ValueError`: `values` and `ids` differ in length.
    """
    if len(values) != len(ids):
        raise ValueError(f"`numeric_values` has {len(values)} entries but `input_ids` has {len(ids)}")
    return pad_sequence(values, length, 0.0, side)


def _check_side(side: str) -> None:
    if side not in SIDES:
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")
