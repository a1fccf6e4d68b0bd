"""The classification head and its One-vs-Rest loss, fused and tiled so that no `[N, V]` tensor ever exists.

The straightforward path (`CausalQwenAction.classify` then `loss.causal_qwen_loss`) builds loc_S, scale_S, log P,
log(1 − P) and their gradients over the whole vocabulary: at N = 4096 positions and V = 151,936 classes
each of them is 2.5 GB in fp32. Here the head and the loss run together over tiles of
`[rows, vocab_chunk]` (a chunk of positions × a block of classes) inside one `torch.autograd.Function`:

    d = loc_U @ W_cls[k].T + (b_cls[k] − C_k)           loc_S − C
    s = max(scale_U' @ |W_cls[k]|.T, scale_min)         scale_S
    −log(1 − P) for every class, −log P for the target  atan2 forms of docs/design.md §1

and, in the same pass, the gradients of that loss with respect to every input. Only the loss and the
gradients (`[N, C]`, `[V, C]`, `[V]`) are kept; `backward` merely scales them, in place, by the incoming gradient
(so a second backward through the same graph, with `retain_graph=True`, raises).

Why gradients in forward rather than recomputation in backward: recomputing repeats the two forward
matrix products of every tile (a third of the six), and on CPU those products are nearly all of the
time. Keeping the gradients costs no extra peak memory in a training step, because backward follows at
once and would have to allocate the same gradients anyway. When no input requires a gradient (evaluation,
`torch.no_grad()`), forward computes the loss only.

Why tiles over classes as well as positions: a block of classes keeps |W_cls|, sign(W_cls) and the
weight-gradient accumulators at `[vocab_chunk, C]` instead of `[V, C]`, so that the weight gradient is
finished block by block and nothing of size `[V, C]` is allocated beyond the gradient itself. Tall tiles
(many positions) also make the matrix products efficient, since each block of W is read once per chunk of
positions. Memory is then bounded by the budget, whatever N.

Precision: every tile is computed in fp32, the loss is accumulated in fp64 across tiles, and gradients are
accumulated in fp32 and returned in the dtype of each input. On the CPU, bf16 inputs are upcast block by block
(faster than bf16 products on CPUs without bf16 units). On CUDA with bf16 or fp16 inputs the six products run on
the tensor cores with fp32 outputs (`out_dtype`): the two forward products are then as exact as fp32 ones (a
product of two half-precision numbers is exact in fp32, and the sums are fp32), and the four gradient products
take the fp32 tile gradients rounded to the inputs' dtype, as autograd's own half-precision backward would.
The function is differentiable once (no double backward). The derivation of the loss terms and of every gradient
is in docs/design.md §4.1. Read top to bottom: the public functions, the autograd function, the loop over tiles,
one tile, then the buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .cauchy import _LOG_PI, linear, ovr_log_prob_gradients, ovr_log_probs, ovr_probability
from .labels import IGNORE_INDEX

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "ChunkedOvRHeadLoss",
    "choose_chunk_sizes",
    "chunked_ovr_loss",
    "ovr_class_probability",
    "class_threshold",
]

DEFAULT_MEMORY_BUDGET = 256 * 2**20
"""Bytes of scratch space for one tile (positions × classes) and its weight block."""

# Scratch per tile element: five fp32 buffers and two boolean masks.
_BYTES_PER_TILE_ELEMENT = 5 * 4 + 2
# Scratch per weight-block element: at most four fp32 `[vocab_chunk, C]` buffers.
_BYTES_PER_WEIGHT_ELEMENT = 4 * 4
# Narrower class blocks make the matrix products inefficient; below this width, chunk positions instead.
_MIN_VOCAB_CHUNK = 2048

_PI = math.pi


def chunked_ovr_loss(
    loc_u: torch.Tensor,
    scale_u_noisy: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    threshold: torch.Tensor | float,
    targets: torch.Tensor,
    *,
    scale_min: float,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    memory_budget: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OvR classification loss of the Cauchy head, summed over labelled positions, without any `[N, V]` tensor.

    Equals `loss.ovr_classification_loss(loc_S, scale_S, ...)` summed over the positions whose target is not
    `IGNORE_INDEX`, with `loc_S = loc_u @ weight.T + bias` and `scale_S = max(scale_u_noisy @ |weight|.T,
    scale_min)`, i.e. what `CausalQwenAction.classify` computes. Targets are used as given (no shift).

    Args:
        loc_u: `[..., C]` loc_U.
        scale_u_noisy: `[..., C]` scale_U' = scale_U + |b_noise| (`CausalQwenAction.noisy_scale`), not floored.
        weight: `[V, C]` W_cls.
        bias: `[V]` b_cls, or None.
        threshold: `[V]`, `[]` or a float: the OvR threshold C (may require a gradient).
        targets: `[...]` class ids, `IGNORE_INDEX` (−100) where no loss is wanted.
        scale_min: floor on scale_S; no gradient flows where it binds, as with `torch.clamp`.
        chunk_size: positions per tile (default: chosen from `memory_budget`).
        vocab_chunk_size: classes per tile (default: chosen from `memory_budget`).
        memory_budget: bytes of scratch space for a tile (default `DEFAULT_MEMORY_BUDGET`).

    Returns:
        `(loss_sum, valid_count)`: the fp32 scalar sum of per-position losses and the int64 scalar count of labelled
        positions. The caller divides `loss_sum` by `valid_count` (or by `num_items_in_batch`). The probability of a
        single class, which the regression gate needs, is `ovr_class_probability`.
    """
    features = loc_u.shape[-1]
    vocab = weight.shape[0]
    _check_shapes(loc_u, scale_u_noisy, weight, bias, targets)
    threshold = _threshold_tensor(threshold, vocab, weight.device)
    flat_loc = loc_u.reshape(-1, features)
    flat_scale = scale_u_noisy.reshape(-1, features)
    flat_targets = targets.reshape(-1)

    valid_count = (flat_targets != IGNORE_INDEX).sum()
    rows, classes = choose_chunk_sizes(int(valid_count), vocab, features, memory_budget=memory_budget,
                                       chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size)
    differentiable = (flat_loc, flat_scale, weight, bias, threshold)
    compute_grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in differentiable)
    loss_sum = ChunkedOvRHeadLoss.apply(flat_loc, flat_scale, weight, bias, threshold, flat_targets, float(scale_min),
                                        rows, classes, compute_grads)
    return loss_sum, valid_count


def ovr_class_probability(
    loc_u: torch.Tensor,
    scale_u_noisy: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    threshold: torch.Tensor | float,
    class_id: int,
    *,
    scale_min: float,
) -> torch.Tensor:
    """P(S_k > C_k) of the single class `k = class_id`, from its row of the head: `[..., C]` → `[...]` fp32.

    Computed as the straightforward path does (head in the input dtype, probability in fp32), so that the
    regression gate sees the same value; gradients flow with plain autograd.
    """
    row = slice(class_id, class_id + 1)
    loc, scale = linear(loc_u, scale_u_noisy, weight[row], None if bias is None else bias[row])
    scale = scale.squeeze(-1).clamp(min=scale_min)
    return ovr_probability(loc.squeeze(-1).float(), scale.float(), class_threshold(threshold, class_id))


def class_threshold(threshold: torch.Tensor | float, class_id: int) -> torch.Tensor | float:
    """C of one class, from a per-class `[V]` threshold or a shared scalar one, in fp32."""
    if isinstance(threshold, torch.Tensor) and threshold.dim() > 0:
        threshold = threshold[class_id]
    return threshold.float() if isinstance(threshold, torch.Tensor) else threshold


def choose_chunk_sizes(
    num_rows: int,
    vocab_size: int,
    hidden_size: int,
    *,
    memory_budget: int | None = None,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
) -> tuple[int, int]:
    """Tile shape `(rows, vocab_chunk)` whose scratch space fits in `memory_budget` bytes.

    Without overrides, a tile takes every position and as many classes as fit; only when that would
    leave fewer than 2048 classes per block are the positions chunked too (then blocks are 2048 wide).
    Either size can be fixed by the caller; the other one then fills the budget.

    Args:
        num_rows: N, the number of positions with a label.
        vocab_size: V.
        hidden_size: C, the width of W_cls.
        memory_budget: bytes of scratch space; defaults to `DEFAULT_MEMORY_BUDGET`.
        chunk_size: positions per tile, or None to choose.
        vocab_chunk_size: classes per tile, or None to choose.

    Returns:
        `(rows, vocab_chunk)`, each at least 1, at most `max(num_rows, 1)` and `vocab_size`.
    """
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
    for name, value in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size),
                        ("memory_budget", budget)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    num_rows = max(num_rows, 1)
    weight_bytes = hidden_size * _BYTES_PER_WEIGHT_ELEMENT

    def classes_for(rows: int) -> int:
        return max(1, budget // (rows * _BYTES_PER_TILE_ELEMENT + weight_bytes))

    def rows_for(classes: int) -> int:
        return max(1, (budget - classes * weight_bytes) // (classes * _BYTES_PER_TILE_ELEMENT))

    if chunk_size is not None and vocab_chunk_size is not None:
        rows, classes = chunk_size, vocab_chunk_size
    elif chunk_size is not None:
        rows, classes = chunk_size, classes_for(min(chunk_size, num_rows))
    elif vocab_chunk_size is not None:
        rows, classes = rows_for(min(vocab_chunk_size, vocab_size)), vocab_chunk_size
    else:
        rows, classes = num_rows, classes_for(num_rows)
        floor = min(vocab_size, _MIN_VOCAB_CHUNK)
        if classes < floor:
            classes = floor
            rows = rows_for(classes)
    return min(rows, num_rows), min(classes, vocab_size)


class ChunkedOvRHeadLoss(torch.autograd.Function):
    """Σ over labelled positions of the OvR loss −Σ_k [y_k log P_k + (1 − y_k) log(1 − P_k)], tile by tile.

    Inputs of `forward` (see `chunked_ovr_loss` for the user-facing wrapper):
        loc_u: `[N, C]` loc_U.
        scale_u: `[N, C]` scale_U' = scale_U + |b_noise| (not floored; the floor applies to scale_S).
        weight: `[V, C]` W_cls.
        bias: `[V]` b_cls, or None.
        threshold: `[V]` or `[]` C.
        targets: `[N]` class ids, `IGNORE_INDEX` where no loss is wanted.
        scale_min: the floor on scale_S; the gradient is zero where it binds, as for `torch.clamp`.
        rows, classes: the tile shape.
        compute_grads: False skips every gradient (loss only).

    Returns:
        The fp32 scalar loss summed over labelled positions (not averaged).
    """

    @staticmethod
    def forward(
        ctx,
        loc_u: torch.Tensor,
        scale_u: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        threshold: torch.Tensor,
        targets: torch.Tensor,
        scale_min: float,
        rows: int,
        classes: int,
        compute_grads: bool,
    ) -> torch.Tensor:
        needs = [compute_grads and flag for flag in ctx.needs_input_grad[:5]]
        labelled = (targets != IGNORE_INDEX).nonzero().squeeze(1)
        all_labelled = labelled.numel() == targets.numel()
        # Only labelled positions are computed; their rows are gathered once (an [n, C] copy).
        loc_rows = loc_u if all_labelled else loc_u.index_select(0, labelled)
        scale_rows = scale_u if all_labelled else scale_u.index_select(0, labelled)
        row_targets = targets if all_labelled else targets.index_select(0, labelled)

        loss, grads = _run_tiles(loc_rows.contiguous(), scale_rows.contiguous(), weight.contiguous(), bias,
                                 threshold, row_targets, scale_min, rows, classes, needs)
        # Kept as a plain attribute, not saved tensors: backward takes them over and scales them in place, so
        # that no second [V, C] gradient is ever allocated.
        ctx.gradients = _finish_gradients(grads, needs, loc_u, scale_u, weight, bias, threshold, labelled,
                                          all_labelled)
        return loss.to(torch.float32)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        gradients, ctx.gradients = ctx.gradients, None
        if gradients is None:
            raise RuntimeError(
                "the chunked OvR loss computes its gradients once, in forward; backpropagating through it a second "
                "time (retain_graph=True) is not supported"
            )
        # The usual case is a loss that is only divided later; 1 skips a pass over the [V, C] gradient.
        if not bool(grad_output == 1):
            for grad in gradients:
                if grad is not None:
                    grad.mul_(grad_output)
        return (*gradients, None, None, None, None, None)


def _run_tiles(
    loc_rows: torch.Tensor,
    scale_rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    threshold: torch.Tensor,
    targets: torch.Tensor,
    scale_min: float,
    rows: int,
    classes: int,
    needs: list[bool],
) -> tuple[torch.Tensor, _Gradients]:
    """Loss (fp64 scalar) and gradients of the labelled rows, tile by tile: classes outer, positions inner.

    Classes are the outer loop so that each block of W is converted, made absolute and given its weight
    gradient once; the per-position accumulators (`[n, C]`) are small and shared by all blocks.
    """
    device = loc_rows.device
    n, features = loc_rows.shape
    vocab = weight.shape[0]
    need_loc, need_scale, need_weight, need_bias, need_threshold = needs
    grads = _Gradients(
        loc=torch.zeros(n, features, dtype=torch.float32, device=device) if need_loc else None,
        scale=torch.zeros(n, features, dtype=torch.float32, device=device) if need_scale else None,
        weight=(torch.empty_like(weight) if n else torch.zeros_like(weight)) if need_weight else None,
        class_sum=torch.zeros(vocab, dtype=torch.float32, device=device) if need_bias or need_threshold else None,
    )
    loss = torch.zeros((), dtype=torch.float64, device=device)
    if n == 0:
        return loss, grads

    rows, classes = min(rows, n), min(classes, vocab)
    half = _half_products(weight, loc_rows, scale_rows)
    scratch = _Scratch.allocate(rows, classes, features, device=device, weight_dtype=weight.dtype,
                                half_products=half, weight_grad=need_weight)
    # b − C, so that a single addmm gives d = loc_S − C directly.
    shift = -threshold.float().expand(vocab) if bias is None else bias.float() - threshold.float()
    x_loc, x_scale = (loc_rows, scale_rows) if half else (loc_rows.float(), scale_rows.float())
    for k0 in range(0, vocab, classes):
        block = _WeightBlock.prepare(weight, k0, min(k0 + classes, vocab), scratch, grads)
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            loss += _tile(x_loc[r0:r1], x_scale[r0:r1], targets[r0:r1], shift[k0 : block.k1], block, scratch,
                          scale_min, any(needs))
            if any(needs):
                _accumulate(grads, scratch, block, x_loc[r0:r1], x_scale[r0:r1], r0, first_rows=r0 == 0)
        block.finish_weight_gradient(grads)
    return loss, grads


def _tile(
    x_loc: torch.Tensor,
    x_scale: torch.Tensor,
    targets: torch.Tensor,
    shift: torch.Tensor,
    block: _WeightBlock,
    scratch: _Scratch,
    scale_min: float,
    with_grads: bool,
) -> torch.Tensor:
    """Loss of one tile (fp64 scalar); with `with_grads`, leaves ∂L/∂loc_S and ∂L/∂scale_S in the scratch."""
    m, cols = x_loc.shape[0], block.k1 - block.k0
    shifted = _addmm(shift, x_loc, block.weight.t(), _view(scratch.shifted, m, cols))
    scale = _addmm(None, x_scale, block.abs_weight.t(), _view(scratch.scale, m, cols))
    if with_grads:
        torch.lt(scale, scale_min, out=_view(scratch.clamped, m, cols))
    scale.clamp_(min=scale_min)
    loss = _tile_loss(shifted, scale, scratch, m, cols)

    # The target class is a positive: swap its −log(1 − P) for −log P.
    local = targets - block.k0
    hit_rows = ((local >= 0) & (local < cols)).nonzero().squeeze(1)
    hit = (hit_rows, local.index_select(0, hit_rows))
    log_p, grad_loc_pos, grad_scale_pos = _positive_terms(shifted[hit], scale[hit])
    loss = loss - (log_p - _view(scratch.work, m, cols)[hit]).sum().double()
    if with_grads:
        # From here the two tile buffers hold gradients (no third [m, cols] buffer is needed for them).
        _tile_gradients(shifted, scale, scratch, m, cols)
        grad_loc_s, grad_scale_s = scale, shifted
        grad_loc_s.index_put_(hit, grad_loc_pos)
        grad_scale_s.index_put_(hit, grad_scale_pos)
        grad_scale_s.masked_fill_(_view(scratch.clamped, m, cols), 0.0)
    return loss


def _tile_loss(
    shifted: torch.Tensor, scale: torch.Tensor, scratch: _Scratch, rows: int, cols: int
) -> torch.Tensor:
    """Σ −log(1 − P) over the tile, every class taken as a negative; leaves log(1 − P) in `scratch.work`.

    With t = atan2(s, |d|) (accurate as a small angle): where d > 0, π(1 − P) = t and log(1 − P) = log(t/π);
    elsewhere πP = t and log(1 − P) = log1p(−t/π).
    """
    angle = _view(scratch.angle, rows, cols)
    above = _view(scratch.above, rows, cols)
    log_q = _view(scratch.work, rows, cols)
    log_small = _view(scratch.other, rows, cols)
    torch.abs(shifted, out=angle)
    torch.atan2(scale, angle, out=angle)
    torch.gt(shifted, 0, out=above)
    torch.mul(angle, -1.0 / _PI, out=log_q).log1p_()
    torch.log(angle, out=log_small).sub_(_LOG_PI)
    torch.where(above, log_small, log_q, out=log_q)
    # An fp32 sum is accurate enough inside a tile (pairwise) and much faster than one in fp64 on CPU.
    return -log_q.sum().double()


def _tile_gradients(shifted: torch.Tensor, scale: torch.Tensor, scratch: _Scratch, rows: int, cols: int) -> None:
    """Turn `shifted` into ∂L/∂scale_S and `scale` into ∂L/∂loc_S of L = −log(1 − P), in place.

    With q = π(1 − P) = atan2(s, d): ∂L/∂d = s / ((s² + d²)·q) and ∂L/∂s = −d / ((s² + d²)·q), formed with
    n = hypot(s, d) as (s/q)/n/n and −((d/n)/n)/q: s/q is about max(d, s) and (d/n)/n about 1/d, so neither
    overflows where the result does not (s² + d² overflows fp32 once |d| > 1.8e19, and (s² + d²)·q underflows at a
    subnormal floor). ∂L/∂s is ±inf only where its true value is beyond the dtype, at a floored scale, and zeroed
    there.
    """
    angle = _view(scratch.angle, rows, cols)
    above = _view(scratch.above, rows, cols)
    norm = _view(scratch.work, rows, cols)
    q = _view(scratch.other, rows, cols)
    # q = t where d > 0, else π − t (no cancellation: π − t ≥ π/2 there).
    torch.mul(angle, -1.0, out=q).add_(_PI)
    torch.where(above, angle, q, out=q)
    torch.hypot(scale, shifted, out=norm)
    shifted.div_(norm).div_(norm).div_(q).neg_()
    scale.div_(q).div_(norm).div_(norm)


def _positive_terms(shifted: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the target classes (`[m]` each): log P, ∂(−log P)/∂loc_S and ∂(−log P)/∂scale_S.

    With p = πP = atan2(s, −d): ∂(−log P)/∂d = −s / ((s² + d²)·p), ∂(−log P)/∂s = d / ((s² + d²)·p).
    """
    log_p, _ = ovr_log_probs(shifted, scale, 0.0)
    grad_d, grad_s = ovr_log_prob_gradients(shifted, scale)
    return log_p, -grad_d, -grad_s


def _accumulate(
    grads: _Gradients,
    scratch: _Scratch,
    block: _WeightBlock,
    x_loc: torch.Tensor,
    x_scale: torch.Tensor,
    r0: int,
    first_rows: bool,
) -> None:
    """Chain rule through loc_S = loc_U @ W.T + b and scale_S = scale_U' @ |W|.T for the tile just computed.

    The weight-gradient block is written by the first chunk of positions and accumulated by the others, so it
    needs no zeroing.
    """
    m, cols = x_loc.shape[0], block.k1 - block.k0
    grad_scale_s = _view(scratch.shifted, m, cols)
    grad_loc_s = _view(scratch.scale, m, cols)
    if grads.class_sum is not None:
        grads.class_sum[block.k0 : block.k1] += grad_loc_s.sum(0)
    # Half-precision products take the tile gradients in the inputs' dtype.
    grad_loc_s, grad_scale_s = grad_loc_s.to(x_loc.dtype), grad_scale_s.to(x_loc.dtype)
    if grads.loc is not None:
        acc = grads.loc[r0 : r0 + m]
        _addmm(acc, grad_loc_s, block.weight, acc)
    if grads.scale is not None:
        acc = grads.scale[r0 : r0 + m]
        _addmm(acc, grad_scale_s, block.abs_weight, acc)
    if block.grad_loc is not None:
        first = None if first_rows else block.grad_loc
        _addmm(first, grad_loc_s.t(), x_loc, block.grad_loc)
        first = None if first_rows else block.grad_scale
        _addmm(first, grad_scale_s.t(), x_scale, block.grad_scale)


def _finish_gradients(
    grads: _Gradients,
    needs: list[bool],
    loc_u: torch.Tensor,
    scale_u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    threshold: torch.Tensor,
    labelled: torch.Tensor,
    all_labelled: bool,
) -> list[torch.Tensor | None]:
    """Gradients in the shape and dtype of each input (None where none is needed)."""

    def to_positions(rows_grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
        if rows_grad is None:
            return None
        if all_labelled:
            return rows_grad.to(like.dtype)
        full = torch.zeros_like(like)
        return full.index_copy_(0, labelled, rows_grad.to(like.dtype))

    grad_bias = grad_threshold = None
    if grads.class_sum is not None and needs[3]:
        grad_bias = grads.class_sum.to(bias.dtype)
    if grads.class_sum is not None and needs[4]:
        # d = loc_S − C, so ∂L/∂C = −∂L/∂loc_S summed over positions (and over classes for a scalar C).
        negated = -grads.class_sum
        grad_threshold = (negated if threshold.dim() else negated.sum()).to(threshold.dtype)
    return [to_positions(grads.loc, loc_u), to_positions(grads.scale, scale_u), grads.weight, grad_bias,
            grad_threshold]


@dataclass
class _WeightBlock:
    """Rows k0:k1 of W in fp32, their absolute values, and their weight-gradient accumulators."""

    k0: int
    k1: int
    weight: torch.Tensor  # [cols, C] fp32, or W's own half-precision rows for half-precision products
    abs_weight: torch.Tensor  # [cols, C]
    grad_loc: torch.Tensor | None  # Σ ∂L/∂loc_S.T @ loc_U in fp32 (a view of the final gradient when W is fp32)
    grad_scale: torch.Tensor | None  # Σ ∂L/∂scale_S.T @ scale_U'
    copied: bool  # grad_loc is a scratch buffer, copied into the final gradient at the end of the block

    @classmethod
    def prepare(cls, weight: torch.Tensor, k0: int, k1: int, scratch: _Scratch, grads: _Gradients) -> _WeightBlock:
        cols, features = k1 - k0, weight.shape[1]
        block = weight[k0:k1]
        if scratch.weight is not None:
            block = _view(scratch.weight, cols, features).copy_(block)
        abs_block = torch.abs(block, out=_view(scratch.abs_weight, cols, features))
        copied = scratch.weight_grad_loc is not None
        grad_loc = grad_scale = None
        if grads.weight is not None:
            grad_loc = _view(scratch.weight_grad_loc, cols, features) if copied else grads.weight[k0:k1]
            grad_scale = _view(scratch.weight_grad_scale, cols, features)
        return cls(k0, k1, block, abs_block, grad_loc, grad_scale, copied)

    def finish_weight_gradient(self, grads: _Gradients) -> None:
        """∂L/∂W = Σ g_loc.T @ loc_U + sign(W) ⊙ Σ g_scale.T @ scale_U' (sign(0) = 0, as `abs` backward)."""
        if self.grad_loc is None:
            return
        sign = torch.sign(self.weight, out=self.abs_weight)  # |W| of this block is no longer needed
        self.grad_loc.addcmul_(self.grad_scale, sign)
        if self.copied:
            grads.weight[self.k0 : self.k1].copy_(self.grad_loc)


def _half_products(weight: torch.Tensor, loc_rows: torch.Tensor, scale_rows: torch.Tensor) -> bool:
    """Run the products on CUDA tensor cores with fp32 outputs: half-precision inputs on a GPU."""
    half = (torch.bfloat16, torch.float16)
    return weight.is_cuda and weight.dtype in half and loc_rows.dtype == scale_rows.dtype == weight.dtype


def _addmm(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = acc + a @ b in fp32 (acc None: a @ b; acc may be `out` itself); half-precision a, b give fp32 too."""
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out) if acc is None else torch.addmm(acc, a, b, out=out)
    if acc is None:
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.addmm(acc, a, b, out_dtype=torch.float32, out=out)


@dataclass
class _Scratch:
    """Flat buffers reused by every tile, so that a tile allocates nothing large.

    Tile buffers hold `rows × vocab_chunk` elements, weight buffers `vocab_chunk × C`; a smaller last tile
    uses a prefix of each (`_view`).
    """

    shifted: torch.Tensor  # d = loc_S − C, then ∂L/∂scale_S
    scale: torch.Tensor  # scale_S, then ∂L/∂loc_S
    angle: torch.Tensor  # t = atan2(scale_S, |d|), the smaller of π·P and π·(1 − P)
    work: torch.Tensor  # log(1 − P), then 1 / ((s² + d²)·π(1 − P))
    other: torch.Tensor  # log(t/π), then π·(1 − P)
    clamped: torch.Tensor  # bool: scale_S was floored (no gradient flows to it)
    above: torch.Tensor  # bool: d > 0, i.e. P > 1/2
    weight: torch.Tensor | None  # fp32 copy of a block of W when W is not fp32 (and products are fp32)
    abs_weight: torch.Tensor  # |W| of the block, then sign(W); in W's dtype for half-precision products
    weight_grad_loc: torch.Tensor | None  # Σ ∂L/∂loc_S.T @ loc_U for the block, when W is not fp32
    weight_grad_scale: torch.Tensor | None  # Σ ∂L/∂scale_S.T @ scale_U' for the block

    @classmethod
    def allocate(
        cls, rows: int, classes: int, features: int, *, device: torch.device, weight_dtype: torch.dtype,
        half_products: bool, weight_grad: bool
    ) -> _Scratch:
        def buffer(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.empty(numel, dtype=dtype, device=device)

        tile, block = rows * classes, classes * features
        not_fp32 = weight_dtype != torch.float32
        return cls(
            shifted=buffer(tile), scale=buffer(tile), angle=buffer(tile), work=buffer(tile), other=buffer(tile),
            clamped=buffer(tile, torch.bool), above=buffer(tile, torch.bool),
            weight=buffer(block) if not_fp32 and not half_products else None,
            abs_weight=buffer(block, weight_dtype if half_products else torch.float32),
            weight_grad_loc=buffer(block) if weight_grad and not_fp32 else None,
            weight_grad_scale=buffer(block) if weight_grad else None,
        )


def _view(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return flat[: rows * cols].view(rows, cols)


@dataclass
class _Gradients:
    """Gradients of the inputs that need one (None for the others), filled tile by tile."""

    loc: torch.Tensor | None  # [n, C] fp32, rows of the labelled positions
    scale: torch.Tensor | None  # [n, C] fp32
    weight: torch.Tensor | None  # [V, C] in the dtype of W, written block by block
    class_sum: torch.Tensor | None  # [V]: Σ_n ∂L/∂loc_S, which is ∂L/∂b and −∂L/∂C


def _threshold_tensor(threshold: torch.Tensor | float, vocab: int, device: torch.device) -> torch.Tensor:
    if not isinstance(threshold, torch.Tensor):
        return torch.tensor(float(threshold), dtype=torch.float32, device=device)
    if threshold.dim() > 1 or (threshold.dim() == 1 and threshold.shape[0] != vocab):
        raise ValueError(f"threshold must be a scalar or have shape [{vocab}], got {tuple(threshold.shape)}")
    return threshold


def _check_shapes(
    loc_u: torch.Tensor,
    scale_u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
) -> None:
    if scale_u.shape != loc_u.shape:
        raise ValueError(f"scale_u_noisy must have the shape of loc_u {tuple(loc_u.shape)}, got {tuple(scale_u.shape)}")
    if weight.dim() != 2 or weight.shape[1] != loc_u.shape[-1]:
        raise ValueError(f"weight must have shape [V, {loc_u.shape[-1]}], got {tuple(weight.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must have shape [{weight.shape[0]}], got {tuple(bias.shape)}")
    if targets.shape != loc_u.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(loc_u.shape[:-1])}, got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor, got {targets.dtype}")
