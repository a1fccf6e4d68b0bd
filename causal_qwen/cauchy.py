"""The Cauchy distribution, as CausalQwen uses it.

Every random quantity of the model is Cauchy(loc, scale). The family is closed under linear maps:
if X_i ~ Cauchy(μ_i, γ_i) are independent, then Σ a_i X_i + b ~ Cauchy(Σ a_i μ_i + b, Σ |a_i| γ_i).
That is what lets the model push a distribution through its heads exactly, without sampling.

Functions here take and return plain tensors that broadcast against each other; `loc` and `scale`
always have the same shape. Formulas are written in the forms that stay accurate in fp32 over a
152k-class vocabulary and for values up to 1e30 (see docs/design.md §1).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "value_interval",
    "linear",
    "linear_by_blocks",
    "cdf",
    "interval_probability",
    "ovr_probability",
    "ovr_log_probs",
    "ovr_log_prob_gradients",
    "nll",
    "quantile",
    "central_interval",
    "sample",
    "from_uniform",
    "kl_divergence",
    "symlog",
    "symexp",
    "transform_values",
    "untransform_values",
]

_LOG_PI = math.log(math.pi)


def linear(
    loc: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    abs_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Push independent Cauchy(loc, scale) inputs through `x @ weight.T + bias`.

    Args:
        loc, scale: `[..., in_features]`.
        weight: `[out_features, in_features]`, or `[in_features]` for a single output without its axis.
        bias: `[out_features]` or None.
        abs_weight: |weight|, when the caller has it already (`linear_by_blocks` builds it in a reused buffer).

    Returns:
        `(loc, scale)` of the outputs, each `[..., out_features]` (`[...]` for a 1-D weight).
    """
    out_loc = torch.nn.functional.linear(loc, weight, bias)
    out_scale = torch.nn.functional.linear(scale, weight.abs() if abs_weight is None else abs_weight)
    return out_loc, out_scale


# Bytes of |W| built at a time by `linear_by_blocks`: within a CPU core's L2 cache, so that each block of W is read
# from memory once (for loc) and its absolute value stays in cache for scale; on CUDA, large blocks (few launches).
_BLOCK_BYTES = {"cpu": 2 << 20, "cuda": 64 << 20}


@torch.no_grad()
def linear_by_blocks(
    loc: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    block_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear` without autograd, taking W a block of rows at a time: |W| is never built whole, nor kept.

    Each block of W gives its slice of loc and, through its absolute value in a reused buffer, of scale. At a few
    positions (a generation step) this costs about what a cached |W| would (W is read once from memory, the buffer
    stays in cache), and it cannot go stale, whatever writes W (`weight.data.lerp_` of an EMA included).
    """
    out_features, in_features = weight.shape
    if block_rows is None:
        budget = _BLOCK_BYTES.get(weight.device.type, _BLOCK_BYTES["cuda"])
        block_rows = max(1, budget // (in_features * weight.element_size()))
    lead = loc.shape[:-1]
    loc2, scale2 = loc.reshape(-1, in_features), scale.reshape(-1, in_features)
    out_loc = loc2.new_empty(loc2.shape[0], out_features)
    out_scale = scale2.new_empty(scale2.shape[0], out_features)
    buffer = weight.new_empty(min(block_rows, out_features), in_features)
    for start in range(0, out_features, block_rows):
        block = weight[start:start + block_rows]
        rows = block.shape[0]
        abs_block = torch.abs(block, out=buffer[:rows])
        block_bias = None if bias is None else bias[start:start + rows]
        out_loc[:, start:start + rows], out_scale[:, start:start + rows] = linear(
            loc2, scale2, block, block_bias, abs_weight=abs_block
        )
    return out_loc.reshape(*lead, out_features), out_scale.reshape(*lead, out_features)


def cdf(x: torch.Tensor, loc: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """P(X ≤ x) for X ~ Cauchy(loc, scale)."""
    return torch.atan2(scale, loc - x) / math.pi


def interval_probability(
    lower: torch.Tensor, upper: torch.Tensor, loc: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """P(lower < X ≤ upper) = cdf(upper) − cdf(lower) for X ~ Cauchy(loc, scale) and lower ≤ upper.

    With a = (upper − loc)/scale and b = (lower − loc)/scale it is (atan a − atan b)/π. Where both ends lie on the
    same side of loc the difference is taken as one angle, atan((a − b)/(1 + ab)), so that a narrow interval far in
    a tail keeps its relative accuracy (the two cdfs there agree in most of their digits).
    """
    a, b = (upper - loc) / scale, (lower - loc) / scale
    same_side = a * b > 0
    tail = torch.atan((a - b) / (1 + torch.where(same_side, a * b, torch.zeros_like(a))))
    return torch.where(same_side, tail, torch.atan(a) - torch.atan(b)) / math.pi


def ovr_probability(loc: torch.Tensor, scale: torch.Tensor, threshold: torch.Tensor | float) -> torch.Tensor:
    """One-vs-Rest probability P(S > C) = 1/2 + atan((loc − C)/scale)/π, as `atan2(scale, C − loc)/π`.

    The `atan2` form never divides by a tiny scale and stays accurate when P is close to 0. Its gradient is
    written out (`_OvRProbability`): autograd's `atan2` backward forms scale² + (loc − C)², which overflows fp32
    once |loc − C| > 1.8e19 (NaN gradients) and underflows to 0 for scales below 1e-19.
    """
    return _OvRProbability.apply(loc - threshold, scale)


def ovr_log_probs(
    loc: torch.Tensor, scale: torch.Tensor, threshold: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(log P, log(1 − P))` of the One-vs-Rest decision S > C, both accurate near 0 and near 1.

    With a = atan2(scale, C − loc)/π = P and b = atan2(scale, loc − C)/π = 1 − P, each of them is
    computed as a small angle where it is small, so the log of the small one is taken directly and the
    other side goes through `log1p`. The gradient is written out (`_OvRLogProbs`): through autograd, the log's
    1/P overflows fp32 once P < 3e-39 (a scale floored at 1e-38 or below), and the `atan2` backward once
    |loc − C| > 1.8e19, giving inf or NaN gradients with a finite loss.
    """
    return _OvRLogProbs.apply(loc - threshold, scale)


class _OvRProbability(torch.autograd.Function):
    """P = atan2(s, −d)/π of d = loc − C and s = scale > 0, with ∂P/∂d = s/(π(s² + d²)), ∂P/∂s = −d/(π(s² + d²)).

    s² + d² is never formed: with n = hypot(s, d) (which neither overflows nor underflows), s/(s² + d²) = (s/n)/n.
    """

    @staticmethod
    def forward(ctx, d: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(d, s)
        return torch.atan2(s, -d) / math.pi

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        d, s = ctx.saved_tensors
        n = torch.hypot(s, d)
        grad = grad / math.pi
        return (s / n) / n * grad, -(d / n) / n * grad


class _OvRLogProbs(torch.autograd.Function):
    """`(log P, log(1 − P))` of d = loc − C and s = scale > 0, with the gradients written without overflow.

    With p = πP = atan2(s, −d), q = π(1 − P) = atan2(s, d) and n = hypot(s, d) (docs/design.md §4.1):
    ∂log P/∂d = s/(n²p), ∂log P/∂s = −d/(n²p), ∂log(1 − P)/∂d = −s/(n²q), ∂log(1 − P)/∂s = d/(n²q).
    They are formed as (s/p)/n/n and ((d/n)/n)/p: s/p is at most about max(|d|, s) (p ≈ s/|d| when small) and
    (d/n)/n about 1/d, so no intermediate exceeds the result (or 1/s), and no square is formed. The gradients are
    then finite wherever their true values fit in the dtype (∂/∂s at a subnormal floor may be ±inf, as its true value
    is; the floor's clamp drops it).
    """

    @staticmethod
    def forward(ctx, d: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.atan2(s, -d)
        q = torch.atan2(s, d)
        ctx.save_for_backward(d, s, p, q)
        p, q = p / math.pi, q / math.pi
        p_is_small = p <= 0.5
        log_p = torch.where(p_is_small, torch.log(p), torch.log1p(-q.clamp(max=0.5)))
        log_q = torch.where(p_is_small, torch.log1p(-p.clamp(max=0.5)), torch.log(q))
        return log_p, log_q

    @staticmethod
    def backward(ctx, grad_log_p: torch.Tensor, grad_log_q: torch.Tensor):
        d, s, p, q = ctx.saved_tensors
        n = torch.hypot(s, d)
        k = (d / n) / n
        grad_d, grad_s = torch.zeros_like(d), torch.zeros_like(d)
        for grad, angle, sign in ((grad_log_p, p, 1.0), (grad_log_q, q, -1.0)):
            if grad is not None:
                grad_d = grad_d + sign * grad * (_over_angle(s, angle, d) / n / n)
                grad_s = grad_s - sign * _divide(k * grad, angle)
        return grad_d, grad_s


def _over_angle(s: torch.Tensor, angle: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """s/angle for angle = atan2(s, ±d); it tends to |d| as the angle goes to 0 (where it underflowed)."""
    return torch.where(angle > 0, s / angle, d.abs())


def _divide(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """x/angle, 0 where the angle underflowed to 0 (the log there is −inf: no gradient is right)."""
    return torch.where(angle > 0, x / angle, 0.0)


def ovr_log_prob_gradients(d: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(∂log P/∂d, ∂log P/∂s)` of P = P(S > C), d = loc − C, s = scale > 0, without overflow (`_OvRLogProbs`)."""
    p = torch.atan2(s, -d)
    n = torch.hypot(s, d)
    return _over_angle(s, p, d) / n / n, -_divide((d / n) / n, p)


def nll(value: torch.Tensor, loc: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of `value` under Cauchy(loc, scale): log(π·scale) + log(1 + r²).

    With r = (value − loc)/scale, the tail |r| > 1 is written as log(π·scale) + 2·log|r| + log1p(r⁻²),
    and log|r| as log|value − loc| − log(scale), so nothing overflows even when r² would.
    """
    diff = value - loc
    log_scale = torch.log(scale)
    abs_diff = diff.abs()
    in_core = abs_diff <= scale
    # Each branch sees a harmless argument where it is not selected, so gradients stay finite.
    r_core = torch.where(in_core, diff, torch.zeros_like(diff)) / scale
    core = torch.log1p(r_core.square())
    safe_abs = torch.where(in_core, scale, abs_diff)
    inv_r = scale / safe_abs
    tail = 2.0 * (torch.log(safe_abs) - log_scale) + torch.log1p(inv_r.square())
    return _LOG_PI + log_scale + torch.where(in_core, core, tail)


def quantile(loc: torch.Tensor, scale: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """Q(p) = loc + scale·tan(π(p − 1/2)), for p in (0, 1), computed in the dtype of `loc`.

    In the tails the tangent is written as ±1/tan(π·tail) with tail = min(p, 1 − p), so that a p close to 0 or 1
    keeps its digits (tan near π/2 loses them all, and flips sign once π(p − 1/2) rounds past π/2).
    """
    if not isinstance(p, torch.Tensor):
        if not 0.0 < p < 1.0:
            raise ValueError(f"p must lie in (0, 1), got {p}")
        p = torch.tensor(p, dtype=loc.dtype, device=loc.device)
    return loc + scale * _standard_quantile(p.to(loc.dtype))


def _standard_quantile(p: torch.Tensor) -> torch.Tensor:
    """tan(π(p − 1/2)), as −1/tan(πp) below 1/4 and 1/tan(π(1 − p)) above 3/4 (1 − p is exact there)."""
    tail = torch.minimum(p, 1.0 - p)
    in_tail = tail < 0.25
    cot = 1.0 / torch.tan(math.pi * torch.where(in_tail, tail, 0.25))
    centre = torch.tan(math.pi * (torch.where(in_tail, 0.5, p) - 0.5))
    return torch.where(in_tail, torch.where(p < 0.5, -cot, cot), centre)


def central_interval(
    loc: torch.Tensor, scale: torch.Tensor, coverage: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(lower, upper)` of the central `coverage` interval of Cauchy(loc, scale), in the dtype of `loc`.

    The half-width is scale/tan(π(1 − coverage)/2), from the tail probability itself: finite and ordered for every
    coverage in (0, 1), 1 − 1e-12 included (through the quantiles at 1 − tail, the tail would round away).
    """
    if isinstance(coverage, bool) or not isinstance(coverage, (int, float)):
        raise TypeError(f"coverage must be a number in (0, 1), got {type(coverage).__name__}")
    if not 0.0 < coverage < 1.0:
        raise ValueError(f"coverage must lie in (0, 1), got {coverage}")
    tail = torch.tensor((1.0 - coverage) / 2.0, dtype=loc.dtype, device=loc.device)
    half_width = scale / torch.tan(math.pi * tail)
    return loc - half_width, loc + half_width


def value_interval(
    loc_y: torch.Tensor, scale_y: torch.Tensor, coverage: float, value_transform: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(median, lower, upper)` in value space, float64, of a value whose head predicts Cauchy(loc_y, scale_y) in the
    space of `value_transform`: quantiles commute with the monotone transform, so these are exact."""
    loc, scale = loc_y.double(), scale_y.double()
    lower, upper = central_interval(loc, scale, coverage)
    return tuple(untransform_values(bound, value_transform) for bound in (loc, lower, upper))


def sample(
    loc: torch.Tensor, scale: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """A reparameterised draw loc + scale·tan(π(ε − 1/2)) with ε ~ U(0, 1), differentiable in loc and scale."""
    return from_uniform(loc, scale, uniform(loc.shape, loc.device, generator))


def from_uniform(loc: torch.Tensor, scale: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The draw loc + scale·tan(π(ε − 1/2)) of Cauchy(loc, scale) for given ε ~ U(0, 1) (broadcasting).

    The tangent is taken in the dtype of ε (fp32 from `uniform`), then the draw in that of `loc`.
    """
    return loc + scale * standard_from_uniform(eps).to(loc.dtype)


def uniform(shape: tuple[int, ...] | torch.Size, device: torch.device,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """ε ~ U(0, 1) in fp32 on `device`, drawn where `generator` lives (a CPU generator may drive a GPU model)."""
    where = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=where, dtype=torch.float32).to(device)


def standard_from_uniform(eps: torch.Tensor) -> torch.Tensor:
    """Map ε ~ U(0, 1) to a standard Cauchy draw tan(π(ε − 1/2))."""
    return torch.tan(math.pi * (eps - 0.5))


def kl_divergence(
    loc_p: torch.Tensor, scale_p: torch.Tensor, loc_q: torch.Tensor, scale_q: torch.Tensor
) -> torch.Tensor:
    """KL(Cauchy(loc_p, scale_p) ‖ Cauchy(loc_q, scale_q)) = log(((γp + γq)² + (μp − μq)²) / (4 γp γq)).

    The closed form is symmetric in its two arguments and zero exactly when they are equal. It is evaluated as
    log(1 + a² + b²) with a = (γp − γq)/(2√γp√γq) and b = (μp − μq)/(2√γp√γq) (since (γp + γq)² − 4γpγq =
    (γp − γq)²): no scale is squared, so scales down to the smallest subnormal neither underflow nor give 0/0, the
    value near 0 keeps its relative precision, and a large a or b goes through its logarithm instead of its square.
    """
    root = torch.sqrt(scale_p) * torch.sqrt(scale_q)
    a = (scale_p - scale_q) / root / 2.0
    b = (loc_p - loc_q) / root / 2.0
    big, small = torch.maximum(a.abs(), b.abs()), torch.minimum(a.abs(), b.abs())
    # Each branch gets a harmless argument where it is not taken, so that neither gives an inf or NaN gradient.
    is_big = big > 1.0
    near = torch.log1p(torch.where(is_big, 0.0, a).square() + torch.where(is_big, 0.0, b).square())
    big_safe = torch.where(is_big, big, 1.0)
    far = 2.0 * torch.log(big_safe) + torch.log1p(big_safe.reciprocal().square() + (small / big_safe).square())
    return torch.where(is_big, far, near)


def symlog(value: torch.Tensor) -> torch.Tensor:
    """sign(v)·ln(1 + |v|): compresses magnitudes while keeping 0 at 0 and the order of values.

    Written as s·ln(1 + s·v) with the sign s = ±1 a constant, not as sign(v)·ln(1 + |v|): autograd gives that
    product the derivative 0 at v = 0 (sign and |·| have derivative 0 there), where the true one is 1, and a learned
    quantity that starts at 0, as the context-value path's raw-space combination does, would then never move. A
    product by ±1 is exact, so this is the two branches' value and derivative to the bit, in six operations rather
    than eight (each a kernel launch on a GPU); the clamp moves no number and gives a NaN the derivative 0 that the
    branches gave it. Where no gradient is taken, the same value comes from three operations, ln(1 + |v|) with the
    sign of v."""
    if not _differentiated(value):
        return torch.log1p(value.abs()).copysign(value)
    sign = _unit_sign(value)
    return sign * torch.log1p((sign * value).clamp(min=0))


def symexp(value: torch.Tensor) -> torch.Tensor:
    """The inverse of `symlog`: sign(t)·(e^|t| − 1), as s·(e^(s·t) − 1) for the derivative 1 at 0 (`symlog`)."""
    if not _differentiated(value):
        return torch.expm1(value.abs()).copysign(value)
    sign = _unit_sign(value)
    return sign * torch.expm1((sign * value).clamp(min=0))


def _differentiated(value: torch.Tensor) -> bool:
    """Whether autograd records an operation on `value`: only then does the form of `symlog` and `symexp` matter."""
    return value.requires_grad and torch.is_grad_enabled()


def _unit_sign(value: torch.Tensor) -> torch.Tensor:
    """±1 by the sign bit of `value` (−1 at −0), outside autograd: the constant s of `symlog` and `symexp`."""
    return torch.ones_like(value).copysign(value.detach())


def transform_values(values: torch.Tensor, value_transform: str) -> torch.Tensor:
    """Map values into the regression head's space: `symlog` for `"symlog"`, unchanged for `"identity"`."""
    return symlog(values) if value_transform == "symlog" else values


def untransform_values(y: torch.Tensor, value_transform: str) -> torch.Tensor:
    """Map a point of the regression head's space back to a value (the inverse of `transform_values`)."""
    return symexp(y) if value_transform == "symlog" else y
