"""The context-value path's read-out guard of docs/design.md §1c (`_fit_guard`): where the path misses by more than
the read-out, the read-out takes the value whole."""

from __future__ import annotations

import torch

from .path_rows import _Rows, _value

# The read-out's guard (`_fit_guard`, docs/design.md §1c): a logistic regression of "the path misses by more than the
# read-out" on the query's leading principal coordinates (at most this many, one per `_ROWS_PER_GUARD_DIM` held-out
# rows), each row weighed by the difference of the two misses (capped, so that one wild row does not decide alone);
# its logit times `_GUARD_SHARPNESS` is the guard, checked by `_GUARD_FOLDS`-fold cross-validation on the held-out rows.
_GUARD_DIMS = 8
_ROWS_PER_GUARD_DIM = 8
_GUARD_STAKES = 1.0
_GUARD_SHARPNESS = 100.0
_GUARD_RIDGE = 1e-3
_GUARD_FOLDS = 5


def _location_misses(small, rows: _Rows, transform: str, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
    """|loc_Y − y| `[N]` in the head's space through the path `small`, and through the read-out alone (its
    locations as `rows` hold them: at held-out rows, leave-one-out)."""
    loc, _ = _value(small, transform, rows, noise)
    return (loc - rows.target).abs(), (rows.loc_linear - rows.target).abs()


def _guard_features(rows: _Rows, dims: int) -> torch.Tensor:
    return rows.queries[:, :dims]


def _logistic_guard(features: torch.Tensor, worse: torch.Tensor, stakes: torch.Tensor) -> torch.Tensor:
    """Weights `[d + 1]` (the last the bias) of a ridge logistic regression of `worse` on `features`, each row
    weighed by its `stakes` (how much the choice costs there); float64, by L-BFGS from 0 (convex: one minimum)."""
    x = torch.cat((features, torch.ones(len(features), 1, dtype=torch.float64)), -1)
    weights = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    total = stakes.sum().clamp(min=1e-12)
    ridge = torch.ones(x.shape[1], dtype=torch.float64)
    ridge[-1] = 0.0  # the bias is not penalised

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        logits = x @ weights
        loss = (stakes * torch.nn.functional.binary_cross_entropy_with_logits(
            logits, worse, reduction="none")).sum() / total + _GUARD_RIDGE * (ridge * weights.square()).sum()
        loss.backward()
        return loss

    optimizer = torch.optim.LBFGS([weights], max_iter=200, line_search_fn="strong_wolfe", tolerance_grad=1e-10)
    with torch.enable_grad():
        optimizer.step(closure)
    return weights.detach()


@torch.no_grad()
def _fit_guard(small, held_out: _Rows, transform: str, noise: float) -> float:
    """Fit the read-out's guard of `small` (docs/design.md §1c) on rows the locations were not fitted on, and return
    the share of them where it hands the value back to the read-out.

    The choice among the candidates was fitted on all kinds of rows at once, so a path that copies exactly on one
    kind may be chosen on another where a stated number only has the right size (a price read as a stated depth %).
    The error the evaluation punishes decides instead: on each held-out row, is the path's location further from the
    target than the read-out's (leave-one-out) location? A ridge logistic regression of that on the query's leading
    principal coordinates, each row weighed by how much the choice costs there, says where (which kind of query) the
    read-out is the better; the guard is its logit times `_GUARD_SHARPNESS`, so that wherever the logit is above
    1/`_GUARD_SHARPNESS` (a probability just above ½) the read-out's score is up by 10⁴ and it takes the value whole. (A
    softer guard, up by 40 at a probability of 0.88, left a Texas city's median price copied from the stated year on
    new rows of the task whose held-out rows it handed to the read-out.) It is kept only where, fitted on 4 of 5 folds
    of these rows, it lowers the mean error on the fifth, summed over the folds; otherwise the guard stays 0."""
    small.guard.weight.zero_()  # 0 wherever no guard is kept: the choice as fitted
    small.guard.bias.zero_()
    n = len(held_out.target)
    dims = min(_GUARD_DIMS, held_out.queries.shape[1], n // _ROWS_PER_GUARD_DIM)
    if dims < 1:
        return 0.0
    path_miss, readout_miss = _location_misses(small, held_out, transform, noise)
    worse = (path_miss > readout_miss).double()
    if not bool(worse.any()):
        return 0.0
    stakes = (path_miss - readout_miss).abs().clamp(max=_GUARD_STAKES)
    features = _guard_features(held_out, dims)

    def misses(weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # Where the logit is positive the read-out holds the value (the guard saturates just above 0).
        return torch.where(features[rows] @ weights[:-1] + weights[-1] > 0, readout_miss[rows], path_miss[rows])

    folds = torch.arange(n) % _GUARD_FOLDS
    guarded = unguarded = 0.0
    for fold in range(_GUARD_FOLDS):
        test, train = folds == fold, folds != fold
        if not bool(test.any()) or not bool(worse[train].any()):
            guarded += float(path_miss[test].sum())
            unguarded += float(path_miss[test].sum())
            continue
        weights = _logistic_guard(features[train], worse[train], stakes[train])
        guarded += float(misses(weights, test).sum())
        unguarded += float(path_miss[test].sum())
    if guarded >= unguarded:
        return 0.0
    weights = _logistic_guard(features, worse, stakes)
    small.guard.weight[0, :dims] = weights[:-1] * _GUARD_SHARPNESS
    small.guard.bias.fill_(float(weights[-1]) * _GUARD_SHARPNESS)
    return float((misses(weights, torch.arange(n)) == readout_miss).double().mean())
