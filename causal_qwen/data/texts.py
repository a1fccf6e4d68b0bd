"""Reading a user's texts (JSONL, CSV, plain text) and tokenizing them for training or evaluation."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable
from pathlib import Path

__all__ = ["read_texts", "tokenize_texts"]


def read_texts(path: str | Path, text_column: str = "text") -> list[str]:
    """Texts from a `.jsonl` (one object per line), `.csv` (with a header) or `.txt` file (one text per line)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"data file {path} does not exist")
    suffix = path.suffix.lower()
    with path.open(encoding="utf-8") as f:
        if suffix == ".jsonl":
            rows = [json.loads(line) for line in f if line.strip()]
            return [_column(row, text_column, path, i) for i, row in enumerate(rows)]
        if suffix == ".csv":
            return [_column(row, text_column, path, i) for i, row in enumerate(csv.DictReader(f))]
        if suffix == ".txt":
            return [line.rstrip("\n") for line in f if line.strip()]
    raise ValueError(f"data file {path} must end in .jsonl, .csv or .txt")


def _column(row: dict, column: str, path: Path, index: int) -> str:
    if column not in row or not isinstance(row[column], str):
        raise ValueError(f"row {index} of {path} has no text column {column!r}")
    return row[column]


def tokenize_texts(tokenizer, texts: Iterable[str], max_length: int | None = None) -> list[dict]:
    """One feature dict per text (`input_ids`, `attention_mask`, `numeric_values` as lists), for the collator."""
    texts = list(texts)
    if not texts:
        return []
    encoded = tokenizer(texts, truncation=max_length is not None, max_length=max_length)
    keys = [k for k in ("input_ids", "attention_mask", "numeric_values") if k in encoded]
    return [{k: encoded[k][i] for k in keys} for i in range(len(texts))]
