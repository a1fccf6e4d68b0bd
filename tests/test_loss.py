"""The loss against a straightforward float64 implementation of docs/design.md §4, values and gradients."""

import math

import pytest
import torch

from causal_qwen.loss import AnchorTerm, DecisionScores, LossOptions, LossTargets, causal_qwen_loss

NUM = 7
V = 12


def reference_loss(loc_s, scale_s, loc_y, scale_y, labels, values, threshold, alpha, lam, detach, transform,
                   vocab=V, num=NUM):
    """Position by position, with the textbook formulas (float64 inputs expected)."""
    cls_terms, reg_terms, n_valid, n_num = [], [], 0, 0
    batch, seq = labels.shape
    for b in range(batch):
        for i in range(seq - 1):
            y = int(labels[b, i + 1])
            if y == -100:
                continue
            n_valid += 1
            p = 0.5 + torch.atan((loc_s[b, i] - threshold) / scale_s[b, i]) / math.pi
            onehot = torch.zeros(vocab, dtype=p.dtype)
            onehot[y] = 1.0
            cls_terms.append(-(onehot * torch.log(p) + (1 - onehot) * torch.log(1 - p)).sum())
            if y == num:
                n_num += 1
                v = float(values[b, i + 1])
                target = math.copysign(math.log1p(abs(v)), v) if transform == "symlog" else v
                r = (target - loc_y[b, i]) / scale_y[b, i]
                nll = torch.log(math.pi * scale_y[b, i]) + torch.log(1 + r * r)
                p_num = p[num].detach() if detach else p[num]
                reg_terms.append((alpha + (1 - alpha) * p_num) * nll)
    cls = torch.stack(cls_terms).sum() / n_valid if n_valid else torch.tensor(0.0, dtype=torch.float64)
    reg = torch.stack(reg_terms).sum() / n_num if n_num else torch.tensor(0.0, dtype=torch.float64)
    return cls + lam * reg, cls, reg


def loss_of(loc_s, scale_s, loc_y, scale_y, labels, values, *, threshold, num_items_in_batch=None,
            num_numbers_in_batch=None, **options):
    """The loss of the `[B, S, V]` scores for unshifted `labels`, with `LossOptions(**options)`."""
    targets = LossTargets.from_labels(labels, values, num_items_in_batch=num_items_in_batch,
                                      num_numbers_in_batch=num_numbers_in_batch)
    return causal_qwen_loss(DecisionScores(loc_s, scale_s, threshold), loc_y, scale_y, targets, LossOptions(**options))


def make_inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    loc_s = (torch.randn(2, 6, V, generator=g) * 3 + 10).to(dtype)
    scale_s = (torch.rand(2, 6, V, generator=g) * 2 + 0.05).to(dtype)
    loc_y = torch.randn(2, 6, generator=g).to(dtype)
    scale_y = (torch.rand(2, 6, generator=g) + 0.1).to(dtype)
    labels = torch.tensor([[-100, 3, NUM, 5, NUM, -100], [-100, -100, NUM, 1, 2, NUM]])
    values = torch.zeros(2, 6, dtype=torch.float64)
    values[0, 2], values[0, 4], values[1, 2], values[1, 5] = 3.25, -120.5, 0.75, 4096.0
    return loc_s, scale_s, loc_y, scale_y, labels, values


@pytest.mark.parametrize("transform", ["identity", "symlog"])
@pytest.mark.parametrize("alpha,lam,detach", [(0.0, 1.0, True), (0.3, 2.5, False), (1.0, 0.5, True)])
def test_loss_and_gradients_match_reference(transform, alpha, lam, detach):
    threshold = torch.linspace(9.0, 12.0, V)
    tensors = [t.requires_grad_() for t in make_inputs()[:4]]
    labels, values = make_inputs()[4:]
    options = LossOptions(num_token_id=NUM, gate_alpha=alpha, reg_loss_weight=lam, detach_gate=detach,
                          value_transform=transform)
    out = causal_qwen_loss(DecisionScores(tensors[0], tensors[1], threshold), tensors[2], tensors[3],
                           LossTargets.from_labels(labels, values), options)
    ref_tensors = [t.detach().double().requires_grad_() for t in tensors]
    ref = reference_loss(*ref_tensors, labels, values, threshold.double(), alpha, lam, detach, transform)
    for got, want in zip((out.loss, out.cls_loss, out.reg_loss), ref, strict=False):
        assert got.item() == pytest.approx(want.item(), rel=1e-5)
    out.loss.backward()
    ref[0].backward()
    for got, want in zip(tensors, ref_tensors, strict=False):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-7)


def test_gate_detached_by_default_gives_no_classifier_gradient_from_regression():
    loc_s, scale_s, loc_y, scale_y, labels, values = make_inputs()
    loc_s.requires_grad_()
    loc_y.requires_grad_()
    out = loss_of(loc_s, scale_s, loc_y, scale_y, labels, values, threshold=10.0, num_token_id=NUM,
                           reg_loss_weight=1.0)
    grad, grad_y = torch.autograd.grad(out.reg_loss, (loc_s, loc_y), allow_unused=True)
    assert grad is None and grad_y.abs().max().item() > 0.0
    out = loss_of(loc_s, scale_s, loc_y, scale_y, labels, values, threshold=10.0, num_token_id=NUM,
                           detach_gate=False)
    (grad,) = torch.autograd.grad(out.reg_loss, loc_s)
    assert grad[..., NUM].abs().max().item() > 0.0


def test_empty_denominators_give_zero_not_nan():
    loc_s, scale_s, loc_y, scale_y, _, values = make_inputs()
    no_labels = torch.full((2, 6), -100)
    out = loss_of(loc_s, scale_s, loc_y, scale_y, no_labels, values, threshold=10.0, num_token_id=NUM)
    assert out.loss.item() == 0.0 and out.cls_loss.item() == 0.0 and out.reg_loss.item() == 0.0
    no_num = torch.tensor([[-100, 3, 4, 5, 1, -100], [0, 1, 2, 3, 4, 5]])
    out = loss_of(loc_s, scale_s, loc_y, scale_y, no_num, values, threshold=10.0, num_token_id=NUM)
    assert out.reg_loss.item() == 0.0 and torch.isfinite(out.loss)


def test_num_items_in_batch_replaces_the_valid_count():
    loc_s, scale_s, loc_y, scale_y, labels, values = make_inputs()
    base = loss_of(loc_s, scale_s, loc_y, scale_y, labels, values, threshold=10.0, num_token_id=NUM)
    n_valid = int((labels[:, 1:] != -100).sum())
    scaled = loss_of(loc_s, scale_s, loc_y, scale_y, labels, values, threshold=10.0, num_token_id=NUM,
                              num_items_in_batch=torch.tensor(4 * n_valid))
    assert scaled.cls_loss.item() == pytest.approx(base.cls_loss.item() / 4, rel=1e-6)
    # The regression mean is reported as is and enters the total with this batch's share of valid positions.
    assert scaled.reg_loss.item() == pytest.approx(base.reg_loss.item(), rel=1e-6)
    assert scaled.loss.item() == pytest.approx(base.cls_loss.item() / 4 + base.reg_loss.item() / 4, rel=1e-6)


@pytest.mark.parametrize("lam", [1.0, 2.5])
def test_micro_batch_losses_with_both_counts_sum_to_the_whole_batch_loss(lam):
    # Row 1 holds no <NUM> target, as a data-parallel rank whose batch has no number. Summed over the two rows, as
    # Trainer sums micro-batches (and DDP their gradients), the losses give the float64 reference on both rows.
    loc_s, scale_s, loc_y, scale_y, labels, values = (t.double() if t.is_floating_point() else t
                                                      for t in make_inputs())
    labels[1] = torch.tensor([-100, -100, 4, 1, 2, 3])
    leaves = [t.detach().requires_grad_() for t in (loc_s, scale_s, loc_y, scale_y)]
    want, _, _ = reference_loss(*leaves, labels, values, 10.0, 0.0, lam, True, "identity")
    want_grads = torch.autograd.grad(want, leaves)
    n_valid = torch.tensor(int((labels[:, 1:] != -100).sum()))
    n_numbers = torch.tensor(int((labels[:, 1:] == NUM).sum()))
    got = sum(
        loss_of(*(t[b:b + 1] for t in leaves), labels[b:b + 1], values[b:b + 1], threshold=10.0,
                num_token_id=NUM, reg_loss_weight=lam, value_transform="identity", num_items_in_batch=n_valid,
                num_numbers_in_batch=n_numbers).loss
        for b in (0, 1)
    )
    # The loss is accumulated in fp32 (docs/design.md §4), hence fp32 tolerances.
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    for g, w in zip(torch.autograd.grad(got, leaves), want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_value_head_stays_in_the_graph_without_a_number_target():
    # Sharding engines reduce gradients in the order they become ready; the same graph on every rank keeps that
    # order, so a batch without <NUM> targets gives loc_Y a zero gradient rather than none.
    loc_s, scale_s, loc_y, scale_y, _, values = make_inputs()
    loc_y.requires_grad_()
    no_num = torch.tensor([[-100, 3, 4, 5, 1, -100], [0, 1, 2, 3, 4, 5]])
    out = loss_of(loc_s, scale_s, loc_y, scale_y, no_num, values, threshold=10.0, num_token_id=NUM)
    (grad,) = torch.autograd.grad(out.loss, loc_y, allow_unused=True)
    assert grad is not None and torch.equal(grad, torch.zeros_like(loc_y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_for_extreme_values_and_scores(dtype):
    loc_s, scale_s, loc_y, scale_y, labels, values = make_inputs(dtype=dtype)
    with torch.no_grad():
        loc_s[0, :, :6] = 1e4      # far above the threshold
        loc_s[1, :, :6] = -1e4     # far below
        scale_s[0, 1] = 1e-6
    values[0, 2], values[1, 5] = 1e30, -1e30
    tensors = [t.detach().requires_grad_() for t in (loc_s, scale_s, loc_y, scale_y)]
    out = loss_of(*tensors, labels, values, threshold=10.0, num_token_id=NUM,
                           value_transform="identity", detach_gate=False)
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.loss.dtype == torch.float32
    for t in tensors:
        assert torch.isfinite(t.grad.float()).all()


def test_values_beyond_float32_need_symlog():
    loc_s, scale_s, loc_y, scale_y, labels, values = make_inputs()
    values[0, 2] = 1e300
    with pytest.raises(ValueError, match="numeric_labels"):
        loss_of(loc_s, scale_s, loc_y, scale_y, labels, values, threshold=10.0, num_token_id=NUM,
                         value_transform="identity")
    out = loss_of(loc_s, scale_s, loc_y, scale_y, labels, values, threshold=10.0, num_token_id=NUM,
                           value_transform="symlog")
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("num_items", [None, 13])
def test_anchor_term_is_the_kl_mean_over_the_targets_labelled_positions(num_items):
    # β · Σ over labelled positions of Σ_c KL(U ‖ U⁰), divided by their count or by num_items_in_batch, in float64
    # from the closed form KL = log(((γ1 + γ2)² + (μ1 − μ2)²) / (4 γ1 γ2)); targets given unshifted or shifted agree.
    loc_s, scale_s, loc_y, scale_y, labels, values = make_inputs()
    g = torch.Generator().manual_seed(3)
    loc_u, anchor_loc = torch.randn(2, 6, 4, generator=g), torch.randn(2, 6, 4, generator=g)
    scale_u, anchor_scale = torch.rand(2, 6, 4, generator=g) + 0.1, torch.rand(2, 6, 4, generator=g) + 0.1
    options = LossOptions(num_token_id=NUM, anchor_weight=0.7)
    head = DecisionScores(loc_s, scale_s, 10.0)
    anchor = AnchorTerm(loc_u, scale_u, anchor_loc, anchor_scale)
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    shifted_values = torch.nn.functional.pad(values[:, 1:], (0, 1))
    for targets in (LossTargets.from_labels(labels, values, num_items_in_batch=num_items),
                    LossTargets.from_labels(None, shift_labels=shifted, shift_numeric_labels=shifted_values,
                                            num_items_in_batch=num_items)):
        plain = causal_qwen_loss(head, loc_y, scale_y, targets, options)
        out = causal_qwen_loss(head, loc_y, scale_y, targets, options, anchor)
        mu1, g1, mu2, g2 = (t.double() for t in (loc_u, scale_u, anchor_loc, anchor_scale))
        kl = torch.log(((g1 + g2) ** 2 + (mu1 - mu2) ** 2) / (4 * g1 * g2)).sum(-1)
        valid = shifted != -100
        count = num_items if num_items is not None else int(valid.sum())
        want = plain.loss.double() + 0.7 * kl[valid].sum() / count
        assert out.loss.item() == pytest.approx(want.item(), rel=1e-6)
        assert out.cls_loss.item() == plain.cls_loss.item() and out.reg_loss.item() == plain.reg_loss.item()
        assert torch.equal(targets.labels, shifted) and torch.equal(targets.valid, valid)


def test_loss_options_take_the_config_defaults():
    from causal_qwen import CausalQwenConfig

    config = CausalQwenConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, num_token_id=15)
    assert LossOptions(num_token_id=15) == LossOptions.from_config(config)
    assert LossOptions(num_token_id=15).value_transform == config.value_transform == "symlog"
