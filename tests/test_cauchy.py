"""The Cauchy ops against textbook formulas evaluated in float64 and against torch.distributions."""

import math

import pytest
import torch

from causal_qwen import cauchy


def test_linear_matches_sampled_sum_distribution():
    torch.manual_seed(1)
    loc, scale = torch.randn(3, 5, dtype=torch.float64), torch.rand(3, 5, dtype=torch.float64) + 0.1
    weight, bias = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    out_loc, out_scale = cauchy.linear(loc, scale, weight, bias)
    expected_loc = torch.stack([(weight[j] * loc).sum(-1) + bias[j] for j in range(4)], -1)
    expected_scale = torch.stack([(weight[j].abs() * scale).sum(-1) for j in range(4)], -1)
    torch.testing.assert_close(out_loc, expected_loc)
    torch.testing.assert_close(out_scale, expected_scale)


def test_cdf_and_ovr_probability_match_torch_distributions():
    loc = torch.tensor([-3.0, 0.0, 2.0, 50.0], dtype=torch.float64)
    scale = torch.tensor([0.5, 1.0, 2.0, 1e-3], dtype=torch.float64)
    threshold = 1.5
    reference = torch.distributions.Cauchy(loc, scale)
    torch.testing.assert_close(cauchy.cdf(torch.tensor(threshold, dtype=torch.float64), loc, scale),
                               reference.cdf(torch.tensor(threshold, dtype=torch.float64)))
    textbook = 0.5 + torch.atan((loc - threshold) / scale) / math.pi
    torch.testing.assert_close(cauchy.ovr_probability(loc, scale, threshold), textbook)


def test_ovr_log_probs_accurate_in_fp32_at_both_ends():
    loc = torch.tensor([-1e4, -30.0, 14.9, 15.0, 15.1, 40.0, 1e4])
    scale = torch.full_like(loc, 1e-3)
    log_p, log_q = cauchy.ovr_log_probs(loc, scale, 15.0)
    p64 = 0.5 + torch.atan((loc.double() - 15.0) / scale.double()) / math.pi
    # float64 references: log of the small side computed from the angle directly.
    ref_log_p = torch.log(torch.atan2(scale.double(), 15.0 - loc.double()) / math.pi)
    ref_log_q = torch.log(torch.atan2(scale.double(), loc.double() - 15.0) / math.pi)
    torch.testing.assert_close(log_p.double(), ref_log_p, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(log_q.double(), ref_log_q, rtol=1e-5, atol=1e-6)
    assert torch.allclose(log_p.exp().double() + log_q.exp().double(), torch.ones_like(p64), atol=1e-6)


def test_nll_matches_torch_and_stays_finite_for_huge_values():
    value = torch.tensor([0.3, -2.0, 7.5], dtype=torch.float64)
    loc = torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64)
    scale = torch.tensor([1.0, 0.5, 3.0], dtype=torch.float64)
    torch.testing.assert_close(cauchy.nll(value, loc, scale), -torch.distributions.Cauchy(loc, scale).log_prob(value))

    huge = torch.tensor([1e30, -1e30, 3e38], requires_grad=True)
    out = cauchy.nll(huge, torch.zeros(3), torch.full((3,), 1e-6))
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(huge.grad).all()
    expected = math.log(math.pi * 1e-6) + 2 * (math.log(1e30) - math.log(1e-6))
    assert out[0].item() == pytest.approx(expected, rel=1e-5)


def _simpson_density_integral(lower: float, upper: float, loc: float, scale: float, steps: int = 2000) -> float:
    """∫ Cauchy density over [lower, upper] by Simpson's rule in float64: no difference of two cdfs."""
    h = (upper - lower) / steps
    density = [scale / (math.pi * ((lower + i * h - loc) ** 2 + scale**2)) for i in range(steps + 1)]
    inner = sum((4 if i % 2 else 2) * density[i] for i in range(1, steps))
    return h / 3 * (density[0] + inner + density[-1])


def test_interval_probability_is_the_cdf_difference_and_keeps_tail_intervals():
    loc = torch.tensor([0.0, 2.0, -1.0, 0.0], dtype=torch.float64)
    scale = torch.tensor([1.0, 0.5, 3.0, 2.0], dtype=torch.float64)
    lower = torch.tensor([-1.0, 2.5, -20.0, -7.0], dtype=torch.float64)
    upper = torch.tensor([1.0, 4.0, -3.0, -6.5], dtype=torch.float64)
    reference = torch.distributions.Cauchy(loc, scale)
    torch.testing.assert_close(cauchy.interval_probability(lower, upper, loc, scale),
                               reference.cdf(upper) - reference.cdf(lower))
    # A unit interval 1e8 scales out in either tail: the two cdfs agree to 16 digits, their difference is noise.
    for lo in (1e8, -1e8 - 1.0):
        got = cauchy.interval_probability(*(torch.tensor(x, dtype=torch.float64) for x in (lo, lo + 1.0, 0.0, 1.0)))
        assert got.item() == pytest.approx(_simpson_density_integral(lo, lo + 1.0, 0.0, 1.0), rel=1e-12)


def test_quantile_inverts_cdf_and_sample_is_reproducible():
    loc, scale = torch.tensor([2.0]), torch.tensor([0.5])
    for p in (0.05, 0.25, 0.5, 0.9):
        q = cauchy.quantile(loc, scale, p)
        assert cauchy.cdf(q, loc, scale).item() == pytest.approx(p, abs=1e-6)
    with pytest.raises(ValueError, match="p must"):
        cauchy.quantile(loc, scale, 1.0)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = cauchy.sample(torch.zeros(10000), torch.ones(10000), generator=g1)
    torch.testing.assert_close(a, cauchy.sample(torch.zeros(10000), torch.ones(10000), generator=g2))
    # The sample median and quartiles of a standard Cauchy are 0 and ±1.
    assert abs(a.median().item()) < 0.05
    assert a.quantile(0.75).item() == pytest.approx(1.0, abs=0.08)


def test_kl_divergence_closed_form():
    mu1, g1, mu2, g2 = torch.tensor(0.3), torch.tensor(1.2), torch.tensor(-0.4), torch.tensor(0.7)
    expected = math.log(((1.2 + 0.7) ** 2 + 0.7**2) / (4 * 1.2 * 0.7))
    assert cauchy.kl_divergence(mu1, g1, mu2, g2).item() == pytest.approx(expected, rel=1e-6)
    assert cauchy.kl_divergence(mu1, g1, mu1, g1).item() == pytest.approx(0.0, abs=1e-7)
    # Monte Carlo check of the closed form: E_p[log p(x) − log q(x)].
    torch.manual_seed(0)
    p, q = torch.distributions.Cauchy(mu1.double(), g1.double()), torch.distributions.Cauchy(mu2.double(), g2.double())
    x = p.sample((400000,))
    assert (p.log_prob(x) - q.log_prob(x)).mean().item() == pytest.approx(expected, rel=0.03)


def test_symlog_roundtrip():
    v = torch.tensor([-1e6, -2.5, 0.0, 0.5, 123.0], dtype=torch.float64)
    torch.testing.assert_close(cauchy.symexp(cauchy.symlog(v)), v)
    assert cauchy.symlog(torch.tensor(0.0)).item() == 0.0


def test_symlog_and_symexp_have_their_derivatives_everywhere_zero_included():
    """d symlog(v)/dv = 1/(1 + |v|) and d symexp(t)/dt = e^|t|, both 1 at 0: a learned quantity that starts at 0
    (the context-value path's raw-space combination) must get a gradient there. The values are the closed forms'."""
    v = torch.tensor([-1e3, -2.5, -1e-12, 0.0, 1e-12, 0.5, 123.0], dtype=torch.float64, requires_grad=True)
    y = cauchy.symlog(v)
    (grad,) = torch.autograd.grad(y.sum(), v)
    plain = v.detach()
    torch.testing.assert_close(y.detach(), torch.sign(plain) * torch.log1p(plain.abs()), rtol=0.0, atol=0.0)
    torch.testing.assert_close(grad, 1.0 / (1.0 + plain.abs()), rtol=1e-15, atol=0.0)
    t = v.detach().clamp(-30.0, 30.0).requires_grad_()
    (grad,) = torch.autograd.grad(cauchy.symexp(t).sum(), t)
    torch.testing.assert_close(grad, t.detach().abs().exp(), rtol=1e-15, atol=0.0)
    assert grad[3].item() == 1.0 and torch.autograd.gradcheck(cauchy.symlog, (v,))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_symlog_and_symexp_without_a_gradient_equal_their_differentiable_form_bit_for_bit(dtype):
    """Where nothing is differentiated the two are computed in fewer operations: the same bits, the sign of a zero
    included, at zeros, subnormals, the dtype's limits, past exp's range and at ±inf (NaN stays NaN)."""
    values = [0.0, -0.0, 5e-324, -1e-320, 1e-12, -1e-12, 0.5, -2.5, 88.0, 89.0, 709.0, 710.0, -710.0, 1e300, -1.7e308,
              math.inf, -math.inf, math.nan]
    v = torch.tensor(values, dtype=torch.float64).to(dtype)
    bits = {torch.float64: torch.int64, torch.float32: torch.int32}.get(dtype, torch.int16)
    for f in (cauchy.symlog, cauchy.symexp):
        plain = f(v)
        differentiable = f(v.clone().requires_grad_())
        assert differentiable.requires_grad and not plain.requires_grad
        with torch.no_grad():
            assert torch.equal(f(v.clone().requires_grad_()).view(bits), plain.view(bits))
        finite = ~plain.isnan()
        assert torch.equal(plain[finite].view(bits), differentiable.detach()[finite].view(bits))
        assert torch.equal(plain.isnan(), v.isnan())
    # And the closed forms, in float64 (to a rounding: torch's log1p and expm1 are not the math library's).
    v64 = torch.tensor(values[:-1], dtype=torch.float64)
    closed = torch.tensor([math.copysign(math.log1p(abs(x)), x) for x in values[:-1]], dtype=torch.float64)
    torch.testing.assert_close(cauchy.symlog(v64), closed, rtol=1e-15, atol=1e-300)
    inside = v64[v64.abs() < 709]
    closed = torch.tensor([math.copysign(math.expm1(abs(x)), x) for x in inside.tolist()], dtype=torch.float64)
    torch.testing.assert_close(cauchy.symexp(inside), closed, rtol=1e-15, atol=1e-300)


@pytest.mark.parametrize("block_rows", [None, 1, 7, 64, 1000])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_by_blocks_equals_linear(block_rows, with_bias):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(100, 16, generator=g)
    bias = torch.randn(100, generator=g) if with_bias else None
    loc = torch.randn(3, 2, 16, generator=g)
    scale = torch.rand(3, 2, 16, generator=g)
    got = cauchy.linear_by_blocks(loc, scale, weight, bias, block_rows=block_rows)
    for a, b in zip(got, cauchy.linear(loc, scale, weight, bias), strict=True):
        assert a.shape == b.shape == (3, 2, 100)
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("loc_p,scale_p,loc_q,scale_q", [
    (0.0, 1e-30, 0.0, 1e-30), (0.0, 1e-30, 0.0, 3e-30), (2e-29, 1e-30, 0.0, 1e-30), (0.0, 1e-30, 0.5, 1.0),
    (0.0, 1.0, 1e-4, 1.0), (0.0, 1.0, 0.0, 1.0 + 1e-4), (3.0, 1e-20, -4.0, 1e20), (0.3, 1.2, -0.4, 0.7),
])
def test_kl_divergence_is_accurate_at_extreme_scales_in_fp32(loc_p, scale_p, loc_q, scale_q):
    # The closed form in float64, where neither (γp + γq)² nor 4γpγq leaves the range for these inputs, taken on
    # the fp32-rounded arguments; its difference form log1p(((γp − γq)² + Δμ²)/(4γpγq)) keeps the digits near 0.
    args = [torch.tensor(v, dtype=torch.float32, requires_grad=True) for v in (loc_p, scale_p, loc_q, scale_q)]
    mp, gp, mq, gq = (a.item() for a in args)
    expected = math.log1p(((gp - gq) ** 2 + (mp - mq) ** 2) / (4 * gp * gq))
    value = cauchy.kl_divergence(*args)
    assert value.item() == pytest.approx(expected, rel=1e-5, abs=1e-30)
    value.backward()
    assert all(torch.isfinite(a.grad) for a in args)
    # ∂KL/∂μp = 2Δμ / ((γp + γq)² + Δμ²), ∂KL/∂γp = 2(γp + γq)/((γp + γq)² + Δμ²) − 1/γp, in float64.
    denominator = (gp + gq) ** 2 + (mp - mq) ** 2
    assert args[0].grad.item() == pytest.approx(2 * (mp - mq) / denominator, rel=1e-4, abs=1e-12)
    assert args[1].grad.item() == pytest.approx(2 * (gp + gq) / denominator - 1 / gp, rel=1e-4, abs=1e-6 / gp)


def test_central_interval_stays_ordered_and_accurate_up_to_coverage_one():
    loc, scale = torch.tensor([1.0], dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64)
    for coverage in (0.5, 0.9, 0.99, 0.999, 1 - 1e-8, 1 - 1e-12, 1 - 2**-53):
        lower, upper = cauchy.central_interval(loc, scale, coverage)
        half = 2.0 / math.tan(math.pi * (1 - coverage) / 2)  # scale · cot(π · tail)
        assert lower.item() < 1.0 < upper.item()
        assert upper.item() - 1.0 == pytest.approx(half, rel=1e-12) and 1.0 - lower.item() == pytest.approx(half)
    for bad, kind in ((1.0, ValueError), (0.0, ValueError), (float("nan"), ValueError), ("0.9", TypeError)):
        with pytest.raises(kind, match="coverage"):
            cauchy.central_interval(loc, scale, bad)


def test_quantile_keeps_its_digits_in_the_tails():
    loc, scale = torch.zeros((), dtype=torch.float32), torch.ones((), dtype=torch.float32)
    for p in (1e-9, 1e-6, 0.1, 0.3, 0.5, 0.7, 0.9, 1 - 1e-6):
        q = cauchy.quantile(loc, scale, p).item()
        p = float(torch.tensor(p, dtype=torch.float32))  # the p the fp32 quantile sees
        expected = -1 / math.tan(math.pi * p) if p < 0.5 else 1 / math.tan(math.pi * (1 - p)) if p > 0.5 else 0.0
        assert q == pytest.approx(expected, rel=1e-5, abs=1e-7)
