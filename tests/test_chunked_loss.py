"""The fused, tiled OvR head + loss against a float64 reference and against the straightforward path."""

import math

import pytest
import torch

from causal_qwen import CausalQwenConfig, CausalQwenForCausalLM, cauchy
from causal_qwen.chunked_loss import (
    choose_chunk_sizes,
    chunked_ovr_loss,
    ovr_class_probability,
)
from causal_qwen.loss import (
    DecisionScores,
    LossOptions,
    LossTargets,
    Tiling,
    causal_qwen_loss,
    ovr_classification_loss,
)
from causal_qwen.modeling import CausalQwenAction

N, V, C = 50, 300, 16
NUM = 290
SCALE_MIN = 0.3
# Tile shapes: automatic, non-dividing in both directions, one position, one class block wider than V,
# every position in one chunk, and several class blocks.
TILES = [(None, None), (7, 13), (1, None), (None, 1000), (1000, 64), (50, 300)]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tiles mean many tiny matrix products; thread start-up would dominate them on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_inputs(seed=0, learnable=True, dtype=torch.float32):
    """Inputs of the head with padding, `<NUM>` targets and scales that hit the floor for some classes."""
    g = torch.Generator().manual_seed(seed)
    loc_u = torch.randn(N, C, generator=g)
    scale_u = torch.rand(N, C, generator=g) * 0.3 + 0.01
    weight = torch.randn(V, C, generator=g) * 0.5
    weight[:20] *= 0.01  # these classes have scale_S below the floor
    weight[20, 3] = 0.0  # sign(0) = 0: no gradient through |W| there
    bias = torch.randn(V, generator=g) * 0.3
    threshold = torch.randn(V, generator=g) + 1.0
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::6] = -100
    targets[1::9] = NUM
    targets[2] = 5  # a class whose scale is floored
    tensors = [t.to(dtype).requires_grad_() for t in (loc_u, scale_u, weight, bias)]
    tensors.append(threshold.requires_grad_(learnable))
    return (*tensors, targets)


def reference_sum(loc_u, scale_u, weight, bias, threshold, targets, scale_min=SCALE_MIN):
    """Σ over labelled positions of −Σ_k [y_k log P_k + (1 − y_k) log(1 − P_k)], textbook formulas."""
    loc_s = loc_u @ weight.T + bias
    scale_s = (scale_u @ weight.abs().T).clamp(min=scale_min)
    p = 0.5 + torch.atan((loc_s - threshold) / scale_s) / math.pi
    onehot = torch.nn.functional.one_hot(targets.clamp(min=0), weight.shape[0]).to(p.dtype)
    per_position = -(onehot * torch.log(p) + (1 - onehot) * torch.log(1 - p)).sum(-1)
    return per_position[targets != -100].sum()


def straightforward_sum(loc_u, scale_u, weight, bias, threshold, targets, scale_min=SCALE_MIN):
    """The model's own path: `cauchy.linear` in the input dtype, then `loss.ovr_classification_loss`."""
    loc_s, scale_s = cauchy.linear(loc_u, scale_u, weight, bias)
    valid = targets != -100
    return ovr_classification_loss(loc_s[valid], scale_s.clamp(min=scale_min)[valid], targets[valid],
                                   threshold).sum()


def float64_copies(tensors):
    return [t.detach().double().requires_grad_(t.requires_grad) for t in tensors]


def grads_of(loss, tensors):
    wanted = [t for t in tensors if t.requires_grad]
    return torch.autograd.grad(loss, wanted)


def assert_grads_close(got, want, rtol, atol_fraction):
    """Element-wise `rtol`, plus an absolute slack of `atol_fraction` of the largest reference entry."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), w.double(), rtol=rtol, atol=atol_fraction * w.abs().max().item())


@pytest.mark.parametrize("chunk_size,vocab_chunk_size", TILES)
@pytest.mark.parametrize("learnable", [True, False])
def test_loss_and_gradients_match_float64_reference(chunk_size, vocab_chunk_size, learnable):
    *tensors, targets = make_inputs(learnable=learnable)
    loss, count = chunked_ovr_loss(*tensors, targets, scale_min=SCALE_MIN, chunk_size=chunk_size,
                                   vocab_chunk_size=vocab_chunk_size)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert int(count) == int((targets != -100).sum())
    ref_tensors = float64_copies(tensors)
    ref = reference_sum(*ref_tensors, targets)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert_grads_close(grads_of(loss, tensors), grads_of(ref, ref_tensors), rtol=1e-4, atol_fraction=1e-5)


def test_inputs_exercise_the_floor_padding_and_num():
    loc_u, scale_u, weight, *_, targets = make_inputs()
    raw = scale_u @ weight.abs().T
    clamped = raw < SCALE_MIN
    assert 0.05 < clamped.float().mean().item() < 0.5
    assert (targets == -100).any() and (targets == NUM).any() and bool(clamped[2, 5])


def test_scalar_threshold_and_no_bias():
    loc_u, scale_u, weight, _, _, targets = make_inputs()
    threshold = torch.tensor(0.7, requires_grad=True)
    loss, _ = chunked_ovr_loss(loc_u, scale_u, weight, None, threshold, targets, scale_min=SCALE_MIN,
                                  chunk_size=9, vocab_chunk_size=40)
    tensors = [loc_u, scale_u, weight, threshold]
    ref_tensors = float64_copies(tensors)
    ref = reference_sum(ref_tensors[0], ref_tensors[1], ref_tensors[2], 0.0, ref_tensors[3], targets)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert_grads_close(grads_of(loss, tensors), grads_of(ref, ref_tensors), rtol=1e-4, atol_fraction=1e-5)
    plain, _ = chunked_ovr_loss(loc_u, scale_u, weight, None, 0.7, targets, scale_min=SCALE_MIN)
    assert plain.item() == pytest.approx(loss.item(), rel=1e-6)


def test_extreme_decisions_stay_finite_and_accurate():
    """Scores far from the threshold (P ≈ 1e-7 or 1 − 1e-7) keep an accurate loss and finite gradients."""
    *tensors, targets = make_inputs()
    with torch.no_grad():
        tensors[3].mul_(0).add_(torch.linspace(-3e3, 3e3, V))  # bias
    loss, _ = chunked_ovr_loss(*tensors, targets, scale_min=SCALE_MIN, vocab_chunk_size=37)
    ref_tensors = float64_copies(tensors)
    ref = reference_sum(*ref_tensors, targets)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert_grads_close(grads_of(loss, tensors), grads_of(ref, ref_tensors), rtol=1e-4, atol_fraction=1e-5)


def test_gradient_is_scaled_by_the_incoming_gradient():
    *tensors, targets = make_inputs()
    loss, count = chunked_ovr_loss(*tensors, targets, scale_min=SCALE_MIN, chunk_size=11)
    unit = grads_of(loss, tensors)
    loss, count = chunked_ovr_loss(*tensors, targets, scale_min=SCALE_MIN, chunk_size=11)
    scaled = grads_of(loss * 2.5 / count, tensors)
    for s, u in zip(scaled, unit, strict=True):
        torch.testing.assert_close(s, u * 2.5 / count, rtol=1e-6, atol=0.0)


def test_no_labelled_position_gives_zero_loss_and_zero_gradients():
    *tensors, targets = make_inputs()
    targets = torch.full_like(targets, -100)
    loss, count = chunked_ovr_loss(*tensors, targets, scale_min=SCALE_MIN, chunk_size=4)
    assert loss.item() == 0.0 and int(count) == 0
    for grad in grads_of(loss, tensors):
        assert torch.isfinite(grad).all() and not grad.any()


def test_no_grad_and_frozen_inputs():
    loc_u, scale_u, weight, bias, threshold, targets = make_inputs(learnable=False)
    with torch.no_grad():
        loss, _ = chunked_ovr_loss(loc_u, scale_u, weight, bias, threshold, targets, scale_min=SCALE_MIN)
    assert loss.grad_fn is None
    weight.requires_grad_(False)
    frozen, _ = chunked_ovr_loss(loc_u, scale_u, weight, bias, threshold, targets, scale_min=SCALE_MIN,
                                    chunk_size=8)
    grads = torch.autograd.grad(frozen, (loc_u, scale_u, bias))
    ref_tensors = float64_copies([loc_u, scale_u, weight, bias, threshold])
    ref = reference_sum(*ref_tensors, targets)
    assert frozen.item() == pytest.approx(loss.item(), rel=1e-6) == pytest.approx(ref.item(), rel=1e-5)
    want = torch.autograd.grad(ref, (ref_tensors[0], ref_tensors[1], ref_tensors[3]))
    assert_grads_close(grads, want, rtol=1e-4, atol_fraction=1e-5)


def test_class_probability_equals_the_full_head():
    loc_u, scale_u, weight, bias, threshold, _ = make_inputs()
    p_num = ovr_class_probability(loc_u.view(5, 10, C), scale_u.view(5, 10, C), weight, bias, threshold, NUM,
                                  scale_min=SCALE_MIN)
    loc_s = loc_u @ weight.T + bias
    scale_s = (scale_u @ weight.abs().T).clamp(min=SCALE_MIN)
    full = torch.atan2(scale_s, threshold - loc_s) / math.pi
    assert p_num.shape == (5, 10)
    torch.testing.assert_close(p_num.reshape(-1), full[:, NUM], rtol=1e-5, atol=1e-7)
    floored = ovr_class_probability(loc_u, scale_u, weight, bias, threshold, 5, scale_min=SCALE_MIN)
    torch.testing.assert_close(floored, full[:, 5], rtol=1e-5, atol=1e-7)


def test_shapes_are_checked():
    loc_u, scale_u, weight, bias, threshold, targets = make_inputs()
    with pytest.raises(ValueError, match="scale_u_noisy"):
        chunked_ovr_loss(loc_u, scale_u[:-1], weight, bias, threshold, targets, scale_min=SCALE_MIN)
    with pytest.raises(ValueError, match="threshold"):
        chunked_ovr_loss(loc_u, scale_u, weight, bias, threshold[:-1], targets, scale_min=SCALE_MIN)
    with pytest.raises(ValueError, match="targets"):
        chunked_ovr_loss(loc_u, scale_u, weight, bias, threshold, targets[:-1], scale_min=SCALE_MIN)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_ovr_loss(loc_u, scale_u, weight, bias, threshold, targets, scale_min=SCALE_MIN, chunk_size=0)


def test_chunk_sizes_fill_the_budget_and_do_not_grow_with_positions():
    vocab, hidden, budget = 151_936, 896, 256 * 2**20
    shapes = {n: choose_chunk_sizes(n, vocab, hidden, memory_budget=budget) for n in (1, 50, 4096, 16384, 10**6)}
    for n, (rows, classes) in shapes.items():
        assert 1 <= rows <= n and 1 <= classes <= vocab
        assert rows * classes * 22 + classes * hidden * 16 <= budget
    assert shapes[1][0] == 1
    assert shapes[16384] == shapes[10**6]  # beyond one chunk of positions, the tile no longer changes
    assert choose_chunk_sizes(50, 300, 16) == (50, 300)
    assert choose_chunk_sizes(50, 300, 16, chunk_size=7)[0] == 7
    assert choose_chunk_sizes(50, 300, 16, vocab_chunk_size=13)[1] == 13


# The straightforward path of the model: CausalQwenAction, then loss.causal_qwen_loss of its decision scores.


def straightforward_loss(action, loc_u, scale_u, labels, values, options, num_items_in_batch=None):
    """The loss of the `[B, S, V]` scores of the action module."""
    out = action(loc_u, scale_u)
    targets = LossTargets.from_labels(labels, values, num_items_in_batch=num_items_in_batch)
    return causal_qwen_loss(DecisionScores(out.loc_S, out.scale_S, action.threshold), out.loc_Y, out.scale_Y, targets,
                            options)


def make_action(learnable=True, use_numeric=True, dtype=torch.float32, seed=0):
    config = CausalQwenConfig(
        vocab_size=V, hidden_size=C, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_token_id=NUM, learnable_threshold=learnable, use_numeric=use_numeric,
        scale_min=SCALE_MIN, ovr_threshold=1.0,
    )
    action = CausalQwenAction(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        action.cls_head.weight.copy_(torch.randn(V, C, generator=g) * 0.5)
        action.cls_head.weight[:20] *= 0.01
        action.cls_head.bias.copy_(torch.randn(V, generator=g) * 0.3)
        action.b_noise.copy_(torch.randn(C, generator=g) * 0.05)
        action.threshold.add_(torch.randn(V, generator=g))
        if action.reg_head is not None:
            action.reg_head.weight.copy_(torch.randn(1, C, generator=g) * 0.3)
            action.reg_head.bias.fill_(0.2)
    return action.to(dtype)


def make_batch(dtype=torch.float32, seed=1, with_num=True):
    g = torch.Generator().manual_seed(seed)
    batch, seq = 5, 11
    loc_u = torch.randn(batch, seq, C, generator=g).to(dtype).requires_grad_()
    scale_u = (torch.rand(batch, seq, C, generator=g) * 0.3 + 0.01).to(dtype).requires_grad_()
    labels = torch.randint(0, NUM, (batch, seq), generator=g)
    labels[:, 0] = -100
    labels[1, 6:] = -100  # padding
    values = torch.zeros(batch, seq, dtype=torch.float64)
    if with_num:
        for b, s, v in ((0, 3, 3.25), (0, 8, -120.5), (2, 2, 0.75), (3, 10, 4096.0), (4, 5, -0.5)):
            labels[b, s], values[b, s] = NUM, v
    return loc_u, scale_u, labels, values


def differentiable_inputs(action, loc_u, scale_u):
    return [loc_u, scale_u] + [p for p in action.parameters() if p.requires_grad]


LOSS_OPTIONS = [
    dict(gate_alpha=0.0, reg_loss_weight=1.0, detach_gate=True, value_transform="identity"),
    dict(gate_alpha=0.3, reg_loss_weight=2.5, detach_gate=False, value_transform="symlog"),
]


@pytest.mark.parametrize("options", LOSS_OPTIONS)
@pytest.mark.parametrize("learnable", [True, False])
@pytest.mark.parametrize("num_items", [None, 37])
def test_causal_qwen_loss_matches_straightforward_path(options, learnable, num_items):
    action = make_action(learnable=learnable)
    loc_u, scale_u, labels, values = make_batch()
    inputs = differentiable_inputs(action, loc_u, scale_u)
    assert any(p is action.threshold for p in inputs) == learnable

    loss_options = LossOptions(num_token_id=NUM, **options)
    want = straightforward_loss(action, loc_u, scale_u, labels, values, loss_options, num_items_in_batch=num_items)
    targets = LossTargets.from_labels(labels, values, num_items_in_batch=num_items)
    got = action(loc_u, scale_u, targets, output_distributions=False, loss_options=loss_options,
                 tiling=Tiling(chunk_size=6, vocab_chunk_size=70))
    for name in ("loss", "cls_loss", "reg_loss"):
        assert getattr(got, name).item() == pytest.approx(getattr(want, name).item(), rel=1e-5), name
    assert want.reg_loss.item() != 0.0
    assert_grads_close(grads_of(got.loss, inputs), grads_of(want.loss, inputs), rtol=1e-4, atol_fraction=1e-5)


def test_batch_without_num_and_text_only_model():
    for use_numeric in (True, False):
        action = make_action(use_numeric=use_numeric)
        loc_u, scale_u, labels, values = make_batch(with_num=use_numeric is False)
        inputs = differentiable_inputs(action, loc_u, scale_u)
        num_token_id = NUM if use_numeric else None
        options = LossOptions(num_token_id=num_token_id)
        want = straightforward_loss(action, loc_u, scale_u, labels, values, options)
        got = action(loc_u, scale_u, LossTargets.from_labels(labels, values), output_distributions=False,
                     loss_options=options)
        assert got.reg_loss.item() == 0.0 == want.reg_loss.item()
        assert got.loss.item() == pytest.approx(want.loss.item(), rel=1e-5)
        got_grads = torch.autograd.grad(got.loss, inputs, allow_unused=True, materialize_grads=True)
        want_grads = torch.autograd.grad(want.loss, inputs, allow_unused=True, materialize_grads=True)
        assert_grads_close(got_grads, want_grads, rtol=1e-4, atol_fraction=1e-5)


def test_all_padding_batch_gives_zero_loss_without_nan():
    action = make_action()
    loc_u, scale_u, labels, values = make_batch()
    labels = torch.full_like(labels, -100)
    inputs = differentiable_inputs(action, loc_u, scale_u)
    got = action(loc_u, scale_u, LossTargets.from_labels(labels, values), output_distributions=False)
    assert got.loss.item() == got.cls_loss.item() == got.reg_loss.item() == 0.0
    grads = torch.autograd.grad(got.loss, inputs, allow_unused=True, materialize_grads=True)
    assert all(torch.isfinite(g).all() and not g.any() for g in grads)


# bf16: both paths round the inputs and the head's weights to bf16; the chunked one then computes each tile
# in fp32, the straightforward one keeps loc_S and scale_S in bf16. Errors are measured against the float64
# loss of the same bf16-rounded inputs, relative to the largest entry of each gradient.
# Measured: loss 2e-8 (tiles are fp32), gradients 3e-3 (their rounding to bf16, 2⁻⁹ ≈ 2e-3, at the end).
BF16_LOSS_RTOL = 1e-5
BF16_GRAD_ATOL_FRACTION = 5e-3


def relative_errors(got, want):
    return [((g.double() - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want, strict=True)]


def test_bf16_inputs_within_tolerance_and_no_worse_than_straightforward():
    *tensors, targets = make_inputs(dtype=torch.bfloat16)
    loss, _ = chunked_ovr_loss(*tensors, targets, scale_min=SCALE_MIN, chunk_size=9, vocab_chunk_size=70)
    grads = grads_of(loss, tensors)
    assert loss.dtype == torch.float32
    assert [g.dtype for g in grads] == [t.dtype for t in tensors if t.requires_grad]

    ref_tensors = float64_copies(tensors)
    ref = reference_sum(*ref_tensors, targets)
    ref_grads = grads_of(ref, ref_tensors)
    assert loss.item() == pytest.approx(ref.item(), rel=BF16_LOSS_RTOL)
    chunked_errors = relative_errors(grads, ref_grads)
    assert max(chunked_errors) < BF16_GRAD_ATOL_FRACTION

    plain = straightforward_sum(*tensors, targets)
    plain_errors = relative_errors(grads_of(plain, tensors), ref_grads)
    assert abs(loss.item() - ref.item()) <= abs(plain.float().item() - ref.item()) + 1e-6 * abs(ref.item())
    for chunked_error, plain_error in zip(chunked_errors, plain_errors, strict=True):
        assert chunked_error <= plain_error + 1e-3


def test_second_backward_through_the_same_graph_raises():
    *tensors, targets = make_inputs()
    loss, count = chunked_ovr_loss(*tensors, targets, scale_min=SCALE_MIN)
    (loss / count).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def test_model_loss_through_the_chunked_path(tiny_qwen):
    """On a tiny CausalQwen: the model's loss equals the chunked loss on its loc_U, scale_U, gradients included.

    Without the context-value path, whose read the action network would take besides loc_U and scale_U."""
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=120, learnable_threshold=True, gate_alpha=0.2,
                                            ovr_threshold=0.5, abduction_scale_init=0.5, context_values=False).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("model."):
                p.add_(torch.randn(p.shape) * 0.05)
    ids = torch.randint(0, 100, (2, 7))
    ids[0, 3], ids[1, 5] = 120, 120
    values = torch.zeros(2, 7, dtype=torch.float64)
    values[0, 3], values[1, 5] = 2.5, -0.75
    labels = ids.clone()
    labels[1, :2] = -100
    params = [p for p in model.parameters() if p.requires_grad]

    out = model(ids, numeric_values=values, labels=labels)
    want = torch.autograd.grad(out.loss, params, allow_unused=True, materialize_grads=True)
    out = model(ids, numeric_values=values, labels=labels)
    got = model.action(out.loc_U, out.scale_U, LossTargets.from_labels(labels, values), output_distributions=False,
                       tiling=Tiling(vocab_chunk_size=50))
    assert got.loss.item() == pytest.approx(out.loss.item(), rel=1e-5)
    assert got.reg_loss.item() == pytest.approx(out.reg_loss.item(), rel=1e-5) and got.reg_loss.item() != 0.0
    grads = torch.autograd.grad(got.loss, params, allow_unused=True, materialize_grads=True)
    assert_grads_close(grads, want, rtol=1e-4, atol_fraction=1e-5)


def atan2_reference_sum(loc_u, scale_u, weight, bias, threshold, targets, scale_min):
    """`reference_sum` with the atan2 forms, so that float64 keeps P ≈ 1e-20 (the atan form cancels there)."""
    loc_s = loc_u @ weight.T + bias
    scale_s = (scale_u @ weight.abs().T).clamp(min=scale_min)
    d = loc_s - threshold
    log_p, log_q = torch.log(torch.atan2(scale_s, -d) / math.pi), torch.log(torch.atan2(scale_s, d) / math.pi)
    onehot = torch.nn.functional.one_hot(targets.clamp(min=0), weight.shape[0]).to(log_p.dtype)
    per_position = -(onehot * log_p + (1 - onehot) * log_q).sum(-1)
    return per_position[targets != -100].sum()


@pytest.mark.parametrize("case", ["far_from_threshold", "tiny_floor"])
def test_straightforward_gradients_finite_where_atan2_backward_overflows(case):
    """|loc_S − C| ≈ 1e20 (s² + d² overflows fp32) or a floor of 1e-39 (1/P overflows): the straightforward path's
    gradients stay finite and equal float64's and the fused path's."""
    *tensors, targets = make_inputs()
    scale_min = SCALE_MIN
    with torch.no_grad():
        if case == "far_from_threshold":
            tensors[3][30:60] = 1e20   # far above: P = 1 in fp32
            tensors[3][60:90] = -1e20  # far below: P ≈ 1e-21
            targets[3:33:2] = torch.arange(30, 90, 4)
        else:
            scale_min = 1e-39          # a subnormal floor in fp32
            tensors[2][:20] = 0.0      # scale_S = the floor for these classes; class 5 is a target
    ref_tensors = float64_copies(tensors)
    ref = atan2_reference_sum(*ref_tensors, targets, scale_min=scale_min)
    fused, _ = chunked_ovr_loss(*tensors, targets, scale_min=scale_min, vocab_chunk_size=37)
    plain = straightforward_sum(*tensors, targets, scale_min=scale_min)
    assert torch.isfinite(ref) and plain.item() == pytest.approx(ref.item(), rel=1e-5)
    assert fused.item() == pytest.approx(ref.item(), rel=1e-5)
    want = grads_of(ref, ref_tensors)
    assert_grads_close(grads_of(plain, tensors), want, rtol=1e-4, atol_fraction=1e-5)
    assert_grads_close(grads_of(fused, tensors), want, rtol=1e-4, atol_fraction=1e-5)


@pytest.mark.parametrize("d,s", [(1e20, 1.0), (-1e20, 1.0), (-3e19, 1e-3), (2.0, 1e-39), (-2.0, 1e-39),
                                 (0.5, 3e-39), (1e-3, 1.0), (-40.0, 1e-30)])
def test_ovr_probability_and_log_probs_gradients_against_float64(d, s):
    loc = torch.tensor([d], requires_grad=True)
    scale = torch.tensor([s], requires_grad=True)
    loc64, scale64 = loc.detach().double().requires_grad_(), scale.detach().double().requires_grad_()
    p, (log_p, log_q) = cauchy.ovr_probability(loc, scale, 0.0), cauchy.ovr_log_probs(loc, scale, 0.0)
    p64 = torch.atan2(scale64, -loc64) / math.pi
    log_p64, log_q64 = torch.log(p64), torch.log(torch.atan2(scale64, loc64) / math.pi)
    for got, want in ((p, p64), (log_p, log_p64), (log_q, log_q64)):
        g_loc, g_scale = torch.autograd.grad(got.sum(), (loc, scale), retain_graph=True)
        w_loc, w_scale = torch.autograd.grad(want.sum(), (loc64, scale64), retain_graph=True)
        for g, w in ((g_loc, w_loc), (g_scale, w_scale)):
            if abs(w.item()) < 3e38:  # representable in fp32: finite and accurate (subnormals may flush to 0)
                assert torch.isfinite(g).all()
                torch.testing.assert_close(g.double(), w, rtol=2e-4, atol=torch.finfo(torch.float32).tiny)


@pytest.mark.parametrize("case", ["far_from_threshold", "tiny_floor"])
def test_training_a_model_left_in_eval_mode_has_finite_gradients(tiny_qwen, case):
    """`from_qwen` returns the model in eval mode; training it so takes the straightforward path, whose gradients
    must equal the fused path's (a training-mode step) where autograd's atan2 backward overflowed."""
    extra = {"scale_min": 1e-39} if case == "tiny_floor" else {}
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=120, ovr_threshold=0.5, **extra)
    with torch.no_grad():
        if case == "far_from_threshold":
            model.action.cls_head.bias[:40] = 1e20
            model.action.cls_head.bias[40:80] = -1e20
        else:
            model.action.cls_head.weight[:50] = 0.0  # scale_S at the floor for these classes
    ids = torch.randint(0, 100, (2, 7))
    params = [p for p in model.parameters() if p.requires_grad]
    losses, grads = [], []
    for training in (False, True):
        model.train(training)
        out = model(ids, labels=ids)
        assert (out.loc_S is not None) == (not training)
        losses.append(out.loss.item())
        grads.append(torch.autograd.grad(out.loss, params, allow_unused=True, materialize_grads=True))
    assert math.isfinite(losses[0]) and losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert_grads_close(grads[0], grads[1], rtol=1e-4, atol_fraction=1e-5)
