"""Data for CausalQwen: a deterministic corpus of English and Chinese text in which numbers matter, and batching."""

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

__all__ = [
    "CausalQwenDataCollator",
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
