"""Tests for the numeric corpus: determinism, targets that follow from the text, splits and extrapolation ranges."""

from __future__ import annotations

import math
import re
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from causal_qwen.data import (
    LANGUAGES,
    SPLITS,
    TEMPLATES,
    VALUE_RANGES,
    NumericExample,
    corpus_statistics,
    from_jsonl,
    generate_corpus,
    make_splits,
    template_baselines,
    to_jsonl,
)
from causal_qwen.numbers import find_numbers

NUMERIC_TEMPLATES = [name for name in TEMPLATES if name != "non_numeric"]

# The test's own reading of numbers, independent of the library's grammar: a plain decimal that does not touch a
# Latin letter, a digit or a dot (Chinese characters may touch it).
NUMBER = re.compile(r"(?<![A-Za-z0-9_.])-?\d+(?:\.\d+)?(?![A-Za-z0-9_])")
HAN = re.compile(r"[\u4e00-\u9fff]")

# Conversion factors, restated here so that the test does not trust the library's table:
# (English unit, Chinese unit) of source and result, factor, offset.
CONVERSIONS = [
    (("km", "公里"), ("miles", "英里"), 0.621371, 0.0),
    (("miles", "英里"), ("km", "公里"), 1.609344, 0.0),
    (("meters", "米"), ("feet", "英尺"), 3.28084, 0.0),
    (("kg", "千克"), ("pounds", "磅"), 2.20462, 0.0),
    (("liters", "升"), ("gallons", "加仑"), 0.264172, 0.0),
    (("°C", "摄氏度"), ("°F", "华氏度"), 1.8, 32.0),
]
# Roles that keep their training range in the extrapolation split (counts, durations, rates).
SHARED_ROLES = {"quantity", "hours", "percent"}


def parse(text: str) -> list[tuple[int, int, float]]:
    return [(match.start(), match.end(), float(match.group())) for match in NUMBER.finditer(text)]


def unit_after(example: NumericExample, unit: str) -> bool:
    """Whether the target is followed by `unit` (after one space in English, directly in Chinese)."""
    rest = example.text[example.target_char_span[1] :]
    return rest.startswith(" " + unit if example.language == "en" else unit)


def recompute(example: NumericExample, numbers: list[float]) -> None:
    """Check that the target follows from the earlier numbers and the words, by the template's documented rule."""
    text, target, template = example.text, example.target_value, example.template
    earlier = numbers[:-1]
    if template == "price_total":
        price, quantity = earlier
        assert abs(target - price * quantity) <= 0.005 + 1e-9 * target
        assert round(target, 2) == target
    elif template == "unit_conversion":
        (value,) = earlier
        # Identify the conversion from the unit words around the numbers, not from the record's variant.
        matches = []
        for (src_en, src_zh), (dst_en, dst_zh), factor, offset in CONVERSIONS:
            src, dst = (src_en, dst_en) if example.language == "en" else (src_zh, dst_zh)
            value_end = numbers_spans(text)[0][1]
            follows = text[value_end:].startswith(" " + src if example.language == "en" else src)
            if follows and unit_after(example, dst):
                matches.append((factor, offset))
        assert len(matches) == 1, text
        factor, offset = matches[0]
        assert abs(target - (value * factor + offset)) <= 0.005 + 1e-12 * abs(target), text
    elif template == "sum_difference":
        a, b = earlier
        adds = any(word in text for word in ("plus", "received", "adding", "加", "增加"))
        subtracts = any(word in text for word in ("minus", "gave away", "moved", "减", "送走"))
        assert adds != subtracts, text
        assert target == (a + b if adds else a - b), text
    elif template == "rate_distance":
        speed, hours = earlier
        assert target == speed * hours
        assert unit_after(example, "km" if example.language == "en" else "公里")
    elif template == "average":
        assert len(earlier) in (3, 4, 5)
        count_word = {3: ("three", "三"), 4: ("four", "四"), 5: ("five", "五")}[len(earlier)]
        assert count_word[0 if example.language == "en" else 1] in text
        assert abs(target - math.fsum(earlier) / len(earlier)) <= 0.005 + 1e-12 * target
    elif template == "measurement_noise":
        (true_value,) = earlier
        # Documented bound: noise clipped at 1.5 %, plus the rounding of the reading to 4 significant digits.
        assert abs(target - true_value) <= 0.016 * true_value, text
    elif template == "heavy_tailed":
        base = earlier[0]
        if len(earlier) == 2:
            percent = earlier[1]
            grows = any(word in text for word in ("grew", "增长"))
            falls = any(word in text for word in ("fell", "下降"))
            assert grows != falls, text
            expected = base * (1 + (percent if grows else -percent) / 100)
            assert abs(target - expected) <= 0.5 + 1e-12 * target, text
        else:
            words = {2: ("doubled", "翻了一番"), 3: ("tripled", "三倍"), 10: ("tenfold", "十倍")}
            found = [factor for factor, pair in words.items() if any(word in text for word in pair)]
            assert len(found) == 1, text
            assert target == base * found[0], text
    else:  # pragma: no cover
        raise AssertionError(f"no rule for {template}")


def numbers_spans(text: str) -> list[tuple[int, int]]:
    return [(start, end) for start, end, _ in parse(text)]


# --------------------------------------------------------------------------------------------------------------


def test_same_seed_gives_identical_corpus():
    first = generate_corpus(300, "train", seed=7)
    assert first == generate_corpus(300, "train", seed=7)
    assert [example.text for example in first] != [example.text for example in generate_corpus(300, "train", seed=8)]
    # A prefix of a longer corpus is the shorter corpus: examples are drawn one after another from one stream.
    assert generate_corpus(100, "train", seed=7) == first[:100]


def test_splits_use_different_streams_and_are_disjoint():
    splits = make_splits(500, 150, 150, 150, seed=1)
    assert {name: len(examples) for name, examples in splits.items()} == {
        "train": 500, "validation": 150, "test": 150, "extrapolation": 150
    }
    for name, examples in splits.items():
        assert {example.split for example in examples} == {name}
    train_texts = {example.text for example in splits["train"]}
    for name in ("validation", "test", "extrapolation"):
        assert not train_texts & {example.text for example in splits[name]}
    # Validation and test come from different streams: only the few sentences without numbers may coincide.
    validation = {example.text for example in splits["validation"] if example.template != "non_numeric"}
    test = {example.text for example in splits["test"] if example.template != "non_numeric"}
    assert len(validation & test) <= 2
    assert [e.text for e in generate_corpus(50, "validation", 1)] != [e.text for e in generate_corpus(50, "test", 1)]


@pytest.mark.parametrize("split", ["train", "extrapolation"])
@pytest.mark.parametrize("template", NUMERIC_TEMPLATES)
def test_target_follows_from_the_text(template, split):
    examples = generate_corpus(120, split, seed=3, templates=[template])
    assert {example.language for example in examples} == set(LANGUAGES)
    for example in examples:
        numbers = parse(example.text)
        assert numbers, example.text
        start, end, value = numbers[-1]
        # The target is the last number, its span covers exactly its digits, and the text reads back as the value.
        assert (start, end) == example.target_char_span
        assert float(example.text[start:end]) == example.target_value == value
        # The record's inputs are the earlier numbers of the text, in order.
        assert [number[2] for number in numbers[:-1]] == list(example.inputs.values())
        # Every number is written plainly: no exponent, no leading zero, no trailing ".0".
        for number_start, number_end, _ in numbers:
            digits = example.text[number_start:number_end]
            assert "e" not in digits and not digits.endswith(".0") and not re.match(r"-?0\d", digits), digits
        # The project's number grammar reads the same numbers, so each one becomes exactly one <NUM> token.
        assert [(span.start, span.end, span.value) for span in find_numbers(example.text)] == numbers
        recompute(example, [number[2] for number in numbers])


def test_non_numeric_examples_have_no_numbers():
    examples = generate_corpus(60, "train", seed=0, templates=["non_numeric"])
    for example in examples:
        assert example.target_value is None and example.target_char_span is None and example.inputs == {}
        assert not parse(example.text) and not find_numbers(example.text)
    with pytest.raises(ValueError, match="templates"):
        generate_corpus(5, "extrapolation", templates=["non_numeric"])


def test_extrapolation_values_lie_outside_the_training_ranges():
    train = generate_corpus(1500, "train", seed=11)
    extrapolation = generate_corpus(700, "extrapolation", seed=11)
    assert "non_numeric" not in {example.template for example in extrapolation}

    def roles(example):
        named = dict(example.inputs)
        named["target"] = example.target_value
        # Every listed value of `average` is a "value".
        return [("value" if role.startswith("x") else role, value) for role, value in named.items()]

    # Each value lies in the documented range of its role and split.
    for examples, kind in ((train, "train"), (extrapolation, "extrapolation")):
        for example in examples:
            if example.target_value is None:
                continue
            for role, value in roles(example):
                low, high = VALUE_RANGES[example.template][role][kind]
                assert low <= value <= high, (example.text, role, value)

    # Per template and variant, every extrapolation magnitude exceeds every training magnitude.
    def magnitudes(examples):
        found: dict[tuple[str, str], list[float]] = {}
        for example in examples:
            if example.target_value is not None:
                key = (example.template, example.variant)
                found.setdefault(key, []).extend(abs(v) for role, v in roles(example) if role not in SHARED_ROLES)
        return found

    train_magnitudes, extrapolation_magnitudes = magnitudes(train), magnitudes(extrapolation)
    assert set(extrapolation_magnitudes) <= set(train_magnitudes)
    assert {template for template, _ in extrapolation_magnitudes} == set(NUMERIC_TEMPLATES)
    for key, values in extrapolation_magnitudes.items():
        assert min(values) > max(train_magnitudes[key]), key

    # Documented ranges themselves: shifted roles are disjoint, shared roles identical.
    for template, ranges in VALUE_RANGES.items():
        for role, by_kind in ranges.items():
            if role in SHARED_ROLES:
                assert by_kind["train"] == by_kind["extrapolation"]
            elif template != "unit_conversion":  # °C shares one row with the linear units; checked empirically above
                assert by_kind["train"][1] < by_kind["extrapolation"][0], (template, role)


def test_both_languages_and_language_selection():
    examples = generate_corpus(200, "train", seed=2)
    assert {example.language for example in examples} == {"en", "zh"}
    for example in examples:
        assert bool(HAN.search(example.text)) == (example.language == "zh"), example.text
    english = generate_corpus(50, "train", seed=2, languages=("en",))
    assert {example.language for example in english} == {"en"}


def test_heavy_tailed_values_span_many_orders_of_magnitude():
    targets = [example.target_value for example in generate_corpus(400, "train", seed=0, templates=["heavy_tailed"])]
    assert max(targets) / min(targets) > 1e4
    # A few extreme values pull the mean far above the median: the mark of a heavy tail.
    assert statistics.fmean(targets) > 5 * statistics.median(targets)
    # The light-tailed templates stay within a few orders of magnitude.
    averages = [example.target_value for example in generate_corpus(400, "train", seed=0, templates=["average"])]
    assert max(averages) / min(averages) < 1e3


def test_corpus_statistics_numbers_do_not_overwhelm_words():
    examples = generate_corpus(1000, "train", seed=5)
    stats = corpus_statistics(examples)
    assert stats["n_examples"] == 1000
    assert set(stats["templates"]) == set(TEMPLATES)
    # Numbers matter but words dominate: a corpus that is mostly digits would not train the text head.
    assert 0.05 < stats["number_fraction"] < 0.3
    assert 1.5 < stats["numbers_per_example"] < 4
    assert 0.05 < stats["templates"]["non_numeric"] / 1000 < 0.2
    # Every template appears in both languages.
    pairs = {(example.template, example.language) for example in examples}
    assert pairs == {(template, language) for template in TEMPLATES for language in LANGUAGES}


def test_template_baselines():
    def example(template, value):
        return NumericExample("x", template, "en", value, None if value is None else (0, 1), "train")

    examples = [example("a", 1.0), example("a", 2.0), example("a", 9.0), example("b", 4.0), example("c", None)]
    assert template_baselines(examples) == {"a": (4.0, 2.0), "b": (4.0, 4.0)}
    baselines = template_baselines(generate_corpus(500, "train", seed=0))
    assert set(baselines) == set(NUMERIC_TEMPLATES)
    mean, median = baselines["heavy_tailed"]
    assert mean > median


def test_jsonl_round_trip(tmp_path):
    examples = generate_corpus(80, "extrapolation", seed=4) + generate_corpus(80, "train", seed=4)
    path = tmp_path / "corpus.jsonl"
    to_jsonl(examples, path)
    assert from_jsonl(path) == examples
    # Chinese is stored as characters, one example per line.
    content = path.read_text(encoding="utf-8")
    assert len(content.splitlines()) == len(examples) and HAN.search(content)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_examples": -1}, "n_examples"),
        ({"n_examples": 2, "split": "dev"}, "split"),
        ({"n_examples": 2, "languages": ("fr",)}, "languages"),
        ({"n_examples": 2, "languages": ()}, "languages"),
        ({"n_examples": 2, "templates": ["poetry"]}, "templates"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate_corpus(**kwargs)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**32), split=st.sampled_from(SPLITS))
def test_any_seed_is_deterministic_and_consistent(seed, split):
    examples = generate_corpus(25, split, seed)
    assert examples == generate_corpus(25, split, seed)
    for example in examples:
        assert example.split == split
        if example.target_value is None:
            assert not parse(example.text)
            continue
        start, end = example.target_char_span
        assert float(example.text[start:end]) == example.target_value
        assert parse(example.text)[-1][:2] == (start, end)
