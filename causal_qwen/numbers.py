"""Numbers in text: the grammar that finds them and the formatter that writes them back.

CausalQwen reads every number of a text as one `<NUM>` token whose value travels in a parallel float64 tensor.
This module decides which character runs are numbers ([`find_numbers`]) and how a value is written back as
digits ([`format_number`]). The full grammar, with examples and the reason for every decision, is in
`docs/number_grammar.md`; in short:

- A candidate is a maximal run of digits (ASCII or full-width) joined by `.`, `,`, an exponent (`e5`, `E-7`), a
  leading `-` and the chain separators `-`, `/`, `:`. Runs are found by one regular expression in which every
  character can be matched in only one way, so scanning is linear in the length of the text.
- A run glued to a word on either side (`Qwen2`, `H100`, `3D`, `GPT-4`, `0.5B`) is text, as are versions and
  dotted groups (`1.2.3`), leading-zero codes (`007`), times and ratios (`12:30`), chains of three or more
  groups (`2024-01-15`, `555-123-4567`) and numbers that float64 cannot hold exactly (more significant digits
  than the shortest round-trip representation of their double).
- `3-5` and `1/2` are two numbers around a text separator; `1,234,567.89` is one number (well-formed thousands
  groups) and `1,2,3` a list of three.
- Values are written back by one policy: the shortest decimal that round-trips through float64 (Python's
  `repr`), without a trailing `.0` and with a bare exponent (`1e-5`, `1e16`). Every formatted value is read
  back by the grammar as one number with the identical value.
"""

from __future__ import annotations

import math
import re
import unicodedata
from decimal import Decimal
from typing import NamedTuple

__all__ = ["NumberSpan", "find_numbers", "format_number", "parse_number", "round_to_interval", "scan_numbers",
           "supported_place"]

# Digits that form numbers: ASCII and full-width (U+FF10..U+FF19). Python's `float` and `Decimal` read both.
_DIGIT = "[0-9\uff10-\uff19]"
_ZEROS = "0\uff10"

# One group of a candidate: an optional leading dot, digits with `.`/`,` separators, an optional exponent. The
# exponent also swallows `.`/`,` groups after it (`1e5.5`, `1e2,500`) so that such runs are judged, and
# rejected, as a whole instead of leaving a number behind that a re-written exponent could join.
_GROUP = rf"\.?{_DIGIT}+(?:[.,]{_DIGIT}+)*(?:[eE][+\-]?{_DIGIT}+(?:[.,]{_DIGIT}+)*)?"
# A candidate: an optional minus sign, then groups chained by `-`, `/` or `:`. Each character can be matched in
# exactly one way (a separator is always followed by a digit or `.digit`), so the engine never backtracks.
_CANDIDATE = re.compile(rf"-?{_GROUP}(?:[-/:]{_GROUP})*")
# Where a candidate splits into chained groups: a `-` or `/` right after a digit (a sign or an exponent sign
# follows a non-digit).
_CHAIN_SEPARATOR = re.compile(rf"(?<={_DIGIT})[-/]")
_EXPONENT = re.compile(rf"[+\-]?{_DIGIT}+")
# Well-formed thousands groups: 1 to 3 leading digits without a leading zero, then groups of exactly 3.
_THOUSANDS = re.compile(rf"-?[1-9\uff11-\uff19]{_DIGIT}{{0,2}}(?:,{_DIGIT}{{3}})+(?:\.{_DIGIT}+)?")
# The common case, decided without the exactness test: at most 15 characters of ASCII digits and one dot, no
# leading zero, no exponent. A decimal of at most 15 significant digits in the normal float range is the
# shortest repr of its double, so it is exact.
_SIMPLE = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?")
_SIMPLE_MAX_LENGTH = 15
# Short numbers that `format_number` writes as they are: no leading zero, no trailing fractional zero, no exponent.
_SHORT_CANONICAL = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]*[1-9])?")

# Scripts written without spaces between words (Han, kana, Hangul, Thai, Lao, Myanmar, Khmer, ...): a number
# touching them is not glued to a word (`价格是99.9元`, `3個`, `10월`).
_UNSPACED_SCRIPT = re.compile(
    "[\u0e00-\u0eff\u1000-\u109f\u1100-\u11ff\u1780-\u17ff\u2e80-\u2fdf\u3000-\u9fff\ua960-\ua97f"
    "\uac00-\ud7ff\uf900-\ufaff\uff66-\uffdc\U00016fe0-\U00016fff\U0001b000-\U0001b2ff\U00020000-\U0003ffff]"
)

# Cache of `_is_glue`, one entry per distinct character met next to a candidate.
_GLUE: dict[str, bool] = {}

_MIN_NORMAL = 2.2250738585072014e-308
# Exponents with more significant digits than this are text: `1e1234567` is no float64.
_MAX_EXPONENT_DIGITS = 6
# No float64 needs more than 17 significant digits; longer digit strings are rejected before any conversion.
_MAX_SIGNIFICANT_DIGITS = 17


class NumberSpan(NamedTuple):
    """A number found in a text: `text[start:end]` reads as `value`."""

    start: int
    end: int
    value: float


def find_numbers(text: str) -> list[NumberSpan]:
    """
    Find the numbers of a text, left to right.

    Args:
        text (`str`): Any string.

    Returns:
        `list[NumberSpan]`: The spans that the grammar reads as numbers, in order and not overlapping, each with
        its float64 value. Everything outside the spans is text.
    """
    if not isinstance(text, str):
        raise TypeError(f"`text` must be a str, got {type(text).__name__}")
    return list(map(NumberSpan._make, scan_numbers(text)))


def scan_numbers(text: str) -> list[tuple[int, int, float]]:
    """[`find_numbers`] with plain `(start, end, value)` tuples, faster on number-dense text (the tokenizer's loop)."""
    spans: list[tuple[int, int, float]] = []
    append, simple, glue = spans.append, _SIMPLE.fullmatch, _GLUE
    length = len(text)
    for match in _CANDIDATE.finditer(text):
        start, end = match.span()
        # A run touching a word on either side is part of that word (`Qwen2`, `3D`, `GPT-4`, `0.5B`).
        if start:
            before = text[start - 1]
            is_glue = glue.get(before)
            if is_glue or (is_glue is None and _is_glue(before)):
                continue
        if end < length:
            after = text[end]
            is_glue = glue.get(after)
            if is_glue or (is_glue is None and _is_glue(after)):
                continue
        run = text[start:end]
        if end - start <= _SIMPLE_MAX_LENGTH and simple(run):
            append((start, end, float(run)))
        # `.5` right after `.` or `,` would be written back as `0.5` and join that character (`1..5`, `1,.5e3`).
        elif run[0] != "." or not start or text[start - 1] not in ".,":
            spans.extend(_read_candidate(run, start))
    return spans


def parse_number(text: str) -> float | None:
    """
    Read a whole string as one number.

    Args:
        text (`str`): The string, e.g. `"1,234.5"` or `"1e-5"`.

    Returns:
        `float | None`: The value if the grammar reads all of `text` as exactly one number, else `None`.
    """
    spans = find_numbers(text)
    if len(spans) == 1 and spans[0].start == 0 and spans[0].end == len(text):
        return spans[0].value
    return None


def format_number(value: float) -> str:
    """
    Write a value as digits, by the one formatting policy of CausalQwen.

    The digits are the shortest decimal that reads back as the same float64 (Python's `repr`); the form is
    positional for 1e-4 <= |value| < 1e16 and scientific outside, without a trailing `.0`, an exponent `+` or
    exponent leading zeros: `99.9`, `5`, `-0.25`, `0.0001`, `1e-5`, `1.5e16`, `-0`.

    Args:
        value (`float`): A finite real number (Python or NumPy float or int, 0-d tensor).

    Returns:
        `str`: The canonical digits, which [`find_numbers`] reads back as one number with the identical value.

    Raises:
        `TypeError`: `value` is not a real number (strings and booleans included).
        `ValueError`: `value` is NaN or infinite.
    """
    if isinstance(value, (str, bytes, bool)):
        raise TypeError(f"`value` must be a real number, got {type(value).__name__}")
    try:
        value = float(value)
    except (TypeError, ValueError) as error:
        raise TypeError(f"`value` must be a real number, got {type(value).__name__}") from error
    if not math.isfinite(value):
        raise ValueError(f"`value` must be finite to be written as digits, got {value}")
    mantissa, _, exponent = repr(value).partition("e")
    mantissa = mantissa.removesuffix(".0")
    return f"{mantissa}e{int(exponent)}" if exponent else mantissa


def supported_place(value: float, low: float, high: float) -> int | None:
    """
    The decimal place a value's interval supports: `round(value, place)` keeps the digits down to the second
    significant digit of the interval's half-width (high − low)/2, and at least the value's leading digit. A
    half-width of 2.85 keeps tenths (29.21944 → 29.2), one of 800 keeps tens (6912.3 → 6910).

    Args:
        value, low, high (`float`): A median and the bounds of its interval, `low <= value <= high`.

    Returns:
        `int | None`: The `ndigits` of Python's `round`; None where every digit stands (a width of 0, or a value of
        0) or none does (a bound that is not finite).
    """
    half = (high - low) / 2
    if not (math.isfinite(half) and math.isfinite(value)) or half <= 0 or value == 0:
        return None
    place = 1 - math.floor(math.log10(half))
    return max(place, -math.floor(math.log10(abs(value))))


def round_to_interval(value: float, low: float, high: float) -> float:
    """`value` rounded to the place its interval supports ([`supported_place`]); unchanged where it gives none.
    A value copied exactly has an interval far narrower than its last digit, and keeps every digit; a value outside
    its interval (a sampled one) is rounded to the digits of the interval stretched to hold it."""
    place = supported_place(value, min(low, value), max(high, value))
    return value if place is None else round(value, place)


def _is_glue(char: str) -> bool:
    """Whether `char` belongs to a word that swallows a touching number: a letter, digit, mark or `_`."""
    is_glue = char == "_" or (
        unicodedata.category(char)[0] in "LNM" and _UNSPACED_SCRIPT.match(char) is None
    )
    _GLUE[char] = is_glue
    return is_glue


def _read_candidate(run: str, offset: int) -> list[tuple[int, int, float]]:
    """The numbers of one candidate run that starts at `offset` of the text (none when the run is text)."""
    # Times, ratios and references (`12:30`, `3:2`, `16:9`) are text.
    if ":" in run:
        return []
    groups = _CHAIN_SEPARATOR.split(run, maxsplit=2)
    if len(groups) == 1:
        return _read_group(run, offset)
    # Three groups or more are dates, phone numbers and serials (`2024-01-15`, `555-123-4567`, `1/2/3`): text.
    if len(groups) > 2:
        return []
    # Two groups are a range or a fraction (`3-5`, `1/2`): two numbers around a text separator.
    first, second = groups
    return _read_group(first, offset) + _read_group(second, offset + len(first) + 1)


def _read_group(group: str, offset: int, check_rewrite: bool = True) -> list[tuple[int, int, float]]:
    """The numbers of one group of a chain: a single number, a thousands number or a comma list."""
    mantissa, exponent = _split_exponent(group)
    if exponent is not None and not _EXPONENT.fullmatch(exponent):
        return []  # `1e5.5`, `1e2,500`, `3,1e2,500`
    if "," not in mantissa:
        value = _read_number(group, mantissa, exponent)
        return [] if value is None else [(offset, offset + len(group), value)]
    if exponent is None and _THOUSANDS.fullmatch(mantissa):
        plain = mantissa.replace(",", "")
        value = _read_number(plain, plain, None)
        return [] if value is None else [(offset, offset + len(group), value)]
    return _read_list(group, mantissa, exponent, offset, check_rewrite)


def _read_list(
    group: str, mantissa: str, exponent: str | None, offset: int, check_rewrite: bool
) -> list[tuple[int, int, float]]:
    """A comma list written without spaces (`1,2,3`, `-0.5,7`): each item is a number or stays text."""
    spans, rewritten = [], []
    canonical = True
    items = mantissa.split(",")
    start = offset
    for index, item_mantissa in enumerate(items):
        # The exponent, if any, belongs to the last item (`2,1e5` is 2 and 1e5).
        is_last = index == len(items) - 1
        item = group[start - offset :] if is_last else item_mantissa
        value = _read_number(item, item_mantissa, exponent if is_last else None)
        if value is None:
            rewritten.append(item)
        else:
            spans.append((start, start + len(item), value))
            if canonical and not _is_canonical(item, value):
                canonical = False
            rewritten.append(item if canonical else format_number(value))
        start += len(item) + 1
    if check_rewrite and spans and not canonical:
        # Decoding writes each value in canonical form; the list must read back as the same values. It would
        # not if the rewrite formed thousands groups (`1,100.0,200` -> `1,100,200`) or put an exponent before a
        # comma (`0.00001,2` -> `1e-5,2`). Such a list stays text, so decoding gives it back verbatim.
        reread = _read_group(",".join(rewritten), 0, check_rewrite=False)
        if [format_number(span[2]) for span in reread] != [format_number(span[2]) for span in spans]:
            return []
    return spans


def _read_number(text: str, mantissa: str, exponent: str | None) -> float | None:
    """
    The value of one comma-free number, or None when the grammar keeps it as text.

    `text` is the number as written (`-1.5e3`), `mantissa` its part before the exponent marker (`-1.5`) and
    `exponent` the part after it (`3`, already checked to be digits with an optional sign), None without one.
    """
    if exponent is None and len(text) <= _SIMPLE_MAX_LENGTH and _SIMPLE.fullmatch(text):
        return float(text)
    integer, _, fraction = (mantissa[1:] if mantissa[:1] == "-" else mantissa).partition(".")
    # Versions and dotted groups (`1.2.3`, `192.168.0.1`) and leading-zero codes (`007`, `01`, `00.5`) are text.
    if "." in fraction or not (integer or fraction):
        return None
    if len(integer) > 1 and integer[0] in _ZEROS:
        return None
    significant = (integer + fraction).strip(_ZEROS)
    if len(significant) > _MAX_SIGNIFICANT_DIGITS:
        return None
    if exponent is not None and len(exponent.lstrip("+-").lstrip(_ZEROS)) > _MAX_EXPONENT_DIGITS:
        return None
    value = float(text)
    # Up to 15 significant digits a decimal in the normal range is exactly the shortest repr of its double.
    if len(significant) <= 15 and (not significant or _MIN_NORMAL <= abs(value) < math.inf):
        return value
    # Otherwise the written decimal must equal that shortest repr: `9007199254740993`, `1e400`, `1e-320` are
    # text because float64 does not hold them.
    if not math.isfinite(value) or Decimal(text) != Decimal(repr(value)):
        return None
    return value


def _is_canonical(text: str, value: float) -> bool:
    """Whether `text` is exactly what `format_number(value)` writes (cheap for the common short forms)."""
    if len(text) <= _SIMPLE_MAX_LENGTH and _SHORT_CANONICAL.fullmatch(text):
        return value == 0.0 or abs(value) >= 1e-4
    return format_number(value) == text


def _split_exponent(text: str) -> tuple[str, str | None]:
    """Split `1.5e-3` into `("1.5", "-3")`; `(text, None)` without an exponent."""
    index = text.find("e")
    if index < 0:
        index = text.find("E")
        if index < 0:
            return text, None
    return text[:index], text[index + 1 :]
