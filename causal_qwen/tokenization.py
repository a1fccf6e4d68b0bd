"""Tokenizer of CausalQwen: a Qwen2 tokenizer that reads every number of a text as one `<NUM>` token."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import BatchEncoding, Qwen2Tokenizer
from transformers.tokenization_utils_base import PaddingStrategy, TensorType, TruncationStrategy
from transformers.utils import is_torch_tensor, logging, to_py_obj

from .number_splicing import decode_numbers, encode_numbers, pad_values, truncate_and_wrap

__all__ = ["CausalQwenTokenizer"]

NUM_TOKEN = "<NUM>"

logger = logging.get_logger(__name__)


class CausalQwenTokenizer(Qwen2Tokenizer):
    r"""
    Qwen2 tokenizer that replaces every number of a text by one `<NUM>` token and returns its value in a parallel
    `numeric_values` sequence (0.0 at every other position).

    Numbers are found by [`causal_qwen.numbers.find_numbers`] (the grammar is documented in
    `docs/number_grammar.md`). The text between numbers is tokenized exactly as the Qwen2 tokenizer tokenizes that
    piece of text on its own; the pieces of a whole batch go to the Rust tokenizer in one call. Decoding writes each
    value back with [`causal_qwen.numbers.format_number`]. The splicing of `<NUM>` ids and values into sequences is
    [`causal_qwen.number_splicing`]'s; this class brings the Qwen2 model and the transformers API around it.

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
        vocab (`str` or `dict[str, int]`, *optional*), merges (`str` or `list[str]`, *optional*):
            The BPE vocabulary and merges, as for [`Qwen2Tokenizer`].
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

    def __init__(self, vocab: str | dict[str, int] | None = None, merges: str | list[str] | None = None,
                 num_token: str = NUM_TOKEN, use_numeric: bool = True, **kwargs):
        # A `*_token` keyword is registered by the base class as a named special token: it is added to the
        # vocabulary after the tokens already there, exposed as `self.num_token` / `self.num_token_id` and saved.
        super().__init__(vocab=vocab, merges=merges, num_token=num_token, use_numeric=use_numeric, **kwargs)
        self.use_numeric = bool(use_numeric)
        if not self.use_numeric:
            self.model_input_names = [name for name in self.model_input_names if name != "numeric_values"]
        self._literal_num_ids: list[int] | None = None
        self._warned_too_long = False

    @property
    def num_token_id(self) -> int:
        """`int`: Id of the `<NUM>` token."""
        return self.convert_tokens_to_ids(self.num_token)

    # ------------------------------------------------------------------------------------------------------------
    # Encoding
    # ------------------------------------------------------------------------------------------------------------

    def _encode_plus(self, *args, **kwargs) -> BatchEncoding:
        # The one private method of transformers this class relies on: `__call__`, `encode` (so `tokenize`) and
        # `apply_chat_template` encode through it, with the parameters of `TokenizersBackend._encode_plus` that
        # `_encode_numbers` takes by name; tests/test_tokenization.py::test_encode_plus_is_the_one_hook pins both.
        _check_max_length(kwargs.get("max_length"))
        _check_encodable("text", args[0] if args else kwargs.get("text"))
        _check_encodable("text_pair", args[1] if len(args) > 1 else kwargs.get("text_pair"))
        if not self.use_numeric:
            return super()._encode_plus(*args, **kwargs)
        return self._encode_numbers(*args, **kwargs)

    def _encode_numbers(
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
        """`_encode_plus` with numbers: `<NUM>` ids and their values, truncated, padded and tensored together."""
        _reject_unsupported(
            text_pair=text_pair is not None,
            is_split_into_words=is_split_into_words,
            return_overflowing_tokens=return_overflowing_tokens,
            return_offsets_mapping=return_offsets_mapping,
            sanitize_control_tokens=bool(kwargs.get("sanitize_control_tokens")),
        )
        texts, is_batched = _as_text_batch(text)
        split_special_tokens = self.split_special_tokens if split_special_tokens is None else split_special_tokens
        encode_segments = partial(_encode_segments, self.backend_tokenizer, split_special_tokens=split_special_tokens)
        input_ids, numeric_values = encode_numbers(
            texts, encode_segments, self.num_token, self.num_token_id, self._literal_num_token_ids()
        )
        around = _special_tokens_around(self.backend_tokenizer) if add_special_tokens else ([], [])
        limit = None if truncation_strategy == TruncationStrategy.DO_NOT_TRUNCATE else max_length
        encoded = _framed_rows(input_ids, numeric_values, *around, limit, self.truncation_side,
                               return_token_type_ids, return_special_tokens_mask)
        if max_length is None and verbose:
            self._warn_if_too_long(encoded["input_ids"])
        data = self._pad_with_values(encoded, padding=padding_strategy, max_length=max_length,
                                     pad_to_multiple_of=pad_to_multiple_of, padding_side=padding_side,
                                     return_attention_mask=return_attention_mask, verbose=verbose)
        if return_length:
            data["length"] = [len(ids) for ids in data["input_ids"]]
        if not is_batched and return_tensors is None:
            # Same unbatching rule as the Qwen2 tokenizer: sequences lose their batch axis, `length` keeps it.
            data = {key: value[0] if value and isinstance(value[0], list) else value for key, value in data.items()}
        return _batch_encoding(data, return_tensors)

    def _literal_num_token_ids(self) -> list[int]:
        """Ids of the string "<NUM>" read as ordinary text (its BPE pieces, not the special token)."""
        if self._literal_num_ids is None:  # with special tokens split, "<NUM>" goes through BPE like any text
            self._literal_num_ids = _encode_segments(self.backend_tokenizer, [self.num_token], True)[0]
        return self._literal_num_ids

    def _warn_if_too_long(self, input_ids: list[list[int]]) -> None:
        """Warn once, as the Qwen2 tokenizer does, when an untruncated sequence is longer than the model takes."""
        longest = max(map(len, input_ids), default=0)
        if 0 < self.model_max_length < longest and not self._warned_too_long:
            logger.warning(f"Token indices sequence length is longer than the specified maximum sequence length for "
                           f"this model ({longest} > {self.model_max_length}). Running this sequence through the "
                           "model will result in indexing errors")
            self._warned_too_long = True

    def tokenize(self, text: str, pair: str | None = None, add_special_tokens: bool = False, **kwargs) -> list[str]:
        """Token strings of `text`; with `use_numeric`, each number is the string `<NUM>`."""
        # The ids name the tokens: an encoding with numbers spliced in has no Rust encoding to ask for its tokens.
        ids = self.encode(text, text_pair=pair, add_special_tokens=add_special_tokens, **kwargs)
        return self.convert_ids_to_tokens(ids)

    def apply_chat_template(self, conversation: list[dict[str, str]] | list[list[dict[str, str]]], *args, **kwargs):
        """
        The base chat template, numbers included: with `tokenize=True` and `return_dict=True` (the defaults) the
        result holds `numeric_values` aligned with `input_ids`; `return_dict=False` gives the ids only.
        """
        # The assistant mask is built from character offsets, which the encoding with numbers does not have (the
        # text-only tokenizer is Qwen2's and has them).
        if self.use_numeric:
            _reject_unsupported(return_assistant_tokens_mask=bool(kwargs.get("return_assistant_tokens_mask")))
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
        columns = _as_columns(encoded_inputs)
        if return_tensors is None:
            return_tensors = _tensor_type_of(columns.get("input_ids"))
        # Tensors are padded as Python lists: converting back at the end keeps float64 values exact.
        padded = self._pad_with_values({key: to_py_obj(value) for key, value in columns.items()}, padding=padding,
                                       max_length=max_length, pad_to_multiple_of=pad_to_multiple_of,
                                       padding_side=padding_side, return_attention_mask=return_attention_mask,
                                       verbose=verbose)
        return _batch_encoding(padded, return_tensors)

    def _pad_with_values(self, encoded: dict[str, Any], padding_side: str | None = None, **padding) -> dict[str, Any]:
        """Pad the lists of `encoded` as the base tokenizer does, and `numeric_values` with 0.0 on the same side."""
        encoded = dict(encoded)
        values = encoded.pop("numeric_values", None)
        ids = encoded.get(self.model_input_names[0])
        padded = dict(super().pad(encoded, padding_side=padding_side, **padding))
        if values is not None and ids is not None:
            side = self.padding_side if padding_side is None else padding_side
            padded_ids = padded[self.model_input_names[0]]
            if ids and isinstance(ids[0], (list, tuple)):
                if len(values) != len(ids):
                    raise ValueError(f"`numeric_values` has {len(values)} rows but `input_ids` has {len(ids)}")
                padded["numeric_values"] = [
                    pad_values(row, row_ids, len(padded_row), side)
                    for row, row_ids, padded_row in zip(values, ids, padded_ids, strict=True)
                ]
            else:
                padded["numeric_values"] = pad_values(values, ids, len(padded_ids), side)
        return padded

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
        # The one switch of decoding: without values, the text-only tokenizer leaves `<NUM>` as text, as Qwen2 does.
        if not self.use_numeric and numeric_values is None:
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        # Spaces are never cleaned up: the text between numbers must come back exactly.
        decode_runs = partial(self.backend_tokenizer.decode_batch, skip_special_tokens=skip_special_tokens)
        return decode_numbers(
            to_py_obj(token_ids), to_py_obj(numeric_values), decode_runs, self.num_token, self.num_token_id
        )


def _encode_segments(backend: Tokenizer, segments: list[str], split_special_tokens: bool) -> list[list[int]]:
    """Ids of each text segment on its own, from one call to the Rust tokenizer for all of them."""
    # No padding or truncation left on the backend by an earlier call: each segment is encoded whole.
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    if backend.encode_special_tokens != split_special_tokens:
        backend.encode_special_tokens = split_special_tokens
    return [encoding.ids for encoding in backend.encode_batch_fast(segments, add_special_tokens=False)]


def _special_tokens_around(backend: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts before and after one sequence (none for Qwen2's)."""
    post_processor = backend.post_processor
    if post_processor is None or post_processor.num_special_tokens_to_add(False) == 0:
        return [], []
    encoding = backend.encode("a", add_special_tokens=True)
    mask = encoding.special_tokens_mask
    first = mask.index(0)
    last = len(mask) - mask[::-1].index(0)
    return encoding.ids[:first], encoding.ids[last:]


def _framed_rows(
    input_ids: list[list[int]],
    numeric_values: list[list[float]],
    prefix: list[int],
    suffix: list[int],
    max_length: int | None,
    side: str,
    token_type_ids: bool | None,
    special_tokens_mask: bool,
) -> dict[str, list]:
    """The rows cut to `max_length` and framed by the special tokens, with the optional masks the options ask for."""
    rows = [truncate_and_wrap(ids, values, prefix, suffix, max_length, side)
            for ids, values in zip(input_ids, numeric_values, strict=True)]
    encoded: dict[str, list] = {"input_ids": [ids for ids, _ in rows], "numeric_values": [v for _, v in rows]}
    if token_type_ids:
        encoded["token_type_ids"] = [[0] * len(ids) for ids in encoded["input_ids"]]
    if special_tokens_mask:
        content = [len(ids) - len(prefix) - len(suffix) for ids in encoded["input_ids"]]
        encoded["special_tokens_mask"] = [[1] * len(prefix) + [0] * n + [1] * len(suffix) for n in content]
    return encoded


def _batch_encoding(data: dict[str, Any], return_tensors: str | TensorType | None) -> BatchEncoding:
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


def _reject_unsupported(**requested: bool) -> None:
    """Refuse the options that need character offsets or a second text, which numbers as `<NUM>` do not keep."""
    for name, is_requested in requested.items():
        if is_requested:
            raise NotImplementedError(
                f"`{name}` is not supported by CausalQwenTokenizer with use_numeric=True; "
                "load the tokenizer with use_numeric=False for plain Qwen2 tokenization"
            )


def _as_columns(
    encoded_inputs: BatchEncoding | Mapping[str, Any] | Sequence[Mapping[str, Any]],
) -> Mapping[str, Any]:
    """The columns of one encoded input, of a batch, or of a list of examples (a collate function's input)."""
    if isinstance(encoded_inputs, (list, tuple)) and encoded_inputs and isinstance(encoded_inputs[0], Mapping):
        encoded_inputs = {key: [example[key] for example in encoded_inputs] for key in encoded_inputs[0].keys()}
    if not isinstance(encoded_inputs, Mapping):
        raise TypeError(
            f"`encoded_inputs` must be a dict of lists or a list of dicts, got {type(encoded_inputs).__name__}"
        )
    return encoded_inputs


def _check_max_length(max_length: Any) -> None:
    """A `max_length` of at least one id: 0 would truncate every text to nothing, which fails only much later."""
    if max_length is None:
        return
    if isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral):
        raise TypeError(f"max_length must be a positive int or None, got {type(max_length).__name__}")
    if max_length < 1:
        raise ValueError(f"max_length must be a positive int or None, got {max_length}: it would truncate every text "
                         "to nothing")


def _as_text_batch(text: str | Sequence[str]) -> tuple[list[str], bool]:
    """The texts of one text or a batch, and whether it was a batch."""
    is_batched = isinstance(text, (list, tuple))
    texts = list(text) if is_batched else [text]
    for index, item in enumerate(texts):
        if not isinstance(item, str):
            where = f"`text[{index}]`" if is_batched else "`text`"
            raise TypeError(f"{where} must be a str, got {type(item).__name__}")
    return texts, is_batched


def _check_encodable(name: str, text: Any) -> None:
    """Texts with a UTF-8 encoding: a lone surrogate (such as "\\ud800", left by a bad decode) has none, and the Rust
    tokenizer refuses it with a TypeError that names neither the argument nor the character."""
    texts = text if isinstance(text, (list, tuple)) else [text]
    for index, item in enumerate(texts):
        # `isascii` is a flag CPython keeps on every str: an ASCII text costs no scan.
        if not isinstance(item, str) or item.isascii():
            continue
        try:
            item.encode("utf-8")
        except UnicodeEncodeError as error:
            where = f"`{name}[{index}]`" if isinstance(text, (list, tuple)) else f"`{name}`"
            raise ValueError(
                f"{where} holds a lone surrogate {item[error.start]!r} at character {error.start}, which is not a "
                "character and has no UTF-8 encoding (a text decoded with errors='surrogateescape' or cut inside a "
                "UTF-16 pair); decode the source as UTF-8, or replace them: text.encode('utf-8', "
                "'replace').decode('utf-8')"
            ) from None


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
