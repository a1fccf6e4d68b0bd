"""generate() in every mode against Qwen2's greedy search and against full-forward recomputations."""

import math

import pytest
import torch
from transformers import Qwen2ForCausalLM

from causal_qwen import CausalQwenForCausalLM
from causal_qwen.generation import CausalQwenGenerateOutput

NUM = 120
PAD = 0

MODES = [
    dict(mode="standard"),
    dict(mode="standard", shared_noise=True),
    dict(mode="causal"),
    dict(mode="causal", shared_individual=True),
    dict(mode="traditional"),
    dict(mode="traditional", do_sample=True, top_k=20, temperature=0.8),
]


@pytest.fixture
def model(tiny_qwen):
    """A CausalQwen whose OvR decisions depend on the context (threshold near the logits, wide U)."""
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, ovr_threshold=0.3,
                                            abduction_scale_init=0.05, noise_init=0.02).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        model.action.reg_head.weight.normal_(0.0, 0.5, generator=g)
    return model


def left_padded_batch():
    torch.manual_seed(3)
    ids = torch.randint(1, 100, (3, 8))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = PAD, 0
    ids[2, :5], mask[2, :5] = PAD, 0
    return ids, mask


def gen(model, ids, mask, seed=0, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=kwargs.pop("max_new_tokens", 8),
                          pad_token_id=PAD, generator=torch.Generator().manual_seed(seed),
                          return_dict_in_generate=True, **kwargs)


def positions_from_mask(mask):
    return (mask.cumsum(-1) - 1).clamp(min=0)


def full_forward(model, output, mask_prompt):
    """One forward over the final sequences with their numbers, positions as generate sets them."""
    seq = output.sequences
    mask = torch.cat([mask_prompt, torch.ones(seq.shape[0], seq.shape[1] - mask_prompt.shape[1],
                                              dtype=mask_prompt.dtype)], 1)
    with torch.no_grad():
        return model(seq, numeric_values=output.numeric_values, attention_mask=mask,
                     position_ids=positions_from_mask(mask))


@pytest.mark.parametrize("use_cache", [True, False])
def test_traditional_greedy_equals_qwen2_greedy(tiny_qwen, use_cache):
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM).eval()
    ids, mask = left_padded_batch()
    expected = tiny_qwen.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                  pad_token_id=PAD, use_cache=use_cache)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=10, mode="traditional", do_sample=False,
                         pad_token_id=PAD, use_cache=use_cache)
    assert isinstance(got, torch.Tensor)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("options", MODES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_cache_and_no_cache_agree(model, options):
    ids, mask = left_padded_batch()
    ids[0, 4] = NUM
    values = torch.zeros(ids.shape, dtype=torch.float64)
    values[0, 4] = 17.25
    with_cache = gen(model, ids, mask, numeric_values=values, use_cache=True, **options)
    without = gen(model, ids, mask, numeric_values=values, use_cache=False, **options)
    assert torch.equal(with_cache.sequences, without.sequences)
    torch.testing.assert_close(with_cache.numeric_values, without.numeric_values)


def test_standard_is_argmax_of_ovr_probabilities(model):
    ids, mask = left_padded_batch()
    out = gen(model, ids, mask, mode="standard")
    full = full_forward(model, out, mask)
    p = 0.5 + torch.atan((full.loc_S.double() - 0.3) / full.scale_S.double()) / math.pi
    start = ids.shape[1]
    assert torch.equal(out.sequences[:, start:], p[:, start - 1:-1].argmax(-1))
    # Not a degenerate case: the sequences differ from what traditional greedy picks somewhere.
    assert len({tuple(s) for s in out.sequences[:, start:].tolist()}) > 1


def test_shared_individual_uses_one_epsilon_per_sequence(model):
    ids, mask = left_padded_batch()
    out = gen(model, ids, mask, seed=11, mode="causal", shared_individual=True)
    eps = torch.rand((3, 32), generator=torch.Generator().manual_seed(11))
    full = full_forward(model, out, mask)
    u = full.loc_U.double() + full.scale_U.double() * torch.tan(math.pi * (eps.double() - 0.5)).unsqueeze(1)
    w, b = model.action.cls_head.weight.double(), model.action.cls_head.bias.double()
    loc_s = u @ w.T + b
    scale_s = (model.action.b_noise.double().abs() @ w.abs().T).clamp(min=model.config.scale_min)
    p = 0.5 + torch.atan((loc_s - 0.3) / scale_s) / math.pi
    start = ids.shape[1]
    assert torch.equal(out.sequences[:, start:], p[:, start - 1:-1].argmax(-1))


def test_shared_noise_uses_one_noise_draw_per_sequence(model):
    ids, mask = left_padded_batch()
    out = gen(model, ids, mask, seed=4, mode="standard", shared_noise=True)
    eps = torch.rand((3, 32), generator=torch.Generator().manual_seed(4))
    full = full_forward(model, out, mask)
    shift = model.action.b_noise.double().abs() * torch.tan(math.pi * (eps.double() - 0.5))
    loc_u = full.loc_U.double() + shift.unsqueeze(1)
    w, b = model.action.cls_head.weight.double(), model.action.cls_head.bias.double()
    loc_s, scale_s = loc_u @ w.T + b, full.scale_U.double() @ w.abs().T
    p = 0.5 + torch.atan((loc_s - 0.3) / scale_s) / math.pi
    start = ids.shape[1]
    assert torch.equal(out.sequences[:, start:], p[:, start - 1:-1].argmax(-1))


def test_seeds_reproduce_and_differ(model):
    ids, mask = left_padded_batch()
    for options in (dict(mode="causal"), dict(mode="traditional", do_sample=True)):
        a = gen(model, ids, mask, seed=1, max_new_tokens=12, **options).sequences
        b = gen(model, ids, mask, seed=1, max_new_tokens=12, **options).sequences
        c = gen(model, ids, mask, seed=2, max_new_tokens=12, **options).sequences
        assert torch.equal(a, b)
        assert not torch.equal(a, c)


@pytest.mark.parametrize("mode", ["standard", "causal", "traditional"])
def test_forced_numbers_take_the_modes_value_and_feed_back(model, mode):
    with torch.no_grad():
        model.action.threshold[NUM] = -1e4  # P_<NUM> ≈ 1: every step emits a number
        model.action.cls_head.bias[NUM] = 1e3  # and the softmax picks it too
    ids, mask = left_padded_batch()
    out = gen(model, ids, mask, seed=9, mode=mode, output_value_scores=True, max_new_tokens=5)
    start = ids.shape[1]
    assert (out.sequences[:, start:] == NUM).all()
    generated_values = out.numeric_values[:, start:]
    # Values are the medians written with float32 precision (the precision the heads compute in).
    torch.testing.assert_close(generated_values, model.to_value(out.loc_Y.double()), rtol=1e-7, atol=0.0)
    assert all(len(repr(v).replace("-", "").replace(".", "").lstrip("0")) <= 9 for v in generated_values[0].tolist())
    assert generated_values.abs().min() > 0 and out.scale_Y.shape == generated_values.shape
    if mode != "causal":
        # A full forward with the values fed back predicts the same medians at every generated step.
        full = full_forward(model, out, mask)
        torch.testing.assert_close(full.loc_Y[:, start - 1:-1].double(), out.loc_Y.double(), rtol=1e-4, atol=1e-5)
    # The values are not all alike: each step reads the previous number.
    assert generated_values[0].unique().numel() > 1


def test_without_return_dict_returns_ids_and_num_return_sequences(model):
    ids, mask = left_padded_batch()
    seqs = model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=PAD)
    assert isinstance(seqs, torch.Tensor) and seqs.shape == (3, 12)
    values = torch.zeros(ids.shape, dtype=torch.float64)
    out = gen(model, ids, mask, numeric_values=values, mode="traditional", do_sample=True, num_return_sequences=2,
              max_new_tokens=3)
    assert isinstance(out, CausalQwenGenerateOutput)
    assert out.sequences.shape == (6, 11) and out.numeric_values.shape == (6, 11)
    # In causal mode each returned sequence is its own individual: copies of one prompt may differ.
    causal = gen(model, ids, mask, numeric_values=values, mode="causal", num_return_sequences=4, max_new_tokens=6)
    assert causal.sequences.shape == (12, 14)
    assert torch.equal(causal.sequences[:4, :8], ids[:1].expand(4, 8))
    assert len({tuple(row) for row in causal.sequences[:4, 8:].tolist()}) > 1


def test_eos_stops_and_pads(model):
    ids, mask = left_padded_batch()
    first = gen(model, ids, mask, mode="standard", max_new_tokens=1).sequences[:, -1]
    out = gen(model, ids, mask, mode="standard", max_new_tokens=6, eos_token_id=int(first[0]))
    assert out.sequences.shape[1] <= ids.shape[1] + 6
    assert out.numeric_values.shape == out.sequences.shape


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="greedy"), "mode"),
    (dict(mode="standard", shared_individual=True), "shared_individual"),
    (dict(mode="traditional", shared_individual=True), "shared_individual"),
    (dict(mode="causal", shared_noise=True), "shared_noise"),
    (dict(mode="standard", do_sample=True), "do_sample"),
    (dict(numeric_values=torch.zeros(3, 5, dtype=torch.float64)), "numeric_values"),
    (dict(num_beams=2), "num_beams"),
])
def test_bad_generation_arguments(model, kwargs, match):
    ids, mask = left_padded_batch()
    with pytest.raises(ValueError, match=match):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=PAD, **kwargs)


@pytest.mark.slow
def test_real_qwen25_traditional_greedy_equals_qwen2(qwen25_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen25_dir, padding_side="left")
    qwen = Qwen2ForCausalLM.from_pretrained(qwen25_dir, dtype=torch.float32).eval()
    model = CausalQwenForCausalLM.from_qwen(qwen, tokenizer=tokenizer).eval()
    batch = tokenizer(["def fibonacci(n):", "The capital of France is"], return_tensors="pt", padding=True)
    expected = qwen.generate(**batch, max_new_tokens=8, do_sample=False)
    got = model.generate(**batch, max_new_tokens=8, mode="traditional", do_sample=False)
    assert torch.equal(got, expected)
