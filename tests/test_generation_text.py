"""Generation with the real Qwen2.5 tokenizer: numbers through pipeline(), streamers and decode."""

import io
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
    result = pipe(prompt, max_new_tokens=3)[0]["generated_text"]

    batch = tokenizer(prompt, return_tensors="pt")
    out = numbers_model.generate(**batch, max_new_tokens=3, return_dict_in_generate=True)
    start = batch["input_ids"].shape[1]
    generated = out.numeric_values[0, start:].tolist()
    assert (out.sequences[0, start:] == tokenizer.num_token_id).all()
    expected = prompt + tokenizer.decode(out.sequences[0, start:], numeric_values=out.numeric_values[0, start:])
    assert result == expected
    assert "<NUM>" not in result and all(str(v)[:5] in result for v in generated)
    # The prompt's values reached the model: another price gives other generated numbers.
    other = pipe(prompt.replace("99.9", "5000"), max_new_tokens=3)[0]["generated_text"]
    assert other.split("cost")[1] != result.split("cost")[1]
    new_only = pipe(prompt, max_new_tokens=3, return_full_text=False)[0]["generated_text"]
    assert prompt + new_only == result
    # Modes and seeds pass through the pipeline.
    causal = pipe(prompt, max_new_tokens=3, mode="causal", generator=torch.Generator().manual_seed(3))
    again = pipe(prompt, max_new_tokens=3, mode="causal", generator=torch.Generator().manual_seed(3))
    assert causal == again


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
