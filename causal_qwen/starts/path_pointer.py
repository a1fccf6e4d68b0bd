"""Which earlier numbers hold a row's target (`_copied_slots`), and the context-value path's pointer fitted to them
before its locations are (`_fit_pointer`)."""

from __future__ import annotations

import math

import torch

from ..cauchy import untransform_values
from .path_rows import _Rows, _state

# An earlier number within this relative distance of a nonzero target holds it: its rows are fitted again at other
# scales (`path._with_scaled_copies`), and where another number is in view they teach the pointer.
_COPY_TOLERANCE = 0.02
# The pointer is fitted to the copied numbers first (`_fit_pointer`) where at least this many fitted rows repeat one
# of several numbers.
_MIN_POINTER_ROWS = 10
_POINTER_DIMS = (4, 8, 16, 32, 64)
_POINTER_STEPS = 200  # L-BFGS iterations of each form
_POINTER_TOLERANCE = 1e-3  # held-out cross-entropy (nats per row) within which the simpler form is kept


def _copied_slots(rows: _Rows, transform: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Which earlier numbers hold the target `[N, J]` (within `_COPY_TOLERANCE` of it, a nonzero target: the copies
    that `_with_scaled_copies` rescales), and which rows tell them apart from another number in view `[N]`."""
    values = rows.entries[..., 1]
    target = untransform_values(rows.target, transform)
    near = (values - target[:, None]).abs() <= _COPY_TOLERANCE * target.abs()[:, None]
    near = near & rows.present & (target != 0)[:, None]
    return near, near.any(-1) & (rows.present & ~near).any(-1)


def _copy_scores(small, rows: _Rows) -> torch.Tensor:
    """The copies' scores `[N, J]` of `small` on `rows` (−inf at the slots not in view), as `read` scores them."""
    r = small.rank
    own, before = rows.keys.chunk(2, dim=-1)
    query = small.query(rows.queries)[:, None, :r]
    key = small.keys(own, before)[..., :r]
    return ((query * key).sum(-1) * r ** -0.5).masked_fill(~rows.present, float("-inf"))


def _copies_told(split: dict, transform: str) -> bool:
    """Whether at least `_MIN_POINTER_ROWS` fitted rows, and one held out, repeat one of several numbers."""
    told = {part: _copied_slots(rows, transform)[1] for part, rows in split.items()}
    return int(told[False].sum()) >= _MIN_POINTER_ROWS and bool(told[True].any())


def _fit_pointer(small, split: dict, transform: str) -> bool:
    """Fit the copies' scores by the cross-entropy of the pointer to the numbers that hold the target, at the rows
    whose target repeats one of several numbers (`_copied_slots`); returns whether it did (not with fewer than
    `_MIN_POINTER_ROWS` such rows fitted, or none held out).

    Fitted by the value's error with the rest of the path, the pointer stayed split between numbers of similar size in
    symlog space: on Seattle highs asked for again, 4% of the test rows put 0.15-0.79 of the weight on the year, the
    low or the precipitation, which the width at its floor did not cover (docs/experiments.md, "A pointer fitted to
    the copied number"). Which number a copy takes is known wherever the target repeats one, and the cross-entropy to
    it is convex in the query, as a ratio's pair of roles is (`experiments/combination_roles.py`). The locations' fit
    starts from the pointer this leaves, and saturates it where the value's error asks: held there, the read-out's
    share fell too slowly to reach float precision (a median relative error of 7·10⁻⁴ on those highs).

    Several forms are fitted, each by L-BFGS, and the held-out cross-entropy chooses: keys of the role alone, the
    words before each number (K'·z_{j−1}, the copies' rows of K at 0), or of the number's own features too; in the
    leading 4 to 64 coordinates (`_POINTER_DIMS`). Of those within `_POINTER_TOLERANCE` of the best, the first of
    that order: a number's own features carry its size, which the held-out rows share with the fitted ones (their
    scaled copies have the same features) but new text need not, and on the Seattle rows fitted by Adam the pointer
    with all 64 coordinates of them put 0.99 on the precipitation at the two coldest test days. A row whose number is
    known by its own features alone (the first one of a text, say) is the reason for the second form."""
    if not _copies_told(split, transform):
        return False
    told = {part: _copied_slots(rows, transform) for part, rows in split.items()}
    rows = {part: _Rows(*(t[told[part][1]] for t in split[part])) for part in split}
    near = {part: told[part][0][told[part][1]] for part in split}

    def cross_entropy(held_out: bool) -> torch.Tensor:
        log_p = _copy_scores(small, rows[held_out]).log_softmax(-1)
        return -log_p.masked_fill(~near[held_out], float("-inf")).logsumexp(-1).mean()

    r, dims = small.rank, small.query.in_features
    original = _state(small)
    fits = []
    for own in (False, True):
        params = [small.query.weight, small.query.bias, small.key.bias, small.key_before.weight]
        params += [small.key.weight] if own else []
        for used in sorted({min(d, dims) for d in _POINTER_DIMS}):
            small.load_state_dict(original)
            with torch.no_grad():
                for weight in (p for p in params if p.dim() == 2):
                    weight[:r, used:] = 0.0
                if not own:
                    small.key.weight[:r] = 0.0
            mask = (torch.arange(dims) < used).double()
            hooks = [p.register_hook(lambda grad, mask=mask: torch.cat((
                grad[:r] * (mask if grad.dim() == 2 else 1.0), torch.zeros_like(grad[r:])))) for p in params]
            optimizer = torch.optim.LBFGS(params, max_iter=_POINTER_STEPS, line_search_fn="strong_wolfe")

            def closure(optimizer=optimizer):
                optimizer.zero_grad()
                loss = cross_entropy(False)
                loss.backward()
                return loss

            try:
                with torch.enable_grad():  # the value head's start runs under no_grad
                    optimizer.step(closure)
            finally:
                for hook in hooks:
                    hook.remove()
            with torch.no_grad():
                held_out = float(cross_entropy(True))
            if math.isfinite(held_out):
                fits.append((held_out, _state(small)))
    if not fits:
        small.load_state_dict(original)
        return False
    best = min(held_out for held_out, _ in fits)
    small.load_state_dict(next(state for held_out, state in fits if held_out <= best + _POINTER_TOLERANCE))
    return True
