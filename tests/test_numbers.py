"""The number grammar and the value formatter, on their own (no tokenizer)."""

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from causal_qwen.numbers import NumberSpan, find_numbers, format_number, parse_number, round_to_interval

# (text, [(written number, value), ...]) -- every example of docs/number_grammar.md.
GRAMMAR_EXAMPLES = [
    # Numbers.
    ("99.9", [("99.9", 99.9)]),
    ("-5", [("-5", -5.0)]),
    ("+3", [("3", 3.0)]),
    ("0.5", [("0.5", 0.5)]),
    (".5", [(".5", 0.5)]),
    ("1,234,567.89", [("1,234,567.89", 1234567.89)]),
    ("1e-5", [("1e-5", 1e-5)]),
    ("6.02E23", [("6.02E23", 6.02e23)]),
    ("９９.９", [("９９.９", 99.9)]),
    ("价格是99.9元", [("99.9", 99.9)]),
    ("50%", [("50", 50.0)]),
    ("$50", [("50", 50.0)]),
    ("1.50", [("1.50", 1.5)]),
    ("-0", [("-0", -0.0)]),
    ("0.30000000000000004", [("0.30000000000000004", 0.30000000000000004)]),
    ("9007199254740992", [("9007199254740992", 9007199254740992.0)]),
    ("5e-324", [("5e-324", 5e-324)]),
    ("第3章", [("3", 3.0)]),
    ("3個", [("3", 3.0)]),
    ("10월", [("10", 10.0)]),
    ("y=-5;", [("-5", -5.0)]),
    ("(-2.5)", [("-2.5", -2.5)]),
    ("[1, 2.5, -3]", [("1", 1.0), ("2.5", 2.5), ("-3", -3.0)]),
    # Ranges, fractions and lists: numbers around text separators.
    ("3-5", [("3", 3.0), ("5", 5.0)]),
    ("10-20%", [("10", 10.0), ("20", 20.0)]),
    ("1/2", [("1", 1.0), ("2", 2.0)]),
    ("-3-5", [("-3", -3.0), ("5", 5.0)]),
    ("3--5", [("3", 3.0), ("-5", -5.0)]),
    ("5,-3", [("5", 5.0), ("-3", -3.0)]),
    ("1,2,3", [("1", 1.0), ("2", 2.0), ("3", 3.0)]),
    ("1,2.50,3", [("1", 1.0), ("2.50", 2.5), ("3", 3.0)]),
    ("2,1e5", [("2", 2.0), ("1e5", 1e5)]),
    ("+1 555-123-4567", [("1", 1.0)]),
    ("3.x", [("3", 3.0)]),
    ("1..5", [("1", 1.0)]),
    ("#50 (50)", [("50", 50.0), ("50", 50.0)]),
    ("ราคา50บาท", [("50", 50.0)]),
    ("3-007", [("3", 3.0)]),
    ("3,14", [("3", 3.0), ("14", 14.0)]),
    ("1 234", [("1", 1.0), ("234", 234.0)]),
    ("−5", [("5", 5.0)]),
    ("1e+5", [("1e+5", 1e5)]),
    # Text: digits glued to words, versions, codes, dates, times, too many digits.
    ("Qwen2", []),
    ("H100", []),
    ("3D", []),
    ("v2", []),
    ("5kg", []),
    ("x_1", []),
    ("GPT-4", []),
    ("COVID-19", []),
    ("0x1F", []),
    ("100ms", []),
    ("Fig.3", []),
    ("x,.5", []),
    ("½5", []),
    ("01/15/2024", []),
    ("x86-64", []),
    ("Qwen2.5-0.5B", []),
    ("No.5", []),
    ("e\u03015", []),
    ("1.2.3", []),
    ("192.168.0.1", []),
    ("007", []),
    ("01", []),
    ("00.5", []),
    ("2024-01-15", []),
    ("2024/01/15", []),
    ("555-123-4567", []),
    ("12:30", []),
    ("16:9", []),
    ("12345678901234567890", []),
    ("9007199254740993", []),
    ("1e400", []),
    ("1e-400", []),
    ("1e5.5", []),
    ("1e2,500", []),
    ("1,100.0,200", []),
    ("0.00001,2", []),
    ("1.0,007", []),
]


@pytest.mark.parametrize(("text", "expected"), GRAMMAR_EXAMPLES, ids=[example[0] for example in GRAMMAR_EXAMPLES])
def test_grammar_examples(text, expected):
    spans = find_numbers(text)
    assert [(text[span.start : span.end], span.value) for span in spans] == expected
    for span, (_, value) in zip(spans, expected, strict=True):
        assert math.copysign(1.0, span.value) == math.copysign(1.0, value)  # -0 keeps its sign


def test_spans_are_number_spans_in_text_order():
    text = "From 3 to 4.5, then -2 and 1,000."
    spans = find_numbers(text)
    assert spans == [
        NumberSpan(5, 6, 3.0),
        NumberSpan(10, 13, 4.5),
        NumberSpan(20, 22, -2.0),
        NumberSpan(27, 32, 1000.0),
    ]
    assert spans[1].value == 4.5 and text[spans[1].start : spans[1].end] == "4.5"


def test_find_numbers_rejects_non_strings():
    with pytest.raises(TypeError, match="`text`"):
        find_numbers(b"12")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (99.9, "99.9"),
        (5.0, "5"),
        (-5.0, "-5"),
        (1e-05, "1e-5"),
        (0.0001, "0.0001"),
        (1e16, "1e16"),
        (123456789012345.0, "123456789012345"),
        (9007199254740992.0, "9007199254740992"),
        (-0.0, "-0"),
        (0.0, "0"),
        (1.5e-07, "1.5e-7"),
        (2.5e300, "2.5e300"),
        (5e-324, "5e-324"),
        (1.7976931348623157e308, "1.7976931348623157e308"),
        (0.1 + 0.2, "0.30000000000000004"),
        (7, "7"),
        (np.float64(2.5), "2.5"),
        (np.float32(0.5), "0.5"),
    ],
)
def test_format_number_policy(value, expected):
    assert format_number(value) == expected
    assert parse_number(expected) == float(value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, np.float64("nan")])
def test_format_number_rejects_non_finite(value):
    with pytest.raises(ValueError, match="finite"):
        format_number(value)


@pytest.mark.parametrize("value", ["5", True, None, [1.0]])
def test_format_number_rejects_non_numbers(value):
    with pytest.raises(TypeError, match="`value`"):
        format_number(value)


def test_parse_number_needs_exactly_one_whole_number():
    assert parse_number("1,234.5") == 1234.5
    assert parse_number("1e-5") == 1e-5
    for text in ["", "1 2", "3-5", " 5", "5%", "abc", "H100", "1.2.3"]:
        assert parse_number(text) is None, text


@settings(max_examples=300)
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_formatted_values_read_back_as_one_identical_number(value):
    written = format_number(value)
    assert re.fullmatch(r"-?\d+(\.\d+)?(e-?\d+)?", written)
    parsed = parse_number(written)
    assert parsed == value and math.copysign(1.0, parsed) == math.copysign(1.0, value)
    # Also inside text, between the separators a decoder puts around numbers.
    for context in ("x {} y", "价格{}元", "({}),", "$ {}%", "{}\n"):
        text = context.format(written)
        assert [span.value for span in find_numbers(text)] == [value]


# Pieces of mixed text: separators that the grammar treats specially, words, CJK, full-width digits.
PIECES = st.sampled_from(
    [" ", ",", ".", "-", "+", "/", ":", "e", "E", "%", "$", "_", "a", "x", "Qwen", "价格", "元", "１", "０", "0",
     "00", "5", "12", "\n", "é", "\u0301", "<NUM>", ", ", ". ", "-."]
)
NUMBERS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False).map(format_number),
    st.integers(-10**6, 10**6).map(str),
    st.decimals(allow_nan=False, allow_infinity=False, places=3).map(str),
)
MIXED_TEXT = st.lists(st.one_of(PIECES, PIECES, NUMBERS, NUMBERS, st.text(max_size=3)), max_size=25).map("".join)


@settings(max_examples=300)
@given(st.one_of(MIXED_TEXT, st.text()))
def test_spans_are_ordered_exact_and_never_raise(text):
    spans = find_numbers(text)
    position = 0
    for span in spans:
        assert position <= span.start < span.end <= len(text)
        assert math.isfinite(span.value)
        written = text[span.start : span.end].replace(",", "")
        assert float(written) == span.value  # the value is the written decimal, not an approximation of it
        position = span.end


@settings(max_examples=300)
@given(MIXED_TEXT)
def test_rewriting_numbers_in_canonical_form_reads_back_the_same(text):
    """What decoding does to a text: numbers rewritten by `format_number`, the text between them kept."""
    spans = find_numbers(text)
    pieces, rewritten, position = [], [], 0
    for span in spans:
        pieces.append(text[position : span.start])
        rewritten.append(text[position : span.start] + format_number(span.value))
        position = span.end
    pieces.append(text[position:])
    rewritten.append(text[position:])
    rewritten_text = "".join(rewritten)
    respans = find_numbers(rewritten_text)
    assert [format_number(span.value) for span in respans] == [format_number(span.value) for span in spans]
    position, repieces = 0, []
    for span in respans:
        repieces.append(rewritten_text[position : span.start])
        position = span.end
    repieces.append(rewritten_text[position:])
    assert repieces == pieces
    if all(text[span.start : span.end] == format_number(span.value) for span in spans):
        assert rewritten_text == text


@pytest.mark.parametrize(
    "build",
    [
        lambda n: "1" * n,
        lambda n: "1." * (n // 2),
        lambda n: "1," * (n // 2),
        lambda n: "1-" * (n // 2),
        lambda n: "12:" * (n // 3),
        lambda n: "1e" * (n // 2),
        lambda n: "-." * (n // 2),
        lambda n: "0." + "0" * n + "1",
        lambda n: "1e" + "9" * n,
        lambda n: "9,999" * (n // 5),
        lambda n: "a1" * (n // 2),
        lambda n: "1.5 " * (n // 4),
    ],
    ids=["digits", "dots", "commas", "dashes", "colons", "exponents", "signs", "zeros", "exponent", "groups",
         "glued", "spaced"],
)
def test_scanner_reads_pathological_runs_as_ordered_exact_spans(build):
    # Runs a backtracking grammar would read in quadratic time; benchmarks/bench_number_scanner.py times them (a
    # linear scanner: well under a second on 1 MB, twice that on 2 MB). Here what is found in them is checked.
    text = build(100_000)
    position = 0
    for span in find_numbers(text):
        assert position <= span.start < span.end <= len(text)
        assert math.isfinite(span.value)
        assert float(text[span.start : span.end].replace(",", "")) == span.value
        position = span.end


@pytest.mark.parametrize(("value", "low", "high", "written"), [
    (29.21944, 26.37, 32.07, "29.2"),  # a half-width of 2.85: tenths
    (6912.3, 6100.0, 7700.0, "6910"),  # of 800: tens
    (0.0123456, 0.0103, 0.0143, "0.0123"),  # of 0.002: ten-thousandths
    (62.0, 62.0 - 1e-9, 62.0 + 1e-9, "62"),  # a copy: its interval is narrower than its last digit
    (12.825866, 12.825866 - 1e-7, 12.825866 + 1e-7, "12.825866"),  # every digit stands
    (6912.3, -1e6, 1e6, "7000"),  # far wider than the value: its leading digit stays
    (6912.3, -math.inf, math.inf, "6912.3"),  # no finite width: nothing to round by
    (0.0, -1.0, 1.0, "0"),
])
def test_a_value_keeps_the_digits_its_interval_supports(value, low, high, written):
    assert format_number(round_to_interval(value, low, high)) == written
