"""A model and a tokenizer that disagree on the <NUM> id are refused where they meet."""

import json

import pytest
import torch
from conftest import tiny_qwen2_config
from transformers import AutoTokenizer, Qwen2ForCausalLM, TrainingArguments, pipeline

from causal_qwen import CausalQwenForCausalLM, CausalQwenTokenizer, CausalQwenTrainer
from causal_qwen.pairing import check_tokenizer_matches

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer(qwen25_dir):
    return CausalQwenTokenizer.from_pretrained(qwen25_dir)


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(tiny_qwen2_config(vocab_size=151936)).eval()
    return CausalQwenForCausalLM.from_qwen(qwen, tokenizer=tokenizer)


def test_matching_and_unconcerned_pairs_pass(model, tokenizer, qwen25_dir):
    check_tokenizer_matches(model, tokenizer)
    check_tokenizer_matches(model.config, tokenizer)
    check_tokenizer_matches(model, AutoTokenizer.from_pretrained(qwen25_dir))  # plain Qwen2: numbers as digits
    check_tokenizer_matches(model, CausalQwenTokenizer.from_pretrained(qwen25_dir, use_numeric=False))
    check_tokenizer_matches(model, None)
    check_tokenizer_matches(Qwen2ForCausalLM(tiny_qwen2_config()), tokenizer)


def test_a_disagreeing_pair_is_refused(model, tokenizer, tmp_path):
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_token_id": 151700}))
    # Each file loads on its own: from_pretrained of the model alone cannot know the tokenizer.
    other = CausalQwenForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"<NUM> id is 151665 but .*num_token_id is 151700"):
        check_tokenizer_matches(other, tokenizer)
    with pytest.raises(ValueError, match="151700"):
        pipeline("text-generation", model=str(tmp_path))
    with pytest.raises(ValueError, match="151700"):
        CausalQwenTrainer(model=other, args=TrainingArguments(str(tmp_path / "out"), report_to=[]),
                          processing_class=tokenizer, value_head_start=False)


def test_pipeline_and_trainer_accept_a_matching_pair(model, tokenizer, tmp_path):
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    assert pipe.tokenizer is tokenizer
    CausalQwenTrainer(model=model, args=TrainingArguments(str(tmp_path / "out"), report_to=[]),
                      processing_class=tokenizer, value_head_start=False)
