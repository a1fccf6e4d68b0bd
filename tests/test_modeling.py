"""CausalQwenForCausalLM against the Qwen2 it is built from and against its own formulas."""

import math
import os
import shutil
import stat
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_qwen2_config
from test_loss import reference_loss
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2ForCausalLM

from causal_qwen import CausalQwenConfig, CausalQwenForCausalLM, CausalQwenOutput

NUM = 120


def build(tiny_qwen, **overrides):
    return CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, **overrides).eval()


def randomize_heads(model, seed=0):
    """Move every causal parameter away from its initial value so that formulas are really exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("model."):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        model.action.b_noise.mul_(10.0)


def test_output_dataclass_and_logits_alias(tiny_qwen):
    model = build(tiny_qwen)
    out = model(torch.randint(0, 100, (2, 5)))
    assert isinstance(out, CausalQwenOutput)
    assert out.logits is out.loc_S
    assert out.loc_S.shape == out.scale_S.shape == (2, 5, 128)
    assert out.loc_Y.shape == out.scale_Y.shape == (2, 5)
    assert out.loc_U.shape == out.scale_U.shape == (2, 5, 32)


def test_init_reproduces_qwen_from_object(tiny_qwen):
    model = build(tiny_qwen)
    ids = torch.randint(0, 100, (3, 9))
    with torch.no_grad():
        qwen = tiny_qwen(ids, output_hidden_states=True)
        out = model(ids)
    assert (out.loc_S - qwen.logits).abs().max().item() <= 1e-5
    assert (out.loc_U - qwen.hidden_states[-1]).abs().max().item() <= 1e-5
    torch.testing.assert_close(out.scale_U, torch.full_like(out.scale_U, model.config.abduction_scale_init))
    # The head is a separate copy: training it must not move the input embedding.
    cls_weight = model.get_output_embeddings().weight
    assert cls_weight is model.action.cls_head.weight
    assert cls_weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


@pytest.mark.slow
def test_init_reproduces_qwen_from_saved_dir_with_real_tokenizer(tmp_path, qwen25_dir):
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(tiny_qwen2_config(vocab_size=151936)).eval()
    qwen.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(qwen25_dir / name, tmp_path / name)
    model = CausalQwenForCausalLM.from_qwen(tmp_path).eval()
    assert model.config.num_token_id == 151665  # len(tokenizer): the first spare row
    assert model.config.vocab_size == 151936
    ids = torch.tensor([[9707, 1879, 11, 151643, 100]])
    with torch.no_grad():
        reference = qwen(ids, output_hidden_states=True)
        out = model(ids)
    # docs/design.md §3 (revision 2): every column is Qwen's but <NUM>'s, which by default starts at the digits' mean.
    other = torch.arange(151936) != 151665
    assert (out.loc_S[..., other] - reference.logits[..., other]).abs().max().item() <= 1e-5
    digits = [15, 16, 17, 18, 19, 20, 21, 22, 23, 24]  # "0" ... "9" in the Qwen2.5 vocabulary
    expected_num = reference.logits[..., digits].mean(-1)
    assert (out.loc_S[..., 151665] - expected_num).abs().max().item() <= 1e-5
    assert (out.loc_U - reference.hidden_states[-1]).abs().max().item() <= 1e-5


def test_num_token_id_resolution_and_growth(tiny_qwen):
    class FakeTokenizer:
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, tokenizer=FakeTokenizer(121))
    assert model.config.num_token_id == 121 and model.config.vocab_size == 128
    # No spare row: the embedding and the head grow by one, Qwen's rows unchanged.
    grown = CausalQwenForCausalLM.from_qwen(tiny_qwen, tokenizer=FakeTokenizer(128)).eval()
    assert grown.config.num_token_id == 128 and grown.config.vocab_size == 129
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        assert (grown(ids).loc_S[..., :128] - tiny_qwen(ids).logits).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="tokenizer= .*or num_token_id"):
        CausalQwenForCausalLM.from_qwen(tiny_qwen)
    with pytest.raises(ValueError, match="disagrees"):
        CausalQwenForCausalLM.from_qwen(tiny_qwen, tokenizer=FakeTokenizer(121), num_token_id=122)
    with pytest.raises(ValueError, match="beyond the vocabulary"):
        CausalQwenForCausalLM.from_qwen(tiny_qwen, tokenizer=FakeTokenizer(140))
    with pytest.raises(TypeError, match="model_or_path"):
        CausalQwenForCausalLM.from_qwen(42, num_token_id=NUM)
    text_only = CausalQwenForCausalLM.from_qwen(tiny_qwen, use_numeric=False)
    assert text_only.numeric_embedding is None and text_only.action.reg_head is None


def test_w_num_drawn_with_the_embedding_std(tiny_qwen):
    with torch.no_grad():
        tiny_qwen.model.embed_tokens.weight.mul_(7.0)
    model = build(tiny_qwen)
    expected = tiny_qwen.model.embed_tokens.weight.std().item()
    # 32 draws: the sample std is within a factor 2 of the target with overwhelming probability.
    assert 0.5 * expected < model.numeric_embedding.w_num.std().item() < 2.0 * expected
    assert model.numeric_embedding.d_num.abs().max().item() == 0.0


def test_heads_equal_their_formulas(tiny_qwen):
    # The linear law of docs/design.md §1; the context-value path's formula is tested in test_context_values.py.
    model = build(tiny_qwen, context_values=False)
    randomize_heads(model)
    ids = torch.randint(0, 100, (2, 6))
    with torch.no_grad():
        out = model(ids)
        z = tiny_qwen.model(ids).last_hidden_state.double()
    a, act = model.abduction, model.action
    loc_u = z @ a.loc_net.weight.double().T + a.loc_net.bias.double()
    scale_u = torch.log1p(torch.exp(z @ a.scale_net.weight.double().T + a.scale_net.bias.double()))
    scale_u_noisy = scale_u + act.b_noise.double().abs()
    w_cls, w_reg = act.cls_head.weight.double(), act.reg_head.weight.double()[0]
    loc_s = loc_u @ w_cls.T + act.cls_head.bias.double()
    scale_s = scale_u_noisy @ w_cls.abs().T
    loc_y = loc_u @ w_reg + act.reg_head.bias.double()
    gamma_y = act.reg_log_noise.double().exp()  # docs/design.md §1 revision 2: the value's own noise, on by default
    scale_y = scale_u_noisy @ w_reg.abs() + gamma_y
    for got, want in [(out.loc_U, loc_u), (out.scale_U, scale_u), (out.loc_S, loc_s), (out.scale_S, scale_s),
                      (out.loc_Y, loc_y), (out.scale_Y, scale_y)]:
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    p = model.ovr_probabilities(out.loc_S, out.scale_S)
    torch.testing.assert_close(p.double(), 0.5 + torch.atan((loc_s - 15.0) / scale_s) / math.pi, rtol=1e-4, atol=1e-6)


def test_scale_floor(tiny_qwen):
    model = build(tiny_qwen, abduction_scale_init=1e-9, noise_init=0.0, scale_min=1e-3)
    out = model(torch.randint(0, 100, (1, 4)))
    assert out.scale_U.min().item() >= 1e-3 and out.scale_S.min().item() >= 1e-3
    assert out.scale_Y.min().item() >= 1e-3


def test_numbers_change_only_positions_at_and_after_them(tiny_qwen):
    model = build(tiny_qwen)
    ids = torch.randint(0, 100, (1, 8))
    ids[0, 4] = NUM
    zeros = torch.zeros(1, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="no numeric_values"):
        model(ids)  # a <NUM> without its value is refused rather than read as 0
    with torch.no_grad():
        plain = model(ids, numeric_values=zeros)
        values = zeros.clone()
        values[0, 4] = 1234.5
        with_number = model(ids, numeric_values=values)
    diff = (with_number.loc_S - plain.loc_S).abs().amax(-1)[0]
    assert diff[:4].max().item() == 0.0
    assert (diff[4:] > 1e-4).all()
    phi = model.numeric_embedding(torch.zeros(1, 1, 32), torch.tensor([[5]]), torch.tensor([[0.0]]))
    assert phi.abs().max().item() == 0.0


def test_loss_through_the_model_equals_reference(tiny_qwen):
    model = build(tiny_qwen, gate_alpha=0.2, reg_loss_weight=0.7, ovr_threshold=0.5, value_transform="identity",
                  abduction_scale_init=0.5)
    randomize_heads(model)
    ids = torch.randint(0, 100, (2, 7))
    ids[0, 3], ids[1, 5] = NUM, NUM
    values = torch.zeros(2, 7, dtype=torch.float64)
    values[0, 3], values[1, 5] = 2.5, -0.75
    labels = ids.clone()
    labels[1, :2] = -100
    out = model(ids, numeric_values=values, labels=labels)
    with torch.no_grad():
        full = model(ids, numeric_values=values)
    ref = reference_loss(full.loc_S.double(), full.scale_S.double(), full.loc_Y.double(), full.scale_Y.double(),
                         labels, values, 0.5, 0.2, 0.7, True, "identity", vocab=128, num=NUM)
    for got, want in zip((out.loss, out.cls_loss, out.reg_loss), ref, strict=False):
        assert got.item() == pytest.approx(want.item(), rel=1e-5)
    assert out.reg_loss.item() != 0.0


def test_training_step_takes_the_fused_path_with_the_same_loss_and_gradients(tiny_qwen):
    model = build(tiny_qwen, learnable_threshold=True, ovr_threshold=0.5, abduction_scale_init=0.3).train()
    randomize_heads(model)
    ids = torch.randint(0, 100, (2, 9))
    ids[:, 4] = NUM
    values = torch.zeros(2, 9, dtype=torch.float64)
    values[:, 4] = torch.tensor([3.0, -250.0], dtype=torch.float64)
    labels = ids.clone()
    labels[0, :3] = -100
    results = []
    for full in (False, True):
        model.zero_grad()
        out = model(ids, numeric_values=values, labels=labels, output_distributions=full)
        out.loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (fused, fused_grads), (straight, straight_grads) = results
    assert fused.loc_S is None and fused.logits is None and straight.loc_S is not None
    torch.testing.assert_close(fused.loc_Y, straight.loc_Y)
    for name in ("loss", "cls_loss", "reg_loss"):
        assert getattr(fused, name).item() == pytest.approx(getattr(straight, name).item(), rel=1e-5)
    assert fused_grads.keys() == straight_grads.keys() and "action.threshold" in fused_grads
    for name, grad in straight_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6 * grad.abs().max().item())


def test_frozen_backbone_gets_no_gradient(tiny_qwen):
    model = build(tiny_qwen).train()
    ids = torch.randint(0, 100, (2, 6))
    ids[:, 2] = NUM
    values = torch.zeros(2, 6, dtype=torch.float64)
    values[:, 2] = 3.0
    model(ids, numeric_values=values, labels=ids).loss.backward()
    assert all(p.grad is None for p in model.model.parameters())
    assert model.numeric_embedding.w_num.grad is not None and model.numeric_embedding.w_num.grad.abs().sum() > 0
    assert model.action.cls_head.weight.grad is not None
    unfrozen = build(tiny_qwen, freeze_backbone=False).train()
    unfrozen(ids, numeric_values=values, labels=ids).loss.backward()
    assert unfrozen.model.embed_tokens.weight.grad is not None


def test_learnable_threshold_is_a_parameter(tiny_qwen):
    model = build(tiny_qwen, learnable_threshold=True, ovr_threshold=3.0)
    assert isinstance(model.action.threshold, torch.nn.Parameter)
    assert model.action.threshold.shape == (128,) and model.action.threshold.eq(3.0).all()
    ids = torch.randint(0, 100, (1, 5))
    model(ids, labels=ids).loss.backward()
    assert model.action.threshold.grad.abs().sum() > 0
    assert "action.threshold" in dict(build(tiny_qwen).named_buffers())


@pytest.mark.parametrize("learnable", [False, True])
def test_save_load_and_auto_roundtrip(tmp_path, tiny_qwen, learnable):
    model = build(tiny_qwen, learnable_threshold=learnable)
    randomize_heads(model)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert AutoConfig.from_pretrained(tmp_path).model_type == "causal_qwen"
    ids = torch.randint(0, 100, (2, 6))
    ids[0, 1] = NUM
    values = torch.zeros(2, 6, dtype=torch.float64)
    values[0, 1] = -42.0
    with torch.no_grad():
        expected = model(ids, numeric_values=values)
    for loader in (CausalQwenForCausalLM, AutoModelForCausalLM):
        loaded = loader.from_pretrained(tmp_path, dtype=torch.float32).eval()
        assert isinstance(loaded, CausalQwenForCausalLM)
        with torch.no_grad():
            got = loaded(ids, numeric_values=values)
        for name in ("loc_S", "scale_S", "loc_Y", "scale_Y", "loc_U", "scale_U"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), name
    keys = set(CausalQwenForCausalLM.from_pretrained(tmp_path).state_dict())
    assert {"numeric_embedding.w_num", "abduction.loc_net.weight", "abduction.scale_net.weight",
            "action.cls_head.weight", "action.reg_head.weight", "action.b_noise", "action.threshold"} <= keys
    assert set(tiny_qwen.model.state_dict()) == {k[len("model."):] for k in keys if k.startswith("model.")}


@pytest.mark.skipif(os.name == "nt", reason="POSIX permission bits")
def test_saved_weights_have_the_mode_of_every_other_saved_file(tmp_path, tiny_qwen):
    # safetensors writes through a temporary file created 0o600 and renamed into place; the folder's other files
    # get 0o666 less the umask, as the weights should.
    model = build(tiny_qwen)
    mask = os.umask(0o027)
    try:
        model.save_pretrained(tmp_path / "one")
        model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    finally:
        os.umask(mask)
    for folder in (tmp_path / "one", tmp_path / "sharded"):
        modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in folder.iterdir()}
        weights = [name for name in modes if name.endswith(".safetensors")]
        assert weights and "config.json" in modes
        assert set(modes.values()) == {0o640}, modes
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    # Saved over an existing file, the weights keep its mode, as a file written with open() does.
    (tmp_path / "one" / "model.safetensors").chmod(0o600)
    model.save_pretrained(tmp_path / "one")
    assert stat.S_IMODE((tmp_path / "one" / "model.safetensors").stat().st_mode) == 0o600


def test_fresh_model_from_config_starts_at_identity_abduction():
    config = CausalQwenConfig(**tiny_qwen2_config().to_dict() | {"num_token_id": NUM, "tie_word_embeddings": False})
    model = CausalQwenForCausalLM(config)
    torch.testing.assert_close(model.abduction.loc_net.weight, torch.eye(32))
    assert model.abduction.scale_net.weight.abs().max().item() == 0.0
    softplus_bias = torch.nn.functional.softplus(model.abduction.scale_net.bias)
    torch.testing.assert_close(softplus_bias, torch.full((32,), config.abduction_scale_init))
    torch.testing.assert_close(model.action.b_noise, torch.full((32,), config.noise_init))


def test_value_interval_is_exact_under_symlog(tiny_qwen):
    model = build(tiny_qwen, value_transform="symlog")
    loc_y, scale_y = torch.tensor([2.0]), torch.tensor([0.3])
    median, low, high = model.value_interval(loc_y, scale_y, coverage=0.5)
    assert median.item() == pytest.approx(math.expm1(2.0))
    assert low.item() == pytest.approx(math.expm1(2.0 - 0.3)) and high.item() == pytest.approx(math.expm1(2.3))
    with pytest.raises(ValueError, match="coverage"):
        model.value_interval(loc_y, scale_y, coverage=1.5)


def test_a_value_off_num_raises_instead_of_moving_the_output(tiny_qwen):
    # Values belong to <NUM> positions (0 elsewhere); one elsewhere means values and ids are misaligned.
    model = build(tiny_qwen)
    ids = torch.randint(0, 100, (2, 5))
    ids[0, 2] = NUM
    values = torch.zeros(2, 5, dtype=torch.float64)
    values[0, 2] = 0.0  # the number 0 at a <NUM> is a value like any other
    with torch.no_grad():
        reference = model(ids, numeric_values=values)
    values[0, 2] = 3.5
    for position in ((0, 1), (1, 4)):
        shifted = values.clone()
        shifted[position] = 2.0
        with pytest.raises(ValueError, match=rf"numeric_values holds a value at .*{list(position)}.* not <NUM>"):
            model(ids, numeric_values=shifted)
        with pytest.raises(ValueError, match="numeric_values"):
            model.generate(ids, numeric_values=shifted, max_new_tokens=2)
    assert torch.isfinite(reference.loc_S).all()


def test_bad_inputs_raise_naming_the_argument(tiny_qwen):
    model = build(tiny_qwen)
    ids = torch.randint(0, 100, (2, 5))
    with pytest.raises(ValueError, match="numeric_values"):
        model(ids, numeric_values=torch.zeros(2, 4, dtype=torch.float64))
    bad = torch.zeros(2, 5, dtype=torch.float64)
    bad[0, 1] = float("nan")
    with pytest.raises(ValueError, match="numeric_values"):
        model(ids, numeric_values=bad)
    bad[0, 1] = float("inf")
    with pytest.raises(ValueError, match="numeric_values"):
        model(ids, numeric_values=bad)
    with pytest.raises(TypeError, match="numeric_values"):
        model(ids, numeric_values=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.tensor([[1, 128]]))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.tensor([[-1, 3]]))
    with pytest.raises(TypeError, match="input_ids"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels=torch.full((2, 5), 500))
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels=ids[:, :4])
    with_num = ids.clone()
    with_num[0, 2] = NUM
    with pytest.raises(ValueError, match="numeric_labels"):
        model(with_num, labels=with_num)
    with pytest.raises(ValueError, match="numeric_labels"):
        model(with_num, labels=with_num, numeric_labels=torch.zeros(2, 3))
    # The loss reads every position: keeping fewer with labels is refused (Qwen2 fails inside its loss).
    for kept in (1, torch.tensor([4])):
        with pytest.raises(ValueError, match="logits_to_keep must be 0"):
            model(ids, labels=ids, logits_to_keep=kept)
        with pytest.raises(ValueError, match="logits_to_keep must be 0"):
            model(ids, shift_labels=ids, logits_to_keep=kept)
    assert model(ids, labels=ids, logits_to_keep=0).loss.isfinite()
    text_only = CausalQwenForCausalLM.from_qwen(tiny_qwen, use_numeric=False)
    with pytest.raises(ValueError, match="use_numeric=False"):
        text_only(ids, numeric_values=torch.ones(2, 5))


def test_an_empty_batch_or_sequence_raises_naming_the_argument(tiny_qwen):
    # Without the check the backbone fails in a reshape of the attention that names neither the input nor the cause.
    model = build(tiny_qwen)
    for shape in ((0, 5), (2, 0), (0, 0)):
        with pytest.raises(ValueError, match=rf"input_ids has shape \({shape[0]}, {shape[1]}\): an empty batch"):
            model(torch.zeros(shape, dtype=torch.long))
        with pytest.raises(ValueError, match="input_ids has shape"):
            model(torch.zeros(shape, dtype=torch.long), numeric_values=torch.zeros(shape, dtype=torch.float64),
                  labels=torch.zeros(shape, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids must be 2-D, \[batch, sequence\], got shape \(5,\)"):
        model(torch.ones(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"inputs_embeds has shape \(2, 0, 32\)"):
        model(inputs_embeds=torch.zeros(2, 0, 32))
    with torch.no_grad():  # one sequence of one token is enough
        assert model(torch.ones(1, 1, dtype=torch.long)).loc_S.shape == (1, 1, 128)


def one_number(value: float, dtype: torch.dtype = torch.float64) -> dict:
    ids = torch.tensor([[5, 7, NUM, 9, NUM, 11]])
    values = torch.zeros(ids.shape, dtype=dtype)
    values[0, 2], values[0, 4] = value, 3.0
    return dict(input_ids=ids, numeric_values=values, labels=ids)


def finite_step(model, inputs: dict) -> bool:
    """Whether a training step's loss and every gradient are finite."""
    model.zero_grad()
    out = model(**inputs)
    out.loss.backward()
    return bool(torch.isfinite(out.loss)) and all(bool(torch.isfinite(p.grad).all())
                                                  for p in model.parameters() if p.grad is not None)


def test_values_beyond_what_the_model_carries_raise_naming_numeric_values(tiny_qwen):
    # With the identity transform the head's space is the value itself, held in float32 by the loss: past float32's
    # range T(v) is ±inf and the loss and its gradients are not finite.
    model = build(tiny_qwen, value_transform="identity", context_values=False)
    for value in (1e300, -1e300, -1.7e308, 2.0 ** 128 - 2.0 ** 103):  # the last: the first to round to inf
        inputs = one_number(value)
        with pytest.raises(ValueError, match=r"numeric_values holds 1 value\(s\) .* torch.float32 .*3.403e\+38"):
            model(**inputs)
        with torch.no_grad(), pytest.raises(ValueError, match="numeric_values holds 1 value"):
            model(**{**inputs, "labels": None})  # read only as context, too
    # Up to float32's own rounding to inf a value is carried.
    for value in (torch.finfo(torch.float32).max, -(2.0 ** 128 - 2.0 ** 103 - 2.0 ** 75)):
        assert finite_step(model, one_number(value))


def test_a_float16_model_carries_values_within_float16(tiny_qwen):
    # The narrower of the model's dtype and the loss's float32 bounds T(v): 65504 is float16's largest value, and
    # values from 65520 round to inf there.
    model = build(tiny_qwen, value_transform="identity").to(torch.float16)
    with torch.no_grad():
        assert torch.isfinite(model(**one_number(65504.0)).loc_Y).all()
        with pytest.raises(ValueError, match=r"numeric_values .* torch.float16 .*6.55e\+04"):
            model(**one_number(65520.0))
        # symlog(v) ≤ 709.8 for every finite float64 v: a symlog model reads any value, in float16 as well.
        out = build(tiny_qwen).to(torch.float16)(**one_number(1e300))
    assert torch.isfinite(out.loss) and torch.isfinite(out.loc_Y).all()


def test_a_training_step_refuses_values_its_gradient_cannot_carry(tiny_qwen):
    # The context-value path's raw-space combination Σ w_j·v_j has the gradient v_j in w_j: a fresh model's step on
    # 1e300 gave inf/NaN gradients in the path's keys, and so in everything before them, without an error.
    model = build(tiny_qwen)
    assert model.config.value_transform == "symlog" and model.config.context_values
    for value in (1e300, -1e39):
        with pytest.raises(ValueError, match=r"numeric_values .* records gradients: .* torch.float32.*3.403e\+38"):
            model(**one_number(value))
    with torch.no_grad():  # inference reads every finite float64 value
        out = model(**one_number(1e300))
    assert torch.isfinite(out.loss) and torch.isfinite(out.loc_Y).all()
    assert finite_step(model, one_number(torch.finfo(torch.float32).max))
    # Without the path the values reach the model only through symlog, and a step on 1e300 is finite.
    assert finite_step(build(tiny_qwen, context_values=False), one_number(1e300))


@pytest.mark.parametrize("field,value,kind", [
    ("num_token_id", 128, ValueError), ("num_token_id", -1, ValueError), ("abduction_scale_init", 0.0, ValueError),
    ("noise_init", -1.0, ValueError), ("scale_min", float("nan"), ValueError), ("gate_alpha", 1.5, ValueError),
    ("value_transform", "log", ValueError), ("causal_size", 16, ValueError), ("ovr_threshold", "high", TypeError),
])
def test_config_rejects_bad_fields(field, value, kind):
    fields = tiny_qwen2_config().to_dict() | {"num_token_id": NUM, field: value}
    with pytest.raises(kind, match=field):
        CausalQwenConfig(**fields)


def test_model_requires_num_token_id_when_numeric():
    config = CausalQwenConfig(**tiny_qwen2_config().to_dict())
    with pytest.raises(ValueError, match="num_token_id"):
        CausalQwenForCausalLM(config)


@pytest.mark.slow
def test_real_qwen25_init_matches_qwen(qwen25_dir):
    qwen = Qwen2ForCausalLM.from_pretrained(qwen25_dir, dtype=torch.float32).eval()
    model = CausalQwenForCausalLM.from_qwen(qwen25_dir).eval()
    assert model.config.num_token_id == 151665
    ids = torch.tensor([[9707, 1879, 11, 279, 3349, 374, 220, 24, 24, 13, 24]])
    with torch.no_grad():
        reference = qwen(ids, output_hidden_states=True)
        out = model(ids)
    assert (out.loc_U - reference.hidden_states[-1]).abs().max().item() <= 1e-5
    # docs/design.md §3 (revision 2): every column is Qwen's but <NUM>'s, which by default starts at the digits' mean.
    # Each logit is a sum of 896 float32 products, which Qwen's head and ours (by blocks of the vocabulary) may add in
    # other orders: each is held to the exact sum over Qwen's features (float64) within float32's rounding of the sum
    # of the products' sizes, 8·ε·Σ_j |z_j·W_ij| (Qwen's own head lands within 2.1 of them, ours within 2.4). A
    # fixed 1e-5 does not tell an order apart from a wrong weight: both heads miss the exact sum by 1.2-1.4e-5.
    features = reference.hidden_states[-1][0].double()
    weight = qwen.lm_head.weight.double()
    digits = [15, 16, 17, 18, 19, 20, 21, 22, 23, 24]  # "0" ... "9" in the Qwen2.5 vocabulary
    weight = torch.cat([weight[:151665], weight[digits].mean(0, keepdim=True), weight[151666:]])
    exact = features @ weight.T
    rounding = 8 * torch.finfo(torch.float32).eps * (features.abs() @ weight.abs().T)
    assert ((out.loc_S[0].double() - exact).abs() <= rounding).all()
    other = torch.arange(151936) != 151665
    assert ((reference.logits[0].double() - exact).abs() <= rounding)[:, other].all()  # Qwen's head, the same bound
    assert torch.isfinite(out.scale_S).all() and torch.isfinite(out.loc_Y).all()


def test_scale_s_follows_weight_updates(tiny_qwen):
    model = build(tiny_qwen)
    ids = torch.randint(0, 100, (1, 5))
    with torch.no_grad():
        first = model(ids)
        model.action.cls_head.weight.mul_(-3.0)  # in place, as an optimiser step would
        second = model(ids)
        expected = (first.scale_U + model.action.b_noise.abs()) @ model.action.cls_head.weight.abs().T
    torch.testing.assert_close(second.scale_S, expected.clamp(min=model.config.scale_min))
    torch.testing.assert_close(second.scale_S, 3.0 * first.scale_S)


# EMA and weight averaging write through `.data`, which does not bump the parameter's version counter.
DATA_WRITES = {
    "mul_": lambda w, other: w.data.mul_(-3.0),
    "copy_": lambda w, other: w.data.copy_(other),
    "lerp_": lambda w, other: w.data.lerp_(other, 0.5),
    "zero_": lambda w, other: w.data[:60].zero_(),
}


@pytest.mark.parametrize("write", sorted(DATA_WRITES))
def test_generation_follows_writes_through_data(tiny_qwen, write):
    model = build(tiny_qwen)
    randomize_heads(model)
    ids = torch.randint(0, 100, (2, 5))
    weight = model.action.cls_head.weight
    other = torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)) * weight.abs().mean()
    with torch.no_grad():
        model(ids)
        model.generate(ids, max_new_tokens=6, do_sample=False)
        DATA_WRITES[write](weight, other)
        out = model(ids)
        got = model.generate(ids, max_new_tokens=6, do_sample=False)
    expected = (out.scale_U + model.action.b_noise.abs()) @ weight.abs().T
    torch.testing.assert_close(out.scale_S, expected.clamp(min=model.config.scale_min))
    fresh = build(tiny_qwen)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(got, fresh.generate(ids, max_new_tokens=6, do_sample=False))


def test_text_only_training_step_skips_the_backbone_backward(tiny_qwen):
    model = build(tiny_qwen, freeze_backbone=True).train()
    ids = torch.randint(0, 100, (2, 6))
    out = model(ids, labels=ids)
    # No number anywhere: the embedding output does not depend on any trainable parameter.
    emb = model.numeric_embedding(model.model.embed_tokens(ids), ids, torch.zeros(2, 6, dtype=torch.float64))
    assert not emb.requires_grad
    out.loss.backward()
    # The numeric embedding and the regression head still get a gradient (exactly 0), as DDP needs.
    assert model.numeric_embedding.d_num.grad.abs().max() == 0 and model.action.reg_head.weight.grad.abs().max() == 0
    assert model.action.cls_head.weight.grad is not None


def without_anchor(model, ids, labels, **options):
    """The model's forward with its anchor and the anchor's weight taken away for the call."""
    anchor, weight = model.abduction_anchor, model.config.abduction_anchor_weight
    model.abduction_anchor, model.config.abduction_anchor_weight = None, 0.0
    try:
        return model(ids, labels=labels, **options)
    finally:
        model.abduction_anchor, model.config.abduction_anchor_weight = anchor, weight


def test_abduction_finetuning_with_kl_anchor(tiny_qwen, tmp_path):
    model = build(tiny_qwen).train()
    model.enable_abduction_finetuning(anchor_weight=0.5)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"abduction.loc_net.weight", "abduction.loc_net.bias", "abduction.scale_net.weight",
                         "abduction.scale_net.bias"}
    ids = torch.randint(0, 100, (2, 6))
    labels = ids.clone()
    labels[0, :2] = -100
    # At the start the anchor equals the abduction network: the KL term and its gradient vanish.
    with_anchor = model(ids, labels=labels, output_distributions=True)
    anchor = model.abduction_anchor
    without = without_anchor(model, ids, labels, output_distributions=True)
    assert with_anchor.loss.item() == pytest.approx(without.loss.item(), rel=1e-6)
    # Move the abduction network: the loss grows by β · mean over labelled positions of Σ_c KL (closed form).
    with torch.no_grad():
        model.abduction.loc_net.bias.add_(0.3)
        model.abduction.scale_net.bias.add_(0.7)
    out = model(ids, labels=labels, output_distributions=True)
    plain = without_anchor(model, ids, labels, output_distributions=True)
    with torch.no_grad():
        z = tiny_qwen.model(ids).last_hidden_state.double()
        g0 = model.config.abduction_scale_init
        g1 = torch.nn.functional.softplus(model.abduction.scale_net.bias.double()).expand_as(z)
        kl = torch.log(((g1 + g0) ** 2 + 0.3**2) / (4 * g1 * g0)).sum(-1)
    valid = labels[:, 1:] != -100
    expected = plain.loss.item() + 0.5 * kl[:, :-1][valid].mean().item()
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    out.loss.backward()
    assert model.abduction.loc_net.bias.grad is not None and model.action.cls_head.weight.grad is None
    # The anchor is saved and comes back; re-enabling keeps it.
    model.save_pretrained(tmp_path)
    reloaded = CausalQwenForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.abduction_anchor_weight == 0.5
    torch.testing.assert_close(reloaded.abduction_anchor.scale_net.bias, anchor.scale_net.bias)
    reloaded.enable_abduction_finetuning(anchor_weight=0.5)
    torch.testing.assert_close(reloaded.abduction_anchor.loc_net.bias, anchor.loc_net.bias)
    assert not any(p.requires_grad for p in reloaded.abduction_anchor.parameters())


def test_regression_noise_adds_a_learnable_value_scale(tiny_qwen, tmp_path):
    # docs/design.md §1 revision 2: γ_Y > 0 by default (1.0 until the value head is fitted); 0 is the seeds' model.
    assert build(tiny_qwen).action.reg_log_noise.item() == 0.0
    assert build(tiny_qwen, regression_noise=0.0).action.reg_log_noise is None
    model = build(tiny_qwen, regression_noise=0.7, context_values=False)  # the linear law's scale_Y
    assert model.action.reg_log_noise.item() == pytest.approx(math.log(0.7))
    randomize_heads(model)
    ids = torch.randint(0, 100, (2, 6))
    ids[:, 3] = NUM
    values = torch.zeros(2, 6, dtype=torch.float64)
    values[:, 3] = torch.tensor([12.0, -3.0], dtype=torch.float64)
    with torch.no_grad():
        out = model(ids, numeric_values=values)
    act = model.action
    scale_u_noisy = out.scale_U.double() + act.b_noise.double().abs()
    want = scale_u_noisy @ act.reg_head.weight.double()[0].abs() + act.reg_log_noise.double().exp()
    torch.testing.assert_close(out.scale_Y.double(), want, rtol=1e-5, atol=1e-7)

    # The regression loss reaches it on both loss paths, with the same gradient, and it round-trips.
    grads = []
    for full in (False, True):
        model.train().zero_grad()
        model(ids, numeric_values=values, labels=ids, output_distributions=full).loss.backward()
        grads.append(act.reg_log_noise.grad.clone())
    assert grads[0].abs().item() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)
    model.save_pretrained(tmp_path)
    loaded = CausalQwenForCausalLM.from_pretrained(tmp_path)
    assert loaded.action.reg_log_noise.item() == act.reg_log_noise.item()

    for bad in (-1.0, float("inf")):
        with pytest.raises(ValueError, match="regression_noise"):
            build(tiny_qwen, regression_noise=bad)
    with pytest.raises(ValueError, match="regression_noise"):
        CausalQwenForCausalLM.from_qwen(tiny_qwen, use_numeric=False, regression_noise=1.0)


@pytest.mark.parametrize("regression_noise", [1.0, 0.0])
def test_the_values_loss_does_not_train_b_noise(tiny_qwen, regression_noise):
    # docs/design.md §1: b_noise is the decisions' noise. Its gradient is the class loss's alone, on both loss
    # paths; the value's loss reaches the value head and the features, and scale_Y still reads |b_noise|.
    model = build(tiny_qwen, regression_noise=regression_noise, context_values=False)
    randomize_heads(model)
    ids = torch.randint(0, 100, (2, 8))
    ids[:, 3], ids[1, 6] = NUM, NUM
    values = torch.zeros(2, 8, dtype=torch.float64)
    values[:, 3], values[1, 6] = torch.tensor([12.0, -3.0], dtype=torch.float64), 250.0
    act = model.action
    model.train()
    for full in (False, True):
        grads = {}
        for term in ("loss", "cls_loss", "reg_loss"):
            model.zero_grad(set_to_none=True)
            out = model(ids, numeric_values=values, labels=ids, output_distributions=full)
            getattr(out, term).backward()
            grads[term] = (act.b_noise.grad, act.reg_head.weight.grad, model.abduction.loc_net.weight.grad)
        assert grads["reg_loss"][0] is None or not grads["reg_loss"][0].any()
        assert grads["reg_loss"][1].abs().sum() > 0 and grads["reg_loss"][2].abs().sum() > 0
        assert grads["cls_loss"][0].abs().sum() > 0
        torch.testing.assert_close(grads["loss"][0], grads["cls_loss"][0], rtol=1e-6, atol=0.0)
    with torch.no_grad():
        out = model(ids, numeric_values=values)
    want = (out.scale_U.double() + act.b_noise.double().abs()) @ act.reg_head.weight.double()[0].abs()
    if regression_noise:
        want = want + act.reg_log_noise.double().exp()
    torch.testing.assert_close(out.scale_Y.double(), want.clamp(min=model.config.scale_min), rtol=1e-5, atol=1e-7)


def test_checkpoint_with_a_0_dim_value_noise_loads_on_both_paths(tiny_qwen, tmp_path):
    # Checkpoints written while action.reg_log_noise was 0-dim: from_pretrained (transformers' weight conversions)
    # and load_state_dict (torch's module hooks) are separate paths, and each reads it as the [1] vector it is now.
    from safetensors.torch import load_file, save_file

    model = build(tiny_qwen, regression_noise=0.5)
    randomize_heads(model)
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["action.reg_log_noise"] = tensors["action.reg_log_noise"].reshape(())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})

    loaded = CausalQwenForCausalLM.from_pretrained(tmp_path)
    fresh = build(tiny_qwen, regression_noise=0.5)
    fresh.load_state_dict(tensors)
    for other in (loaded, fresh):
        assert other.action.reg_log_noise.shape == (1,)
        assert other.state_dict().keys() == model.state_dict().keys()
        for name, tensor in model.state_dict().items():
            assert torch.equal(other.state_dict()[name], tensor), name


def test_num_row_from_digit_rows_keeps_every_other_logit_and_greedy(tiny_qwen):
    digits = list(range(10, 20))
    model = build(tiny_qwen, num_row_init=digits)
    ids = torch.randint(0, 100, (3, 9))
    with torch.no_grad():
        qwen = tiny_qwen(ids).logits
        out = model(ids)
    others = [k for k in range(128) if k != NUM]
    assert (out.loc_S[..., others] - qwen[..., others]).abs().max().item() <= 1e-5
    torch.testing.assert_close(out.loc_S[..., NUM], qwen[..., digits].mean(-1), rtol=1e-5, atol=1e-5)
    # The mean of the digit logits never beats the best digit, so Qwen's greedy choice is unchanged.
    assert torch.equal(out.loc_S.argmax(-1), qwen.argmax(-1))
    assert build(tiny_qwen).action.cls_head.weight[NUM].equal(tiny_qwen.lm_head.weight[NUM])

    with pytest.raises(ValueError, match="num_row_init"):
        build(tiny_qwen, num_row_init="mean")
    with pytest.raises(ValueError, match="num_row_init"):
        build(tiny_qwen, num_row_init=[])
    with pytest.raises(ValueError, match="num_row_init"):
        build(tiny_qwen, num_row_init=[5, 400])
    with pytest.raises(ValueError, match="num_row_init"):
        build(tiny_qwen, num_row_init="digits")  # an object without a tokenizer


@pytest.mark.slow
def test_real_qwen25_num_row_from_digits(qwen25_dir):
    from causal_qwen import CausalQwenTokenizer

    tokenizer = CausalQwenTokenizer.from_pretrained(qwen25_dir)
    qwen = Qwen2ForCausalLM.from_pretrained(qwen25_dir, dtype=torch.float32).eval()
    model = CausalQwenForCausalLM.from_qwen(qwen, tokenizer=tokenizer, num_row_init="digits").eval()
    digit_ids = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    assert len(set(digit_ids)) == 10 and tokenizer.decode(digit_ids) == "0123456789"
    enc = tokenizer("The price is 12.5 dollars and 3 more", return_tensors="pt")
    num_pos = (enc.input_ids[0] == 151665).nonzero()[0].item()
    with torch.no_grad():
        out = model(enc.input_ids, numeric_values=enc.numeric_values)
        qwen_logits = qwen(enc.input_ids[:, :num_pos]).logits[0, -1]  # the text before the first number
    got = out.loc_S[0, num_pos - 1]
    assert got[151665].item() == pytest.approx(qwen_logits[digit_ids].mean().item(), abs=1e-4)
    assert (got[:151665] - qwen_logits[:151665]).abs().max().item() <= 1e-4


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not different, different


def test_conversion_is_deterministic_and_leaves_the_global_rng_alone(tiny_qwen, tmp_path):
    torch.manual_seed(1)
    first = build(tiny_qwen)
    torch.manual_seed(2)
    state = torch.get_rng_state()
    second = build(tiny_qwen)
    assert torch.equal(torch.get_rng_state(), state)
    assert_same_weights(first, second)
    assert first.config.conversion_seed == second.config.conversion_seed == 0

    # The same checkpoint through a folder converts to the same model (the folder has no tokenizer: give the id).
    tiny_qwen.save_pretrained(tmp_path / "qwen")
    state = torch.get_rng_state()
    from_folder = CausalQwenForCausalLM.from_qwen(tmp_path / "qwen", tokenizer=SimpleNamespace(num_token_id=NUM))
    assert torch.equal(torch.get_rng_state(), state)
    assert_same_weights(first, from_folder)


def test_conversion_seed_changes_only_the_drawn_weights(tiny_qwen, tmp_path):
    base, other = build(tiny_qwen), build(tiny_qwen, seed=7)
    sa, sb = base.state_dict(), other.state_dict()
    assert {k for k in sa if not torch.equal(sa[k], sb[k])} == {
        "numeric_embedding.w_num", "action.reg_head.weight", "abduction.context_values.key.weight"}
    assert other.config.conversion_seed == 7
    assert_same_weights(other, build(tiny_qwen, seed=7))
    # w_reg: small normal draws with Qwen2's initializer_range, b_reg = 0 (docs/design.md §3.4).
    std = tiny_qwen.config.initializer_range
    assert 0.5 * std < other.action.reg_head.weight.std().item() < 2.0 * std
    assert other.action.reg_head.bias.abs().max().item() == 0.0

    other.save_pretrained(tmp_path / "cq")
    assert CausalQwenConfig.from_pretrained(tmp_path / "cq").conversion_seed == 7
    assert "| `conversion_seed` | `7` |" in (tmp_path / "cq" / "README.md").read_text()
    assert CausalQwenConfig(**tiny_qwen2_config().to_dict() | {"num_token_id": NUM}).conversion_seed is None


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True, "0"])
def test_conversion_seed_must_be_a_non_negative_int(tiny_qwen, seed):
    with pytest.raises(ValueError, match="seed"):
        build(tiny_qwen, seed=seed)


def test_conversion_seed_is_not_a_config_override(tiny_qwen):
    with pytest.raises(ValueError, match="seed="):
        build(tiny_qwen, conversion_seed=3)


def numbered_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (2, 9), generator=g)
    ids[0, 3], ids[1, 6], ids[0, 8] = NUM, NUM, NUM
    values = torch.zeros(2, 9, dtype=torch.float64)
    values[0, 3], values[1, 6], values[0, 8] = 2.5, -40.0, 7.0
    labels = ids.clone()
    labels[1, :2] = -100
    return ids, values, labels


@pytest.mark.parametrize("training", [False, True])
def test_shift_labels_give_the_loss_of_the_unshifted_labels(tiny_qwen, training):
    model = build(tiny_qwen, learnable_threshold=True, abduction_scale_init=0.3).train(training)
    randomize_heads(model)
    ids, values, labels = numbered_batch()
    shift_labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    shift_values = torch.nn.functional.pad(values[:, 1:], (0, 1))
    expected = model(ids, numeric_values=values, labels=labels)
    assert expected.reg_loss.item() != 0.0
    # As the Trainer passes them under context parallelism: labels and shift_labels; the values shifted by the model,
    # or given shifted; or shift_labels alone.
    for kwargs in (dict(labels=labels, shift_labels=shift_labels),
                   dict(labels=labels, shift_labels=shift_labels, shift_numeric_labels=shift_values),
                   dict(shift_labels=shift_labels, numeric_labels=values),
                   dict(shift_labels=shift_labels, shift_numeric_labels=shift_values)):
        got = model(ids, numeric_values=values, **kwargs)
        for name in ("loss", "cls_loss", "reg_loss"):
            torch.testing.assert_close(getattr(got, name), getattr(expected, name), msg=f"{name} {sorted(kwargs)}")
    # shift_labels replace the shift of labels: other labels change nothing, other shift_labels change the loss.
    other = torch.randint(0, 100, labels.shape)
    torch.testing.assert_close(model(ids, numeric_values=values, labels=other, shift_labels=shift_labels).loss,
                               expected.loss)
    assert model(ids, numeric_values=values, labels=labels, shift_labels=other).loss.item() != pytest.approx(
        expected.loss.item(), rel=1e-4)


def test_shift_labels_are_keywords_not_labels_trainer_waits_for():
    # Trainer takes every forward parameter named "*label*" for a label each batch must carry.
    from transformers.utils import find_labels

    assert find_labels(CausalQwenForCausalLM) == ["labels", "numeric_labels"]


def test_shift_labels_of_a_shard_take_the_values_beyond_it(tiny_qwen):
    """Context parallelism shifts the whole sequence, then gives each device a shard: the last target of a shard
    is the first token of the next, and its value comes with `shift_numeric_labels`."""
    model = build(tiny_qwen, abduction_scale_init=0.3).train()
    randomize_heads(model)
    ids, values, labels = numbered_batch()
    shift_labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    shift_values = torch.nn.functional.pad(values[:, 1:], (0, 1))
    # The first shard, positions 0-2: the target of its last position is the <NUM> at position 3, in the next shard.
    shard = slice(0, 3)
    assert shift_labels[0, 2] == NUM
    with pytest.raises(ValueError, match="shift_numeric_labels"):
        model(ids[:, shard], numeric_values=values[:, shard], labels=labels[:, shard],
              shift_labels=shift_labels[:, shard])
    got = model(ids[:, shard], numeric_values=values[:, shard], shift_labels=shift_labels[:, shard],
                shift_numeric_labels=shift_values[:, shard], output_distributions=True)
    assert (shift_labels[:, shard] == NUM).sum() == 1 and got.reg_loss.item() != 0.0
    # The shard's loss is that of the full sequence restricted to the shard's targets.
    masked = shift_labels.clone()
    masked[:, 3:] = -100
    restricted = model(ids, numeric_values=values, shift_labels=masked, shift_numeric_labels=shift_values,
                       output_distributions=True)
    for name in ("cls_loss", "reg_loss"):
        torch.testing.assert_close(getattr(got, name), getattr(restricted, name), rtol=1e-5, atol=1e-6)


def test_shift_labels_are_checked(tiny_qwen):
    model = build(tiny_qwen)
    ids, values, labels = numbered_batch()
    shift_labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    with pytest.raises(ValueError, match="shift_labels must have shape"):
        model(ids, numeric_values=values, shift_labels=shift_labels[:, :-1])
    with pytest.raises(ValueError, match="shift_labels holds ids outside"):
        model(ids, numeric_values=values, shift_labels=shift_labels + 1000)
    with pytest.raises(ValueError, match="shift_labels contain <NUM>"):
        model(ids.clamp(max=NUM - 1), shift_labels=shift_labels)
    with pytest.raises(ValueError, match="pass shift_labels"):
        model(ids, numeric_values=values, labels=labels, shift_numeric_labels=values)


def test_auto_model_gives_the_qwen2_backbone(tmp_path, tiny_qwen):
    from transformers import AutoModel, Qwen2Model

    from causal_qwen import CausalQwenModel

    model = build(tiny_qwen)
    randomize_heads(model)
    model.save_pretrained(tmp_path)
    backbone = AutoModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert isinstance(backbone, CausalQwenModel) and isinstance(backbone, Qwen2Model)
    assert isinstance(backbone.config, CausalQwenConfig)
    assert AutoModel.from_config(model.config).__class__ is CausalQwenModel
    assert set(backbone.state_dict()) == set(tiny_qwen.model.state_dict())
    ids = torch.randint(0, 100, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(backbone(ids).last_hidden_state, model.model(ids).last_hidden_state,
                                   rtol=0, atol=0)
        torch.testing.assert_close(backbone(ids).last_hidden_state, tiny_qwen.model(ids).last_hidden_state,
                                   rtol=0, atol=0)
    # The backbone saves and reloads on its own, and the full model's folder names it for remote code.
    backbone.save_pretrained(tmp_path / "backbone")
    assert isinstance(AutoModel.from_pretrained(tmp_path / "backbone"), CausalQwenModel)
    import json

    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModel"] == "modeling.CausalQwenModel"
    assert auto_map["AutoModelForCausalLM"] == "modeling.CausalQwenForCausalLM"


@pytest.mark.parametrize("learnable", [False, True])
def test_resizing_the_vocabulary_resizes_the_threshold(tiny_qwen, learnable):
    model = build(tiny_qwen, learnable_threshold=learnable, ovr_threshold=2.0)
    with torch.no_grad():
        model.action.threshold[:5] = torch.arange(5.0)
    before = model.action.threshold.detach().clone()
    model.resize_token_embeddings(150)
    assert model.config.vocab_size == 150 and model.action.cls_head.out_features == 150
    assert isinstance(model.action.threshold, torch.nn.Parameter) == learnable
    assert torch.equal(model.action.threshold[:128], before) and model.action.threshold[128:].eq(2.0).all()
    ids = torch.randint(0, 150, (2, 6))
    ids[ids == NUM] = 0
    ids[0, 2] = 149
    out = model(ids, labels=ids)
    assert torch.isfinite(out.loss) and model.ovr_probabilities(out.loc_S, out.scale_S).shape == (2, 6, 150)
    model.resize_token_embeddings(NUM + 1)
    assert model.action.threshold.shape == (NUM + 1,)
    with pytest.raises(ValueError, match="would drop <NUM>"):
        model.resize_token_embeddings(NUM)
    with pytest.raises(ValueError, match="would drop <NUM>"):
        model.resize_token_embeddings(64, pad_to_multiple_of=64)
    assert model.config.vocab_size == NUM + 1 and model.action.threshold.shape == (NUM + 1,)


def numbered_inputs():
    torch.manual_seed(3)
    ids = torch.randint(1, 100, (2, 7))
    ids[0, 3] = NUM
    values = torch.zeros(ids.shape, dtype=torch.float64)
    values[0, 3] = 2.5
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return dict(input_ids=ids, numeric_values=values, attention_mask=mask, use_cache=False)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_forward_compiles_into_one_graph(tiny_qwen, backend):
    """No data-dependent check breaks the graph: the value checks are skipped while tracing."""
    import torch._dynamo

    model = build(tiny_qwen)
    randomize_heads(model)
    inputs = numbered_inputs()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with torch.no_grad():
        got, expected = compiled(**inputs), model(**inputs)
        # Without numbers the eager forward leaves the numeric embedding out; the graph adds its zero terms.
        plain = {**inputs, "numeric_values": None, "input_ids": inputs["input_ids"].clamp(max=NUM - 1)}
        got_plain, expected_plain = compiled(**plain), model(**plain)
    for name in ("loc_S", "scale_S", "loc_Y", "scale_Y"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name))
        torch.testing.assert_close(getattr(got_plain, name), getattr(expected_plain, name))
    torch._dynamo.reset()


def test_forward_exports(tiny_qwen):
    model = build(tiny_qwen)
    randomize_heads(model)
    inputs = numbered_inputs()
    program = torch.export.export(model, args=(), kwargs=inputs)
    with torch.no_grad():
        got, expected = program.module()(**inputs), model(**inputs)
    for name in ("loc_S", "scale_S", "loc_Y", "scale_Y"):
        torch.testing.assert_close(got[name], expected[name])
    # The eager model still checks values; only tracing skips them.
    with pytest.raises(ValueError, match="numeric_values must be finite"):
        model(**{**inputs, "numeric_values": torch.full(inputs["input_ids"].shape, math.inf, dtype=torch.float64)})


def test_logits_carry_the_gradient_of_the_layers_before_a_frozen_head(tiny_qwen):
    model = build(tiny_qwen)
    randomize_heads(model)
    model.train().enable_abduction_finetuning(0)
    assert not model.action.cls_head.weight.requires_grad
    ids = torch.randint(0, 100, (2, 5))
    out = model(ids, output_distributions=True)
    assert out.logits.requires_grad and out.scale_S.requires_grad
    # A loss on the logits alone: Σ R·loc_S, with loc_S = W_cls·(W_loc z + b_loc) + b_cls, so ∂/∂b_loc = Σ_pos R·W_cls.
    weights = torch.randn(out.logits.shape, generator=torch.Generator().manual_seed(0))
    (out.logits * weights).sum().backward()
    expected = (weights.double().sum((0, 1)) @ model.action.cls_head.weight.double()).float()
    torch.testing.assert_close(model.abduction.loc_net.bias.grad, expected, rtol=1e-4, atol=1e-5)
    # Inference still skips autograd.
    with torch.no_grad():
        assert not model(ids, output_distributions=True).logits.requires_grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_value_interval_is_computed_in_float64_whatever_the_dtype(tiny_qwen, dtype):
    model = build(tiny_qwen, value_transform="symlog")
    loc_y, scale_y = torch.tensor([2.0, 5.0], dtype=dtype), torch.tensor([0.25, 0.5], dtype=dtype)
    for coverage in (0.9, 0.99, 0.999, 1 - 1e-8, 1 - 1e-12):
        median, low, high = model.value_interval(loc_y, scale_y, coverage=coverage)
        assert median.dtype == low.dtype == high.dtype == torch.float64
        for i, (loc, scale) in enumerate(zip(loc_y.tolist(), scale_y.tolist(), strict=True)):
            half = scale / math.tan(math.pi * (1 - coverage) / 2)  # in float64 from the stored (rounded) inputs
            for got, want in ((median[i], loc), (low[i], loc - half), (high[i], loc + half)):
                want = math.copysign(math.expm1(abs(want)), want) if abs(want) < 700 else math.copysign(math.inf, want)
                assert got.item() == pytest.approx(want, rel=1e-9)
            assert low[i] <= median[i] <= high[i]


def test_abduction_anchor_at_the_smallest_scales_gives_a_finite_loss_and_gradient(tiny_qwen):
    model = build(tiny_qwen, scale_min=1e-30, abduction_scale_init=1e-30).train()
    model.enable_abduction_finetuning(anchor_weight=1.0)
    ids = torch.randint(0, 100, (2, 6))
    at_start = model(ids, labels=ids)
    without = without_anchor(model, ids, ids)
    assert torch.isfinite(at_start.loss) and at_start.loss.item() == pytest.approx(without.loss.item(), rel=1e-6)
    # Scale U by 3 everywhere: each of the C coordinates adds KL = log((1 + 3)² / (4·3)) = log(4/3).
    with torch.no_grad():
        model.abduction.scale_net.bias.fill_(math.log(3e-30))  # softplus(x) = eˣ for x ≪ 0
    out = model(ids, labels=ids)
    plain = without_anchor(model, ids, ids)
    assert out.loss.item() == pytest.approx(plain.loss.item() + 32 * math.log(4 / 3), rel=1e-5)
    out.loss.backward()
    # Every parameter the fine-tuning trains (the context-value path is refitted, not trained: frozen here).
    trained = [p for p in model.abduction.parameters() if p.requires_grad]
    assert len(trained) == 4 and all(torch.isfinite(p.grad).all() for p in trained)
