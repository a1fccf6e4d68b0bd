"""Starts from data of the heads in `model.action`, fitted before the first optimizer step.

One pass over the data starts two things: the value head, as a least-squares read-out of loc_U, and the `<NUM>`
row of the classification head, as a probe of the same loc_U (below).

With a frozen backbone the regression head is a linear read-out of loc_U, whose few dimensions of huge variance
(|z| above 100 in Qwen2.5) dominate every Adam step: at rates that keep Qwen's logits intact the head needs
hundreds of steps to find the level of the targets (symlog values near 8), and its median misses by ~100% until
then. Least squares finds the read-out at once, so training starts from it (a linear probe, then fine-tuning):

- the rows are the positions whose label is `<NUM>` (exactly where the regression loss reads the head), x = loc_U
  there, y = the true value in the head's space (`value_transform`);
- ridge regression on standardised features, in float64: `w_reg`, `b_reg`; the penalty is chosen among
  `penalties` by the median absolute leave-one-out residual (exact for ridge, from one SVD);
- γ_Y, the value's own noise scale, starts at the median absolute leave-one-out residual: the median |Y − m| of a
  Cauchy(m, γ) is γ, and out-of-sample residuals do not shrink with the number of features as in-sample ones do.

The same pass starts the decision for `<NUM>`. Its classification row is new (docs/design.md §3: the mean of the
digit rows), and a mean of the digits' rows says "a digit may come" where the text asks "a number comes": on the
Qwen2.5-0.5B experiment standard mode's `<NUM>` decisions score num_f1 0 at conversion, 0.79 with the best bias
alone, and 0.94 on the corpus test split once the row itself is fitted (docs/experiments.md). Adam moves each weight
by about the learning rate per step, so training does not get there in a few hundred steps. The start fits the row
and its bias as a linear probe of loc_U for "the next token is `<NUM>`", measured by what standard mode does with
them: `<NUM>` is chosen where its standardised margin (loc_S − C)/scale_S beats every other class's
([`num_decision_start`]).

`CausalQwenTrainer` calls [`fit_value_head`] before its first step; for `Trainer` or a custom loop call it
yourself. The fit is recorded in `config.value_head_fit`, so a saved and reloaded model does not redo it.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

import torch
from transformers.utils import logging

from ..cauchy import linear, transform_values
from ..checks import check_positive_finite
from ..context_values import CausalQwenContextValues, entry_values
from ..labels import IGNORE_INDEX, next_token_targets
from .learning import FOLDS, LearningRows, kinds_of, kinds_score
from .path import ContextRows, fit_context_values, one_thread

__all__ = ["NotEnoughNumbersError", "ValueHeadFit", "ValueStart", "fit_value_head", "known_next_tokens",
           "num_decision_start", "read_value_rows", "refit_value_readout", "ridge_readout", "start_value_side"]

logger = logging.get_logger(__name__)

PENALTIES = (0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0)
"""Ridge penalties tried, on features standardised to unit variance (the penalty is in units of positions)."""

NUM_ROW_PENALTY = 100.0
"""Ridge penalty of the `<NUM>` row's probe (standardised features, units of positions). On Qwen2.5-0.5B, 1, 10 and
100 score alike on held-out texts (num_f1 0.96, 0.96, 0.94), and 100 changes the row least (by 0.6 of its norm)."""


_Fit = TypeVar("_Fit", bound=Callable)


class NotEnoughNumbersError(ValueError):
    """The batches hold fewer `<NUM>` targets than a fit of the value head needs (text-only data holds none)."""


@dataclass
class ValueHeadFit:
    """What [`fit_value_head`] did: the rows it used, the penalty it chose and the residual scale it measured; for
    the `<NUM>` decision (None when off): the labelled positions it read, how far the `<NUM>` row moved
    (‖Δw‖/‖w‖), the bias offset, and standard mode's num_f1 on those positions before and after; and for the
    context-value path (None without it, `path.fit_context_values`): its rows, the held-out value NLL of
    the linear read-out alone and of the path, the step it kept (0: the linear read-out alone, or in a refit the
    path as it was) and the shift of its log-width per choice fitted on the held-out rows, the seed of the
    random start it kept, the map of the query's leading principal coordinates added to its log-width there
    (one weight per coordinate; docs/math.md), and in a refit the held-out value NLL of the path as it was, on the
    same rows (the step 0 candidate, as its widths were calibrated, which `context_nll` of the fit that wrote it
    was measured before), and the candidates it switched off as unused (`path._switch_off_unused`; the
    NLL of the path is the fit's before that, which each switch raised by at most 10⁻³ on the held-out rows), and
    whether the fit it kept had its pointer fitted to the copied numbers first (`path._fit_pointer`; None:
    the path as it was, or none kept), and the held-out value NLL of the path on the rows as read (without the
    scaled copies of `context_nll`), which chose it (the read-out's where none was kept), and the share of the
    held-out rows where the read-out's guard (docs/design.md §1c) hands the value back to the read-out.
    """

    positions: int
    penalty: float
    loo_median_abs_error: float
    regression_noise: float | None
    num_positions: int | None = None
    num_row_change: float | None = None
    num_bias_offset: float | None = None
    num_f1_before: float | None = None
    num_f1_after: float | None = None
    context_rows: int | None = None
    context_nll_linear: float | None = None
    context_nll: float | None = None
    context_step: int | None = None
    context_width_shift: list[float] | None = None
    context_seed: int | None = None
    context_width_map: list[float] | None = None
    context_nll_before: float | None = None
    context_off: list[str] | None = None
    context_pointer: bool | None = None
    context_nll_as_read: float | None = None
    context_guarded: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _StartRows:
    """What one pass over the start batches reads, in float64 on the CPU.

    `x` `[N, C]`, `y` `[N]`: loc_U and the true value (head space) where the next label is `<NUM>`. `u`, `u_scale`
    `[M, C]`: the heads' Cauchy input at labelled positions of the same batches (up to `max_decision_positions`);
    `rival` `[M]`: the largest standardised margin (loc_S − C)/scale_S of any class but `<NUM>` there; `is_num`
    `[M]`: whether the label is `<NUM>`.
    """

    x: torch.Tensor
    y: torch.Tensor
    u: torch.Tensor
    u_scale: torch.Tensor
    rival: torch.Tensor
    is_num: torch.Tensor
    x_scale: torch.Tensor | None = None  # scale_U at the rows of `x`, with the context-value path
    context: ContextRows | None = None  # the path's rows, aligned with `x`


@torch.no_grad()
def _rival_margin(action, loc: torch.Tensor, scale: torch.Tensor, num_id: int, chunk: int = 64) -> torch.Tensor:
    """The largest standardised margin over every class but `<NUM>`, `[M]`, a chunk of positions at a time (the
    `[M, V]` scores are never held whole)."""
    rivals = []
    for lo, sc in zip(loc.split(chunk), scale.split(chunk), strict=True):
        margin = action.margin(*action.classify(lo, sc))
        margin[:, num_id] = -math.inf
        rivals.append(margin.max(-1).values.double().cpu())
    return torch.cat(rivals)


def known_next_tokens(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The next token of every position where it is known, `[B, S]`, `IGNORE_INDEX` elsewhere.

    Where a position has a label, the label; where it has none (a prompt, labels −100) but it and the next position
    are part of the same text (both attended, and the next does not restart `position_ids` at 0), the next input
    id: the decision to write `<NUM>` learns from every token the text shows, not only from the labelled ones. With
    prompt/completion data whose completion is one number, the labels alone hold one `<NUM>` and one end of text
    per example, and the prompt's own next tokens are the negatives that say where a number does *not* come.
    """
    targets, _ = next_token_targets(batch["labels"])
    ids = batch["input_ids"].to(targets.device)
    following = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=IGNORE_INDEX)
    known = torch.ones_like(ids, dtype=torch.bool)
    mask = batch.get("attention_mask")
    if mask is not None:
        mask = mask.to(targets.device).bool()
        known &= mask & torch.nn.functional.pad(mask[:, 1:], (0, 1), value=False)
    positions = batch.get("position_ids")
    if positions is not None:
        known &= torch.nn.functional.pad(positions.to(targets.device)[:, 1:] != 0, (0, 1), value=False)
    known[:, -1] = False
    return torch.where(targets != IGNORE_INDEX, targets, torch.where(known, following, IGNORE_INDEX))


@torch.no_grad()
def _read_rows(model, batches: Iterable[Mapping[str, torch.Tensor]], max_positions: int,
               max_decision_positions: int = 0) -> _StartRows:
    device = next(model.parameters()).device
    xs, ys, us, u_scales, rivals, labels, x_scales, keys = [], [], [], [], [], [], [], []
    count = decided = 0
    context = ContextRows() if getattr(model.abduction, "context_values", None) is not None else None
    features = {}
    # The features the path reads, from the path itself (through PEFT's wrappers, whichever copy the forward calls).
    paths = [m for m in model.modules() if isinstance(m, CausalQwenContextValues)] if context is not None else []
    hooks = [m.register_forward_pre_hook(lambda module, args: features.update(z=args[0])) for m in paths]
    # transformers' progress bar (off with `transformers.utils.logging.disable_progress_bar()`): on a CPU the start's
    # pass over the data through the backbone takes minutes.
    progress = logging.tqdm(desc="value start: reading value rows", unit=" rows", leave=False)
    try:
        for batch in batches:
            seen = sum(len(t) for t in xs)
            if _read_batch(model, batch, device, max_decision_positions - decided, (xs, ys, us, u_scales, rivals,
                           labels, x_scales, keys), context, features):
                count, decided = sum(len(t) for t in xs), sum(len(t) for t in us)
                progress.update(count - seen)
            if count >= max_positions and decided >= max_decision_positions:
                break
    finally:
        progress.close()
        for hook in hooks:
            hook.remove()
    if not xs:
        raise NotEnoughNumbersError("batches hold no position whose label is <NUM>: there is nothing to fit the value "
                                    "head on")
    # The rows in an order of their own content, not of the batches': the fits, their held-out fifth and their sums
    # are then the same whatever order the data came in (docs/design.md §1c).
    order = sorted(range(len(keys)), key=keys.__getitem__)[:max_positions]
    index = torch.tensor(order, dtype=torch.long)
    x, y = torch.cat(xs)[index], torch.cat(ys)[index]
    if context is not None:
        context.reorder(order)
    empty = torch.empty(0, x.shape[1], dtype=torch.float64)
    return _StartRows(x, transform_values(y, model.config.value_transform),
                      torch.cat(us) if us else empty, torch.cat(u_scales) if u_scales else empty,
                      torch.cat(rivals) if rivals else torch.empty(0, dtype=torch.float64),
                      torch.cat(labels) if labels else torch.empty(0, dtype=torch.bool),
                      torch.cat(x_scales)[index], context)


def _row_keys(batch: Mapping[str, torch.Tensor], where: torch.Tensor) -> list[bytes]:
    """A digest of each row's text up to its query (`where` `[B, S]`, row-major as `nonzero` lists them): the ids and
    values of its own text's positions (attended, from its last position id 0), which no batching or padding
    changes."""
    ids = batch["input_ids"].cpu()
    values = batch.get("numeric_values")
    values = torch.zeros(ids.shape, dtype=torch.float64) if values is None else values.cpu().double()
    mask = batch.get("attention_mask")
    attended = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.cpu().bool()
    positions = batch.get("position_ids")
    keys = []
    for b, t in where.nonzero().tolist():
        first = 0
        if positions is not None:
            starts = (positions[b, :t + 1].cpu() == 0).nonzero().flatten()
            first = int(starts[-1]) if len(starts) else 0
        kept = attended[b, first:t + 1]
        digest = hashlib.sha256(ids[b, first:t + 1][kept].numpy().tobytes())
        digest.update(values[b, first:t + 1][kept].numpy().tobytes())
        keys.append(digest.digest())
    return keys


def _read_batch(model, batch, device, decisions_left: int, out: tuple, context: ContextRows | None,
                features: dict) -> bool:
    """Append one batch's rows to the lists of `out`; False when it has no `<NUM>` label."""
    xs, ys, us, u_scales, rivals, labels, x_scales, keys = out
    num_id = model.config.num_token_id
    action = model.action
    values = batch.get("numeric_labels")
    targets, next_values = next_token_targets(batch["labels"],
                                              values if values is not None else batch["numeric_values"])
    where = targets == num_id
    if not bool(where.any()):
        return False
    inputs = {k: batch[k].to(device) for k in ("input_ids", "numeric_values", "attention_mask", "position_ids")
              if batch.get(k) is not None}
    out = model(**inputs, logits_to_keep=0, output_distributions=False)
    keys.extend(_row_keys(batch, where))
    xs.append(out.loc_U[where.to(device)].double().cpu())
    x_scales.append(out.scale_U[where.to(device)].double().cpu())
    ys.append(next_values[where].double().cpu())
    if context is not None:
        numbers = batch.get("numeric_values")
        if numbers is None:
            numbers = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
        context.add(features["z"], batch["input_ids"], numbers, where, num_id, batch.get("position_ids"))
    if decisions_left > 0:
        following = known_next_tokens(batch)
        known = following != IGNORE_INDEX
        loc, scale = action.head_inputs(out.loc_U[known.to(device)], out.scale_U[known.to(device)])
        loc, scale = loc[:decisions_left], scale[:decisions_left]
        us.append(loc.double().cpu())
        u_scales.append(scale.double().cpu())
        rivals.append(_rival_margin(action, loc, scale, num_id))
        labels.append((following[known] == num_id)[:decisions_left].cpu())
    return True


def _read_rows_in_eval(model, batches: Iterable[Mapping[str, torch.Tensor]], max_positions: int,
                       max_decision_positions: int, caller: str) -> _StartRows:
    """`_read_rows` with dropout off, for a CausalQwen with a value head (named by `caller` when it has none)."""
    if not getattr(model.config, "use_numeric", False) or getattr(model, "action", None) is None:
        raise ValueError(f"{caller} needs a CausalQwen model with use_numeric=True (it has a value head)")
    was_training = model.training
    model.eval()
    try:
        return _read_rows(model, batches, max_positions, max_decision_positions)
    finally:
        model.train(was_training)


def _num_f1(chosen: torch.Tensor, truth: torch.Tensor) -> float:
    hits = float((chosen & truth).sum())
    total = float(chosen.sum()) + float(truth.sum())
    return 2.0 * hits / total if total else 0.0


def _probe(x: torch.Tensor, need: torch.Tensor, target: torch.Tensor, penalty: float,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logistic regression P(target) = σ(x·a + c − s·need) with ridge penalty `penalty`·‖a‖²/N (c, s free)."""
    a = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    c = torch.zeros((), dtype=torch.float64, requires_grad=True)
    s = torch.ones((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([a, c, s], lr=1.0, max_iter=500, tolerance_grad=1e-10, tolerance_change=1e-14,
                                  history_size=20, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        logits = x @ a + c - s * need
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target)
        loss = loss + penalty * a.square().sum() / len(target)
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return a.detach(), c.detach(), s.detach()


@one_thread
def num_decision_start(
    u: torch.Tensor,
    u_scale: torch.Tensor,
    row: torch.Tensor,
    bias: float,
    threshold: float,
    rival: torch.Tensor,
    is_num: torch.Tensor,
    *,
    penalty: float = NUM_ROW_PENALTY,
    scale_min: float = 1e-6,
    rounds: int = 5,
) -> tuple[torch.Tensor, float, float, float]:
    """The change (Δw, δ) of the `<NUM>` row and bias under which standard mode picks `<NUM>` where the next token is
    `<NUM>`, at positions `[M]` with every other class held.

    Standard mode picks `<NUM>` where its margin (w·u + b − C)/(|w|·u_scale) exceeds `rival`, the largest margin of
    the other classes. With w = row + Δw that is Δw·u + δ > need, need = C + (|w|·u_scale)·rival − (row·u + bias),
    so (Δw, δ) is a logistic regression of `is_num` on u (standardised, ridge `penalty`) and −need, rescaled so that
    need's coefficient is one. The scale |w|·u_scale moves with w, which moves `need`: the regression is repeated
    with `need` from the new row (at most `rounds` times) while standard mode's num_f1 on the positions, computed
    exactly at the new row, still rises; the best change is kept (none, if none beats the row as it is).

    Args:
        u, u_scale: `[M, C]`, the heads' Cauchy input (loc_U and scale_U + |b_noise|).
        row, bias: the `<NUM>` row `[C]` of the classification head and its bias; threshold: C of `<NUM>`.
        rival: `[M]`; is_num: `[M]` bool.

    Returns:
        `(Δw [C], δ, num_f1 before, num_f1 after)`, float64; no change (zeros) when the data give no decision
        (no `<NUM>` label, or only `<NUM>` labels) or the probe's margin coefficient is not positive.
    """
    if u.dim() != 2 or u.shape != u_scale.shape or row.shape != u.shape[1:]:
        raise ValueError(f"u and u_scale must be [M, C] and row [C], got {tuple(u.shape)}, {tuple(u_scale.shape)} "
                         f"and {tuple(row.shape)}")
    if rival.shape != u.shape[:1] or is_num.shape != u.shape[:1]:
        raise ValueError(f"rival and is_num must be [M] with M = {u.shape[0]}, got {tuple(rival.shape)} and "
                         f"{tuple(is_num.shape)}")
    check_positive_finite("penalty", penalty)
    check_positive_finite("scale_min", scale_min)
    u, u_scale, row, rival, truth = u.double(), u_scale.double(), row.double(), rival.double(), is_num.bool()

    def need(w: torch.Tensor) -> torch.Tensor:
        scale = linear(u, u_scale, w)[1].clamp(min=scale_min)
        return threshold + scale * rival - (u @ row + bias)

    def f1(delta_w: torch.Tensor, delta_b: float) -> float:
        return _num_f1(u @ delta_w + delta_b > need(row + delta_w), truth)

    zero = torch.zeros_like(row)
    before = f1(zero, 0.0)
    if not 0 < int(truth.sum()) < len(truth):
        return zero, 0.0, before, before
    mean, std = u.mean(0), u.std(0).clamp(min=1e-6)
    x, target = (u - mean) / std, truth.double()
    best, delta_w = (before, zero, 0.0), zero
    for _ in range(rounds):
        a, c, s = _probe(x, need(row + delta_w), target, penalty)
        if s <= 0:
            break
        delta_w = a / std / s
        delta_b = float(c / s - (delta_w * mean).sum())
        score = f1(delta_w, delta_b)
        if score <= best[0]:
            break
        best = (score, delta_w, delta_b)
    return best[1], best[2], before, best[0]


def ridge_readout(
    x: torch.Tensor, y: torch.Tensor, penalties: Sequence[float] = PENALTIES
) -> tuple[torch.Tensor, float, float, float]:
    """Ridge regression of `y` `[N]` on `x` `[N, C]` with the penalty of least leave-one-out miss: the mean over kinds
    of rows (clusters of `x`, `learning.kinds_of`) of each kind's median |leave-one-out residual|, the median over all
    rows where the rows are of one kind. On data of several tasks the pooled median let the penalty favour the tasks
    read closely and fail one read loosely (docs/experiments.md, "Numbers that learn").

    Features are centred and scaled to unit variance (the penalty then weighs every dimension alike, whatever its
    raw scale); the intercept is not penalised. Leave-one-out residuals (refitting without row i, features
    standardised once with every row) are exact in closed form for ridge: e_i / (1 − h_ii) with h the hat matrix,
    here from one SVD of the standardised features.

    Returns:
        `(weight [C], bias, penalty, median |LOO residual| over all rows)`, in float64.
    """
    return _ridge(x, y, penalties)[:4]


def _ridge(x: torch.Tensor, y: torch.Tensor, penalties: Sequence[float],
           ) -> tuple[torch.Tensor, float, float, float, torch.Tensor]:
    """[`ridge_readout`], and its leave-one-out residuals `[N]` at the chosen penalty (y_i less the prediction of the
    read-out fitted without row i)."""
    if x.dim() != 2 or y.dim() != 1 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x must be [N, C] and y [N], got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape[0] < 3:
        raise NotEnoughNumbersError(f"the value head needs at least 3 <NUM> positions to fit, got {x.shape[0]}")
    if not penalties:
        raise ValueError("penalties must be a non-empty sequence of positive finite numbers")
    for i, penalty in enumerate(penalties):
        check_positive_finite(f"penalties[{i}]", penalty)
    x, y = x.double(), y.double()
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
    a = (x - mean) / std
    centred = y - y.mean()
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    uty = u.T @ centred
    n = x.shape[0]
    kinds = kinds_of(x)
    best = None
    for penalty in penalties:
        shrink = s.square() / (s.square() + penalty)
        fitted = u @ (shrink * uty)
        # The intercept is a free parameter too: its leverage is 1/n.
        leverage = (u.square() * shrink).sum(1) + 1.0 / n
        loo = (centred - fitted) / (1.0 - leverage).clamp(min=1e-12)
        score = kinds_score(loo.abs(), kinds)
        if best is None or score < best[1]:
            best = (penalty, score, shrink, loo)
    penalty, _, shrink, loo = best
    error = loo.abs().quantile(0.5).item()
    coef = vh.T @ (shrink / s.clamp(min=1e-12) * uty)
    weight = coef / std
    bias = (y.mean() - (weight * mean).sum()).item()
    return weight, bias, float(penalty), float(error), loo


def _check_readout_fits(weight: torch.Tensor, bias: float, y: torch.Tensor, dtype: torch.dtype,
                        value_transform: str) -> None:
    """Refuse a float64 read-out that the head's parameters cannot hold, before any of them is written.

    The head predicts in its own dtype: with `value_transform="identity"` targets beyond its range (3.4e38 for
    float32) cannot be predicted at all, and a read-out of large targets may need weights beyond it.
    """
    limit = torch.finfo(dtype).max
    target = float(y.abs().max())
    largest = max(float(weight.abs().max()), abs(bias))
    if math.isfinite(largest) and largest <= limit and target <= limit:
        return
    hint = " (value_transform='symlog' models such values as their logarithm)" if value_transform == "identity" else ""
    raise ValueError(
        f"the value head cannot start from these targets: they reach {target:.4g} in the head's space "
        f"(value_transform={value_transform!r}) and the least-squares read-out has weights up to {largest:.4g}, "
        f"while the head's {dtype} parameters and predictions hold at most ±{limit:.4g}{hint}"
    )


@one_thread
def _write_readout(model, x: torch.Tensor, y: torch.Tensor, penalties: Sequence[float],
                   ) -> tuple[float, float, float | None, torch.Tensor]:
    """Write the ridge read-out of `y` on `x` into `w_reg`, `b_reg` and γ_Y; `(penalty, LOO error, γ_Y or None, LOO
    residuals [N])`."""
    action = model.action
    weight, bias, penalty, error, loo = _ridge(x, y, penalties)
    _check_readout_fits(weight, bias, y, action.reg_head.weight.dtype, model.config.value_transform)
    action.reg_head.weight.copy_(weight.to(action.reg_head.weight)[None])
    action.reg_head.bias.fill_(bias)
    noise = None
    if action.reg_log_noise is not None:
        noise = max(error, model.config.scale_min)
        action.reg_log_noise.fill_(math.log(noise))
    return penalty, error, noise, loo


def _leaves_random_state(fit: _Fit) -> _Fit:
    """Run `fit` with torch's global random state restored afterwards (CPU and accelerators alike): a seeded run
    draws the same numbers whether or not, and whenever, a start ran."""

    @functools.wraps(fit)
    def forked(*args, **kwargs):
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices):
            return fit(*args, **kwargs)

    return forked


@_leaves_random_state
@torch.no_grad()
def refit_value_readout(
    model,
    batches: Iterable[Mapping[str, torch.Tensor]],
    *,
    penalties: Sequence[float] = PENALTIES,
    max_positions: int = 4096,
) -> ValueHeadFit:
    """Fit `w_reg`, `b_reg` and γ_Y again, as [`fit_value_head`] does, to loc_U as the model computes it now.

    Training moves loc_U (the numeric embedding, the abduction network), and a least-squares read-out with small,
    precise coefficients does not follow it under Adam: on Qwen2.5-0.5B 10 steps moved `w_reg` by 2.7 times its own
    norm and left the held-out value error at 0.41 where the read-out fitted again to the trained loc_U gives 0.06
    (docs/experiments.md). `CausalQwenTrainer` therefore holds the read-out out of the optimizer and calls this before
    every evaluation and checkpoint and at the end of training ([`ValueHeadStartCallback`]). The `<NUM>` decision
    and `config.value_head_fit` (the record of the start) are left as they are.

    With the context-value path (docs/design.md §1b), the path is fitted again after the read-out, as at the start
    (`path.fit_context_values`): like the read-out, its small, precise weights on the backbone's features
    do not survive Adam's per-coordinate steps, so training holds it out of the optimizer with the read-out. Fitting
    the read-out on every row, as the start does, rather than only where the path weighs it most, kept more of the
    start on Qwen2.5-0.5B after 12 steps (docs/experiments.md).
    """
    rows = _read_rows_in_eval(model, batches, max_positions, 0, "refit_value_readout")
    started = (model.config.value_head_fit or {}).get("context_seed")
    return ValueHeadFit(**_fit_value_side(model, rows, penalties, None if started is None else 1, started or 0,
                                          refit=True))


def _fit_value_side(model, rows: _StartRows, penalties: Sequence[float], context_starts: int | None = None,
                    context_seed: int = 0, refit: bool = False) -> dict:
    """The ridge read-out, then the context-value path after it (from `context_starts` random starts from seed
    `context_seed`, the library's number by default): the start's value side, which every refit repeats. Returns the
    [`ValueHeadFit`] fields of both.

    A refit fits the path from the one random start the start kept (`config.value_head_fit["context_seed"]`) and,
    beside it, keeps the path as it is or continues its fit from there where that scores better on the held-out rows.
    The fit is chaotic (on a tiny model a start's held-out NLL moved from 0.67 to 0.81 with the number of threads):
    refits from random starts alone landed in other minima than the start's, and the end-of-training check of trained
    features restored features that had not moved."""
    penalty, error, noise, loo = _write_readout(model, rows.x, rows.y, penalties)
    fields = {"positions": int(rows.x.shape[0]), "penalty": penalty, "loo_median_abs_error": error,
              "regression_noise": noise}
    if rows.context is not None:
        fields.update(fit_context_values(model, rows.context, rows.x, rows.x_scale, rows.y, seed=context_seed,
                                         starts=context_starts, from_current=refit, loo_residuals=loo))
    return fields


@torch.no_grad()
def _path_read(model, rows: _StartRows, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The context-value path's (π_0, m, ρ) `[N]` at each row, as the model reads them (the latest `MAX_CONTEXT`
    earlier numbers of each); (1, 0, 1) without the path."""
    n = rows.x.shape[0]
    path = getattr(model.abduction, "context_values", None)
    if path is None or rows.context is None:
        ones = torch.ones(n, dtype=torch.float64)
        return ones, torch.zeros(n, dtype=torch.float64), ones.clone()
    param = next(path.parameters())
    parts = []
    for lo in range(0, n, chunk):
        queries, keys, values, present = (t[lo:lo + chunk] for t in rows.context.stacked(n))
        own, before = (k.to(param) for k in keys.chunk(2, dim=-1))
        entries = entry_values(present, values, model.config.value_transform).to(param.device)
        read = path.read(queries.to(param)[:, None], path.keys(own, before), entries, present.to(param.device)[:, None],
                         model.config.value_transform, graph=False)
        parts.append(torch.stack((read.linear_weight[:, 0], read.offset[:, 0], read.width[:, 0])).double().cpu())
    linear, offset, width = torch.cat(parts, -1)
    return linear, offset, width


def _learning_rows(model, rows: _StartRows) -> LearningRows:
    """The rows the read-out trains on (`learning.LearningRows`): the start's rows, in folds of every `FOLDS`-th row
    in the rows' content order (fold 0 the path's held-out fifth)."""
    linear, offset, width = _path_read(model, rows)
    noisy = rows.x_scale + model.action.b_noise.detach().double().cpu().abs()
    return LearningRows(rows.x, noisy, linear, offset, width, rows.y, torch.arange(rows.x.shape[0]) % FOLDS)


@dataclass
class ValueStart:
    """What [`start_value_side`] returns: the record of the fit, the rows the read-out trains on after it, and
    whether the model's value side was fitted on those rows (False: a checkpoint's, kept as it was)."""

    fit: ValueHeadFit
    rows: LearningRows
    fitted_on_rows: bool = True


def read_value_rows(model, batches: Iterable[Mapping[str, torch.Tensor]], *, max_positions: int = 4096,
                    penalties: Sequence[float] = PENALTIES) -> ValueStart:
    """The rows the read-out trains on, read from `batches` for a model whose value side is fitted already (a
    checkpoint fine-tuned on new data, a resumed run): nothing is written; the "start" is the model as it is."""
    rows = _read_rows_in_eval(model, batches, max_positions, 0, "read_value_rows")
    penalty = (model.config.value_head_fit or {}).get("penalty", penalties[len(penalties) // 2])
    fit = ValueHeadFit(positions=int(rows.x.shape[0]), penalty=float(penalty), loo_median_abs_error=math.nan,
                       regression_noise=None)
    return ValueStart(fit, _learning_rows(model, rows), fitted_on_rows=False)


def _value_start(model, fit: ValueHeadFit, rows: _StartRows) -> ValueStart:
    return ValueStart(fit, _learning_rows(model, rows))


def fit_value_head(
    model,
    batches: Iterable[Mapping[str, torch.Tensor]],
    *,
    penalties: Sequence[float] = PENALTIES,
    max_positions: int = 4096,
    num_row: bool = True,
    max_decision_positions: int = 8192,
    num_row_penalty: float = NUM_ROW_PENALTY,
    context_starts: int | None = None,
) -> ValueHeadFit:
    """Set `w_reg`, `b_reg` (and γ_Y when the model has one) from a ridge read-out of loc_U on `batches`, and start
    the `<NUM>` row and bias of the classification head from the same batches ([`num_decision_start`]).

    Args:
        model: a [`CausalQwenForCausalLM`] with `use_numeric=True`.
        batches: batches as the collator gives them, with `labels` (the rows are the positions whose next label is
            `<NUM>`, so prompt positions labelled −100 are left out) and the numbers in `numeric_labels` or
            `numeric_values`. The training batches, before the first step, are the intended input; reading stops
            at `max_positions` rows, so batches of data sorted by source should come in a random order
            (`CausalQwenTrainer` reads its training set so).
        penalties: ridge penalties to choose from (on standardised features).
        max_positions: read batches until this many rows are in.
        num_row: also start the `<NUM>` row and bias from the data (False leaves the classification head alone).
        max_decision_positions: labelled positions the `<NUM>` decision is fitted on (each costs a pass of the
            `[V, C]` head).
        num_row_penalty: the ridge penalty of the `<NUM>` row's probe (see [`num_decision_start`]).
        context_starts: random starts of the context-value path's fit (`path.fit_context_values`), which
            keeps the one of least held-out NLL on the rows as read; None: three.

    Returns:
        A [`ValueHeadFit`], also stored as a dict in `model.config.value_head_fit` (saved with the config).

        >>> fit = fit_value_head(model, trainer.get_eval_dataloader(train_dataset))   # plain Trainer
    """
    return start_value_side(model, batches, penalties=penalties, max_positions=max_positions, num_row=num_row,
                            max_decision_positions=max_decision_positions, num_row_penalty=num_row_penalty,
                            context_starts=context_starts).fit


@_leaves_random_state
@torch.no_grad()
def start_value_side(
    model,
    batches: Iterable[Mapping[str, torch.Tensor]],
    *,
    penalties: Sequence[float] = PENALTIES,
    max_positions: int = 4096,
    num_row: bool = True,
    max_decision_positions: int = 8192,
    num_row_penalty: float = NUM_ROW_PENALTY,
    context_starts: int | None = None,
) -> ValueStart:
    """[`fit_value_head`], which it is, keeping the rows it read for the read-out's training from its start
    (`value_learning.ValueLearner`): a [`ValueStart`]."""
    if not isinstance(num_row, bool):
        raise TypeError(f"num_row must be a bool, got {type(num_row).__name__}")
    if not isinstance(max_decision_positions, int) or isinstance(max_decision_positions, bool) \
            or max_decision_positions < 1:
        raise ValueError(f"max_decision_positions must be a positive int, got {max_decision_positions!r}")
    rows = _read_rows_in_eval(model, batches, max_positions, max_decision_positions if num_row else 0,
                              "fit_value_head")
    action = model.action
    value_side, decision = _fit_value_side(model, rows, penalties, context_starts), {}
    if num_row:
        num_id = model.config.num_token_id
        row = action.cls_head.weight[num_id]
        row64 = row.double().cpu()
        delta_w, delta_b, f1_before, f1_after = num_decision_start(
            rows.u, rows.u_scale, row64, float(action.cls_head.bias[num_id]), float(action.threshold[num_id]),
            rows.rival, rows.is_num, penalty=num_row_penalty, scale_min=action.scale_min)
        decision = {"num_positions": int(rows.u.shape[0]),
                    "num_row_change": float(delta_w.norm() / row64.norm().clamp(min=1e-30)),
                    "num_bias_offset": delta_b, "num_f1_before": f1_before, "num_f1_after": f1_after}
        row += delta_w.to(row)
        action.cls_head.bias[num_id] += delta_b
    fit = ValueHeadFit(**value_side, **decision)
    model.config.value_head_fit = fit.to_dict()
    return _value_start(model, fit, rows)
