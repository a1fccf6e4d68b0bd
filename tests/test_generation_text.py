"""Generation with the real Qwen2.5 tokenizer: numbers through pipeline(), streamers and decode."""

import io
import math
from contextlib import redirect_stdout

import pytest
import torch
from conftest import tiny_qwen2_config
from transformers import AutoTokenizer, Qwen2ForCausalLM, TextGenerationPipeline, TextStreamer, pipeline

from causal_qwen import CausalQwenForCausalLM, CausalQwenTextGenerationPipeline, CausalQwenTokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer(qwen25_dir):
    return CausalQwenTokenizer.from_pretrained(qwen25_dir)


@pytest.fixture(scope="module")
def qwen():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2_config(vocab_size=151936)).eval()


@pytest.fixture
def numbers_model(qwen, tokenizer):
    """A model whose every next token is <NUM> (its threshold is far below every score)."""
    model = CausalQwenForCausalLM.from_qwen(qwen, tokenizer=tokenizer).eval()
    with torch.no_grad():
        model.action.threshold[tokenizer.num_token_id] = -1e4
        model.action.reg_head.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
        model.action.reg_head.bias.fill_(3.0)
    return model


def test_pipeline_returns_generated_numbers_as_digits(numbers_model, tokenizer):
    pipe = pipeline("text-generation", model=numbers_model, tokenizer=tokenizer)
    assert isinstance(pipe, CausalQwenTextGenerationPipeline)
    prompt = "价格是99.9元, and 12 apples cost"
    result = pipe(prompt, max_new_tokens=3, full_precision=True)[0]["generated_text"]

    batch = tokenizer(prompt, return_tensors="pt")
    out = numbers_model.generate(**batch, max_new_tokens=3, return_dict_in_generate=True)
    start = batch["input_ids"].shape[1]
    generated = out.numeric_values[0, start:].tolist()
    assert (out.sequences[0, start:] == tokenizer.num_token_id).all()
    expected = prompt + tokenizer.decode(out.sequences[0, start:], numeric_values=out.numeric_values[0, start:])
    assert result == expected
    assert "<NUM>" not in result and all(str(v)[:5] in result for v in generated)
    # The prompt's values reached the model: another price gives other generated numbers.
    other = pipe(prompt.replace("99.9", "5000"), max_new_tokens=3, full_precision=True)[0]["generated_text"]
    assert other.split("cost")[1] != result.split("cost")[1]
    new_only = pipe(prompt, max_new_tokens=3, return_full_text=False, full_precision=True)[0]["generated_text"]
    assert prompt + new_only == result
    # Modes and seeds pass through the pipeline.
    causal = pipe(prompt, max_new_tokens=3, mode="causal", generator=torch.Generator().manual_seed(3))
    again = pipe(prompt, max_new_tokens=3, mode="causal", generator=torch.Generator().manual_seed(3))
    assert causal == again


def test_pipeline_writes_numbers_with_the_digits_their_interval_supports(numbers_model, tokenizer):
    """By default each generated number keeps the digits down to the second significant digit of its 50% interval's
    half-width (and at least its leading digit), the interval computed here from the Cauchy quantiles loc ± scale in
    symlog space; `full_precision=True` writes every digit."""
    pipe = pipeline("text-generation", model=numbers_model, tokenizer=tokenizer)
    prompt = "Total: 12 and"
    written = pipe(prompt, max_new_tokens=3, return_full_text=False)[0]["generated_text"]
    full = pipe(prompt, max_new_tokens=3, return_full_text=False, full_precision=True)[0]["generated_text"]
    batch = tokenizer(prompt, return_tensors="pt")
    out = numbers_model.generate(**batch, max_new_tokens=3, return_dict_in_generate=True, output_value_scores=True)
    start = batch["input_ids"].shape[1]
    values = out.numeric_values[0, start:].tolist()
    rounded = []
    for value, loc, scale in zip(values, out.loc_Y[0].tolist(), out.scale_Y[0].tolist(), strict=True):
        low, high = (math.copysign(math.expm1(abs(y)), y) for y in (loc - scale, loc + scale))
        half = (max(high, value) - min(low, value)) / 2
        place = max(1 - math.floor(math.log10(half)), -math.floor(math.log10(abs(value))))
        rounded.append(round(value, place))
    ids = out.sequences[0, start:]
    assert written == tokenizer.decode(ids, numeric_values=rounded)
    assert full == tokenizer.decode(ids, numeric_values=values)
    assert len(written) < len(full)
    with pytest.raises(TypeError, match="full_precision"):
        pipe(prompt, max_new_tokens=1, full_precision="yes")


def test_pipeline_is_unchanged_for_other_models(qwen, qwen25_dir):
    base_tokenizer = AutoTokenizer.from_pretrained(qwen25_dir)
    ours = pipeline("text-generation", model=qwen, tokenizer=base_tokenizer)
    stock = TextGenerationPipeline(model=qwen, tokenizer=base_tokenizer)
    for kwargs in (dict(do_sample=False, max_new_tokens=5), dict(max_new_tokens=4, return_full_text=False,
                                                                 do_sample=False)):
        assert ours("Hello world", **kwargs) == stock("Hello world", **kwargs)


def test_text_streamer_writes_generated_numbers(numbers_model, tokenizer):
    batch = tokenizer("Total: 12 and", return_tensors="pt")
    printed = io.StringIO()
    with redirect_stdout(printed):
        out = numbers_model.generate(**batch, max_new_tokens=4, streamer=TextStreamer(tokenizer),
                                     return_dict_in_generate=True)
    full = tokenizer.decode(out.sequences[0], numeric_values=out.numeric_values[0])
    assert printed.getvalue().strip() == full.strip()
    assert "<NUM>" not in printed.getvalue()


def test_generated_ids_decode_with_the_prompt_numbers(qwen, tokenizer):
    model = CausalQwenForCausalLM.from_qwen(qwen, tokenizer=tokenizer).eval()
    tokenizer.padding_side = "left"
    prompts = ["A kilo costs 3.5 dollars, so 4 kilos cost", "Hello"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    tokenizer.padding_side = "right"
    out = model.generate(**batch, max_new_tokens=5, mode="traditional", return_dict_in_generate=True)
    texts = tokenizer.batch_decode(out.sequences, numeric_values=out.numeric_values, skip_special_tokens=True)
    for prompt, text in zip(prompts, texts, strict=True):
        assert text.startswith(prompt)


def _first_stop(tokenizer, sequence, values, start, stop_strings):
    """The generated length at which a stop string first reaches into the text of the last token, from full decodes."""
    for k in range(1, len(sequence) - start + 1):
        text = tokenizer.decode(sequence[:start + k], numeric_values=values[:start + k])
        before = tokenizer.decode(sequence[:start + k - 1], numeric_values=values[:start + k - 1])
        if any(text.find(s, max(0, len(before) - len(s) + 1)) >= 0 for s in stop_strings):
            return k
    return None


@pytest.mark.parametrize("stop_strings", [["."], ["00001909"], ["d28", "9092"], "9092", [">"], ["NUM"]])
@pytest.mark.parametrize("mode", ["standard", "traditional"])
def test_stop_strings_see_generated_numbers_as_their_digits(numbers_model, tokenizer, stop_strings, mode):
    with torch.no_grad():
        numbers_model.action.cls_head.bias[tokenizer.num_token_id] = 1e3  # the softmax writes numbers too
    batch = tokenizer(["Total: 12.5 and", "Sum: 7, 8 and"], return_tensors="pt", padding=True, padding_side="left")
    # With an EOS (never generated here) transformers pads the rows that stopped.
    options = dict(max_new_tokens=6, mode=mode, return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id,
                   eos_token_id=tokenizer.eos_token_id)
    full = numbers_model.generate(**batch, **options)
    out = numbers_model.generate(**batch, **options, stop_strings=stop_strings, tokenizer=tokenizer)
    start = batch["input_ids"].shape[1]
    strings = [stop_strings] if isinstance(stop_strings, str) else stop_strings
    stops = []
    for row in range(2):
        sequence, values = full.sequences[row].tolist(), full.numeric_values[row].tolist()
        assert (full.sequences[row, start:] == tokenizer.num_token_id).all()
        stop = _first_stop(tokenizer, sequence, values, start, strings)
        length = start + (stop if stop is not None else 6)
        assert out.sequences[row, :length].tolist() == sequence[:length]
        assert out.numeric_values[row, :length].tolist() == values[:length]
        # A row that stopped is padded to the longest row.
        assert (out.sequences[row, length:] == tokenizer.pad_token_id).all()
        stops.append(stop)
    assert out.sequences.shape[1] == start + max(6 if s is None else s for s in stops)
    if strings in ([">"], ["NUM"]):
        assert stops == [None, None]  # "<NUM>" is not in the text: they never fire
    else:
        assert any(s is not None and s < 6 for s in stops)  # the numbers' digits hold them: they fire


def test_stop_strings_in_beam_search_read_each_candidates_value(numbers_model, tokenizer):
    with torch.no_grad():
        numbers_model.action.cls_head.bias[tokenizer.num_token_id] = 8.0  # <NUM> first, other tokens close behind
    batch = tokenizer("Total: 12 and", return_tensors="pt")
    pad = tokenizer.pad_token_id
    out = numbers_model.generate(**batch, max_new_tokens=6, num_beams=3, num_return_sequences=3, stop_strings=["."],
                                 tokenizer=tokenizer, return_dict_in_generate=True, pad_token_id=pad,
                                 eos_token_id=tokenizer.eos_token_id)
    start = batch["input_ids"].shape[1]
    stopped = 0
    for sequence, values in zip(out.sequences.tolist(), out.numeric_values.tolist(), strict=True):
        length = len(sequence) - next((i for i, t in enumerate(reversed(sequence)) if t != pad), 0)
        stop = _first_stop(tokenizer, sequence[:length], values[:length], start, ["."])
        # A hypothesis ends at its first ".", or runs to the end without one.
        assert stop == length - start or (stop is None and length - start == 6)
        stopped += stop is not None
    assert stopped > 0


def test_stop_strings_need_the_tokenizer_that_writes_numbers(numbers_model, tokenizer, qwen25_dir):
    batch = tokenizer("Total: 12 and", return_tensors="pt")
    with pytest.raises(ValueError, match="tokenizer"):
        numbers_model.generate(**batch, max_new_tokens=2, stop_strings=["."])
    with pytest.raises(ValueError, match="CausalQwenTokenizer"):
        numbers_model.generate(**batch, max_new_tokens=2, stop_strings=["."],
                               tokenizer=AutoTokenizer.from_pretrained(qwen25_dir))


def test_pipeline_stop_strings_stop_at_a_generated_number(numbers_model, tokenizer):
    pipe = pipeline("text-generation", model=numbers_model, tokenizer=tokenizer)
    prompt = "Total: 12 and"
    stopped = pipe(prompt, max_new_tokens=4, return_full_text=False, stop_sequence=".",
                   full_precision=True)[0]["generated_text"]
    batch = tokenizer(prompt, return_tensors="pt")
    full = numbers_model.generate(**batch, max_new_tokens=4, return_dict_in_generate=True)
    start = batch["input_ids"].shape[1]
    sequence, values = full.sequences[0].tolist(), full.numeric_values[0].tolist()
    stop = _first_stop(tokenizer, sequence, values, start, ["."])
    assert stop is not None and stop < 4
    assert stopped == tokenizer.decode(sequence[start:start + stop], numeric_values=values[start:start + stop])
