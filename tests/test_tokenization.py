"""CausalQwenTokenizer on the real Qwen2.5 tokenizer, checked against the Qwen2 tokenizer it wraps."""

import inspect
import json
import logging
import math
import random
import unicodedata

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers.pre_tokenizers import ByteLevel
from transformers import AutoTokenizer, Qwen2Tokenizer
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from causal_qwen.numbers import find_numbers, format_number
from causal_qwen.tokenization import CausalQwenTokenizer

pytestmark = pytest.mark.slow

QWEN25_NUM_ID = 151_665
PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def base(qwen25_dir):
    """The plain Qwen2 tokenizer, as transformers loads it."""
    tokenizer = AutoTokenizer.from_pretrained(qwen25_dir)
    assert isinstance(tokenizer, Qwen2Tokenizer)
    return tokenizer


@pytest.fixture(scope="module")
def tok(qwen25_dir):
    return CausalQwenTokenizer.from_pretrained(qwen25_dir)


@pytest.fixture(scope="module")
def text_tok(qwen25_dir):
    return CausalQwenTokenizer.from_pretrained(qwen25_dir, use_numeric=False)


def plain_ids(base, text):
    return base(text, add_special_tokens=False)["input_ids"]


def expected_encoding(base, pieces):
    """Ids and values built independently: text pieces by the Qwen2 tokenizer, (written, value) pieces as <NUM>."""
    ids, values = [], []
    for piece in pieces:
        if isinstance(piece, str):
            piece_ids = plain_ids(base, piece) if piece else []
            ids += piece_ids
            values += [0.0] * len(piece_ids)
        else:
            ids.append(QWEN25_NUM_ID)
            values.append(piece[1])
    return ids, values


def join(pieces):
    return "".join(piece if isinstance(piece, str) else piece[0] for piece in pieces)


def assert_same_values(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert a == e and math.copysign(1.0, a) == math.copysign(1.0, e)


# ------------------------------------------------------------------------------------------------------------------
# Vocabulary and known ids
# ------------------------------------------------------------------------------------------------------------------


def test_num_token_takes_the_first_free_id(tok, base):
    assert len(base) == QWEN25_NUM_ID
    assert tok.num_token == "<NUM>"
    assert tok.num_token_id == QWEN25_NUM_ID == tok.convert_tokens_to_ids("<NUM>")
    assert len(tok) == len(base) + 1
    assert "<NUM>" in tok.all_special_tokens
    assert tok.added_tokens_decoder[QWEN25_NUM_ID].special
    # Every other id is the base vocabulary's.
    assert {k: v for k, v in tok.get_vocab().items() if k != "<NUM>"} == base.get_vocab()


def test_known_ids(tok, base):
    hello = tok("Hello world")
    assert hello["input_ids"] == [9707, 1879]
    assert hello["numeric_values"] == [0.0, 0.0]
    assert hello["attention_mask"] == [1, 1]

    price = tok("价格是99.9元")
    assert price["input_ids"] == [97480, 20412, QWEN25_NUM_ID, 23305]
    assert price["numeric_values"] == [0.0, 0.0, 99.9, 0.0]
    assert base("价格是99.9元")["input_ids"] == [97480, 20412, 24, 24, 13, 24, 23305]
    assert tok.decode(price["input_ids"], numeric_values=price["numeric_values"]) == "价格是99.9元"


# Texts as pieces: strings stay text, (written, value) pairs are numbers.
TOKENIZER_EXAMPLES = [
    ["价格是", ("99.9", 99.9), "元"],
    ["It costs ", ("-5", -5.0), " today"],
    ["+", ("3", 3.0), " points"],
    ["take ", ("0.5", 0.5), " or ", (".5", 0.5)],
    ["total ", ("1,234,567.89", 1234567.89), " USD"],
    ["rate ", ("1e-5", 1e-5), ", N = ", ("6.02E23", 6.02e23)],
    ["全角", ("９９.９", 99.9), "分"],
    [("50", 50.0), "% off, only $", ("50", 50.0)],
    ["pages ", ("3", 3.0), "-", ("5", 5.0)],
    ["Qwen2 on H100 in 3D, v2"],
    ["version 1.2.3 at 192.168.0.1"],
    ["agent 007 and 01"],
    ["id 12345678901234567890"],
    ["on 2024-01-15 at 12:30, call +", ("1", 1.0), " 555-123-4567"],
    ["GPT-4 and x86-64 and Qwen2.5-0.5B"],
]


@pytest.mark.parametrize("pieces", TOKENIZER_EXAMPLES, ids=[join(p) for p in TOKENIZER_EXAMPLES])
def test_examples_on_the_real_tokenizer(tok, base, pieces):
    text = join(pieces)
    encoded = tok(text)
    ids, values = expected_encoding(base, pieces)
    assert encoded["input_ids"] == ids
    assert_same_values(encoded["numeric_values"], values)
    if not any(isinstance(piece, tuple) for piece in pieces):
        assert encoded["input_ids"] == base(text)["input_ids"]  # all text: exactly the Qwen2 tokenization
    decoded = tok.decode(encoded["input_ids"], numeric_values=encoded["numeric_values"])
    canonical = join([piece if isinstance(piece, str) else (format_number(piece[1]), piece[1]) for piece in pieces])
    assert decoded == canonical
    again = tok(decoded)
    assert again["input_ids"] == encoded["input_ids"]
    assert_same_values(again["numeric_values"], encoded["numeric_values"])


def test_sixteen_significant_digits_survive_as_float64(tok):
    encoded = tok(["x 0.30000000000000004 and 9007199254740992"], return_tensors="pt")
    values = encoded["numeric_values"]
    assert values.dtype == torch.float64 and encoded["input_ids"].dtype == torch.int64
    numbers = values[encoded["input_ids"] == QWEN25_NUM_ID].tolist()
    assert numbers == [0.30000000000000004, 9007199254740992.0]
    assert tok(["x 1"], return_tensors="np")["numeric_values"].dtype == np.float64


def test_literal_num_string_is_text(tok, base):
    text = "write <NUM> here, then 5"
    encoded = tok(text)
    assert encoded["input_ids"].count(QWEN25_NUM_ID) == 1  # only the 5
    assert encoded["input_ids"][-1] == QWEN25_NUM_ID and encoded["numeric_values"][-1] == 5.0
    assert tok.decode(encoded["input_ids"], numeric_values=encoded["numeric_values"]) == text
    assert tok("<NUM>")["input_ids"] == base("<NUM>")["input_ids"]  # the BPE pieces of the string, as in Qwen2


def test_special_tokens_in_text_are_the_base_ids(tok, base):
    text = "<|im_start|>user\nHi<|im_end|>"
    assert tok(text)["input_ids"] == base(text)["input_ids"]
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == "user\nHi"


def test_tokenize_and_encode(tok):
    assert tok.tokenize("价格是99.9元")[2] == "<NUM>"
    assert tok.encode("价格是99.9元") == [97480, 20412, QWEN25_NUM_ID, 23305]


# ------------------------------------------------------------------------------------------------------------------
# Properties on random text
# ------------------------------------------------------------------------------------------------------------------

PIECES = st.sampled_from(
    [" ", ",", ".", "-", "+", "/", ":", "e", "%", "$", "_", "a", "Qwen", "价格", "元", "１", "0", "00", "5", "\n",
     "  ", "é", "<NUM>", "<|im_end|>", ", ", "-."]
)
NUMBERS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False).map(format_number),
    st.integers(-10**6, 10**6).map(str),
    st.decimals(allow_nan=False, allow_infinity=False, places=2).map(str),
)
MIXED_TEXT = st.lists(st.one_of(PIECES, PIECES, NUMBERS, NUMBERS, st.text(max_size=4)), max_size=20).map("".join)
ANY_TEXT = st.one_of(MIXED_TEXT, st.text())


@PROPERTY_SETTINGS
@given(ANY_TEXT)
def test_alignment_and_segments(tok, base, text):
    encoded = tok(text)
    ids, values = encoded["input_ids"], encoded["numeric_values"]
    assert len(values) == len(ids) == len(encoded["attention_mask"])
    spans = find_numbers(text)
    positions = [i for i, token_id in enumerate(ids) if token_id == QWEN25_NUM_ID]
    assert len(positions) == len(spans)  # one <NUM> per number, and <NUM> nowhere else
    assert_same_values([values[i] for i in positions], [span.value for span in spans])
    assert all(value == 0.0 for i, value in enumerate(values) if i not in set(positions))
    # The ids between two numbers are the Qwen2 tokenization of the text between them (literal "<NUM>" aside).
    if "<NUM>" not in text:
        bounds = [0] + [edge for span in spans for edge in (span.start, span.end)] + [len(text)]
        segments = [text[bounds[i] : bounds[i + 1]] for i in range(0, len(bounds), 2)]
        cuts = [-1] + positions + [len(ids)]
        for segment, start, end in zip(segments, cuts[:-1], cuts[1:], strict=True):
            assert ids[start + 1 : end] == (plain_ids(base, segment) if segment else [])


@PROPERTY_SETTINGS
@given(ANY_TEXT)
def test_round_trip(tok, text):
    text = unicodedata.normalize("NFC", text)  # Qwen2 normalizes to NFC: that is the text it can give back
    encoded = tok(text)
    decoded = tok.decode(encoded["input_ids"], numeric_values=encoded["numeric_values"])
    assert "<NUM>" not in decoded or "<NUM>" in text
    again = tok(decoded)
    assert again["input_ids"] == encoded["input_ids"]
    assert_same_values(again["numeric_values"], encoded["numeric_values"])
    if all(text[span.start : span.end] == format_number(span.value) for span in find_numbers(text)):
        assert decoded == text


@PROPERTY_SETTINGS
@given(st.lists(ANY_TEXT, min_size=1, max_size=6))
def test_batch_equals_single(tok, texts):
    batch = tok(texts)
    for row, text in enumerate(texts):
        single = tok(text)
        assert batch["input_ids"][row] == single["input_ids"]
        assert_same_values(batch["numeric_values"][row], single["numeric_values"])
        assert batch["attention_mask"][row] == single["attention_mask"]


@PROPERTY_SETTINGS
@given(ANY_TEXT)
def test_text_only_mode_is_exactly_qwen2(text_tok, base, text):
    assume("<NUM>" not in text)  # a special token of this vocabulary, not of Qwen2's (see test_text_only_mode)
    assert dict(text_tok(text)) == dict(base(text))
    assert dict(text_tok([text, "a 1 b"], padding=True)) == dict(base([text, "a 1 b"], padding=True))


def test_text_only_mode(text_tok, base):
    assert text_tok.use_numeric is False
    encoded = text_tok(["价格是99.9元", "x"], padding=True, return_tensors="pt")
    assert set(encoded) == {"input_ids", "attention_mask"}  # no numeric_values: digits stay digits
    assert encoded["input_ids"][0].tolist() == [97480, 20412, 24, 24, 13, 24, 23305]
    assert text_tok.num_token_id == QWEN25_NUM_ID  # same vocabulary as the numeric tokenizer
    assert text_tok("<NUM>")["input_ids"] == [QWEN25_NUM_ID]
    assert text_tok.decode([QWEN25_NUM_ID]) == "<NUM>"  # decoding is Qwen2's too
    assert text_tok.decode([24, 24, 13, 24]) == "99.9"
    assert text_tok.decode([20, QWEN25_NUM_ID], numeric_values=[0.0, 1.5]) == "51.5"


def test_text_only_tokenize_is_qwen2s(text_tok, base):
    for text in ["价格是99.9元", "<|im_start|>user 3 apples", ""]:
        assert text_tok.tokenize(text) == base.tokenize(text)
    assert text_tok.tokenize("a 1", pair="b 2", add_special_tokens=True) == base.tokenize(
        "a 1", pair="b 2", add_special_tokens=True
    )


def test_assistant_mask_needs_the_text_only_tokenizer(tok):
    messages = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]
    with pytest.raises(NotImplementedError, match="return_assistant_tokens_mask"):
        tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)


# ------------------------------------------------------------------------------------------------------------------
# Padding, truncation, tensors
# ------------------------------------------------------------------------------------------------------------------

BATCH = ["价格是99.9元", "From -3 to 4.5e3, twice 7", "no number"]


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding(tok, side):
    singles = [tok(text) for text in BATCH]
    padded = tok(BATCH, padding=True, padding_side=side, return_tensors="pt")
    length = max(len(single["input_ids"]) for single in singles)
    assert padded["input_ids"].shape == padded["numeric_values"].shape == (3, length)
    for row, single in enumerate(singles):
        n, pad = len(single["input_ids"]), length - len(single["input_ids"])
        real = slice(0, n) if side == "right" else slice(pad, length)
        pads = slice(n, length) if side == "right" else slice(0, pad)
        assert padded["input_ids"][row, real].tolist() == single["input_ids"]
        assert padded["numeric_values"][row, real].tolist() == single["numeric_values"]
        assert padded["attention_mask"][row, real].tolist() == [1] * n
        assert padded["input_ids"][row, pads].tolist() == [tok.pad_token_id] * pad
        assert padded["numeric_values"][row, pads].tolist() == [0.0] * pad
        assert padded["attention_mask"][row, pads].tolist() == [0] * pad
    decoded = tok.batch_decode(padded["input_ids"], numeric_values=padded["numeric_values"], skip_special_tokens=True)
    assert decoded == ["价格是99.9元", "From -3 to 4500, twice 7", "no number"]


def test_padding_to_max_length_and_multiple(tok):
    padded = tok(BATCH, padding="max_length", max_length=32, truncation=True)
    assert {len(ids) for ids in padded["input_ids"]} == {len(v) for v in padded["numeric_values"]} == {32}
    multiple = tok(BATCH, padding=True, pad_to_multiple_of=8, return_tensors="pt")
    assert multiple["input_ids"].shape[1] % 8 == 0
    assert multiple["numeric_values"].shape == multiple["input_ids"].shape


@pytest.mark.parametrize("side", ["right", "left"])
def test_truncation_keeps_numbers_whole(tok, side):
    text = "a 1 b 2 c 3 d 4"
    full = tok(text)
    tok.truncation_side = side
    try:
        for max_length in range(1, len(full["input_ids"]) + 1):  # 0 is refused (test_max_length_must_be_positive)
            cut = tok(text, truncation=True, max_length=max_length)
            kept = slice(0, max_length) if side == "right" else slice(len(full["input_ids"]) - max_length, None)
            assert cut["input_ids"] == full["input_ids"][kept]
            assert cut["numeric_values"] == full["numeric_values"][kept]
    finally:
        tok.truncation_side = "right"


@pytest.mark.parametrize("max_length", [0, -3])
@pytest.mark.parametrize("options", [dict(truncation=True), dict(), dict(padding="max_length"),
                                     dict(truncation=True, padding=True, return_tensors="pt")])
def test_max_length_must_be_positive(tok, text_tok, max_length, options):
    for tokenizer in (tok, text_tok):
        with pytest.raises(ValueError, match=f"max_length must be a positive int or None, got {max_length}"):
            tokenizer(BATCH, max_length=max_length, **options)
        with pytest.raises(ValueError, match="max_length"):
            tokenizer.apply_chat_template([{"role": "user", "content": "1 + 2"}], max_length=max_length,
                                          truncation=True)
    with pytest.raises(TypeError, match="max_length must be a positive int or None, got float"):
        tok(BATCH, max_length=2.5, truncation=True)
    # One id is enough.
    assert [len(ids) for ids in tok(BATCH, max_length=1, truncation=True)["input_ids"]] == [1] * len(BATCH)


def test_pad_as_collate_function(tok):
    examples = [tok(text) for text in BATCH]
    as_tensors = [
        {key: torch.tensor(value, dtype=torch.float64 if key == "numeric_values" else None) for key, value in e.items()}
        for e in examples
    ]
    for inputs in (examples, as_tensors):
        batch = tok.pad(inputs, padding_side="left", return_tensors="pt" if inputs is examples else None)
        assert batch["numeric_values"].dtype == torch.float64
        assert batch["numeric_values"].shape == batch["input_ids"].shape
        reference = tok(BATCH, padding=True, padding_side="left", return_tensors="pt")
        for key in ("input_ids", "attention_mask", "numeric_values"):
            assert torch.equal(batch[key], reference[key]), key
    with pytest.raises(ValueError, match="numeric_values"):
        tok.pad([{"input_ids": [1, 2, 3], "numeric_values": [0.0, 1.5]}])
    with pytest.raises(TypeError, match="encoded_inputs"):
        tok.pad("not an encoding")
    with pytest.raises(ValueError, match="rows"):
        tok.pad({"input_ids": [[1], [2]], "numeric_values": [[0.0]]})


def test_unsupported_options_raise(tok):
    with pytest.raises(NotImplementedError, match="text_pair"):
        tok("1", "2")
    with pytest.raises(NotImplementedError, match="return_offsets_mapping"):
        tok("1", return_offsets_mapping=True)
    with pytest.raises(TypeError, match=r"`text\[1\]`"):
        tok(["ok", 5])


def test_optional_outputs(tok):
    encoded = tok(["a 1", "bb 2 c"], padding=True, return_length=True, return_special_tokens_mask=True,
                  return_token_type_ids=True)
    assert encoded["length"] == [len(ids) for ids in encoded["input_ids"]]
    n, length = len(tok("a 1")["input_ids"]), len(encoded["input_ids"][0])
    assert length > n
    assert encoded["special_tokens_mask"][0] == [0] * n + [1] * (length - n)  # padding is special, as in Qwen2
    assert encoded["token_type_ids"] == [[0] * len(ids) for ids in encoded["input_ids"]]


def test_add_eos_token_wraps_the_numbers(tok, qwen25_dir):
    eos_tok = CausalQwenTokenizer.from_pretrained(qwen25_dir, add_eos_token=True)
    encoded = eos_tok("x 5", truncation=True, max_length=3)
    assert encoded["input_ids"] == tok("x 5")["input_ids"][:2] + [eos_tok.eos_token_id]
    assert encoded["numeric_values"] == [0.0, 0.0, 0.0]
    assert eos_tok("x 5")["numeric_values"][-2:] == [5.0, 0.0]


# ------------------------------------------------------------------------------------------------------------------
# Decoding
# ------------------------------------------------------------------------------------------------------------------


def test_decode_errors_name_the_argument(tok):
    ids = tok("价格是99.9元")["input_ids"]
    with pytest.raises(ValueError, match="numeric_values"):
        tok.decode(ids)
    with pytest.raises(ValueError, match="`numeric_values` has 3 entries"):
        tok.decode(ids, numeric_values=[0.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="position 2"):
        tok.decode(ids, numeric_values=[0.0, 0.0, math.nan, 0.0])
    with pytest.raises(TypeError, match="numeric_values"):
        tok.decode(ids, numeric_values="1234")
    with pytest.raises(TypeError, match="position 2"):
        tok.decode(ids, numeric_values=[0.0, 0.0, "x", 0.0])
    with pytest.raises(ValueError, match="rows"):
        tok.batch_decode([ids, ids], numeric_values=[[0.0] * 4])


def test_decode_formats_generated_values(tok):
    ids = tok("x 1 y")["input_ids"]
    generated = [(99.9, "99.9"), (5.0, "5"), (1e-05, "1e-5"), (-2.5e20, "-2.5e20"), (0.1 + 0.2, "0.30000000000000004")]
    for value, written in generated:
        values = [value if token_id == QWEN25_NUM_ID else 0.0 for token_id in ids]
        assert tok.decode(ids, numeric_values=values) == f"x {written} y"
        as_tensors = tok.decode(torch.tensor(ids), numeric_values=torch.tensor(values, dtype=torch.float64))
        assert as_tensors == f"x {written} y"
    assert tok.decode([]) == ""


# ------------------------------------------------------------------------------------------------------------------
# Saving, loading, chat templates
# ------------------------------------------------------------------------------------------------------------------


def test_save_and_load_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "CausalQwenTokenizer"
    assert config["num_token"] == "<NUM>" and config["use_numeric"] is True
    reloaded = CausalQwenTokenizer.from_pretrained(tmp_path)
    assert reloaded.num_token_id == QWEN25_NUM_ID and len(reloaded) == len(tok)
    for text in BATCH + ["<|im_start|>1<|im_end|>"]:
        assert reloaded(text)["input_ids"] == tok(text)["input_ids"]
        assert reloaded(text)["numeric_values"] == tok(text)["numeric_values"]
    assert reloaded.chat_template == tok.chat_template


def test_text_only_setting_is_saved(text_tok, tmp_path):
    text_tok.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["use_numeric"] is False
    reloaded = CausalQwenTokenizer.from_pretrained(tmp_path)
    assert reloaded.use_numeric is False and reloaded("5")["input_ids"] == [20]


def test_auto_tokenizer_loads_a_saved_folder(tok, tmp_path):
    import causal_qwen  # noqa: F401  (registers CausalQwenTokenizer with AutoTokenizer)

    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert type(loaded) is CausalQwenTokenizer
    assert loaded("价格是99.9元")["input_ids"] == [97480, 20412, QWEN25_NUM_ID, 23305]


def test_chat_template_with_numbers(tok, base):
    messages = [
        {"role": "user", "content": "What is 12*7 and 3.5 + -2?"},
        {"role": "assistant", "content": "12*7 = 84 and 3.5 + -2 = 1.5."},
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert rendered == base.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    encoded = tok.apply_chat_template(messages, tokenize=True, return_dict=True)
    reference = tok(rendered, add_special_tokens=False)
    assert encoded["input_ids"] == reference["input_ids"]
    assert encoded["numeric_values"] == reference["numeric_values"]
    pairs = zip(encoded["input_ids"], encoded["numeric_values"], strict=True)
    numbers = [value for token_id, value in pairs if token_id == QWEN25_NUM_ID]
    assert numbers == [12.0, 7.0, 3.5, -2.0, 12.0, 7.0, 84.0, 3.5, -2.0, 1.5]
    assert encoded["input_ids"][:3] == base.apply_chat_template(messages, tokenize=True, return_dict=False)[:3]
    assert tok.decode(encoded["input_ids"], numeric_values=encoded["numeric_values"]) == rendered
    batch = tok.apply_chat_template([messages, messages[:1]], padding=True, return_tensors="pt", return_dict=True)
    assert batch["numeric_values"].dtype == torch.float64 and batch["numeric_values"].shape == batch["input_ids"].shape


# ------------------------------------------------------------------------------------------------------------------
# Speed
# ------------------------------------------------------------------------------------------------------------------


def test_one_megabyte_of_digits_and_separators(tok):
    # Its time, against the Qwen2 tokenizer on the same string, is measured by benchmarks/bench_tokenizer.py.
    rng = random.Random(0)
    text = "".join(rng.choices("0123456789" * 4 + ".,-+/:eE %  ", k=1_000_000))
    encoded = tok(text, verbose=False)
    assert len(encoded["numeric_values"]) == len(encoded["input_ids"]) > 100_000


# ------------------------------------------------------------------------------------------------------------------
# The transformers API the tokenizer rests on
# ------------------------------------------------------------------------------------------------------------------


def byte_tokenizer(**kwargs) -> CausalQwenTokenizer:
    """A CausalQwenTokenizer built in-process: the 256 byte-level characters as its vocabulary, no merges."""
    vocab = {char: index for index, char in enumerate(sorted(ByteLevel.alphabet()))}
    return CausalQwenTokenizer(vocab=vocab, merges=[], **kwargs)


def test_encode_plus_is_the_one_hook(monkeypatch):
    # `_encode_numbers` takes every parameter of transformers' `_encode_plus` by name, with the same default: a
    # parameter added, renamed or given another default there fails here.
    def parameters(function):
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    assert parameters(CausalQwenTokenizer._encode_numbers) == parameters(TokenizersBackend._encode_plus)
    # Every public way to encode goes through `_encode_plus`, once, and so gets the numbers.
    tok = byte_tokenizer(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    calls = []
    hook = CausalQwenTokenizer._encode_plus

    def counted(self, *args, **kwargs):
        calls.append(1)
        return hook(self, *args, **kwargs)

    monkeypatch.setattr(CausalQwenTokenizer, "_encode_plus", counted)
    chat = [{"role": "user", "content": "a 1"}]
    entry_points = {
        "__call__": lambda: tok("a 1")["numeric_values"][-1],
        "encode": lambda: tok.encode("a 1")[-1],
        "tokenize": lambda: tok.tokenize("a 1")[-1],
        "apply_chat_template": lambda: tok.apply_chat_template(chat)["numeric_values"][-1],
    }
    expected = {"__call__": 1.0, "encode": tok.num_token_id, "tokenize": "<NUM>", "apply_chat_template": 1.0}
    for name, entry_point in entry_points.items():
        calls.clear()
        assert entry_point() == expected[name], name
        assert len(calls) == 1, name


@pytest.mark.parametrize("use_numeric", [True, False])
def test_a_lone_surrogate_raises_naming_the_text(use_numeric):
    # The Rust tokenizer refuses a str without a UTF-8 encoding with a TypeError about its input types.
    tok = byte_tokenizer(use_numeric=use_numeric)
    with pytest.raises(ValueError, match=r"`text` holds a lone surrogate '\\ud800' at character 1"):
        tok("a\ud800 1")
    with pytest.raises(ValueError, match=r"`text\[1\]` holds a lone surrogate '\\udcff' at character 4"):
        tok(["ok", "x 2 \udcff"])
    with pytest.raises(ValueError, match="`text`"):
        tok.encode("\ud800")
    # Text beyond ASCII, astral characters included, is encoded as before.
    text = "héllo 3 😀"
    encoded = tok(text)
    assert tok.decode(encoded["input_ids"], numeric_values=encoded.get("numeric_values")) == text


def test_too_long_warns_once_unless_truncated_or_quiet(caplog):
    tok = byte_tokenizer(model_max_length=4)
    with caplog.at_level(logging.WARNING):
        tok("a 1 bc", verbose=False)
        tok("a 1 bc", truncation=True, max_length=4)
        assert not caplog.records
        tok(["a", "a 1 bc"])
        tok("a 1 bcd")
    assert [record.getMessage() for record in caplog.records] == [
        "Token indices sequence length is longer than the specified maximum sequence length for this model (6 > 4). "
        "Running this sequence through the model will result in indexing errors"
    ]
