"""Reading a user's data (JSONL, CSV, plain text) and tokenizing it for training or evaluation.

Two forms of example, as most fine-tuning data (and TRL) has them:

- a text, `"A kilo costs 3.5 dollars."` or `{"text": ...}`: every position is trained;
- a prompt and its completion, `{"prompt": "A kilo costs 3.5 dollars, so 4 kilos cost", "completion": " 14 dollars."}`:
  the two are tokenized separately and joined, and only the completion (and the end-of-sequence token after it) is
  labelled; the prompt's positions get −100, so neither the classification nor the value loss is computed there.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable
from pathlib import Path

from ..labels import IGNORE_INDEX

__all__ = ["read_examples", "read_texts", "tokenize_examples", "tokenize_texts"]

Example = str | dict


def read_examples(path: str | Path, text_column: str = "text", prompt_column: str = "prompt",
                  completion_column: str = "completion") -> list[Example]:
    """Examples from a `.jsonl` (one object per line), `.csv` (with a header) or `.txt` file (one text per line).

    A `.jsonl`/`.csv` file whose first row has `prompt_column` and `completion_column` gives prompt/completion
    dicts; otherwise each row's `text_column` is a text.
    """
    path, rows = _read_rows(path)
    if rows and isinstance(rows[0], dict) and prompt_column in rows[0] and completion_column in rows[0]:
        return [{"prompt": _column(row, prompt_column, path, i), "completion": _column(row, completion_column, path, i)}
                for i, row in enumerate(rows)]
    return _texts(rows, text_column, path)


def read_texts(path: str | Path, text_column: str = "text") -> list[str]:
    """Texts from a `.jsonl`, `.csv` or `.txt` file (see [`read_examples`] for prompt/completion data)."""
    path, rows = _read_rows(path)
    return _texts(rows, text_column, path)


def _texts(rows: list, column: str, path: Path) -> list[str]:
    """Lines of a `.txt` file as they are; the `column` of each row of a `.jsonl` / `.csv` file."""
    return [row if isinstance(row, str) else _column(row, column, path, i) for i, row in enumerate(rows)]


def _read_rows(path: str | Path) -> tuple[Path, list]:
    """The lines of a `.txt` file, or the rows (dicts) of a `.jsonl` / `.csv` file."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"data file {path} does not exist")
    suffix = path.suffix.lower()
    with path.open(encoding="utf-8") as f:
        if suffix == ".txt":
            return path, [line.rstrip("\n") for line in f if line.strip()]
        if suffix == ".jsonl":
            return path, [json.loads(line) for line in f if line.strip()]
        if suffix == ".csv":
            return path, list(csv.DictReader(f))
    raise ValueError(f"data file {path} must end in .jsonl, .csv or .txt")


def _column(row, column: str, path: Path, index: int) -> str:
    if not isinstance(row, dict) or column not in row or not isinstance(row[column], str):
        raise ValueError(f"row {index} of {path} has no text column {column!r}")
    return row[column]


def tokenize_examples(tokenizer, examples: Iterable[Example], max_length: int | None = None,
                      add_eos: bool = True) -> list[dict]:
    """One feature dict per example (`input_ids`, `attention_mask`, `numeric_values`, and `labels` for
    prompt/completion examples), as lists, for [`CausalQwenDataCollator`].

    Texts are tokenized as they are (the collator labels every position). A prompt/completion pair is tokenized
    in two parts and joined, the end-of-sequence token appended when `add_eos` (so the model learns to stop);
    labels are −100 on the prompt. `max_length` truncates a text at its end, and a pair at the start of its
    prompt, so that the completion, which carries the labels, is kept.
    """
    examples = list(examples)
    texts = [(i, e) for i, e in enumerate(examples) if isinstance(e, str)]
    pairs = [(i, e) for i, e in enumerate(examples) if not isinstance(e, str)]
    features: list[dict | None] = [None] * len(examples)
    if texts:
        encoded = tokenizer([e for _, e in texts], truncation=max_length is not None, max_length=max_length)
        keys = [k for k in ("input_ids", "attention_mask", "numeric_values") if k in encoded]
        for row, (i, _) in enumerate(texts):
            features[i] = {k: list(encoded[k][row]) for k in keys}
    if pairs:
        for i, pair in pairs:
            if not isinstance(pair, dict) or not isinstance(pair.get("prompt"), str) or not isinstance(
                    pair.get("completion"), str):
                raise ValueError(f"examples[{i}] must be a text or a dict with 'prompt' and 'completion' strings, "
                                 f"got {pair!r}")
        prompts = tokenizer([p["prompt"] for _, p in pairs])
        completions = tokenizer([p["completion"] for _, p in pairs])
        eos = getattr(tokenizer, "eos_token_id", None)
        if add_eos and eos is None:
            raise ValueError("add_eos=True needs a tokenizer with an eos_token_id")
        for row, (i, _) in enumerate(pairs):
            features[i] = _join(prompts, completions, row, eos if add_eos else None, max_length)
    return features


def _join(prompts, completions, row: int, eos: int | None, max_length: int | None) -> dict:
    prompt_ids, completion_ids = list(prompts["input_ids"][row]), list(completions["input_ids"][row])
    prompt_values, completion_values = _values(prompts, row), _values(completions, row)
    if eos is not None:
        completion_ids.append(eos)
        completion_values.append(0.0)
    if max_length is not None and len(prompt_ids) + len(completion_ids) > max_length:
        keep = max(0, max_length - len(completion_ids))
        prompt_ids, prompt_values = prompt_ids[len(prompt_ids) - keep:], prompt_values[len(prompt_values) - keep:]
        completion_ids, completion_values = completion_ids[:max_length], completion_values[:max_length]
    ids = prompt_ids + completion_ids
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "numeric_values": prompt_values + completion_values,
            "labels": [IGNORE_INDEX] * len(prompt_ids) + completion_ids}


def _values(encoded, row: int) -> list[float]:
    """The row's numbers; zeros from a tokenizer that has none (a plain Qwen2 tokenizer)."""
    if "numeric_values" in encoded:
        return [float(v) for v in encoded["numeric_values"][row]]
    return [0.0] * len(encoded["input_ids"][row])


def tokenize_texts(tokenizer, texts: Iterable[str], max_length: int | None = None) -> list[dict]:
    """One feature dict per text; the same as [`tokenize_examples`] for plain texts."""
    return tokenize_examples(tokenizer, texts, max_length)
