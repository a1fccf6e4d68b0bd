"""Tokenizer of CausalQwen: a Qwen2 tokenizer that reads every number of a text as one `<NUM>` token."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from transformers import BatchEncoding, Qwen2Tokenizer
from transformers.tokenization_utils_base import PaddingStrategy, TensorType, TruncationStrategy
from transformers.utils import is_torch_tensor, to_py_obj

from .numbers import format_number, scan_numbers

__all__ = ["CausalQwenTokenizer"]

NUM_TOKEN = "<NUM>"


class CausalQwenTokenizer(Qwen2Tokenizer):
    r"""
    Qwen2 tokenizer that replaces every number of a text by one `<NUM>` token and returns its value in a parallel
    `numeric_values` sequence (0.0 at every other position).

    Numbers are found by [`causal_qwen.numbers.find_numbers`] (the grammar is documented in
    `docs/number_grammar.md`). The text between numbers is tokenized exactly as the Qwen2 tokenizer tokenizes that
    piece of text on its own; the pieces of a whole batch go to the Rust tokenizer in one call. Decoding writes each
    value back with [`causal_qwen.numbers.format_number`].

    `<NUM>` is a special token of the vocabulary; loaded from a Qwen2 tokenizer it takes the first free id,
    `len(base_tokenizer)` (151,665 for Qwen2.5), and it is saved with the tokenizer so the id never moves.

    ```python
    >>> tokenizer = CausalQwenTokenizer.from_pretrained("path/to/qwen2.5")
    >>> batch = tokenizer("价格是99.9元", return_tensors="pt")
    >>> batch["input_ids"]
    tensor([[ 97480,  20412, 151665,  23305]])
    >>> batch["numeric_values"]
    tensor([[ 0.0000,  0.0000, 99.9000,  0.0000]], dtype=torch.float64)
    >>> tokenizer.decode(batch["input_ids"][0], numeric_values=batch["numeric_values"][0])
    '价格是99.9元'
    ```

    Args:
        vocab (`str` or `dict[str, int]`, *optional*):
            The BPE vocabulary, as for [`Qwen2Tokenizer`].
        merges (`str` or `list[str]`, *optional*):
            The BPE merges, as for [`Qwen2Tokenizer`].
        num_token (`str`, *optional*, defaults to `"<NUM>"`):
            The token that stands for a number.
        use_numeric (`bool`, *optional*, defaults to `True`):
            Whether numbers become `<NUM>` tokens. With `False` the tokenizer is the plain Qwen2 tokenizer (digits
            stay digits) for the text-only model: its outputs are exactly those of [`Qwen2Tokenizer`], without
            `numeric_values`. Saved in the tokenizer config.
        kwargs (additional keyword arguments, *optional*):
            Passed to [`Qwen2Tokenizer`].
    """

    model_input_names = ["input_ids", "attention_mask", "numeric_values"]

    def __init__(
        self,
        vocab: str | dict[str, int] | None = None,
        merges: str | list[str] | None = None,
        num_token: str = NUM_TOKEN,
        use_numeric: bool = True,
        **kwargs,
    ):
        # A `*_token` keyword is registered by the base class as a named special token: it is added to the
        # vocabulary after the tokens already there, exposed as `self.num_token` / `self.num_token_id` and saved.
        super().__init__(vocab=vocab, merges=merges, num_token=num_token, use_numeric=use_numeric, **kwargs)
        self.use_numeric = bool(use_numeric)
        if not self.use_numeric:
            self.model_input_names = [name for name in self.model_input_names if name != "numeric_values"]
        self._literal_num_ids: list[int] | None = None

    @property
    def num_token_id(self) -> int:
        """`int`: Id of the `<NUM>` token."""
        return self.convert_tokens_to_ids(self.num_token)

    # ------------------------------------------------------------------------------------------------------------
    # Encoding
    # ------------------------------------------------------------------------------------------------------------

    def _encode_plus(
        self,
        text: str | Sequence[str],
        text_pair: str | Sequence[str] | None = None,
        add_special_tokens: bool = True,
        padding_strategy: PaddingStrategy = PaddingStrategy.DO_NOT_PAD,
        truncation_strategy: TruncationStrategy = TruncationStrategy.DO_NOT_TRUNCATE,
        max_length: int | None = None,
        stride: int = 0,
        is_split_into_words: bool = False,
        pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
        return_tensors: str | TensorType | None = None,
        return_token_type_ids: bool | None = None,
        return_attention_mask: bool | None = None,
        return_overflowing_tokens: bool = False,
        return_special_tokens_mask: bool = False,
        return_offsets_mapping: bool = False,
        return_length: bool = False,
        verbose: bool = True,
        split_special_tokens: bool | None = None,
        **kwargs,
    ) -> BatchEncoding:
        if not self.use_numeric:
            return super()._encode_plus(
                text,
                text_pair=text_pair,
                add_special_tokens=add_special_tokens,
                padding_strategy=padding_strategy,
                truncation_strategy=truncation_strategy,
                max_length=max_length,
                stride=stride,
                is_split_into_words=is_split_into_words,
                pad_to_multiple_of=pad_to_multiple_of,
                padding_side=padding_side,
                return_tensors=return_tensors,
                return_token_type_ids=return_token_type_ids,
                return_attention_mask=return_attention_mask,
                return_overflowing_tokens=return_overflowing_tokens,
                return_special_tokens_mask=return_special_tokens_mask,
                return_offsets_mapping=return_offsets_mapping,
                return_length=return_length,
                verbose=verbose,
                split_special_tokens=split_special_tokens,
                **kwargs,
            )
        unsupported = {
            "text_pair": text_pair is not None,
            "is_split_into_words": is_split_into_words,
            "return_overflowing_tokens": return_overflowing_tokens,
            "return_offsets_mapping": return_offsets_mapping,
            "sanitize_control_tokens": bool(kwargs.get("sanitize_control_tokens")),
        }
        for name, requested in unsupported.items():
            if requested:
                raise NotImplementedError(
                    f"`{name}` is not supported by {type(self).__name__} with use_numeric=True; "
                    "load the tokenizer with use_numeric=False for plain Qwen2 tokenization"
                )
        is_batched = isinstance(text, (list, tuple))
        texts = list(text) if is_batched else [text]
        for index, item in enumerate(texts):
            if not isinstance(item, str):
                where = f"`text[{index}]`" if is_batched else "`text`"
                raise TypeError(f"{where} must be a str, got {type(item).__name__}")

        input_ids, numeric_values = self._encode_numeric(texts, split_special_tokens)
        prefix, suffix = self._special_tokens_around_sequence() if add_special_tokens else ([], [])
        if truncation_strategy != TruncationStrategy.DO_NOT_TRUNCATE and max_length is not None:
            budget = max(max_length - len(prefix) - len(suffix), 0)
            input_ids = [self._truncate(ids, budget) for ids in input_ids]
            numeric_values = [self._truncate(values, budget) for values in numeric_values]
        if prefix or suffix:
            input_ids = [prefix + ids + suffix for ids in input_ids]
            numeric_values = [[0.0] * len(prefix) + values + [0.0] * len(suffix) for values in numeric_values]

        encoded: dict[str, list] = {"input_ids": input_ids, "numeric_values": numeric_values}
        if return_token_type_ids:
            encoded["token_type_ids"] = [[0] * len(ids) for ids in input_ids]
        if return_special_tokens_mask:
            content = [len(ids) - len(prefix) - len(suffix) for ids in input_ids]
            encoded["special_tokens_mask"] = [[1] * len(prefix) + [0] * n + [1] * len(suffix) for n in content]
        for ids in input_ids:
            self._eventual_warn_about_too_long_sequence(ids, max_length, verbose)

        # The base padding pads every key, `numeric_values` with 0.0 (see `_pad`), and adds the attention mask.
        padded = super().pad(
            encoded,
            padding=padding_strategy,
            max_length=max_length,
            pad_to_multiple_of=pad_to_multiple_of,
            padding_side=padding_side,
            return_attention_mask=return_attention_mask,
            verbose=verbose,
        )
        data = dict(padded)
        data["numeric_values"] = data.pop("numeric_values")  # after the attention mask, as in model_input_names
        if return_length:
            data["length"] = [len(ids) for ids in data["input_ids"]]
        if not is_batched and return_tensors is None:
            # Same unbatching rule as the Qwen2 tokenizer: sequences lose their batch axis, `length` keeps it.
            data = {key: value[0] if value and isinstance(value[0], list) else value for key, value in data.items()}
        return self._to_batch_encoding(data, return_tensors)

    def _encode_numeric(
        self, texts: list[str], split_special_tokens: bool | None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Token ids and aligned values of each text: numbers become `<NUM>`, the text between them is encoded."""
        num_token, num_token_id = self.num_token, self.num_token_id
        # Each text becomes the list of its pieces: strings (text) with one value (float) between two of them.
        layouts = []
        for text in texts:
            layout: list[str | float] = []
            position = 0
            for start, end, value in scan_numbers(text):
                layout.append(text[position:start])
                layout.append(value)
                position = end
            layout.append(text[position:])
            layouts.append(layout)

        # The literal string "<NUM>" in a text is text, not a number without a value: its two sides are
        # encoded as separate segments around the ordinary BPE pieces of "<NUM>".
        segments = set()
        for layout in layouts:
            for piece in layout:
                if isinstance(piece, str):
                    segments.update(piece.split(num_token) if num_token in piece else (piece,))
        segment_ids = self._encode_segments(segments, split_special_tokens)

        input_ids, numeric_values = [], []
        for layout in layouts:
            ids: list[int] = []
            positions, values = [], []
            for piece in layout:
                if not isinstance(piece, str):
                    positions.append(len(ids))
                    values.append(piece)
                    ids.append(num_token_id)
                elif num_token not in piece:
                    ids += segment_ids[piece]
                else:
                    for index, part in enumerate(piece.split(num_token)):
                        if index:
                            ids += self._literal_num_token_ids()
                        ids += segment_ids[part]
            aligned = [0.0] * len(ids)
            for position, value in zip(positions, values, strict=True):
                aligned[position] = value
            input_ids.append(ids)
            numeric_values.append(aligned)
        return input_ids, numeric_values

    def _encode_segments(self, segments: set[str], split_special_tokens: bool | None) -> dict[str, list[int]]:
        """Ids of each distinct text segment, from one call to the Rust tokenizer for all of them."""
        # Pieces are encoded alone: no padding or truncation left on the backend by an earlier call.
        self.set_truncation_and_padding(
            padding_strategy=PaddingStrategy.DO_NOT_PAD,
            truncation_strategy=TruncationStrategy.DO_NOT_TRUNCATE,
            max_length=None,
            stride=0,
            pad_to_multiple_of=None,
            padding_side=None,
        )
        split_special_tokens = self.split_special_tokens if split_special_tokens is None else split_special_tokens
        if self._tokenizer.encode_special_tokens != split_special_tokens:
            self._tokenizer.encode_special_tokens = split_special_tokens
        batch = [segment for segment in segments if segment]
        encodings = self._tokenizer.encode_batch_fast(batch, add_special_tokens=False)
        segment_ids = {segment: encoding.ids for segment, encoding in zip(batch, encodings, strict=True)}
        segment_ids[""] = []
        return segment_ids

    def _literal_num_token_ids(self) -> list[int]:
        """Ids of the string "<NUM>" read as ordinary text (its BPE pieces, not the special token)."""
        if self._literal_num_ids is None:
            self._literal_num_ids = self._encode_without_added_tokens(self.num_token)
        return self._literal_num_ids

    def _special_tokens_around_sequence(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor puts before and after one sequence (none for Qwen2's)."""
        post_processor = self._tokenizer.post_processor
        if post_processor is None or post_processor.num_special_tokens_to_add(False) == 0:
            return [], []
        encoding = self._tokenizer.encode("a", add_special_tokens=True)
        mask = encoding.special_tokens_mask
        first = mask.index(0)
        last = len(mask) - mask[::-1].index(0)
        return encoding.ids[:first], encoding.ids[last:]

    def _truncate(self, sequence: list, budget: int) -> list:
        """Keep `budget` items of a sequence, cut on `self.truncation_side`. A number is one token, never split."""
        if len(sequence) <= budget:
            return sequence
        return sequence[:budget] if self.truncation_side == "right" else sequence[len(sequence) - budget :]

    def tokenize(self, text: str, pair: str | None = None, add_special_tokens: bool = False, **kwargs) -> list[str]:
        """Token strings of `text`; with `use_numeric`, each number is the string `<NUM>`."""
        if not self.use_numeric:
            return super().tokenize(text, pair=pair, add_special_tokens=add_special_tokens, **kwargs)
        input_ids = self._encode_plus(text, text_pair=pair, add_special_tokens=add_special_tokens, **kwargs)
        return self.convert_ids_to_tokens(input_ids["input_ids"])

    def apply_chat_template(self, conversation: list[dict[str, str]] | list[list[dict[str, str]]], *args, **kwargs):
        """
        The base chat template, numbers included: with `tokenize=True` and `return_dict=True` (the defaults) the
        result holds `numeric_values` aligned with `input_ids`; `return_dict=False` gives the ids only.
        """
        if self.use_numeric and kwargs.get("return_assistant_tokens_mask"):
            raise NotImplementedError(
                "`return_assistant_tokens_mask` needs character offsets, which CausalQwenTokenizer does not track "
                "with use_numeric=True"
            )
        return super().apply_chat_template(conversation, *args, **kwargs)

    # ------------------------------------------------------------------------------------------------------------
    # Padding
    # ------------------------------------------------------------------------------------------------------------

    def pad(
        self,
        encoded_inputs: BatchEncoding | Mapping[str, Any] | Sequence[Mapping[str, Any]],
        padding: bool | str | PaddingStrategy = True,
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
        return_attention_mask: bool | None = None,
        return_tensors: str | TensorType | None = None,
        verbose: bool = True,
    ) -> BatchEncoding:
        """
        Pad one encoded input or a batch, as [`~PreTrainedTokenizerBase.pad`], with `numeric_values` padded by 0.0
        on the padding side and returned as float64 tensors. Works as a collate function on a list of examples.
        """
        if isinstance(encoded_inputs, (list, tuple)) and encoded_inputs and isinstance(encoded_inputs[0], Mapping):
            encoded_inputs = {key: [example[key] for example in encoded_inputs] for key in encoded_inputs[0].keys()}
        if not isinstance(encoded_inputs, Mapping):
            raise TypeError(
                "`encoded_inputs` must be a dict of lists or a list of dicts, got "
                f"{type(encoded_inputs).__name__}"
            )
        if return_tensors is None:
            return_tensors = _tensor_type_of(encoded_inputs.get("input_ids"))
        # Tensors are padded as Python lists: converting back at the end keeps float64 values exact.
        encoded_inputs = {key: to_py_obj(value) for key, value in encoded_inputs.items()}
        padded = super().pad(
            encoded_inputs,
            padding=padding,
            max_length=max_length,
            pad_to_multiple_of=pad_to_multiple_of,
            padding_side=padding_side,
            return_attention_mask=return_attention_mask,
            verbose=verbose,
        )
        return self._to_batch_encoding(dict(padded), return_tensors)

    def _pad(
        self,
        encoded_inputs: dict[str, Any] | BatchEncoding,
        max_length: int | None = None,
        padding_strategy: PaddingStrategy = PaddingStrategy.DO_NOT_PAD,
        pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
        return_attention_mask: bool | None = None,
    ) -> dict:
        values = encoded_inputs.get("numeric_values")
        length = len(encoded_inputs[self.model_input_names[0]])
        if values is not None and len(values) != length:
            raise ValueError(
                f"`numeric_values` has {len(values)} entries but `{self.model_input_names[0]}` has {length}"
            )
        padded = super()._pad(
            encoded_inputs,
            max_length=max_length,
            padding_strategy=padding_strategy,
            pad_to_multiple_of=pad_to_multiple_of,
            padding_side=padding_side,
            return_attention_mask=return_attention_mask,
        )
        difference = len(padded[self.model_input_names[0]]) - length
        if values is not None and difference > 0:
            side = padding_side if padding_side is not None else self.padding_side
            zeros = [0.0] * difference
            padded["numeric_values"] = list(values) + zeros if side == "right" else zeros + list(values)
        return padded

    def _to_batch_encoding(self, data: dict[str, Any], return_tensors: str | TensorType | None) -> BatchEncoding:
        """A `BatchEncoding` of `data`, with `numeric_values` as float64 tensors (int and float32 would round)."""
        values = data.get("numeric_values")
        if return_tensors is not None and values is not None and not _is_tensor(values):
            tensor_type = TensorType(return_tensors)
            try:
                if tensor_type == TensorType.PYTORCH:
                    data["numeric_values"] = torch.tensor(values, dtype=torch.float64)
                elif tensor_type == TensorType.NUMPY:
                    data["numeric_values"] = np.asarray(values, dtype=np.float64)
            except ValueError as error:
                raise ValueError(
                    "Unable to create tensors of sequences of different lengths: pass padding=True (and "
                    "truncation=True) to get batched tensors"
                ) from error
        return BatchEncoding(data, tensor_type=return_tensors)

    # ------------------------------------------------------------------------------------------------------------
    # Decoding
    # ------------------------------------------------------------------------------------------------------------

    def decode(
        self,
        token_ids: int | Sequence[int] | Sequence[Sequence[int]] | Any,
        skip_special_tokens: bool = False,
        numeric_values: Sequence[float] | Sequence[Sequence[float]] | Any | None = None,
        **kwargs,
    ) -> str | list[str]:
        """
        Turn token ids back into text, writing the value of each `<NUM>` as digits with
        [`causal_qwen.numbers.format_number`].

        The ids between two numbers are decoded by the Qwen2 tokenizer and the formatted values are spliced between
        them, so the text comes back exactly (spaces are never cleaned up). With `use_numeric=False` and no
        `numeric_values`, decoding is exactly Qwen2's.

        Args:
            token_ids (`list[int]`, `list[list[int]]`, `np.ndarray` or `torch.Tensor`):
                One sequence or a batch of sequences.
            skip_special_tokens (`bool`, *optional*, defaults to `False`):
                Drop special tokens such as padding and chat markers. `<NUM>` is always written as its value.
            numeric_values (same shape as `token_ids`, *optional*):
                The value of each position, as returned by the tokenizer or the model. Required when the ids contain
                `<NUM>`; positions that are not `<NUM>` are ignored.

        Returns:
            `str` for one sequence, `list[str]` for a batch.

        Raises:
            `ValueError`: a `<NUM>` without `numeric_values`, `numeric_values` of another length than the ids, or a
            NaN or infinite value at a `<NUM>`.
            `TypeError`: `numeric_values` or a value in it is not numeric.
        """
        if not self.use_numeric and numeric_values is None:
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        token_ids = to_py_obj(token_ids)
        numeric_values = to_py_obj(numeric_values)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
            if isinstance(numeric_values, (int, float)):
                numeric_values = [numeric_values]
        if numeric_values is not None and not isinstance(numeric_values, (list, tuple)):
            raise TypeError(
                "`numeric_values` must be a sequence of numbers (list, array or tensor) shaped like `token_ids`, "
                f"got {type(numeric_values).__name__}"
            )
        if not (isinstance(token_ids, (list, tuple)) and token_ids and isinstance(token_ids[0], (list, tuple))):
            return self._decode(token_ids, skip_special_tokens=skip_special_tokens, numeric_values=numeric_values)
        if numeric_values is not None:
            if len(numeric_values) != len(token_ids):
                raise ValueError(
                    f"`numeric_values` has {len(numeric_values)} rows but `token_ids` has {len(token_ids)}"
                )
            if not all(isinstance(row, (list, tuple)) for row in numeric_values):
                raise TypeError("`numeric_values` must have one row of values per sequence of `token_ids`")
        return [
            self._decode(
                ids,
                skip_special_tokens=skip_special_tokens,
                numeric_values=None if numeric_values is None else numeric_values[row],
                row=row,
            )
            for row, ids in enumerate(token_ids)
        ]

    def batch_decode(
        self,
        sequences: Sequence[Sequence[int]] | Any,
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        numeric_values: Sequence[Sequence[float]] | Any | None = None,
        **kwargs,
    ) -> list[str]:
        """Decode a batch of sequences, see [`~CausalQwenTokenizer.decode`]."""
        decoded = self.decode(
            sequences, skip_special_tokens=skip_special_tokens, numeric_values=numeric_values, **kwargs
        )
        return [decoded] if isinstance(decoded, str) else decoded

    def _decode(
        self,
        token_ids: int | Sequence[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        numeric_values: Sequence[float] | None = None,
        row: int | None = None,
        **kwargs,
    ) -> str:
        """Decode one sequence: runs of ordinary ids by the Rust decoder, each `<NUM>` as its formatted value."""
        if not self.use_numeric and numeric_values is None:
            return super()._decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces, **kwargs)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        where = "" if row is None else f" in row {row}"
        if numeric_values is not None and len(numeric_values) != len(token_ids):
            raise ValueError(
                f"`numeric_values`{where} has {len(numeric_values)} entries but `token_ids` has {len(token_ids)}"
            )
        num_token_id = self.num_token_id
        numbers = [position for position, token_id in enumerate(token_ids) if token_id == num_token_id]
        if numbers and numeric_values is None:
            raise ValueError(
                f"`token_ids`{where} contain {self.num_token} at position {numbers[0]} but no `numeric_values` were "
                "given: pass the values returned with the ids to write the numbers"
            )
        # Spaces are never cleaned up: the text between numbers must come back exactly.
        runs, start = [], 0
        for position in numbers:
            runs.append(list(token_ids[start:position]))
            start = position + 1
        runs.append(list(token_ids[start:]))
        texts = self._tokenizer.decode_batch(runs, skip_special_tokens=skip_special_tokens)
        pieces = [texts[0]]
        for position, text in zip(numbers, texts[1:], strict=True):
            pieces.append(self._format_value(numeric_values[position], position, where))
            pieces.append(text)
        return "".join(pieces)

    def _format_value(self, value: Any, position: int, where: str) -> str:
        """The digits of the value at a `<NUM>`, with errors that name the position."""
        try:
            return format_number(value)
        except TypeError as error:
            raise TypeError(
                f"`numeric_values`{where} at position {position} must be a number, got {type(value).__name__}"
            ) from error
        except ValueError as error:
            raise ValueError(
                f"`numeric_values`{where} at position {position} is {value}, which cannot be written as digits"
            ) from error


def _is_tensor(value: Any) -> bool:
    return is_torch_tensor(value) or isinstance(value, np.ndarray)


def _tensor_type_of(value: Any) -> str | None:
    """The tensor type ("pt", "np") of a value or of the first item of a list of values, None for lists."""
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    if is_torch_tensor(value):
        return "pt"
    if isinstance(value, np.ndarray):
        return "np"
    return None
