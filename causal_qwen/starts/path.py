"""Start the context-value path (docs/design.md §1b) from data, with the value head.

The path's scores are rank-r maps of the backbone's features z (896 dimensions in Qwen2.5-0.5B), and a few
thousand rows cannot fit them directly. The start works in the leading principal components of z on the rows:
it fits a path of the same form on those coordinates, with the read-out `w_reg`, `b_reg` and γ_Y as the ridge start
left them: the locations by the mean absolute error of the value (Adam, keeping the step of least error on held-out
rows), then the widths by the value's Cauchy NLL (the regression loss of docs/design.md §4) with the locations fixed.
It writes the result back into the model's path as maps of z (a map of the coordinates is a map of z). Where the path
does not beat the linear read-out alone on the held-out NLL, it starts as the linear read-out (the copies and
combinations at weight ≈ 0, ρ = 1), and the record says so. Between the locations and the widths, the choice alone is
fitted again by the likelihood of a mixture of the candidates (`_fit_choice`). The kept fit's widths are then fitted
again with the read-out's locations as it predicts rows it has not seen (`_refit_widths`), and calibrated on the
held-out rows (`_calibrate_width`). The rows whose target is a copy of an earlier number are fitted (and held out)
again at other scales (`_with_scaled_copies`), so that the choice of a copy does not lean on the read-out.

The rows are the positions whose next label is `<NUM>` (the value head's rows), each with the features and the
values of the `<NUM>` tokens of its text up to it (the latest `max_context`), and the features of the position
before each of those (which the keys read too; 0 at a text's start, as in the model).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import torch

from ..cauchy import nll, transform_values, untransform_values
from ..context_values import CANDIDATES, LINEAR_ONLY_SCORE, MAX_LOG_WIDTH, CausalQwenContextValues, entry_values

__all__ = ["ContextRows", "fit_context_values", "held_out_rows", "one_thread"]

MAX_CONTEXT = 16
"""Earlier numbers each row keeps (the latest ones) for the start; the model itself reads all of them."""

_DIMS = 64
_STEPS = 3000
_PATIENCE = 200  # steps without a better held-out value before the fit stops
_LEARNING_RATE = 1e-2
# The locations' loss is the mean of √(r² + δ²) − δ over the residuals r in the head's space (0: |r|, the median's
# own loss). |r|'s gradient is the sign of each residual, so a rounding flipped steps of the descent and which fit the
# start kept turned on it; smooth within about 1% of a value, over eleven orders of Qwen2.5-0.5B's corpus rows the kept
# fits missed a template's or table's training median 8 times on the profile's test splits against 15, and 1 time
# against 2 on draws five times larger (docs/experiments.md, "A smooth loss for the locations").
_LOCATION_SMOOTHING = 1e-2
_STARTS = 3  # random starts of the fit; the best on the held-out rows is kept
_HELD_OUT_EVERY = 5  # every fifth row is held out to choose the step and to calibrate the width
_MIN_CALIBRATION_ROWS = 20  # fewer held-out rows leave the widths as fitted
# The calibration reads the read-out's locations as it predicts rows unseen (leave-one-out, `loo_residuals`); the
# rest of the fit reads them as fitted unless these say otherwise. Every NLL on the leave-one-out ones calibrated a
# Texas city's median sale price among four public tasks (50% intervals holding 0.53-0.70 of its targets over four
# orders of the rows, 0.20-0.62 as fitted) but kept another fit of real tables as prompt/completion, which missed
# Seattle's highs by 0.42 for 0.32 (docs/experiments.md, "The widths fitted to the read-out's misses"): not kept.
_NLL_READS_UNSEEN = False
_LOCATIONS_READ_UNSEEN = False
# The kept fit's widths are fitted again on the leave-one-out locations (`_refit_widths`), its choice and locations as
# kept, before the calibration: the Texas prices' 50% intervals held 0.53-0.68 of their targets over four orders of
# the rows, 0.25-0.50 without, every error the same, and a tiny model's copies of a noisy reading 0.552 of new
# readings against 0.540 without (docs/experiments.md, "The kept fit's widths on the read-out's misses").
_WIDTHS_READ_UNSEEN = True
# The mean of the earlier values is the target where it is within this distance of it in the head's space (about 2%
# of a value in symlog space), and its score is fitted to say so (`_fit_choice`), kept where the held-out error of the
# other rows rises by at most `_CHOICE_SLACK` of itself.
_CHOICE_TOLERANCE = 0.02
_CHOICE_SLACK = 0.02
# The rows whose target is a copy of an earlier number (within this relative distance) are fitted again with every
# value times each of these scales (`_with_scaled_copies`).
_COPY_TOLERANCE = 0.02
_SCALES = (0.01, 100.0)
# The widths' calibration reads the leading principal coordinates of the query, as many as this and at most one per
# `_ROWS_PER_WIDTH_DIM` held-out rows (`_calibrate_width`).
_CALIBRATION_DIMS = 4
_ROWS_PER_WIDTH_DIM = 25
# A ridge on the calibration's shifts and map, so that one the held-out rows cannot tell stays near 0 (per row's
# NLL; a Cauchy NLL's curvature in a log width is 1/2 per row).
_CALIBRATION_RIDGE = 1e-2
# A combination or the mean whose removal raises the held-out NLL by at most this is switched off: its score is this
# constant, whose weight in the float64 softmax is exactly 0 at every position.
_UNUSED_TOLERANCE = 1e-3
_OFF_SCORE = -1e4
# The pointer is fitted to the copied numbers first (`_fit_pointer`) where at least this many fitted rows repeat one
# of several numbers.
_MIN_POINTER_ROWS = 10
_POINTER_DIMS = (4, 8, 16, 32, 64)
_POINTER_STEPS = 200  # L-BFGS iterations of each form
_POINTER_TOLERANCE = 1e-3  # held-out cross-entropy (nats per row) within which the simpler form is kept
# A fit with its pointer fitted first is preferred where its held-out NLL on the rows that repeat no number is within
# this of the other fits' (nats per row; `_keep`).
_POINTER_ELSEWHERE = 1e-2


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


def held_out_rows(rows: int) -> int:
    """How many of `rows` rows the fit holds out to choose its step and calibrate the widths (every fifth)."""
    return -(-rows // _HELD_OUT_EVERY)


@dataclass
class ContextRows:
    """Per value-head row: the query's features `[N, H]`, the earlier numbers' features and those of the position
    before each `[N, J, 2H]`, their values `[N, J]` (float64) and which are present `[N, J]`. Gathered batch by
    batch by [`ContextRows.add`]."""

    queries: list = field(default_factory=list)
    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    present: list = field(default_factory=list)

    @torch.no_grad()
    def add(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, numeric_values: torch.Tensor,
            where: torch.Tensor, num_token_id: int, position_ids: torch.Tensor | None = None,
            max_context: int = MAX_CONTEXT) -> None:
        """The rows of one batch: `where` `[B, S]` marks the positions whose next label is `<NUM>`; a position whose
        `position_ids` is 0 starts a text, and nothing before it is read (as the model reads them)."""
        hidden = hidden_states.float().cpu()
        # The features of the position before each one: 0 before the first, and at a text's start.
        before = torch.nn.functional.pad(hidden[:, :-1], (0, 0, 1, 0))
        if position_ids is not None:
            before = before * (position_ids.cpu() != 0).expand(hidden.shape[:2])[..., None]
        is_num = (input_ids == num_token_id).cpu()
        values = numeric_values.double().cpu()
        for b, t in where.nonzero().tolist():
            earlier = is_num[b, :t + 1].nonzero().flatten()[-max_context:]
            keys = torch.zeros(max_context, 2 * hidden.shape[-1])
            vals = torch.zeros(max_context, dtype=torch.float64)
            present = torch.zeros(max_context, dtype=torch.bool)
            keys[:len(earlier)] = torch.cat((hidden[b, earlier], before[b, earlier]), -1)
            vals[:len(earlier)] = values[b, earlier]
            present[:len(earlier)] = True
            self.queries.append(hidden[b, t])
            self.keys.append(keys)
            self.values.append(vals)
            self.present.append(present)

    def reorder(self, order: Sequence[int]) -> None:
        """Keep the rows `order` lists, in that order."""
        for part in (self.queries, self.keys, self.values, self.present):
            part[:] = [part[i] for i in order]

    def stacked(self, rows: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.stack(part[:rows]) for part in (self.queries, self.keys, self.values, self.present))


def _coordinates(queries: torch.Tensor, keys: torch.Tensor, present: torch.Tensor, dims: int):
    """Standardised principal coordinates of z: `(mean [H], map [H, d])` with c = (z − mean) @ map."""
    points = torch.cat((queries, keys[present])).double()
    mean = points.mean(0)
    _, s, vh = torch.linalg.svd(points - mean, full_matrices=False)
    # Directions of almost no variance on the rows would get huge weights in z, which reach far elsewhere.
    dims = min(dims, int((s > 1e-4 * s[0]).sum()))
    scale = (s[:dims] / max(len(points) - 1, 1) ** 0.5).clamp(min=1e-9)
    return mean, vh[:dims].T / scale


class _Rows(NamedTuple):
    """One split of the rows, float64, in the coordinates: queries `[N, d]`, keys `[N, J, 2d]` (each earlier number's
    coordinates and those of the position before it), their entries `[N, J, 4]` and presence `[N, J]`, the linear
    read-out's location and spread `[N]`, and the targets `[N]`."""

    queries: torch.Tensor
    keys: torch.Tensor
    entries: torch.Tensor
    present: torch.Tensor
    loc_linear: torch.Tensor
    spread: torch.Tensor
    target: torch.Tensor


def _with_scaled_copies(rows: _Rows, transform: str) -> _Rows:
    """`rows` and, for each of `_SCALES`, its rows whose target is a copy of an earlier number with every value (the
    earlier ones and the target) times that scale, the features and the read-out's location as they are.

    A copy is right at any scale and the read-out is not, but at the scales of the rows the read-out is close to a
    copy's target too, and a choice that leaves it a tenth of the weight costs the fit next to nothing there. At a
    scale never seen that tenth misses by the read-out's whole error: on Qwen2.5-0.5B the repeat of a stated number
    missed by 0.31-0.77 at unseen scales over three fits with a share of 0.14-0.41 on the read-out. Rows where the
    read-out is off by the scale make the copy's the only right answer, in the fit and in the held-out NLL that
    chooses among its starts (docs/experiments.md, "Scaled copies")."""
    if not _SCALES:
        return rows
    copies = _copied_slots(rows, transform)[0].any(-1)
    values, target = rows.entries[..., 1][copies], untransform_values(rows.target, transform)[copies]
    kept = _Rows(*(t[copies] for t in rows))
    parts = [rows] + [kept._replace(entries=entry_values(kept.present, values * scale, transform),
                                    target=transform_values(target * scale, transform)) for scale in _SCALES]
    return _Rows(*(torch.cat(columns) for columns in zip(*parts, strict=True)))


def _value(path, transform, rows: _Rows, noise):
    """The value's `(loc, scale)` `[N]` through `path` on coordinates (`ContextRead.apply`)."""
    loc, scale = _read(path, transform, rows).apply(rows.loc_linear[:, None], rows.spread[:, None], noise)
    return loc[:, 0], scale[:, 0]


def _read(path, transform, rows: _Rows):
    own, before = rows.keys.chunk(2, dim=-1)
    return path.read(rows.queries[:, None], path.keys(own, before), rows.entries, rows.present[:, None], transform)


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


_Fit = TypeVar("_Fit", bound=Callable)
_caller = threading.local()  # the thread count the outermost `one_thread` fit was called with


def one_thread(fit: _Fit) -> _Fit:
    """Run `fit` with torch on one CPU thread, so that its float64 sums are added in one order on any machine.

    The start's fits amplify the last bit of their sums: the path's descent keeps the held-out step of a descent by
    the signs of its residuals, and which of its random starts it keeps turns on a few hundredths of a nat. Torch
    splits a long sum between its threads, and the rows read once on Qwen2.5-0.5B kept random start 0 with one thread
    and start 1 with two, which missed the training median on two real tables where start 0 missed none
    (docs/experiments.md, "The start's fit with one thread and with two"). On one thread a conversion keeps the same
    start on a laptop and on a server of the same instruction set; the backbone that reads the rows keeps every
    thread, and the path's random starts, each on one thread, are fitted side by side on the caller's threads
    (`_side_by_side`)."""
    @functools.wraps(fit)
    def pinned(*args, **kwargs):
        threads, outer = torch.get_num_threads(), getattr(_caller, "threads", None)
        _caller.threads = outer or threads
        torch.set_num_threads(1)
        try:
            return fit(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
            _caller.threads = outer
    return pinned  # type: ignore[return-value]


def _side_by_side(fits: list[Callable[[], tuple]]) -> list[tuple]:
    """The results of `fits`, independent fits that each run on one thread, computed on as many Python threads as the
    caller of the start had torch threads. Each fit's sums are those it would add alone, so the results are the same
    on any number of threads; torch's operations release the GIL, and the six fits of the path on Qwen2.5-0.5B's rows
    took 152 s side by side on 2 cores, 306 s one after another, and 205 s with torch's two threads in each."""
    def run(fit: Callable[[], tuple]) -> tuple:
        with torch.no_grad():  # the mode is per thread, and a worker's starts with gradients on
            return fit()

    workers = min(len(fits), getattr(_caller, "threads", None) or torch.get_num_threads())
    if workers <= 1:
        return [run(fit) for fit in fits]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(run, fits))


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


@one_thread
@torch.no_grad()
def fit_context_values(model, rows: ContextRows, x: torch.Tensor, scale_u: torch.Tensor, y: torch.Tensor,
                       seed: int = 0, starts: int | None = None, from_current: bool = False,
                       loo_residuals: torch.Tensor | None = None) -> dict:
    """Fit `model.abduction.context_values` on the value head's rows and write it; returns the record.

    Args:
        rows: the path's rows, aligned with `x` (loc_U `[N, C]`), `scale_u` (scale_U `[N, C]`) and `y` (the
            targets in the head's space `[N]`), float64.
        seed, starts: the fit runs from the random starts of seeds `seed`, `seed + 1`, … (`starts` of them,
            `_STARTS` by default) and keeps the one of least held-out NLL on the rows as read (`_keep`); the
            record's `context_seed` is its seed, its `context_nll_as_read` that NLL, and its `context_nll` its
            held-out NLL with the scaled copies.
        from_current: also the path as it is, and its fit continued from there, are candidates (a refit's): the
            fit is not convex, and a refit only from random starts can land in another minimum than the start's,
            worse on the held-out rows although the features did not move. With it, the kept fit scores no worse on
            the held-out rows as read than the path as it was (a fit with its pointer fitted first aside: `_keep`).
        loo_residuals: the read-out's leave-one-out residuals `[N]` (`starts._ridge`), which the widths'
            calibration reads at the held-out rows: the read-out was fitted on them too, so its own residuals there
            are in-sample and narrowed the intervals (on 128 one-number completions of real tables, 50% intervals
            covered 0.19 of the test targets).
    """
    path: CausalQwenContextValues = model.abduction.context_values
    action = model.action
    n = min(len(rows.queries), len(y))
    queries, keys, values, present = rows.stacked(n)
    # The earlier numbers fill each row's first slots: slots no row uses weigh exactly 0 in every sum, so they go.
    slots = max(int(present.sum(-1).max()), 1)
    keys, values, present = keys[:, :slots], values[:, :slots], present[:, :slots]
    x, scale_u, y = x[:n].double(), scale_u[:n].double(), y[:n].double()
    w = action.reg_head.weight.detach().double().cpu()[0]
    loc_linear = x @ w + float(action.reg_head.bias)
    spread = (scale_u + action.b_noise.detach().double().cpu().abs()) @ w.abs()
    noise = float(action.reg_log_noise.exp()) if action.reg_log_noise is not None else 0.0
    own, before = keys.chunk(2, dim=-1)
    mean, to_coords = _coordinates(queries, own, present, _DIMS)
    cq = (queries.double() - mean) @ to_coords
    ck = torch.cat([((part.double() - mean) @ to_coords) * present[..., None] for part in (own, before)], -1)
    transform, floor = model.config.value_transform, model.config.scale_min
    entries = entry_values(present, values, transform)
    held = torch.arange(n) % _HELD_OUT_EVERY == 0

    as_fitted = _Rows(cq, ck, entries, present, loc_linear, spread, y)
    unseen = as_fitted if loo_residuals is None else as_fitted._replace(loc_linear=y - loo_residuals[:n].double())

    def halves(rows: _Rows) -> dict[bool, _Rows]:
        return {True: _Rows(*(t[held] for t in rows)), False: _Rows(*(t[~held] for t in rows))}

    def scaled_halves(rows: _Rows) -> dict[bool, _Rows]:
        return {part: _with_scaled_copies(half, transform) for part, half in halves(rows).items()}

    calibration = halves(unseen)[True]
    split = scaled_halves(unseen if _LOCATIONS_READ_UNSEEN else as_fitted)  # the locations' descent's
    nll_split = (split if _NLL_READS_UNSEEN == _LOCATIONS_READ_UNSEEN
                 else scaled_halves(unseen if _NLL_READS_UNSEEN else as_fitted))

    def row_nll(small, rows: _Rows) -> torch.Tensor:
        """The value's NLL `[N]` at each of `rows` through the path `small`."""
        loc, scale = _value(small, transform, rows, noise)
        return nll(rows.target, loc, scale.clamp(min=floor))

    def loss(small, on_held_out: bool, rows: _Rows | None = None):
        return row_nll(small, nll_split[on_held_out] if rows is None else rows).mean()

    def start(draw: int) -> CausalQwenContextValues:
        small = CausalQwenContextValues(cq.shape[1], path.rank, path.log_values).double()
        small.reset_parameters(torch.Generator().manual_seed(seed + draw), keep_loaded=False)
        return small.eval()  # eval: the fit has no use for the training forward's zero terms (`ContextRead.in_graph`)

    linear_only = start(0)
    with torch.no_grad():
        linear_only.choice.bias[0] = LINEAR_ONLY_SCORE
        baseline = float(loss(linear_only, True))
        baseline_as_read = float(loss(linear_only, True, calibration))

    def as_read(state: dict) -> torch.Tensor:
        """A fit's value NLL `[N]` at the held-out rows as read (not their scaled copies)."""
        scratch = start(0)
        scratch.load_state_dict(state)
        return row_nll(scratch, calibration)

    # The fit is not convex, and where it lands depends on the random start of the scores (on Qwen2.5-0.5B, the
    # repeat at unseen scales ranged from 0.005 to 0.38 over three starts): several starts, the best on the held-out
    # rows as read kept (`_keep`).
    # Each start twice where rows repeat a number: as it is, and with its pointer fitted to the copied numbers first
    # (`_fit_pointer`). On Seattle highs asked for again only the second copied every test row; on the corpus, whose
    # copies are a few rows among many, the second never beat the read-out (docs/experiments.md, "A pointer fitted to
    # the copied number").
    draws = _STARTS if starts is None else starts
    pointers = (False, True) if _copies_told(split, transform) else (False,)
    plan = [(draw, pointer) for draw in range(draws) for pointer in pointers]
    done = _side_by_side([functools.partial(_fit_from, start(draw), loss, split, transform, noise, pointer)
                          for draw, pointer in plan])
    fits = [(*fit, seed + draw, pointer) for fit, (draw, pointer) in zip(done, plan, strict=True)]
    if from_current:
        current = _read_back(path, start(0), mean, to_coords)
        with torch.no_grad():
            as_it_is = (float(loss(current, True)), _state(current), 0, seed, None)
        fits += [as_it_is, (*_fit_from(current, loss, split, transform, noise), seed, False)]
    # A fit is kept only where it beats the read-out on the held-out rows as read too: the scaled copies are rows
    # where the read-out is wrong by construction, and with them alone a path worse on every row the data hold passes.
    scored = [(fit, as_read(fit[1])) for fit in fits if fit[1] is not None and fit[0] < baseline]
    scored = [(fit, row_nll) for fit, row_nll in scored if float(row_nll.mean()) < baseline_as_read]
    repeats = _copied_slots(calibration, transform)[0].any(-1)
    best = _keep(scored, ~repeats) if scored else (baseline, None, 0, None, None)
    best_as_read = next((float(row_nll.mean()) for fit, row_nll in scored if fit is best), baseline_as_read)
    small = start(0)
    chosen = linear_only.state_dict() if best[1] is None else best[1]
    small.load_state_dict(chosen)
    off = [] if best[1] is None else _switch_off_unused(
        small, lambda: (loss(small, True), loss(small, True, calibration)))
    guarded = 0.0 if best[1] is None else _fit_guard(small, calibration, transform, noise)
    if _WIDTHS_READ_UNSEEN and best[1] is not None and unseen is not as_fitted:
        unseen_split = scaled_halves(unseen)
        _refit_widths(small, lambda held_out: row_nll(small, unseen_split[held_out]).mean())
    chosen = _state(small)
    shift = torch.zeros(len(CANDIDATES) + 1, dtype=torch.float64)  # per entry of π̄
    reading = torch.zeros(0, dtype=torch.float64)
    if noise > 0 and int(held.sum()) >= _MIN_CALIBRATION_ROWS:
        shift, reading = _calibrate_width(small, transform, calibration, noise, floor)
    chosen["width_by_choice"] = chosen["width_by_choice"] + shift[:-1]
    chosen["mean_width"] = chosen["mean_width"] + shift[-1:]
    chosen["width.weight"] = chosen["width.weight"].clone()
    chosen["width.weight"][0, :len(reading)] += reading
    _write_back(path, chosen, mean, to_coords)
    return {"context_rows": n, "context_nll_linear": baseline, "context_nll": best[0], "context_step": best[2],
            "context_width_shift": shift.tolist(), "context_seed": best[3], "context_width_map": reading.tolist(),
            "context_nll_before": as_it_is[0] if from_current else None, "context_off": off,
            "context_pointer": best[4], "context_nll_as_read": best_as_read, "context_guarded": guarded}


def _keep(scored: list, elsewhere: torch.Tensor) -> tuple:
    """The fit to keep of `scored`, pairs of a fit `(held-out NLL, state, step, seed, pointer)` and its value NLL
    `[N]` at the held-out rows as read: the least mean NLL there. Where a fit's pointer was fitted to the copied
    numbers first (`_fit_pointer`), such fits and a refit's path as it was are preferred where their mean NLL at the
    rows `elsewhere` `[N]` (those whose target repeats no earlier number) is within `_POINTER_ELSEWHERE` of the best
    of the other fits there.

    The least NLL on the rows as read, not with their scaled copies (`_with_scaled_copies`): over ten orders of the
    same rows of the corpus and the tables on Qwen2.5-0.5B, which hold out other rows, the 37 fits that beat the
    read-out ranked by their count of templates and tables above the training median with a Spearman correlation of
    0.43 by the NLL as read and 0.22 by the NLL with the scaled copies; the fits kept by the latter (a fit with its
    pointer fitted first preferred wherever one beat the read-out) were above a median 19 times, those of the rows
    as read 13 (docs/experiments.md, "Which fit the start keeps").

    The pointer's preference, because its labels show the copy of every row where the held-out NLL reads a fifth of
    them: on Seattle highs asked for again a pointer split on 4% of the rows scored the better NLL (-9.26 against
    -7.97) while missing 6 of 147 test rows. Every row there repeats a number; on the corpus and the tables, the fits
    with the pointer fitted first that beat the read-out (in 4 orders of 10) were worse than the best other fit on
    the rows that repeat no number and cost the tables."""
    preferred = [pair for pair in scored if pair[0][4] is not False]
    if any(fit[4] for fit, _ in scored):
        others = [row_nll for fit, row_nll in scored if fit[4] is False]
        if others and bool(elsewhere.any()):
            least = min(float(row_nll[elsewhere].mean()) for row_nll in others)
            preferred = [pair for pair in preferred
                         if float(pair[1][elsewhere].mean()) <= least + _POINTER_ELSEWHERE]
        scored = preferred or scored
    return min(scored, key=lambda pair: float(pair[1].mean()))[0]


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


@torch.no_grad()
def _switch_off_unused(small, held_out_nll) -> list[str]:
    """Switch off, one after the other, each candidate other than the read-out and the copies whose removal raises
    neither held-out NLL (`held_out_nll()`: with the scaled copies, and as read) by more than `_UNUSED_TOLERANCE`;
    returns their names.

    The fit leaves a candidate it does not use at a share near 0 on its rows, where nothing bounds its weights or
    its value. At a row unlike them the share can rise to a few hundredths while the value is far out: on Seattle
    highs asked for again, a log-space combination of symlog −936 at a share of 0.012 read a high of 1.1 as −9,621
    (docs/experiments.md, "A stated value repeated"). Off, its score is a constant, so no row brings it back."""
    off = []
    for index, name in enumerate(CANDIDATES[1:], start=1):
        layer, row = (small.mean_score, 0) if name == "mean" else (small.choice, index)
        kept = layer.weight[row].clone(), layer.bias[row].clone()
        before = [float(nll) for nll in held_out_nll()]
        layer.weight[row] = 0.0
        layer.bias[row] = _OFF_SCORE
        if all(float(nll) <= was + _UNUSED_TOLERANCE for nll, was in zip(held_out_nll(), before, strict=True)):
            off.append(name)
        else:
            layer.weight[row], layer.bias[row] = kept
    return off


def _fit_from(small, loss, split, transform: str, noise: float,
              pointer: bool = False) -> tuple[float, dict | None, int]:
    """Fit the path `small` from its start, with `pointer` its pointer fitted to the copied numbers first: `(held-out
    NLL, state or None, step)`, None where the locations never beat the linear read-out's on the held-out rows."""
    def location_error(held_out: bool):
        rows = split[held_out]
        loc, _ = _value(small, transform, rows, noise)
        return _location_error(loc - rows.target)

    with torch.no_grad():
        linear_error = float(location_error(True))
    # The locations first, by their own loss (the median's, smoothed: `_location_error`): fitted by the NLL with the
    # widths, a wider interval paid for a half-made choice, and the choice between the read-out and a copy stayed
    # soft. Then the widths by the NLL, the locations fixed (docs/experiments.md has the table that chose this).
    if pointer:  # the locations' fit starts from it
        _fit_pointer(small, split, transform)
    widths = _width_parameters(small)
    # The guard is not a location: `_fit_guard` fits it after the choice, on the error the evaluation punishes.
    held = widths + list(small.guard.parameters())
    located = [p for p in small.parameters() if all(p is not w for w in held)]
    # The combinations' weight on a number reads its role, the words before it (K'·z_{j−1} + b_K), not its own
    # features, which carry its size: with K·z_j in them the repeat at unseen scales missed by 0.72-0.81 over three
    # fits, against 0.17-0.56 without (docs/experiments.md, "The combinations: a gradient at their start, and keys
    # of roles"). Their rows of K start at 0 and get no gradient; the copies' keep K·z_j.
    rank = small.rank
    hook = small.key.weight.register_hook(lambda grad: torch.cat((grad[:rank], torch.zeros_like(grad[rank:]))))
    try:
        best = _descend(small, located, location_error, linear_error)
    finally:
        hook.remove()
    if best[1] is None:
        return best
    small.load_state_dict(best[1])
    _fit_choice(small, split, transform, noise)
    best = (best[0], _state(small), best[2])
    with torch.no_grad():
        located_nll = float(loss(small, True))
    widened = _descend(small, widths, lambda held_out: loss(small, held_out), located_nll)
    state = widened[1] if widened[1] is not None else best[1]  # the located state, whose NLL this is
    return min(widened[0], located_nll), state, best[2]


def _location_error(residual: torch.Tensor) -> torch.Tensor:
    """The locations' loss over `residual` `[N]`: the mean of √(r² + δ²) − δ, δ = `_LOCATION_SMOOTHING` (|r| at
    δ = 0)."""
    if _LOCATION_SMOOTHING == 0.0:
        return residual.abs().mean()
    delta = _LOCATION_SMOOTHING
    return ((residual.square() + delta * delta).sqrt() - delta).mean()


def _width_parameters(small) -> list[torch.nn.Parameter]:
    """The parameters of the path's width ρ: its map of the query, and its entries per choice."""
    return [small.width.weight, small.width.bias, small.width_by_choice, small.mean_width]


def _refit_widths(small, unseen_nll) -> None:
    """Fit the widths of the kept path `small` again by `unseen_nll(held_out)`, the value's NLL on the rows with the
    read-out's leave-one-out locations (with the scaled copies), from the widths it has, keeping the step of least
    held-out NLL (none where no step lowers it). The choice and the locations stay as fitted, so every error does.

    The widths' descent in the fit reads the read-out as fitted, and with as many features as rows its residuals
    there are near 0: the width map learns that the read-out is exact, and the calibration's two shifts and few
    coordinates on the held-out rows do not undo that for one task among several (a Texas city's median sale price
    among four public tasks: 50% intervals holding 0.25-0.50 of its test targets over four orders of the rows, 0.53-0.68
    with this refit). Fitting every NLL of the fit on the leave-one-out locations calibrated it but also changed which
    fit is kept on small data (docs/experiments.md, "The widths fitted to the read-out's misses"); here the choice
    among fits is the fit's as before."""
    with torch.no_grad():
        baseline = float(unseen_nll(True))
    refitted = _descend(small, _width_parameters(small), unseen_nll, baseline)[1]
    if refitted is not None:
        small.load_state_dict(refitted)


def _mean_value(rows: _Rows, transform: str) -> torch.Tensor:
    """T(ū) `[N]`, the mean of each row's earlier values in the head's space (0 where there is none)."""
    present = rows.present.double()
    mean = (present * rows.entries[..., 1]).sum(-1) / present.sum(-1).clamp(min=1.0)
    return transform_values(mean, transform)


def _mean_labels(rows: _Rows, transform: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether the mean of the earlier values is the target `[N]` (within `_CHOICE_TOLERANCE` in the head's space),
    and whether the row tells it apart `[N]`: it has an earlier number, and the mean and an earlier value are not
    both the target. Where one number is in view, or the mean of a few happens to equal one of them, the copies are
    as right: such rows labelled either way would teach the mean's score what they do not show."""
    near = (rows.entries[..., 0] - rows.target[:, None]).abs() <= _CHOICE_TOLERANCE
    copy = (near & rows.present).any(-1)
    mean = (_mean_value(rows, transform) - rows.target).abs() <= _CHOICE_TOLERANCE
    return mean & ~copy, rows.present.any(-1) & ~(mean & copy)


def _fit_choice(small, split: dict, transform: str, noise: float) -> None:
    """Fit the mean's score alone (`mean_score`) so that its share π_μ says whether the mean of the earlier
    values is the target (`_mean_labels`): the logistic loss of π_μ at the rows that tell it apart, toward 1 where
    the mean is the target and toward the share the locations' fit gave it elsewhere, keeping the step of least loss
    on the held-out rows. Kept in `small` only where it lowers the held-out absolute error of the
    value on the rows where the mean is the target and raises it on the others by at most `_CHOICE_SLACK` of itself.

    The locations' absolute error rewards a candidate only as much as it moves the blend, and a candidate that is
    exact on a few rows (an average: 30 of 2,846 rows on the corpus and the tables) moves the held-out error too
    little to be chosen before the fit stops: the mean's weight stayed 0.00-0.02 at the corpus's averages. A fit of
    the whole choice by a mixture of the candidates did choose it, but it also moved the read-out's share against the
    copies' elsewhere and cost the real tables; moving the mean's score alone leaves the ratios of the other shares
    as they were at every row (docs/experiments.md, "The mean of the earlier numbers"). Toward 0 elsewhere, it took
    away the share the locations' fit had given the mean as part of a blend (0.33 at the corpus's differences), and
    the others' error then rose past the slack in the kept random start on Qwen2.5-0.5B, so the mean was dropped
    ("The mean's target elsewhere: the locations' share")."""
    column = 1 + CANDIDATES.index("mean")  # of π̄, after the copies' share
    labels = {part: _mean_labels(rows, transform) for part, rows in split.items()}
    exact = {part: label[0] for part, label in labels.items()}
    has_mean = {part: label[1] for part, label in labels.items()}
    if not bool(exact[False].any()):
        return

    def shares(held_out: bool) -> torch.Tensor:
        return _read(small, transform, split[held_out]).choice[:, 0, column][has_mean[held_out]]

    with torch.no_grad():  # the share each row that is not an average keeps: the locations' (a blend there)
        kept = {part: shares(part) for part in split}
    targets = {part: torch.where(exact[part][has_mean[part]], 1.0, kept[part]) for part in split}

    def logistic(held_out: bool) -> torch.Tensor:
        share, target = shares(held_out), targets[held_out]
        tiny = torch.finfo(share.dtype).tiny
        return -(target * share.clamp(min=tiny).log() + (1 - target) * (1 - share).clamp(min=tiny).log()).mean()

    def errors() -> tuple[float, float]:
        """The held-out absolute error where the mean is the target, and elsewhere."""
        rows, label = split[True], exact[True]
        error = (_value(small, transform, rows, noise)[0] - rows.target).abs()
        return float(error[label].mean()) if label.any() else 0.0, float(error[~label].mean())

    saved = _state(small)
    with torch.no_grad():
        baseline, before = float(logistic(True)), errors()
    fitted = _descend(small, list(small.mean_score.parameters()), logistic, baseline)[1]
    if fitted is not None:
        small.load_state_dict(fitted)
        with torch.no_grad():
            after = errors()
        if after[0] < before[0] and after[1] <= before[1] * (1 + _CHOICE_SLACK):
            return
    small.load_state_dict(saved)


def _descend(small, params: list, objective, baseline: float) -> tuple[float, dict | None, int]:
    """Adam on `objective(False)` (the fitted rows) for `params`, keeping the state of least `objective(True)` (the
    held-out rows) if it is below `baseline`, until `_PATIENCE` steps bring no better one: `(held-out value, state or
    None, step)`."""
    optimizer = torch.optim.Adam(params, lr=_LEARNING_RATE)
    best = (baseline, None, 0)
    for step in range(1, _STEPS + 1):
        optimizer.zero_grad()
        with torch.enable_grad():  # the value head's start runs under no_grad
            objective(False).backward()
        optimizer.step()
        with torch.no_grad():
            held_out = float(objective(True))
        if held_out < best[0]:
            best = (held_out, _state(small), step)
        elif step - best[2] >= _PATIENCE:
            break
    return best


def _calibrate_width(small, transform, held_out: _Rows, noise: float,
                     floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A shift of log ρ for the read-out's share of the choice and one for the path's (added to `width_by_choice`,
    the path's entries alike), and a map of the query's leading principal coordinates (added to the width's
    map `a`), that minimise the value's NLL on the held-out rows: `(shift [5], map [dims])`.

    The path's locations and widths are fitted on the same rows, where its errors are smaller than on new text, so
    its widths come out narrow: 50% intervals covered about a quarter of the test targets on Qwen2.5-0.5B. The Cauchy
    NLL of a scale is least where the residuals fall inside the 50% interval half the time, so shifts fitted on rows
    the locations never saw calibrate the intervals. Two, because a guess of the read-out and a reading of the
    context miss by different amounts; not one per choice in π̄ = (π_0, Σ_j π_j, π_ℓ, π_r, π_μ), because a choice
    that the held-out rows hardly make has no residuals to fit, and its shift drifted to ±80 on the tiny model of
    tests/test_keep_start.py, which then misjudged the width wherever that choice was made.

    The map, because rows of different kinds miss by different amounts whatever they chose: with the two shifts alone
    one width served the corpus's copies and the tables' ones, and the corpus's 50% intervals covered 0.38-0.40 of
    its test targets over three fits on Qwen2.5-0.5B (the tables' 0.54-0.65); with four coordinates, 0.45-0.58
    (docs/experiments.md, "A calibration that reads the input"). At most one coordinate per `_ROWS_PER_WIDTH_DIM`
    held-out rows, so that a few rows fit the shifts alone. With a ridge (`_CALIBRATION_RIDGE`), so that what the
    held-out rows cannot tell stays near 0: a share they never give, or a coordinate that hardly varies over them.
    Unbounded, the start on Seattle highs asked for again put 82 on the read-out's shift, where every held-out row
    copies, and −79 on a coordinate of a map: a width e^±40 wherever new text gives that share or moves it.
    """
    with torch.no_grad():
        read = _read(small, transform, held_out)
    loc = (read.linear_weight * held_out.loc_linear[:, None] + read.offset)[:, 0]
    fixed = (read.linear_weight * held_out.spread[:, None])[:, 0]
    log_width, choice = read.width[:, 0].log(), read.choice[:, 0]
    shares = torch.stack((choice[:, 0], choice[:, 1:].sum(-1)), -1)  # the read-out's and the path's
    shift = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    dims = min(_CALIBRATION_DIMS, held_out.queries.shape[1], len(held_out.target) // _ROWS_PER_WIDTH_DIM)
    coords = held_out.queries[:, :dims]
    reading = torch.zeros(dims, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([shift, reading], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        log = log_width + shares @ shift + coords @ reading
        width = log.clamp(-MAX_LOG_WIDTH, MAX_LOG_WIDTH).exp()  # as the model bounds ρ
        loss = nll(held_out.target, loc, (fixed + noise * width).clamp(min=floor)).mean()
        loss = loss + _CALIBRATION_RIDGE * (shift.square().sum() + reading.square().sum())
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    shift, reading = shift.detach(), reading.detach()
    if not (torch.isfinite(shift).all() and torch.isfinite(reading).all()):
        return torch.zeros(choice.shape[1], dtype=torch.float64), torch.zeros(dims, dtype=torch.float64)
    return torch.cat((shift[:1], shift[1:].expand(choice.shape[1] - 1))), reading


@torch.no_grad()
def _read_back(path: CausalQwenContextValues, small: CausalQwenContextValues, mean: torch.Tensor,
               to_coords: torch.Tensor) -> CausalQwenContextValues:
    """Load into `small` the model's path as maps of the coordinates c = (z − mean) @ to_coords: the inverse of
    [`_write_back`] on the span of the coordinates (W·z + b = W·(mean + c·pinv(to_coords)) + b)."""
    from_coords = torch.linalg.pinv(to_coords).T  # [H, d]
    state = {name: tensor.detach().double().cpu() for name, tensor in path.state_dict().items()}
    for name in ("query", "key", "choice", "mean_score", "guard", "width"):
        weight = state[f"{name}.weight"]
        state[f"{name}.bias"] = state[f"{name}.bias"] + weight @ mean
        state[f"{name}.weight"] = weight @ from_coords
    state["key.bias"] = state["key.bias"] + state["key_before.weight"] @ mean
    state["key_before.weight"] = state["key_before.weight"] @ from_coords
    small.load_state_dict(state)
    return small


@torch.no_grad()
def _write_back(path: CausalQwenContextValues, small: dict, mean: torch.Tensor, to_coords: torch.Tensor) -> None:
    """Write a path fitted on coordinates c = (z − mean) @ to_coords as maps of z: W·c + b = (W·to_coordsᵀ)·z +
    (b − W·to_coordsᵀ·mean). The key's two maps share one bias: K·c_j + b + K'·c_{j−1} = (K·to_coordsᵀ)·z_j +
    (K'·to_coordsᵀ)·z_{j−1} + b − (K + K')·to_coordsᵀ·mean, so that K'·z_{j−1} is 0 where z_{j−1} is (before the
    text's start, padding), as the rows had it."""
    for name in ("query", "key", "choice", "mean_score", "guard", "width"):
        weight = small[f"{name}.weight"] @ to_coords.T
        bias = small[f"{name}.bias"] - weight @ mean
        if name == "key":
            before = small["key_before.weight"] @ to_coords.T
            bias = bias - before @ mean
            path.key_before.weight.copy_(before.to(path.key_before.weight))
        layer = getattr(path, name)
        layer.weight.copy_(weight.to(layer.weight))
        layer.bias.copy_(bias.to(layer.bias))
    path.width_by_choice.copy_(small["width_by_choice"].to(path.width_by_choice))
    path.mean_width.copy_(small["mean_width"].to(path.mean_width))
