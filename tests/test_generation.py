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


def independent_decision(model, full, mode, eps=None):
    """loc_S, scale_S of a mode in float64 from a full forward's U (causal: for the individual of ε)."""
    loc_u, scale_u = full.loc_U.double(), full.scale_U.double()
    if mode == "causal":
        loc_u = loc_u + scale_u * torch.tan(math.pi * (eps.double() - 0.5)).unsqueeze(1)
        scale_u = torch.zeros_like(scale_u)
    w, b = model.action.cls_head.weight.double(), model.action.cls_head.bias.double()
    scale_s = ((scale_u + model.action.b_noise.double().abs()) @ w.abs().T).clamp(min=model.config.scale_min)
    return loc_u @ w.T + b, scale_s


@pytest.mark.parametrize("mode", ["standard", "causal", "traditional"])
def test_output_logits_are_loc_s_and_output_scores_what_the_mode_ranks(model, mode):
    ids, mask = left_padded_batch()
    shared = dict(shared_individual=True) if mode == "causal" else {}
    out = gen(model, ids, mask, seed=11, mode=mode, output_logits=True, output_scores=True, **shared)
    full = full_forward(model, out, mask)
    loc_s, scale_s = independent_decision(model, full, mode, torch.rand((3, 32), generator=torch.Generator()
                                                                      .manual_seed(11)))
    steps = slice(ids.shape[1] - 1, -1)
    logits, scores = torch.stack(out.logits, 1).double(), torch.stack(out.scores, 1).double()
    torch.testing.assert_close(logits, loc_s[:, steps], rtol=1e-4, atol=1e-4)
    if mode != "causal":  # the model's own forward at each step (causal mode's loc_S is the individual's)
        torch.testing.assert_close(logits, full.loc_S[:, steps].double(), rtol=1e-4, atol=1e-4)
    expected = loc_s if mode == "traditional" else (loc_s - 0.3) / scale_s
    torch.testing.assert_close(scores, expected[:, steps], rtol=1e-4, atol=1e-3)
    assert torch.equal(out.sequences[:, ids.shape[1]:], scores.argmax(-1))


@pytest.mark.parametrize("mode", ["standard", "traditional"])
def test_a_logits_processor_sees_the_scores_the_mode_ranks(model, mode):
    from transformers import LogitsProcessor, LogitsProcessorList

    seen = []

    class Record(LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen.append(scores.clone())
            return scores

    ids, mask = left_padded_batch()
    out = gen(model, ids, mask, mode=mode, output_logits=True, logits_processor=LogitsProcessorList([Record()]))
    loc_s, scale_s = independent_decision(model, full_forward(model, out, mask), mode)
    expected = loc_s if mode == "traditional" else (loc_s - 0.3) / scale_s
    steps = slice(ids.shape[1] - 1, -1)
    torch.testing.assert_close(torch.stack(seen, 1).double(), expected[:, steps], rtol=1e-4, atol=1e-3)
    if mode == "standard":
        assert not torch.allclose(torch.stack(seen, 1), torch.stack(out.logits, 1), atol=1e-2)


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
    (dict(mode="standard", num_beams=2), "num_beams"),  # without a mode, beams imply traditional
])
def test_bad_generation_arguments(model, kwargs, match):
    ids, mask = left_padded_batch()
    with pytest.raises(ValueError, match=match):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=PAD, **kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(numeric_values=[[0.0] * 8] * 3), "numeric_values must be a floating-point tensor"),
    (dict(numeric_values=torch.zeros(3, 8, dtype=torch.long)), "numeric_values must be a floating-point tensor"),
    (dict(mode="causal", generator=42), "generator must be a torch.Generator"),
    (dict(mode="traditional", do_sample=True, generator=0), "generator must be a torch.Generator"),
])
def test_generate_refuses_arguments_of_the_wrong_type_naming_them(model, kwargs, match):
    ids, mask = left_padded_batch()
    with pytest.raises(TypeError, match=match):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=PAD, **kwargs)
    # The forward gives the same refusal for the same values.
    if "numeric_values" in kwargs:
        with pytest.raises(TypeError, match=match):
            model(ids, attention_mask=mask, numeric_values=kwargs["numeric_values"])


def test_generate_refuses_values_the_forward_refuses(model):
    ids, mask = left_padded_batch()
    values = torch.zeros(ids.shape, dtype=torch.float64)
    values[0, 4] = math.inf
    ids[0, 4] = NUM
    with pytest.raises(ValueError, match="numeric_values must be finite"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=PAD, numeric_values=values)
    embeds = model.get_input_embeddings()(ids)
    with pytest.raises(ValueError, match="numeric_values cannot go with inputs_embeds"):
        model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=2, pad_token_id=PAD,
                       numeric_values=values.nan_to_num(posinf=1.0))


def test_an_inputs_embeds_prompt_generates_as_qwen2_and_as_its_ids(tiny_qwen, model):
    ids, mask = left_padded_batch()
    start = ids.shape[1]
    converted = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM).eval()
    embeds = tiny_qwen.get_input_embeddings()(ids).detach()
    for options in (dict(), dict(num_beams=3, num_return_sequences=2)):
        expected = tiny_qwen.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                      pad_token_id=PAD, **options)
        got = converted.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=10, mode="traditional",
                                 pad_token_id=PAD, **options)
        assert torch.equal(got, expected)
        from_ids = converted.generate(ids, attention_mask=mask, max_new_tokens=10, mode="traditional",
                                      pad_token_id=PAD, **options)
        assert torch.equal(got, from_ids[:, start:])
    # Every mode, numbers included: the embeddings of a prompt without numbers give what its ids give.
    with torch.no_grad():
        model.action.threshold[NUM] = 0.0  # <NUM> wins at some steps and not at others
    embeds = model.get_input_embeddings()(ids).detach()
    for options in (dict(mode="standard"), dict(mode="causal"), dict(mode="traditional", do_sample=True),
                    dict(mode="causal", num_return_sequences=2)):
        from_ids = gen(model, ids, mask, seed=4, **options)
        from_embeds = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=8, pad_token_id=PAD,
                                     generator=torch.Generator().manual_seed(4), return_dict_in_generate=True,
                                     **options)
        assert torch.equal(from_embeds.sequences, from_ids.sequences[:, start:])
        torch.testing.assert_close(from_embeds.numeric_values, from_ids.numeric_values[:, start:])
    assert (from_ids.sequences[:, start:] == NUM).any() and (from_ids.sequences[:, start:] != NUM).any()


@pytest.mark.parametrize("mode", ["standard", "causal", "traditional"])
def test_a_right_padded_batch_warns_as_qwen2_does(tiny_qwen, model, mode):
    from transformers.generation.utils import logger
    from transformers.testing_utils import CaptureLogger

    ids, mask = left_padded_batch()
    right_ids, right_mask = ids.flip(1), mask.flip(1)
    warnings = {}
    for name, generator, options, batch in (("qwen2", tiny_qwen, {}, (right_ids, right_mask)),
                                            ("ours", model, dict(mode=mode), (right_ids, right_mask)),
                                            ("ours, left", model, dict(mode=mode), (ids, mask))):
        with CaptureLogger(logger) as captured:
            generator.generate(batch[0], attention_mask=batch[1], max_new_tokens=2, pad_token_id=PAD, **options)
        warnings[name] = "right-padding was detected" in captured.out
    assert warnings == {"qwen2": True, "ours": True, "ours, left": False}


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


# ---------------------------------------------------------------------------------------------------------------
# Generation options resolved as transformers resolves them
# ---------------------------------------------------------------------------------------------------------------


def test_a_generation_config_with_unset_fields_runs_like_keywords(model):
    ids, mask = left_padded_batch()
    from transformers import GenerationConfig

    got = model.generate(ids, attention_mask=mask, generation_config=GenerationConfig(max_new_tokens=5,
                                                                                      pad_token_id=PAD))
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=PAD)
    assert torch.equal(got, expected)


def test_the_models_generation_config_is_read(tiny_qwen, model):
    """A checkpoint's generation_config.json (here num_beams) counts as transformers counts it."""
    ids, mask = left_padded_batch()
    model.generation_config.num_beams = 2
    with pytest.raises(ValueError, match=r"num_beams=2 needs mode='traditional'"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=PAD, mode="standard")
    traditional = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM).eval()
    traditional.generation_config.num_beams = tiny_qwen.generation_config.num_beams = 2
    expected = tiny_qwen.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD)
    got = traditional.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD, mode="traditional")
    assert torch.equal(got, expected)
    # Without a mode, beam search implies traditional mode, as sampling does: Qwen2's beams.
    assert torch.equal(traditional.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD), expected)



def test_sampling_implies_traditional_mode(tiny_qwen, model):
    ids, mask = left_padded_batch()
    named = gen(model, ids, mask, seed=3, mode="traditional", do_sample=True, top_p=0.9).sequences
    assert torch.equal(gen(model, ids, mask, seed=3, do_sample=True, top_p=0.9).sequences, named)
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=True, top_p=0.9, max_new_tokens=8, pad_token_id=PAD)
    got = model.generate(ids, attention_mask=mask, generation_config=config, generator=torch.Generator().manual_seed(3))
    assert torch.equal(got, named)
    # Without a generator, sampling is Qwen2's on the same weights and the same global seed.
    plain = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM).eval()
    torch.manual_seed(7)
    expected = tiny_qwen.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=20,
                                  pad_token_id=PAD)
    torch.manual_seed(7)
    assert torch.equal(plain.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=20,
                                      pad_token_id=PAD), expected)


def test_a_checkpoint_that_samples_defaults_to_traditional_and_a_named_mode_wins(model):
    ids, mask = left_padded_batch()
    standard = gen(model, ids, mask, mode="standard").sequences
    sampled = gen(model, ids, mask, seed=3, mode="traditional", do_sample=True).sequences
    model.generation_config.do_sample = True
    assert torch.equal(gen(model, ids, mask, seed=3).sequences, sampled)
    assert torch.equal(gen(model, ids, mask, mode="standard").sequences, standard)


@pytest.mark.parametrize("mode", ["standard", "causal"])
def test_a_named_mode_that_does_not_sample_refuses_do_sample(model, mode):
    ids, mask = left_padded_batch()
    with pytest.raises(ValueError, match=rf"do_sample=True.*mode='traditional'.*mode='{mode}'"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=PAD, mode=mode, do_sample=True)


def test_resolve_mode_without_torch():
    from causal_qwen.generation_options import GenerationOptionError, check_generation_options, resolve_mode

    assert resolve_mode(None, True) == "traditional" and resolve_mode(None, None) == "standard"
    assert check_generation_options(None, False, True, None) == "standard"
    assert check_generation_options(None, False, False, True) == "traditional"
    with pytest.raises(GenerationOptionError, match="shared_noise"):
        check_generation_options(None, False, True, True)


# ---------------------------------------------------------------------------------------------------------------
# Beam search (traditional mode)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [
    dict(num_beams=3),
    dict(num_beams=3, num_return_sequences=2, eos_token_id=5, length_penalty=0.5),
    dict(num_beams=2, use_cache=False),
], ids=["beams", "returned-eos-penalty", "no-cache"])
def test_traditional_beam_search_equals_qwen2(tiny_qwen, options):
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM).eval()
    ids, mask = left_padded_batch()
    expected = tiny_qwen.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=PAD, **options)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=PAD, mode="traditional", **options)
    assert torch.equal(got, expected)


def numbered_prompts():
    ids, mask = left_padded_batch()
    ids, mask = ids[:2], mask[:2]
    ids[0, 4], ids[1, 6] = NUM, NUM
    values = torch.zeros(ids.shape, dtype=torch.float64)
    values[0, 4], values[1, 6] = 17.25, -3.5
    return ids, mask, values


def assert_values_are_the_predictions_of_their_own_prefix(model, out, ids, mask, values, per_prompt):
    """Every generated <NUM>'s value is what the model predicts from that sequence's own ids and values before it."""
    from causal_qwen.generated_numbers import shortest_float32

    start = ids.shape[1]
    for row, sequence in enumerate(out.sequences):
        prompt = row // per_prompt
        torch.testing.assert_close(out.numeric_values[row, :start], values[prompt])
        generated = out.numeric_values[row, start:]
        assert (generated[sequence[start:] != NUM] == 0).all()
        for t in (sequence[start:] == NUM).nonzero().flatten().tolist():
            t += start
            row_mask = torch.cat([mask[prompt], torch.ones(t - start, dtype=mask.dtype)])[None]
            with torch.no_grad():
                full = model(sequence[None, :t], numeric_values=out.numeric_values[row:row + 1, :t],
                             attention_mask=row_mask, position_ids=positions_from_mask(row_mask))
            predicted = shortest_float32(model.to_value(full.loc_Y[:, -1].double()))
            torch.testing.assert_close(out.numeric_values[row, t:t + 1], predicted, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("use_cache", [True, False])
def test_beam_search_numbers_travel_with_their_beams(model, use_cache):
    with torch.no_grad():
        model.action.cls_head.bias[NUM] = 1.0  # <NUM> likely but not certain: beams differ in their numbers
        model.numeric_embedding.w_num.mul_(20.0)  # and the numbers read move the next decisions
    ids, mask, values = numbered_prompts()
    out = model.generate(ids, attention_mask=mask, numeric_values=values, max_new_tokens=8, pad_token_id=PAD,
                         mode="traditional", num_beams=4, num_return_sequences=3, return_dict_in_generate=True,
                         output_value_scores=True, use_cache=use_cache)
    assert out.sequences.shape == out.numeric_values.shape == (6, 16) and out.loc_Y.shape == (6, 8)
    start = ids.shape[1]
    numbers = out.sequences[:, start:] == NUM
    assert numbers.any() and not numbers.all()
    assert len({tuple(row) for row in out.numeric_values[:, start:].tolist()}) == 6
    assert_values_are_the_predictions_of_their_own_prefix(model, out, ids, mask, values, per_prompt=3)
    torch.testing.assert_close(out.numeric_values[:, start:][numbers], model.to_value(out.loc_Y.double())[numbers],
                               rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="causal", num_beams=2), r"num_beams=2 needs mode='traditional'"),
    (dict(mode="standard", num_beams=3, num_return_sequences=2), r"num_beams=3 needs mode='traditional'"),
    (dict(mode="traditional", num_beams=2, do_sample=True, generator=torch.Generator()), "generator"),
    (dict(mode="causal", prompt_lookup_num_tokens=2), r"prompt_lookup_num_tokens.*shared_individual=True"),
    (dict(mode="traditional", do_sample=True, prompt_lookup_num_tokens=2, generator=torch.Generator()),
     r"generator cannot drive sampled assisted decoding \(prompt_lookup_num_tokens"),
    (dict(mode="traditional", num_beams=2, num_beam_groups=2, diversity_penalty=1.0), "group_beam_search"),
    (dict(mode="traditional", prefill_chunk_size=4), "prefill_chunk_size"),
])
def test_decoding_strategies_a_mode_cannot_run(model, kwargs, match):
    ids, mask = left_padded_batch()
    with pytest.raises(ValueError, match=match):
        model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=2, pad_token_id=PAD, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Assisted and prompt-lookup decoding (traditional, greedy)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("assistant", ["qwen2", "causal_qwen", "prompt_lookup"])
def test_assisted_decoding_equals_qwen2(tiny_qwen, assistant):
    from conftest import tiny_qwen2_config

    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM).eval()
    ids = left_padded_batch()[0][:1]
    ids = torch.cat([ids, ids[:, 2:6]], 1)  # a repeated n-gram for prompt lookup to find
    if assistant == "prompt_lookup":
        options = dict(prompt_lookup_num_tokens=3)
    elif assistant == "qwen2":
        torch.manual_seed(1)
        options = dict(assistant_model=Qwen2ForCausalLM(tiny_qwen2_config(num_hidden_layers=1)).eval())
    else:
        options = dict(assistant_model=CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM).eval())
    expected = tiny_qwen.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    got = model.generate(ids, max_new_tokens=12, mode="traditional", pad_token_id=PAD, **options)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", [
    dict(mode="traditional"), dict(mode="standard"), dict(mode="standard", shared_noise=True),
    dict(mode="causal", shared_individual=True),
], ids=["traditional", "standard", "standard-shared-noise", "causal-shared-individual"])
@pytest.mark.parametrize("assistant", ["causal_qwen", "prompt_lookup"])
def test_assisted_decoding_with_numbers_equals_greedy(model, assistant, mode):
    # Every mode whose decision draws nothing new at a step verifies the candidates by its own rule, and so gives
    # its own plain generation (the generator's one draw per sequence is the same in both calls).
    with torch.no_grad():
        model.action.cls_head.bias[NUM] = 1.0
        model.numeric_embedding.w_num.mul_(20.0)
    ids, mask, values = numbered_prompts()
    ids, values = ids[:1], values[:1]
    ids = torch.cat([ids, ids[:, 2:6]], 1)  # "… <NUM> …" twice: prompt lookup proposes the <NUM>
    values = torch.cat([values, values[:, 2:6]], 1)
    options = dict(prompt_lookup_num_tokens=4) if assistant == "prompt_lookup" else dict(assistant_model=model)
    expected = gen(model, ids, None, numeric_values=values, max_new_tokens=10, output_value_scores=True, **mode)
    got = gen(model, ids, None, numeric_values=values, max_new_tokens=10, output_value_scores=True, **mode,
              **options)
    assert (expected.sequences[:, ids.shape[1]:] == NUM).any()
    assert torch.equal(got.sequences, expected.sequences)
    # Verifying several positions in one forward rounds differently from one at a time: a float32 ulp or so.
    torch.testing.assert_close(got.numeric_values, expected.numeric_values, rtol=1e-5, atol=0.0)
    torch.testing.assert_close(got.loc_Y, expected.loc_Y, rtol=1e-4, atol=1e-5)


def test_assisted_decoding_without_a_mode_is_the_default_greedy_mode(model):
    # Standard mode's scores are the OvR margins, traditional mode's loc_S: the scores say which mode ran, while the
    # logits are loc_S in both.
    ids = left_padded_batch()[0][:1]
    options = dict(max_new_tokens=6, pad_token_id=PAD, return_dict_in_generate=True, output_logits=True,
                   output_scores=True)
    standard = model.generate(ids, **options)
    traditional = model.generate(ids, mode="traditional", **options)
    got = model.generate(ids, assistant_model=model, **options)
    assert torch.equal(got.sequences, standard.sequences)
    torch.testing.assert_close(torch.cat(got.scores), torch.cat(standard.scores), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(torch.cat(standard.scores), torch.cat(traditional.scores), atol=1e-2)
    torch.testing.assert_close(torch.cat(got.logits), torch.cat(standard.logits), rtol=1e-4, atol=1e-4)
    # The first step reads the same prompt in both modes: the same loc_S, whatever the mode ranks.
    torch.testing.assert_close(standard.logits[0], traditional.logits[0], rtol=1e-5, atol=1e-6)
    full = model(standard.sequences)
    start = ids.shape[1]
    margins = (full.loc_S.double() - 0.3) / full.scale_S.double()
    torch.testing.assert_close(torch.stack(got.scores, 1).double(), margins[:, start - 1:-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("assistant", ["causal_qwen", "prompt_lookup"])
def test_sampled_assisted_decoding_writes_each_number_from_its_own_prefix(model, assistant):
    # Speculative sampling (an assistant with logits) or sampling at each verified position (prompt lookup), in
    # traditional mode, which sampling implies; the numbers follow the accepted ids.
    with torch.no_grad():
        model.action.cls_head.bias[NUM] = 3.0  # sampled often enough to be drawn in 12 tokens
        model.numeric_embedding.w_num.mul_(20.0)
    ids, mask, values = numbered_prompts()
    ids, mask, values = ids[:1], mask[:1], values[:1]
    ids, mask = torch.cat([ids, ids[:, 2:6]], 1), torch.cat([mask, mask[:, 2:6]], 1)
    values = torch.cat([values, values[:, 2:6]], 1)
    options = dict(prompt_lookup_num_tokens=4) if assistant == "prompt_lookup" else dict(assistant_model=model)
    torch.manual_seed(3)
    out = model.generate(ids, attention_mask=mask, numeric_values=values, max_new_tokens=12, do_sample=True,
                         pad_token_id=PAD, return_dict_in_generate=True, **options)
    assert out.sequences.shape[1] > ids.shape[1] and (out.sequences[:, ids.shape[1]:] == NUM).any()
    assert_values_are_the_predictions_of_their_own_prefix(model, out, ids, mask, values, per_prompt=1)


def test_compiled_forward_with_a_static_cache_generates_as_eager(model):
    # transformers compiles the decoding forward for a static cache (on a GPU by default; forced here on the CPU);
    # fullgraph=True fails on any graph break. (transformers' generic test checks there is no recompilation.)
    mode = "standard"
    from transformers import CompileConfig

    with torch.no_grad():
        model.action.cls_head.bias[NUM] = 1.0
        model.numeric_embedding.w_num.mul_(20.0)
    ids, mask, values = numbered_prompts()
    expected = gen(model, ids, mask, mode=mode, numeric_values=values, max_new_tokens=8, output_value_scores=True)
    compile_config = CompileConfig(fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True
    torch.compiler.reset()
    got = gen(model, ids, mask, mode=mode, numeric_values=values, max_new_tokens=8, output_value_scores=True,
              cache_implementation="static", compile_config=compile_config)
    again = gen(model, ids, mask, mode=mode, numeric_values=values, max_new_tokens=8, output_value_scores=True,
                cache_implementation="static", compile_config=compile_config)
    assert (expected.sequences[:, ids.shape[1]:] == NUM).any()
    for out in (got, again):
        assert torch.equal(out.sequences, expected.sequences)
        torch.testing.assert_close(out.numeric_values, expected.numeric_values, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.loc_Y, expected.loc_Y, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Random draws from the generator only; values beyond the float range
# ---------------------------------------------------------------------------------------------------------------


def test_traditional_sampling_leaves_the_global_rng_alone(model):
    from transformers import LogitsProcessor, LogitsProcessorList

    seen = []

    class SeeGlobalState(LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen.append(torch.get_rng_state())
            return scores

    ids, mask = left_padded_batch()
    before = torch.get_rng_state()
    out = gen(model, ids, mask, seed=5, do_sample=True, top_k=20, output_scores=True,
              logits_processor=LogitsProcessorList([SeeGlobalState()]))
    assert torch.equal(torch.get_rng_state(), before)
    assert seen and all(torch.equal(state, before) for state in seen)
    # The scores returned are the processed scores the token was drawn from, not the sampler's mask.
    assert len(out.scores) == 8 and torch.isfinite(out.scores[0]).sum(-1).min() > 1


def test_threads_sampling_on_one_model_reproduce_sequential_runs(model):
    import threading

    ids, mask = left_padded_batch()
    seeds = [1, 2, 3, 4]
    sequential = {seed: gen(model, ids, mask, seed=seed, do_sample=True, max_new_tokens=24).sequences
                  for seed in seeds}
    barrier = threading.Barrier(len(seeds))
    results, errors = {}, []

    def work(seed):
        try:
            barrier.wait()
            for _ in range(3):
                results.setdefault(seed, []).append(
                    gen(model, ids, mask, seed=seed, do_sample=True, max_new_tokens=24).sequences)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for seed in seeds:
        assert all(torch.equal(run, sequential[seed]) for run in results[seed])


def test_the_mode_reaches_the_heads_only_within_generate_and_on_its_thread(model):
    # The forward takes no generation state: the mode acts through hooks on the action module. A forward on another
    # thread while a causal generation is inside its loop is the plain forward, and so is one after it.
    import inspect
    import threading

    from transformers import LogitsProcessor, LogitsProcessorList

    assert "generation_state" not in inspect.signature(type(model).forward).parameters
    ids, mask = left_padded_batch()
    with torch.no_grad():
        plain = model(ids, attention_mask=mask)
    inside, done = threading.Event(), threading.Event()

    class WaitInsideTheLoop(LogitsProcessor):
        def __call__(self, input_ids, scores):
            inside.set()
            assert done.wait(timeout=60)
            return scores

    errors = []

    def generate():
        try:
            gen(model, ids, mask, mode="causal", max_new_tokens=3, logits_processor=LogitsProcessorList(
                [WaitInsideTheLoop()]))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    thread = threading.Thread(target=generate)
    thread.start()
    assert inside.wait(timeout=60)
    with torch.no_grad():
        beside = model(ids, attention_mask=mask)
    done.set()
    thread.join()
    with torch.no_grad():
        after = model(ids, attention_mask=mask)
    assert not errors
    for out in (beside, after):
        for name in ("loc_S", "scale_S", "loc_Y", "scale_Y", "loc_U"):
            assert torch.equal(out[name], plain[name]), name


def forced_numbers(model, reg_bias):
    with torch.no_grad():
        model.action.threshold[NUM] = -1e4
        model.action.cls_head.bias[NUM] = 1e3
        model.action.reg_head.weight.zero_()
        model.action.reg_head.bias.fill_(reg_bias)


@pytest.mark.parametrize("mode", ["standard", "traditional"])
def test_a_value_beyond_the_float_range_is_clamped_and_generation_goes_on(model, mode):
    assert model.config.value_transform == "symlog"
    forced_numbers(model, 1000.0)  # symexp(1000) overflows float64
    ids, mask = left_padded_batch()
    with pytest.warns(RuntimeWarning, match="beyond the float64 range"):
        out = gen(model, ids, mask, mode=mode, max_new_tokens=4)
    generated = out.numeric_values[:, ids.shape[1]:]
    assert (out.sequences[:, ids.shape[1]:] == NUM).all()
    assert torch.isfinite(generated).all() and (generated == torch.finfo(torch.float64).max).all()


def test_a_nan_value_fails_naming_the_cause(model):
    forced_numbers(model, math.nan)
    ids, mask = left_padded_batch()
    with pytest.raises(RuntimeError, match="regression head predicted NaN"):
        gen(model, ids, mask, mode="standard", max_new_tokens=3)


@pytest.mark.slow
def test_real_qwen25_traditional_beam_search_and_prompt_lookup_equal_qwen2(qwen25_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen25_dir, padding_side="left")
    qwen = Qwen2ForCausalLM.from_pretrained(qwen25_dir, dtype=torch.float32).eval()
    # Qwen's own row for the <NUM> id: loc_S is Qwen's logits at every id, which beam search ranks well beyond the top.
    model = CausalQwenForCausalLM.from_qwen(qwen, tokenizer=tokenizer, num_row_init="copy").eval()
    batch = tokenizer(["def fibonacci(n):", "The capital of France is"], return_tensors="pt", padding=True)
    expected = qwen.generate(**batch, max_new_tokens=8, num_beams=3, num_return_sequences=2)
    assert torch.equal(model.generate(**batch, max_new_tokens=8, mode="traditional", num_beams=3,
                                      num_return_sequences=2), expected)
    one = tokenizer(["a b c d e f a b c d e f a b"], return_tensors="pt")
    expected = qwen.generate(**one, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(**one, max_new_tokens=8, mode="traditional", prompt_lookup_num_tokens=3),
                       expected)
