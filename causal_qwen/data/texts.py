"""Reading a user's data (JSONL, CSV, plain text) and tokenizing it for training or evaluation.

Two forms of example, as most fine-tuning data (and TRL) has them:

- a text, `"A kilo costs 3.5 dollars."` or `{"text": ...}`: every position is trained;
- a prompt and its completion, `{"prompt": "A kilo costs 3.5 dollars, so 4 kilos cost", "completion": " 14 dollars."}`:
  the two are tokenized separately and joined, and only the completion (and the end-of-sequence token after it) is
  labelled; the prompt's positions get −100, so neither the classification nor the value loss is computed there.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["read_examples", "read_texts", "tokenize_examples", "tokenize_texts"]

Example = str | dict


def read_examples(path: str | Path, text_column: str = "text", prompt_column: str = "prompt",
                  completion_column: str = "completion") -> list[Example]:
    """Examples from a `.jsonl` (one object per line), `.csv` (with a header) or `.txt` file (one text per line).

    A `.jsonl`/`.csv` file whose first row has `prompt_column` and `completion_column` gives prompt/completion
    dicts; otherwise each row's `text_column` is a text. Files are read as UTF-8 (a byte-order mark is skipped);
    blank lines are skipped. A file without examples, a line that is not valid JSON, a row without its column or
    with an empty text raise a `ValueError` naming the file and the line.
    """
    path, rows = _read_rows(path)
    first = rows[0].value
    if isinstance(first, dict) and prompt_column in first and completion_column in first:
        return [{"prompt": _column(row, prompt_column, path, i, allow_empty=True),
                 "completion": _column(row, completion_column, path, i, allow_empty=True)}
                for i, row in enumerate(rows)]
    return _texts(rows, text_column, path)


def read_texts(path: str | Path, text_column: str = "text") -> list[str]:
    """Texts from a `.jsonl`, `.csv` or `.txt` file (see [`read_examples`] for prompt/completion data)."""
    path, rows = _read_rows(path)
    return _texts(rows, text_column, path)


@dataclass(frozen=True)
class _Row:
    """A row of a data file and the line it starts on (1-based, as an editor counts them)."""

    line: int
    value: str | dict


def _texts(rows: list[_Row], column: str, path: Path) -> list[str]:
    """Lines of a `.txt` file as they are; the `column` of each row of a `.jsonl` / `.csv` file."""
    return [row.value if isinstance(row.value, str) else _column(row, column, path, i) for i, row in enumerate(rows)]


def _read_rows(path: str | Path) -> tuple[Path, list[_Row]]:
    """The non-blank lines of a `.txt` file, or the rows (dicts, or JSON strings) of a `.jsonl` / `.csv` file."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"data file {path} does not exist")
    if not path.is_file():
        raise ValueError(f"data file {path} is not a file")
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl", ".csv"):
        raise ValueError(f"data file {path} must end in .jsonl, .csv or .txt")
    text = _decode(path)
    if suffix == ".csv":
        rows, empty = _csv_rows(text, path), "has a header but no rows"
    else:
        # newline=None: "\r\n" and "\r" end lines as a file opened in text mode reads them.
        lines = [(n, line.rstrip("\n")) for n, line in enumerate(io.StringIO(text, newline=None), start=1)
                 if line.strip()]
        if suffix == ".txt":
            rows = [_Row(n, line) for n, line in lines]
        else:
            rows = [_Row(n, _json_line(line, n, path)) for n, line in lines]
        empty = "has only blank lines"
    if not text:
        empty = "is empty"
    if not rows:
        raise ValueError(f"data file {path} holds no examples: it {empty}")
    return path, rows


def _decode(path: Path) -> str:
    """The file's text; "utf-8-sig" drops the byte-order mark that spreadsheet programs write."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = raw[:error.start].count(b"\n") + 1
        raise ValueError(f"data file {path} is not UTF-8 text: line {line} holds the byte "
                         f"0x{raw[error.start]:02x} ({error.reason}); save it as UTF-8") from None


def _json_line(line: str, number: int, path: Path) -> str | dict:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"line {number} of {path} is not valid JSON: {error.msg} at column {error.colno}") from None
    if not isinstance(value, (dict, str)):
        raise ValueError(f"line {number} of {path} holds a JSON {type(value).__name__}; each line must be an object "
                         "(or a string, a text)")
    return value


def _csv_rows(text: str, path: Path) -> list[_Row]:
    reader = csv.DictReader(io.StringIO(text, newline=""))
    rows = []
    try:
        for row in reader:
            if None in row:
                raise ValueError(f"line {reader.line_num} of {path} has more fields than the header "
                                 f"({len(reader.fieldnames)})")
            # line_num is the record's last line; a quoted field may span lines.
            spanned = sum(value.count("\n") for value in row.values() if isinstance(value, str))
            rows.append(_Row(reader.line_num - spanned, row))
    except csv.Error as error:
        raise ValueError(f"line {reader.line_num} of {path} is not valid CSV: {error}") from None
    return rows


def _column(row: _Row, column: str, path: Path, index: int, allow_empty: bool = False) -> str:
    where = f"row {index} of {path} (line {row.line})"
    if not isinstance(row.value, dict) or column not in row.value:
        columns = ", ".join(map(repr, row.value)) if isinstance(row.value, dict) else "none: the line is a string"
        raise ValueError(f"{where} has no text column {column!r} (its columns: {columns})")
    value = row.value[column]
    if value is None:  # a CSV row with fewer fields than the header
        raise ValueError(f"{where} has no value in column {column!r}: the row has fewer fields than the header")
    if not isinstance(value, str):
        raise ValueError(f"{where}: column {column!r} holds {type(value).__name__} {value!r}, not a string")
    if not value and not allow_empty:
        raise ValueError(f"{where}: column {column!r} is empty (a text needs at least one character)")
    return value


def tokenize_examples(tokenizer, examples: Iterable[Example], max_length: int | None = None,
                      add_eos: bool = True) -> list[dict]:
    """One feature dict per example (`input_ids`, `attention_mask`, `numeric_values`, and `labels` for
    prompt/completion examples), as lists, for [`CausalQwenDataCollator`].

    Texts are tokenized as they are (the collator labels every position). A prompt/completion pair is tokenized
    in two parts and joined, the end-of-sequence token appended when `add_eos` (so the model learns to stop);
    labels are −100 on the prompt. `max_length` truncates a text at its end, and a pair at the start of its
    prompt, so that the completion, which carries the labels, is kept. A tokenizer that does not read numbers (a
    plain Qwen2 tokenizer) gives `numeric_values` 0 everywhere: its numbers stay digits.
    """
    examples = list(examples)
    texts = [(i, e) for i, e in enumerate(examples) if isinstance(e, str)]
    pairs = [(i, e) for i, e in enumerate(examples) if not isinstance(e, str)]
    features: list[dict | None] = [None] * len(examples)
    if texts:
        encoded = tokenizer([e for _, e in texts], truncation=max_length is not None, max_length=max_length)
        for row, (i, _) in enumerate(texts):
            ids = list(encoded["input_ids"][row])
            mask = list(encoded["attention_mask"][row]) if "attention_mask" in encoded else [1] * len(ids)
            features[i] = {"input_ids": ids, "attention_mask": mask, "numeric_values": _values(encoded, row)}
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
    from ..labels import IGNORE_INDEX  # here, not above: `labels` imports torch, which reading a file does not need

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
