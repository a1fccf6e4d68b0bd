"""A synthetic corpus of English and Chinese text in which numbers matter.

Every example is one to three short sentences whose *last* number, the target, follows from the earlier
numbers or from the words around them: a total from a price and a quantity, a converted unit, a sum, a distance
from a speed and a time, an average, a sensor reading close to a stated true value, a heavy-tailed quantity after
a stated growth. A few sentences without numbers are mixed in, because a model must also learn when *not* to write
a number. The words around the target (its unit, the currency, the object counted) follow from the context too,
so the corpus trains and measures the classification head as well as the regression head.

The generator is deterministic: it uses only `random.Random`, seeded per split from a SHA-256 hash of
`(split, seed)`, whose algorithms are documented and the same on every platform. Values pass through `math.log` and
`math.exp` before they are rounded to their printed digits; those are not guaranteed to be correctly rounded, so in
principle a platform whose math library differs in the last bit could change a digit, though no such case is known.
Nothing is downloaded.

Splits: `train`, `validation` and `test` draw from the same value ranges with different seeds; `extrapolation`
draws every magnitude from a range above the training range of its template (see [`VALUE_RANGES`] and
`docs/corpus.md`), to measure how a model predicts values it never saw.

Numbers are written by [`causal_qwen.numbers.format_number`] (shortest round-trip decimal, no trailing `.0`), with
no thousands separators, no exponents, no leading zeros and a space between a number and a Latin unit (`5 kg`), so
that the tokenizer's number grammar reads each of them as exactly one number.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import statistics
import string
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..numbers import find_numbers, format_number

__all__ = [
    "LANGUAGES",
    "SPLITS",
    "TEMPLATES",
    "VALUE_RANGES",
    "NumericExample",
    "corpus_statistics",
    "from_jsonl",
    "generate_corpus",
    "make_splits",
    "template_baselines",
    "to_jsonl",
]

SPLITS = ("train", "validation", "test", "extrapolation")
LANGUAGES = ("en", "zh")
TEMPLATES = (
    "price_total",
    "unit_conversion",
    "sum_difference",
    "rate_distance",
    "average",
    "measurement_noise",
    "heavy_tailed",
    "non_numeric",
)
# How often each template is drawn: about one example in ten has no number at all.
_TEMPLATE_WEIGHTS = {
    "price_total": 3,
    "unit_conversion": 3,
    "sum_difference": 2,
    "rate_distance": 2,
    "average": 2,
    "measurement_noise": 2,
    "heavy_tailed": 3,
    "non_numeric": 2,
}

# Value ranges per template and role, for the training-range splits (`train`, `validation`, `test`) and for
# `extrapolation`. Roles whose ranges differ are magnitudes: in every (template, variant), each magnitude of an
# extrapolation example is larger in absolute value than every magnitude of a training example. Counts, durations
# and rates (`quantity`, `hours`, `percent`) keep their training range, so that only the scale of the values
# changes. `target` bounds cover every variant of the template.
VALUE_RANGES: dict[str, dict[str, dict[str, tuple[float, float]]]] = {
    "price_total": {
        "price": {"train": (1.0, 1000.0), "extrapolation": (10000.0, 100000.0)},
        "quantity": {"train": (2.0, 9.0), "extrapolation": (2.0, 9.0)},
        "target": {"train": (2.0, 9000.0), "extrapolation": (20000.0, 900000.0)},
    },
    "unit_conversion": {
        # °C uses its own interval: train [-40, 100], extrapolation [300, 3000] (°F [-40, 212] and [572, 5432]).
        "value": {"train": (-40.0, 500.0), "extrapolation": (300.0, 200000.0)},
        "target": {"train": (-40.0, 1640.42), "extrapolation": (528.34, 656168.0)},
    },
    "sum_difference": {
        "a": {"train": (1.0, 999.0), "extrapolation": (10000.0, 999999.0)},
        "b": {"train": (1.0, 999.0), "extrapolation": (10000.0, 999999.0)},
        "target": {"train": (1.0, 1998.0), "extrapolation": (10000.0, 1999998.0)},
    },
    "rate_distance": {
        "speed": {"train": (5.0, 120.0), "extrapolation": (2000.0, 40000.0)},
        "hours": {"train": (0.5, 8.0), "extrapolation": (0.5, 8.0)},
        "target": {"train": (2.5, 960.0), "extrapolation": (1000.0, 320000.0)},
    },
    "average": {
        "value": {"train": (1.0, 100.0), "extrapolation": (1000.0, 100000.0)},
        "target": {"train": (1.0, 100.0), "extrapolation": (1000.0, 100000.0)},
    },
    "measurement_noise": {
        "true_value": {"train": (1.0, 900.0), "extrapolation": (2000.0, 100000.0)},
        "target": {"train": (0.985, 913.5), "extrapolation": (1970.0, 101500.0)},
    },
    "heavy_tailed": {
        "base": {"train": (1000.0, 1e9), "extrapolation": (2e10, 1e13)},
        "percent": {"train": (1.0, 150.0), "extrapolation": (1.0, 150.0)},
        "target": {"train": (600.0, 1e10), "extrapolation": (1.2e10, 1e14)},
    },
}

# A word for the statistics: a Latin-script word or one Chinese character.
_WORD = re.compile(r"[A-Za-z]+|[\u4e00-\u9fff]")

# Tail exponent of the truncated Pareto law of `heavy_tailed` bases: below 1 the mean is dominated by a few huge
# values, which is what a Cauchy head has to survive.
_PARETO_ALPHA = 0.5
# Relative noise of `measurement_noise` readings: normal with this standard deviation, clipped at three of them.
_NOISE_STD = 0.005
_NOISE_CLIP = 3 * _NOISE_STD


@dataclass
class NumericExample:
    """
    One example of the numeric corpus.

    Args:
        text (`str`): The full text.
        template (`str`): The template that produced it, one of [`TEMPLATES`].
        language (`str`): `"en"` or `"zh"`.
        target_value (`float | None`): The value of the last number of the text; `None` for `non_numeric`.
        target_char_span (`tuple[int, int] | None`): `(start, end)` such that `text[start:end]` are the target's
            characters; `None` for `non_numeric`.
        split (`str`): One of [`SPLITS`].
        variant (`str`): The sub-case of the template (`"km_to_miles"`, `"subtract"`, ...).
        inputs (`dict[str, float]`): The earlier numbers of the text by role, in the order in which they appear.
    """

    text: str
    template: str
    language: str
    target_value: float | None
    target_char_span: tuple[int, int] | None
    split: str
    variant: str = ""
    inputs: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the span becomes a list)."""
        record = asdict(self)
        if self.target_char_span is not None:
            record["target_char_span"] = list(self.target_char_span)
        return record

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> NumericExample:
        """The inverse of [`to_dict`]."""
        record = dict(record)
        span = record.get("target_char_span")
        record["target_char_span"] = None if span is None else (int(span[0]), int(span[1]))
        record["inputs"] = {name: float(value) for name, value in record.get("inputs", {}).items()}
        return cls(**record)


# A draft of one example before rendering: a `str.format` pattern whose fields are words (str) or numbers (float).
# The numeric field `target` must be the last number of the pattern.
@dataclass
class _Draft:
    pattern: str
    fields: dict[str, str | float]
    variant: str


# --------------------------------------------------------------------------------------------------------------
# Value helpers
# --------------------------------------------------------------------------------------------------------------


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    """A value whose logarithm is uniform: every order of magnitude of the range is equally likely."""
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _round_significant(value: float, digits: int) -> float:
    """`value` rounded to `digits` significant digits (a float whose repr has at most that many)."""
    if value == 0:
        return 0.0
    decimals = digits - 1 - math.floor(math.log10(abs(value)))
    return float(round(value, decimals)) + 0.0


def _truncated_pareto(rng: random.Random, low: float, high: float, alpha: float) -> float:
    """A draw of a Pareto law with tail exponent `alpha` restricted to `[low, high]` (inverse-CDF sampling)."""
    tail = 1.0 - (low / high) ** alpha
    return low / (1.0 - rng.random() * tail) ** (1.0 / alpha)


def _span_range(kind: str, template: str, role: str) -> tuple[float, float]:
    """The documented range of one role of a template, for `kind` "train" or "extrapolation"."""
    return VALUE_RANGES[template][role][kind]


def _capitalize(words: str) -> str:
    """Upper-case the first letter only (`str.capitalize` would lower-case the rest)."""
    return words[:1].upper() + words[1:]


# --------------------------------------------------------------------------------------------------------------
# Templates. Each builder draws the values for one example and returns a draft; `kind` is "train" (the range of
# train/validation/test) or "extrapolation". Word lists are (English, Chinese) pairs so that both languages share
# the same situations.
# --------------------------------------------------------------------------------------------------------------

# (English singular, English plural, Chinese noun, Chinese classifier)
_ITEMS = [
    ("notebook", "notebooks", "笔记本", "本"),
    ("pen", "pens", "钢笔", "支"),
    ("chair", "chairs", "椅子", "把"),
    ("lamp", "lamps", "台灯", "盏"),
    ("backpack", "backpacks", "背包", "个"),
    ("bicycle", "bicycles", "自行车", "辆"),
    ("printer", "printers", "打印机", "台"),
    ("ticket", "tickets", "门票", "张"),
    ("jacket", "jackets", "夹克", "件"),
    ("machine", "machines", "机器", "台"),
]
_PRICE_PATTERNS = {
    "en": [
        "One {item} costs {price} dollars, so {quantity} {items} cost {target} dollars.",
        "The shop sells {items} at {price} dollars each. An order of {quantity} {items} comes to {target} dollars "
        "in total.",
        "At {price} dollars per {item}, buying {quantity} {items} costs {target} dollars.",
    ],
    "zh": [
        "{item}每{cl}{price}元，买{quantity}{cl}一共{target}元。",
        "商店里的{item}单价为{price}元，订购{quantity}{cl}的总价是{target}元。",
        "一{cl}{item}售价{price}元，{quantity}{cl}{item}共计{target}元。",
    ],
}


def _price_total(rng: random.Random, language: str, kind: str) -> _Draft:
    singular, plural, zh_noun, classifier = rng.choice(_ITEMS)
    price = round(_log_uniform(rng, *_span_range(kind, "price_total", "price")), 2)
    quantity = float(rng.randint(*map(int, _span_range(kind, "price_total", "quantity"))))
    # The product of two 2-decimal numbers is rounded back to cents, as a till would.
    total = round(price * quantity, 2)
    words = {"item": singular, "items": plural} if language == "en" else {"item": zh_noun, "cl": classifier}
    pattern = rng.choice(_PRICE_PATTERNS[language])
    return _Draft(pattern, {**words, "price": price, "quantity": quantity, "target": total}, "price_times_quantity")


# name: (factor, offset, dimension, English units (from, to), Chinese units (from, to))
_CONVERSIONS = {
    "km_to_miles": (0.621371, 0.0, "length", ("km", "miles"), ("公里", "英里")),
    "miles_to_km": (1.609344, 0.0, "length", ("miles", "km"), ("英里", "公里")),
    "meters_to_feet": (3.28084, 0.0, "length", ("meters", "feet"), ("米", "英尺")),
    "kg_to_pounds": (2.20462, 0.0, "mass", ("kg", "pounds"), ("千克", "磅")),
    "liters_to_gallons": (0.264172, 0.0, "volume", ("liters", "gallons"), ("升", "加仑")),
    "celsius_to_fahrenheit": (1.8, 32.0, "temperature", ("°C", "°F"), ("摄氏度", "华氏度")),
}
# Conversions are written with 2 decimals.
_CONVERSION_DECIMALS = 2
# The input ranges of the linear conversions and of °C, per kind (see VALUE_RANGES).
_LINEAR_INPUT = {"train": (0.5, 500.0), "extrapolation": (2000.0, 200000.0)}
_CELSIUS_INPUT = {"train": (-40.0, 100.0), "extrapolation": (300.0, 3000.0)}
# (English subject, Chinese subject) per dimension, and the Chinese predicate that introduces the value.
_THINGS = {
    "length": [("the trail", "这条步道"), ("the road", "这段公路"), ("the river section", "这段河道"),
               ("the cable", "这根电缆")],
    "mass": [("the package", "这个包裹"), ("the suitcase", "这个行李箱"), ("the load", "这批货物")],
    "volume": [("the tank", "这个水箱"), ("the barrel", "这个桶"), ("the pool", "这个水池")],
    "temperature": [("the water", "水"), ("the oven", "烤箱"), ("the furnace", "熔炉"), ("the room", "房间")],
}
_ZH_PREDICATES = {"length": "长", "mass": "重", "volume": "的容量是", "temperature": "的温度是"}
_CONVERSION_PATTERNS = {
    "en": [
        "{Thing} is {value} {unit_from}, which is about {target} {unit_to}.",
        "{Thing} measures {value} {unit_from}, or {target} {unit_to}.",
        "Converted to {unit_to}, {value} {unit_from} is {target} {unit_to}.",
    ],
    "zh": [
        "{thing}{predicate}{value}{unit_from}，约合{target}{unit_to}。",
        "{value}{unit_from}换算成{unit_to}约为{target}{unit_to}。",
    ],
}


def _unit_conversion(rng: random.Random, language: str, kind: str) -> _Draft:
    variant = rng.choice(sorted(_CONVERSIONS))
    factor, offset, dimension, en_units, zh_units = _CONVERSIONS[variant]
    if dimension == "temperature":
        value = round(rng.uniform(*_CELSIUS_INPUT[kind]), 1)
    else:
        value = round(_log_uniform(rng, *_LINEAR_INPUT[kind]), 1)
    # `+ 0.0` turns a rounded -0.0 into 0.0, which is written "0" rather than "-0".
    target = round(value * factor + offset, _CONVERSION_DECIMALS) + 0.0
    en_thing, zh_thing = rng.choice(_THINGS[dimension])
    units = en_units if language == "en" else zh_units
    words = {"unit_from": units[0], "unit_to": units[1]}
    if language == "en":
        words["Thing"] = _capitalize(en_thing)
    else:
        words.update(thing=zh_thing, predicate=_ZH_PREDICATES[dimension])
    pattern = rng.choice(_CONVERSION_PATTERNS[language])
    return _Draft(pattern, {**words, "value": value, "target": target}, variant)


# (English place, English things, Chinese place, Chinese classifier, Chinese things)
_COLLECTIONS = [
    ("the library", "books", "图书馆", "本", "书"),
    ("the farm", "sheep", "农场", "只", "羊"),
    ("the warehouse", "boxes", "仓库", "个", "箱子"),
    ("the orchard", "apple trees", "果园", "棵", "苹果树"),
    ("the school", "students", "学校", "名", "学生"),
]
_SUM_PATTERNS = {
    ("en", "add"): [
        "{Place} had {a} {things} and received {b} more, so it now has {target} {things}.",
        "After adding {b} {things} to the {a} it already had, {place} has {target} {things}.",
        "{a} plus {b} equals {target}.",
    ],
    ("en", "subtract"): [
        "{Place} had {a} {things} and gave away {b}, so {target} {things} are left.",
        "Of the {a} {things} at {place}, {b} were moved elsewhere, leaving {target}.",
        "{a} minus {b} equals {target}.",
    ],
    ("zh", "add"): [
        "{place}原有{a}{cl}{things}，又增加了{b}{cl}，现在共有{target}{cl}{things}。",
        "{a}加{b}等于{target}。",
    ],
    ("zh", "subtract"): [
        "{place}原有{a}{cl}{things}，送走了{b}{cl}，还剩{target}{cl}{things}。",
        "{a}减{b}等于{target}。",
    ],
}


def _sum_difference(rng: random.Random, language: str, kind: str) -> _Draft:
    variant = rng.choice(["add", "subtract"])
    low, high = map(int, _span_range(kind, "sum_difference", "a"))
    if variant == "add":
        a, b = rng.randint(low, high), rng.randint(low, high)
        target = a + b
    else:
        # The difference stays at least `low`, so that in extrapolation it is as large as every other magnitude.
        a = rng.randint(2 * low, high)
        b = rng.randint(low, a - low)
        target = a - b
    en_place, en_things, zh_place, classifier, zh_things = rng.choice(_COLLECTIONS)
    if language == "en":
        words = {"place": en_place, "Place": _capitalize(en_place), "things": en_things}
    else:
        words = {"place": zh_place, "cl": classifier, "things": zh_things}
    pattern = rng.choice(_SUM_PATTERNS[language, variant])
    return _Draft(pattern, {**words, "a": float(a), "b": float(b), "target": float(target)}, variant)


_VEHICLES = [("the car", "汽车"), ("the train", "火车"), ("the drone", "无人机"), ("the aircraft", "飞机"),
             ("the rocket", "火箭"), ("the probe", "探测器")]
# Half-hour steps; one hour is left out so that English never reads "1 hours".
_HOURS = [0.5] + [h / 2 for h in range(3, 17)]
_RATE_PATTERNS = {
    "en": [
        "{Vehicle} travels at {speed} km/h for {hours} hours and covers {target} km.",
        "Moving at {speed} km/h for {hours} hours, {vehicle} covers a distance of {target} km.",
    ],
    "zh": [
        "{vehicle}以每小时{speed}公里的速度行驶了{hours}小时，共行驶{target}公里。",
        "{vehicle}的时速是{speed}公里，{hours}小时能行驶{target}公里。",
    ],
}


def _rate_distance(rng: random.Random, language: str, kind: str) -> _Draft:
    speed = float(rng.randint(*map(int, _span_range(kind, "rate_distance", "speed"))))
    hours = rng.choice(_HOURS)
    distance = round(speed * hours, 2)  # exact: an integer times a multiple of 0.5
    en_vehicle, zh_vehicle = rng.choice(_VEHICLES)
    words = {"vehicle": en_vehicle, "Vehicle": _capitalize(en_vehicle)} if language == "en" else {"vehicle": zh_vehicle}
    pattern = rng.choice(_RATE_PATTERNS[language])
    return _Draft(pattern, {**words, "speed": speed, "hours": hours, "target": distance}, "speed_times_hours")


# (English measure, English unit, Chinese measure, Chinese unit)
_MEASURES = [
    ("visitor counts", "visitors", "访客人数", "人"),
    ("sales", "dollars", "销售额", "元"),
    ("parcel deliveries", "parcels", "包裹投递量", "件"),
    ("water use readings", "liters", "用水量", "升"),
]
# The number of values is written as a word, so that every digit string of the text is a value.
_COUNT_WORDS = {3: ("three", "三"), 4: ("four", "四"), 5: ("five", "五")}
_AVERAGE_PATTERNS = {
    "en": [
        "The {measure} over {count} days were {values}, an average of {target} {unit} per day.",
        "Over {count} days the {measure} were {values}; the daily average is {target} {unit}.",
    ],
    "zh": [
        "连续{count}天的{measure}分别为{values}，平均每天{target}{unit}。",
        "{measure}在{count}天里分别是{values}，日均{target}{unit}。",
    ],
}
_AVERAGE_DECIMALS = 2


def _average(rng: random.Random, language: str, kind: str) -> _Draft:
    count = rng.choice(sorted(_COUNT_WORDS))
    low, high = map(int, _span_range(kind, "average", "value"))
    values = [float(rng.randint(low, high)) for _ in range(count)]
    mean = round(math.fsum(values) / count, _AVERAGE_DECIMALS)
    names = [f"x{i + 1}" for i in range(count)]
    slots = ["{" + name + "}" for name in names]
    if language == "en":
        listing = ", ".join(slots[:-1]) + " and " + slots[-1]
    else:
        listing = "、".join(slots[:-1]) + "和" + slots[-1]
    en_measure, en_unit, zh_measure, zh_unit = rng.choice(_MEASURES)
    if language == "en":
        words = {"measure": en_measure, "unit": en_unit, "count": _COUNT_WORDS[count][0]}
    else:
        words = {"measure": zh_measure, "unit": zh_unit, "count": _COUNT_WORDS[count][1]}
    # The list of slots is spliced into the pattern before formatting; braces in `listing` are its own fields.
    pattern = rng.choice(_AVERAGE_PATTERNS[language]).replace("{values}", listing)
    return _Draft(pattern, {**words, **dict(zip(names, values, strict=True)), "target": mean}, f"mean_of_{count}")


# variant: (English patterns, Chinese patterns)
_MEASUREMENT_PATTERNS = {
    "weight": (
        ["A reference weight of {true_value} g is placed on the scale, and the scale reads {target} g.",
         "The calibration mass is {true_value} g; the balance shows {target} g."],
        ["把{true_value}克的标准砝码放在秤上，秤的读数是{target}克。",
         "校准质量为{true_value}克，天平显示{target}克。"],
    ),
    "length": (
        ["The gauge block is {true_value} mm long, and the laser sensor measures {target} mm.",
         "A rod of {true_value} mm is measured as {target} mm by the caliper."],
        ["量块长{true_value}毫米，激光传感器测得{target}毫米。",
         "一根{true_value}毫米的杆，卡尺测量结果为{target}毫米。"],
    ),
    "volume": (
        ["The flask holds exactly {true_value} mL, and the flow meter records {target} mL."],
        ["烧瓶的容量正好是{true_value}毫升，流量计记录到{target}毫升。"],
    ),
    "voltage": (
        ["The reference source outputs {true_value} V, and the voltmeter reads {target} V."],
        ["标准电源输出{true_value}伏，电压表读数为{target}伏。"],
    ),
}
# True values have 3 significant digits, readings 4 (one more than the reference, as an instrument displays).
_TRUE_VALUE_DIGITS = 3
_READING_DIGITS = 4


def _measurement_noise(rng: random.Random, language: str, kind: str) -> _Draft:
    variant = rng.choice(sorted(_MEASUREMENT_PATTERNS))
    true_value = _round_significant(_log_uniform(rng, *_span_range(kind, "measurement_noise", "true_value")),
                                    _TRUE_VALUE_DIGITS)
    noise = min(max(rng.gauss(0.0, _NOISE_STD), -_NOISE_CLIP), _NOISE_CLIP)
    reading = _round_significant(true_value * (1.0 + noise), _READING_DIGITS)
    en_patterns, zh_patterns = _MEASUREMENT_PATTERNS[variant]
    pattern = rng.choice(en_patterns if language == "en" else zh_patterns)
    return _Draft(pattern, {"true_value": true_value, "target": reading}, variant)


# (English subject, English unit, Chinese subject, Chinese unit)
_HEAVY_SUBJECTS = [
    ("the city's population", "people", "这座城市的人口", "人"),
    ("the company's annual revenue", "dollars", "这家公司的年收入", "元"),
    ("the app's monthly download count", "downloads", "这款应用的月下载量", "次"),
    ("the port's yearly cargo", "tonnes", "这个港口的年吞吐量", "吨"),
]
# Multipliers are said in words only: the target follows from the words, not from a number.
_MULTIPLIERS = {
    2: ("doubled", "翻了一番"),
    3: ("tripled", "增长到原来的三倍"),
    10: ("grown tenfold", "增长到原来的十倍"),
}
_HEAVY_PATTERNS = {
    ("en", "growth"): "{Subject} was {base} {unit} last year and grew by {percent} percent to {target} {unit} this "
    "year.",
    ("en", "decline"): "{Subject} was {base} {unit} last year and fell by {percent} percent to {target} {unit} this "
    "year.",
    ("en", "multiply"): "Ten years ago {subject} was {base} {unit}; it has since {multiplier} to {target} {unit}.",
    ("zh", "growth"): "{subject}去年为{base}{unit}，今年增长了{percent}%，达到{target}{unit}。",
    ("zh", "decline"): "{subject}去年为{base}{unit}，今年下降了{percent}%，降至{target}{unit}。",
    ("zh", "multiply"): "{subject}十年前为{base}{unit}，如今{multiplier}，达到{target}{unit}。",
}
# Declines stop at 40 % so that a declined value stays inside the template's target range.
_MAX_DECLINE_PERCENT = 40


def _heavy_tailed(rng: random.Random, language: str, kind: str) -> _Draft:
    low, high = _span_range(kind, "heavy_tailed", "base")
    base = float(round(_truncated_pareto(rng, low, high, _PARETO_ALPHA)))
    variant = rng.choice(["growth", "decline", "multiply"])
    en_subject, en_unit, zh_subject, zh_unit = rng.choice(_HEAVY_SUBJECTS)
    if language == "en":
        words = {"subject": en_subject, "Subject": _capitalize(en_subject), "unit": en_unit}
    else:
        words = {"subject": zh_subject, "unit": zh_unit}
    numbers: dict[str, str | float] = {"base": base}
    if variant == "multiply":
        multiplier = rng.choice(sorted(_MULTIPLIERS))
        words["multiplier"] = _MULTIPLIERS[multiplier][0 if language == "en" else 1]
        target = base * multiplier
    else:
        percent_high = int(_span_range(kind, "heavy_tailed", "percent")[1])
        percent = rng.randint(1, percent_high if variant == "growth" else _MAX_DECLINE_PERCENT)
        numbers["percent"] = float(percent)
        sign = 1 if variant == "growth" else -1
        # Integer arithmetic first: base * (100 ± p) is exact below 2**53, then one rounding to a whole count.
        target = round(base * (100 + sign * percent) / 100)
    numbers["target"] = float(target)
    return _Draft(_HEAVY_PATTERNS[language, variant], {**words, **numbers}, variant)


_PLAIN_SUBJECTS = [
    ("The library", "图书馆"), ("The old bridge", "那座老桥"), ("The railway station", "火车站"),
    ("The bakery", "那家面包店"), ("The small café", "那家小咖啡馆"), ("The museum", "博物馆"),
    ("The garden", "花园"), ("The town hall", "市政厅"),
]
_PLAIN_PREDICATES = [
    ("is closed on holidays.", "节假日不开放。"), ("was painted last spring.", "去年春天刚粉刷过。"),
    ("looks busy today.", "今天看起来很忙。"), ("needs a new sign.", "需要一块新招牌。"),
    ("opens after lunch.", "午饭后才开门。"), ("is quiet in the evening.", "晚上很安静。"),
    ("was mentioned in the news.", "上了新闻。"), ("is popular with tourists.", "很受游客欢迎。"),
]
_PLAIN_FOLLOW_UPS = [("", ""), (" Everyone seemed pleased.", "大家都很满意。"), (" Nobody complained.", "没有人抱怨。"),
                     (" It rained all afternoon.", "整个下午都在下雨。")]


def _non_numeric(rng: random.Random, language: str, kind: str) -> _Draft:
    subject = rng.choice(_PLAIN_SUBJECTS)
    predicate = rng.choice(_PLAIN_PREDICATES)
    follow_up = rng.choice(_PLAIN_FOLLOW_UPS)
    index = 0 if language == "en" else 1
    separator = " " if language == "en" else ""
    text = subject[index] + separator + predicate[index] + follow_up[index]
    # Escape braces so that the text goes through the same formatting path as the other templates.
    return _Draft(text.replace("{", "{{").replace("}", "}}"), {}, "plain")


_BUILDERS: dict[str, Callable[[random.Random, str, str], _Draft]] = {
    "price_total": _price_total,
    "unit_conversion": _unit_conversion,
    "sum_difference": _sum_difference,
    "rate_distance": _rate_distance,
    "average": _average,
    "measurement_noise": _measurement_noise,
    "heavy_tailed": _heavy_tailed,
    "non_numeric": _non_numeric,
}


# --------------------------------------------------------------------------------------------------------------
# Rendering and the public API
# --------------------------------------------------------------------------------------------------------------


def _render(draft: _Draft) -> tuple[str, dict[str, float], tuple[int, int] | None]:
    """Fill a draft's pattern; return the text, the earlier numbers in text order, and the target's span."""
    pieces: list[str] = []
    length = 0
    inputs: dict[str, float] = {}
    target_span = None
    for literal, name, _, _ in string.Formatter().parse(draft.pattern):
        pieces.append(literal)
        length += len(literal)
        if name is None:
            continue
        value = draft.fields[name]
        if isinstance(value, str):
            rendered = value
        else:
            if target_span is not None:
                raise AssertionError(f"pattern {draft.pattern!r} has a number after its target")
            rendered = format_number(value)
            if name == "target":
                target_span = (length, length + len(rendered))
            else:
                inputs[name] = float(value)
        pieces.append(rendered)
        length += len(rendered)
    return "".join(pieces), inputs, target_span


def _split_rng(split: str, seed: int) -> random.Random:
    """The generator of one split: seeded from a hash, so different splits never share a random stream."""
    digest = hashlib.sha256(f"causal_qwen.corpus/{split}/{seed}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def generate_corpus(
    n_examples: int,
    split: str = "train",
    seed: int = 0,
    languages: Sequence[str] = LANGUAGES,
    templates: Sequence[str] | None = None,
    exclude_texts: Collection[str] | None = None,
) -> list[NumericExample]:
    """
    Generate a deterministic numeric corpus.

    Args:
        n_examples (`int`): How many examples to generate.
        split (`str`, *optional*, defaults to `"train"`): One of [`SPLITS`]. `train`, `validation` and `test` use the
            training ranges; `extrapolation` uses the extrapolation ranges of [`VALUE_RANGES`] and has no
            `non_numeric` examples. Each split has its own random stream.
        seed (`int`, *optional*, defaults to 0): The corpus seed; the same `(split, seed, languages, templates)` give
            the same corpus.
        languages (`Sequence[str]`, *optional*, defaults to `("en", "zh")`): Languages to draw from, uniformly.
        templates (`Sequence[str]`, *optional*): Restrict to these templates (drawn with their usual relative
            weights). Defaults to all templates of the split.
        exclude_texts (`Collection[str]`, *optional*): Texts to skip (e.g. the training texts, to keep evaluation
            splits disjoint from training); skipped draws are replaced by new ones.

    Returns:
        `list[NumericExample]`: `n_examples` examples.
    """
    if isinstance(n_examples, bool) or not isinstance(n_examples, int) or n_examples < 0:
        raise ValueError(f"`n_examples` must be a non-negative int, got {n_examples!r}")
    if split not in SPLITS:
        raise ValueError(f"`split` must be one of {SPLITS}, got {split!r}")
    languages = tuple(languages)
    if not languages or any(language not in LANGUAGES for language in languages):
        raise ValueError(f"`languages` must be a non-empty subset of {LANGUAGES}, got {languages!r}")
    kind = "extrapolation" if split == "extrapolation" else "train"
    available = [name for name in TEMPLATES if not (kind == "extrapolation" and name == "non_numeric")]
    if templates is None:
        chosen = available
    else:
        chosen = list(dict.fromkeys(templates))
        unknown = [name for name in chosen if name not in available]
        if not chosen or unknown:
            raise ValueError(f"`templates` must be a non-empty subset of {available} for split {split!r}, "
                             f"got {list(templates)!r}")
    weights = [_TEMPLATE_WEIGHTS[name] for name in chosen]
    excluded = frozenset(exclude_texts or ())

    rng = _split_rng(split, seed)
    examples: list[NumericExample] = []
    # Exclusions can only reject a bounded share of draws unless they cover the whole template space.
    max_draws = 100 * n_examples + 1000
    draws = 0
    while len(examples) < n_examples:
        draws += 1
        if draws > max_draws:
            raise RuntimeError(f"could not draw {n_examples} examples outside `exclude_texts` in {max_draws} draws")
        template = rng.choices(chosen, weights)[0]
        language = rng.choice(languages)
        draft = _BUILDERS[template](rng, language, kind)
        text, inputs, span = _render(draft)
        if text in excluded:
            continue
        target = draft.fields.get("target")
        examples.append(
            NumericExample(
                text=text,
                template=template,
                language=language,
                target_value=None if target is None else float(target),
                target_char_span=span,
                split=split,
                variant=draft.variant,
                inputs=inputs,
            )
        )
    return examples


def make_splits(
    n_train: int,
    n_validation: int,
    n_test: int,
    n_extrapolation: int,
    seed: int = 0,
    languages: Sequence[str] = LANGUAGES,
) -> dict[str, list[NumericExample]]:
    """
    Generate the four splits of one corpus.

    Validation, test and extrapolation come from their own random streams and skip every text that occurs in the
    training split, so that no evaluation example is a verbatim copy of a training one.

    Args:
        n_train (`int`), n_validation (`int`), n_test (`int`), n_extrapolation (`int`): Sizes of the splits.
        seed (`int`, *optional*, defaults to 0): The corpus seed.
        languages (`Sequence[str]`, *optional*, defaults to `("en", "zh")`): Languages to draw from.

    Returns:
        `dict[str, list[NumericExample]]`: The keys `train`, `validation`, `test`, `extrapolation`.
    """
    train = generate_corpus(n_train, "train", seed, languages)
    train_texts = {example.text for example in train}
    splits = {"train": train}
    for split, size in (("validation", n_validation), ("test", n_test), ("extrapolation", n_extrapolation)):
        splits[split] = generate_corpus(size, split, seed, languages, exclude_texts=train_texts)
    return splits


def template_baselines(train_examples: Iterable[NumericExample]) -> dict[str, tuple[float, float]]:
    """
    The trivial baseline: predict the training mean or median of the template's target, whatever the text says.

    A model that reads the numbers must beat both. The median is the fairer one for `heavy_tailed`, where a few
    huge targets drag the mean far from the typical value.

    Args:
        train_examples (`Iterable[NumericExample]`): Training examples; those without a target are ignored.

    Returns:
        `dict[str, tuple[float, float]]`: Template name -> `(mean, median)` of its target values.
    """
    targets: dict[str, list[float]] = {}
    for example in train_examples:
        if example.target_value is not None:
            targets.setdefault(example.template, []).append(example.target_value)
    return {name: (math.fsum(values) / len(values), statistics.median(values)) for name, values in targets.items()}


def corpus_statistics(examples: Sequence[NumericExample]) -> dict[str, Any]:
    """
    Counts that tell whether a corpus is balanced: examples per template and language, numbers and words.

    Words are Latin-script words and Chinese characters (one Chinese character is roughly one token of Qwen's
    tokenizer); numbers are what the number grammar of [`causal_qwen.numbers`] finds.

    Returns:
        `dict[str, Any]`: `n_examples`, `templates` and `languages` (counts), `n_numbers`, `n_words`,
        `number_fraction` (numbers / (numbers + words)) and `numbers_per_example`.
    """
    n_numbers = 0
    n_words = 0
    for example in examples:
        spans = find_numbers(example.text)
        n_numbers += len(spans)
        # Blank out the numbers so that their digits are not counted as words.
        text = example.text
        for span in reversed(spans):
            text = text[: span.start] + " " + text[span.end :]
        n_words += sum(1 for token in _WORD.finditer(text))
    total = n_numbers + n_words
    return {
        "n_examples": len(examples),
        "templates": dict(Counter(example.template for example in examples)),
        "languages": dict(Counter(example.language for example in examples)),
        "n_numbers": n_numbers,
        "n_words": n_words,
        "number_fraction": n_numbers / total if total else 0.0,
        "numbers_per_example": n_numbers / len(examples) if examples else 0.0,
    }



def to_jsonl(examples: Iterable[NumericExample], path: str | Path) -> None:
    """Write examples to a JSON-lines file (UTF-8, one example per line, Chinese kept as characters)."""
    with open(path, "w", encoding="utf-8") as handle:
        for example in examples:
            handle.write(json.dumps(example.to_dict(), ensure_ascii=False) + "\n")


def from_jsonl(path: str | Path) -> list[NumericExample]:
    """Read examples written by [`to_jsonl`]; floats round-trip exactly (JSON writes their shortest repr)."""
    with open(path, encoding="utf-8") as handle:
        return [NumericExample.from_dict(json.loads(line)) for line in handle if line.strip()]
