"""The value side learns during training (docs/design.md §7b): the read-out trained by gradient from its start.

With the backbone frozen and the features the value reads held (the trainer's defaults), a row's features do not
change while the model trains: loc_U, scale_U and the context-value path's read (π_0, m_t, ρ_t) at each value row
are what the start read. So the rows are read once (the start's pass, or one pass over new data for a model fitted
before) and the read-out trains on them by gradient, at no cost to the backbone, one step of its own per optimizer
step of the trainer, on the value's own loss (the Cauchy NLL of the regression term of docs/design.md §4).

Adam moves each coordinate by about its rate per step, and the features of z differ in scale by orders of magnitude
(a few dimensions of Qwen2.5 reach |z| > 100): in z's own coordinates Adam undoes a least-squares read-out in a few
steps (docs/experiments.md). The read-out trains instead in the whitened coordinates of its rows: with a the
standardised features and Σ = aᵀa/N + (λ/N)·I (λ the start's ridge penalty), w_reg = w_start + (Σ^-1/2·v)/σ and
b_reg = b_start + δ − μ·(Σ^-1/2·v)/σ, with v and δ starting at 0. There every direction moves the prediction alike
and a step of Adam is a step of (preconditioned) gradient descent on the read-out's loss.

A guard keeps the best state: every row is held out of one of five monitors (its fold: every fifth row in the rows'
content order), read-outs trained by the same steps on the other four fifths, from the ridge of those rows. So every
row has a location from a read-out that never saw it, and their median absolute error in the head's space (what the
evaluation's median relative error punishes) is measured at every step. Where it is lower than the best so far and no
kind of row (a cluster of their features: in practice a task) is worse than at that best by more than 0.01, the model
gets the state of the read-out trained on every row after as many steps; the monitors' first state (step 0, the
ridges) stands for the start, which was fitted on every row, so a state is judged by how far the same steps took
read-outs that are scored on rows they did not see. (Scored against the start's leave-one-out locations instead, the
monitors, each fitted on four fifths of the rows, began worse than the start on two of five tasks and no state of
theirs passed at 64 rows per task; docs/experiments.md.)

The widths follow the errors: the start's widths were calibrated to the start's misses, and a read-out that learns
misses less on some kinds of rows than on others (a ratio of stated values three times less, a price hardly less), so
with the start's widths its 50% intervals held 0.95 of a ratio's test targets. Wherever the model gets a state, each
row's log ratio of the monitors' miss now to their miss at step 0 is regressed (ridge) on the rows' leading principal
coordinates, and the value's width log ρ gets that map, through the abduction's linear loc_U, in the path's width map
(with the path; γ_Y gets its mean without it).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from ..cauchy import nll
from .path_widths import _CALIBRATION_DIMS, _CALIBRATION_RIDGE

__all__ = ["ValueLearning", "ValueLearner", "LearningRows", "LearningRecord", "start_score"]


# A kind of row may end at most this much worse (median |loc − y| in the head's space, about 1% of a value in
# symlog space), or this share of its error where that is more (the median of twenty rows moves by that much between two
# states that differ by nothing real), than at the best state so far; kinds are clusters of at least
# `_ROWS_PER_KIND` rows on average (one of fewer than half that is not checked).
FOLDS = 5
_KIND_SLACK = 0.01
_KIND_SHARE = 0.1
_ROWS_PER_KIND = 20
_MAX_KINDS = 8
# Misses below this (head space, about a relative error) are exact: a copy's miss is float rounding, and its ratio to
# another is noise; a row exact at both states keeps its width.
_EXACT_MISS = 1e-6
# Where the read-out's own spread is wider than a row's width should be, the path's part of it falls to this share.
_LEAST_SHARE = 0.1
# The widths' map reads at most one principal coordinate per this many rows (the path's calibration reads one per 25
# held-out rows): with the misses of 64 held-out rows over five tasks, two coordinates moved one task's widths by what
# another learnt (humidity's 50% intervals from 0.58 to 0.82 of its test targets, docs/experiments.md).
_ROWS_PER_MAP_DIM = 100


def kinds_of(x: torch.Tensor) -> torch.Tensor:
    """Kinds of rows `[N]`: k-means clusters of their leading principal coordinates (k ≤ `_MAX_KINDS`, at least
    `_ROWS_PER_KIND` rows each on average), deterministic (farthest-point start, Lloyd's iterations): the prompts of
    different tasks lie apart there (docs/design.md §1c)."""
    n = len(x)
    k = max(1, min(_MAX_KINDS, n // _ROWS_PER_KIND))
    if k == 1:
        return torch.zeros(n, dtype=torch.long)
    centred = (x - x.mean(0)) / x.std(0).clamp(min=1e-6)
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)
    points = centred @ vh[:8].T
    centres = [points[(points - points.mean(0)).norm(dim=1).argmax()]]
    while len(centres) < k:
        distance = torch.cdist(points, torch.stack(centres)).min(1).values
        centres.append(points[distance.argmax()])
    centres = torch.stack(centres)
    for _ in range(50):
        labels = torch.cdist(points, centres).argmin(1)
        moved = torch.stack([points[labels == j].mean(0) if bool((labels == j).any()) else centres[j]
                             for j in range(k)])
        if torch.equal(moved, centres):
            break
        centres = moved
    labels = torch.cdist(points, centres).argmin(1)
    return torch.unique(labels, return_inverse=True)[1]  # kinds numbered 0..K-1, none empty


def kinds_score(misses: torch.Tensor, kinds: torch.Tensor) -> float:
    """The mean over kinds (of at least half `_ROWS_PER_KIND` rows) of each kind's median miss; the median over all
    rows where fewer than two kinds have that many. In the head's space a miss is about a relative error, so this is
    the evaluation's median relative error with every task weighed alike: a choice cannot buy a lower pooled median
    with a task that the pooled median does not see (docs/design.md §1c)."""
    counts = kinds.bincount()
    counted = [k for k in range(len(counts)) if counts[k] >= _ROWS_PER_KIND // 2]
    if len(counted) < 2:
        return float(misses.median())
    return float(torch.stack([misses[kinds == k].median() for k in counted]).mean())


@dataclass(frozen=True)
class ValueLearning:
    """Settings of the read-out's training from its start (`CausalQwenTrainer(value_learning=...)`, the CLI's
    `--value-learning-rate` and `--value-learning-batch`).

    Args:
        learning_rate: how far a step of Adam moves a prediction, about, in the head's space (each of the C whitened
            coordinates moves by this over √C, the bias by this).
        batch_rows: rows of each step, drawn from the training rows by a generator of its own.
        seed: that generator's seed.
    """

    learning_rate: float = 3e-3
    batch_rows: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.learning_rate, (int, float)) and math.isfinite(self.learning_rate)
                and self.learning_rate > 0):
            raise ValueError(f"learning_rate must be a positive finite number, got {self.learning_rate!r}")
        if not isinstance(self.batch_rows, int) or isinstance(self.batch_rows, bool) or self.batch_rows < 1:
            raise ValueError(f"batch_rows must be a positive int, got {self.batch_rows!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TypeError(f"seed must be an int, got {self.seed!r}")


@dataclass(frozen=True)
class LearningRows:
    """The value rows as the model reads them, float64 on the CPU: loc_U `x` `[N, C]`, the spread's input
    scale_U' `s` `[N, C]`, the path's read at each row (π_0 `linear_weight`, m `offset`, ρ `width`, `[N]` each; 1, 0
    and 1 without the path), the targets `y` `[N]` in the head's space, and the fold of each row `fold` `[N]` (0 to
    `FOLDS` − 1: the monitor that does not see it; fold 0 is the fifth the path's fit held out)."""

    x: torch.Tensor
    s: torch.Tensor
    linear_weight: torch.Tensor
    offset: torch.Tensor
    width: torch.Tensor
    y: torch.Tensor
    fold: torch.Tensor


@dataclass
class LearningRecord:
    """What the learner did: the median absolute error (head space) on the rows the monitors did not see, at the
    start (their step 0) and at the best state, the step that state is from (0: the start's), and that error at each
    step (the curve)."""

    start_error: float
    best_error: float
    best_step: int = 0
    curve: list[tuple[int, float]] = field(default_factory=list)

    def summary(self, steps: int) -> str:
        """One line of what `steps` steps did, for the end of training."""
        return (f"held-out median absolute error (head space) {self.start_error:.4g} at the start, "
                f"{self.best_error:.4g} after training (best at learner step {self.best_step} of {steps})")


class _WhitenedReadout:
    """`w_reg`, `b_reg` in the whitened coordinates of the rows `fitted` (module docstring), trained by Adam on the
    value's NLL over batches of those rows: w = w₀ + Σ^-1/2·v/σ, b = b₀ + δ − μ·(Σ^-1/2·v)/σ."""

    def __init__(self, rows: LearningRows, fitted: torch.Tensor, w0: torch.Tensor, b0: float, penalty: float,
                 settings: ValueLearning, noise: float, scale_min: float, from_ridge: bool):
        """`fitted` `[N]` the rows it trains on; `from_ridge`: start from the ridge of penalty `penalty` on those rows
        (v = Σ^-1/2·aᵀ(y − ȳ)/N, w₀ = 0, b₀ = ȳ) rather than from (`w0`, `b0`)."""
        self.rows, self.settings, self.noise, self.scale_min = rows, settings, noise, scale_min
        self.w0, self.b0 = w0.clone(), b0
        self.fitted_rows = fitted.nonzero().flatten()
        x = rows.x[fitted]
        self.mean, self.std = x.mean(0), x.std(0).clamp(min=1e-6)
        standard = (x - self.mean) / self.std
        n = max(len(x), 1)
        eigenvalues, vectors = torch.linalg.eigh(standard.T @ standard / n)
        eigenvalues = eigenvalues.clamp(min=0.0) + penalty / n
        self.whiten = (vectors / eigenvalues.sqrt()) @ vectors.T  # Σ^-1/2, symmetric
        self.v = torch.zeros(rows.x.shape[1], dtype=torch.float64, requires_grad=True)
        self.delta = torch.zeros(1, dtype=torch.float64, requires_grad=True)
        if from_ridge:
            with torch.no_grad():
                y = rows.y[fitted]
                self.v += self.whiten @ (standard.T @ (y - y.mean())) / n
                self.w0.zero_()
                self.b0 = float(y.mean())
        # Adam moves each whitened coordinate by about its rate per step, and a prediction by the sum of C such
        # moves of random sign: ~rate·√C. The rate is per prediction, so each coordinate's is rate/√C.
        self.optimizer = torch.optim.Adam([{"params": [self.v], "lr": settings.learning_rate / math.sqrt(len(self.v))},
                                           {"params": [self.delta], "lr": settings.learning_rate}])
        self.generator = torch.Generator().manual_seed(settings.seed)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w `[C]`, b `[1]`) of the current (v, δ)."""
        shift = (self.whiten @ self.v) / self.std
        return self.w0 + shift, self.b0 + self.delta - (shift * self.mean).sum()

    def locations(self, rows: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """(loc_Y, scale_Y) at `rows`, as the model's formula gives them."""
        r = self.rows
        w, b = self.weights()
        loc = r.linear_weight[rows] * (r.x[rows] @ w + b) + r.offset[rows]
        scale = r.linear_weight[rows] * (r.s[rows] @ w.abs()) + self.noise * r.width[rows]
        return loc, scale.clamp(min=self.scale_min)

    def step(self) -> None:
        """One step of Adam on a batch of its rows."""
        if len(self.fitted_rows) == 0:
            return
        pick = torch.randint(len(self.fitted_rows), (min(self.settings.batch_rows, len(self.fitted_rows)),),
                             generator=self.generator)
        rows = self.fitted_rows[pick]
        with torch.enable_grad():
            self.optimizer.zero_grad()
            loc, scale = self.locations(rows)
            nll(self.rows.y[rows], loc, scale).mean().backward()
            self.optimizer.step()


def _fold_readouts(action, rows: LearningRows, settings: ValueLearning, penalty: float,
                   from_ridge: bool) -> list[_WhitenedReadout]:
    """One read-out per fold, on the rows of the other folds, from `action`'s read-out or from the ridge of its
    rows."""
    head = action.reg_head
    w0, b0 = head.weight.detach().double().cpu()[0].clone(), float(head.bias.detach())
    noise = float(action.reg_log_noise.detach().exp()) if action.reg_log_noise is not None else 0.0
    folds = int(rows.fold.max()) + 1 if len(rows.fold) else 0
    return [_WhitenedReadout(rows, rows.fold != k, w0, b0, penalty, settings, noise, action.scale_min,
                             from_ridge=from_ridge) for k in range(folds)]


@torch.no_grad()
def _unseen_locations(rows: LearningRows, readouts: list[_WhitenedReadout]) -> torch.Tensor:
    """Each row's location `[N]` by the one of `readouts` (one per fold) that does not see it."""
    locations = torch.empty_like(rows.y)
    for k, readout in enumerate(readouts):
        held = (rows.fold == k).nonzero().flatten()
        locations[held] = readout.locations(held)[0]
    return locations


def _unseen_misses(rows: LearningRows, readouts: list[_WhitenedReadout]) -> torch.Tensor:
    """|loc − y| `[N]` of each row by the one of `readouts` that does not see it."""
    return (_unseen_locations(rows, readouts) - rows.y).abs()


def _readout_start(action, rows: LearningRows, settings: ValueLearning, penalty: float, fitted_on_rows: bool,
                   kinds: torch.Tensor) -> tuple[list[_WhitenedReadout], bool, float]:
    """The monitors the learner starts from, whether the model's read-out is replaced by the ridge of the rows (a
    checkpoint's, where that reads them better), and the monitors' `kinds_score` on the rows they do not see.

    A read-out fitted on these rows (`fitted_on_rows`) would score its own rows in-sample: the monitors start from
    the ridge of theirs. A checkpoint on new rows starts from its read-out, or from the ridge of the new rows where
    that reads them better on the folds (every kind of row alike): a read-out fitted on another table can miss this
    one by far more than steps of Adam move it."""
    monitors = _fold_readouts(action, rows, settings, penalty, from_ridge=fitted_on_rows)
    score = kinds_score(_unseen_misses(rows, monitors), kinds) if len(rows.y) else math.inf
    if fitted_on_rows or len(monitors) < 2:
        return monitors, False, score
    ridges = _fold_readouts(action, rows, settings, penalty, from_ridge=True)
    ridge_score = kinds_score(_unseen_misses(rows, ridges), kinds)
    return (ridges, True, ridge_score) if ridge_score < score else (monitors, False, score)


def start_score(action, rows: LearningRows, settings: ValueLearning, penalty: float, fitted_on_rows: bool) -> float:
    """What the start of the learner scores on `rows` (`kinds_score` of the monitors' misses on the rows they do not
    see, in the head's space; lower is better), for the value side `action` and the path's read in `rows` hold:
    what chooses between a checkpoint's value side and one fitted afresh on new data (`starts.readout`)."""
    return _readout_start(action, rows, settings, penalty, fitted_on_rows, kinds_of(rows.x))[2]


class ValueLearner:
    """Trains `w_reg`, `b_reg` of `action` on `rows` (module docstring) and writes the state the rows it did not see
    choose into the model, with the widths that follow it. `penalty` is the ridge penalty of the start (on
    standardised features).

    The read-out the model gets trains on every row from the model's read-out; beside it, `FOLDS` monitors train by
    the same steps, each on the rows of the other folds. Where the monitors' state after k steps is the best on the
    rows they did not see, the model gets the other's state after k steps: the held-out misses choose how far to train,
    and every row still trains the model (where rows are few, a read-out of four fifths of them reads new rows worse
    than one of all; docs/experiments.md, "Numbers that learn")."""

    def __init__(self, action, rows: LearningRows, settings: ValueLearning, penalty: float,
                 fitted_on_rows: bool = False, abduction=None):
        """`fitted_on_rows`: the model's read-out is a start fitted on these very rows, so the monitors start from the
        ridge of their own rows (the start's locations would be in-sample); otherwise (a checkpoint on new data) they
        start, like the model's, from the model's read-out. `abduction`: the model's abduction network, whose linear
        loc_U carries the widths' map into the path's width map (None: the widths stay the start's)."""
        self.action, self.rows, self.settings, self.abduction = action, rows, settings, abduction
        self.penalty = penalty
        head = action.reg_head
        w0 = head.weight.detach().double().cpu()[0].clone()
        b0 = float(head.bias.detach())
        self.noise = float(action.reg_log_noise.detach().exp()) if action.reg_log_noise is not None else 0.0
        self.kinds = kinds_of(rows.x)
        self.monitors, self.restarted, _ = _readout_start(action, rows, settings, penalty, fitted_on_rows, self.kinds)
        every = torch.ones_like(rows.fold, dtype=torch.bool)
        self.readout = _WhitenedReadout(rows, every, w0, b0, penalty, settings, self.noise, action.scale_min,
                                        from_ridge=self.restarted)
        if self.restarted:
            self._write()
        self.steps = 0
        self.start_misses = self._misses(self.monitors)
        with torch.no_grad():
            self.start_scales = self.readout.locations(slice(None))[1]
        self.start_widths = self._width_state()
        start = float(self.start_misses.median()) if len(rows.y) else math.inf
        self.best_by_kind = self._errors_by_kind(self.start_misses)
        self.record = LearningRecord(start_error=start, best_error=start)
        self.record.curve.append((0, start))

    def _misses(self, monitors: list[_WhitenedReadout]) -> torch.Tensor:
        return _unseen_misses(self.rows, monitors)

    def unseen_locations(self) -> torch.Tensor:
        """Each row's location `[N]` by the monitor that does not see it."""
        return _unseen_locations(self.rows, self.monitors)

    def step(self) -> float:
        """One step of every read-out; writes the model's where the monitors' is the best so far. Returns the
        monitors' median absolute error on the rows they did not see."""
        if len(self.monitors) < 2:  # no row both trains and is held out
            return self.record.best_error
        for monitor in self.monitors:
            monitor.step()
        self.readout.step()
        self.steps += 1
        locations = self.unseen_locations()
        misses = (locations - self.rows.y).abs()
        error = float(misses.median())
        self.record.curve.append((self.steps, error))
        by_kind = self._errors_by_kind(misses)
        # Better pooled, and no kind of row worse than the best state's by more than `_KIND_SLACK` (or a
        # `_KIND_SHARE` of its error): a pooled median can fall while one task's error rises.
        slack = (self.best_by_kind * _KIND_SHARE).clamp(min=_KIND_SLACK)
        counted = self.kinds.bincount() >= _ROWS_PER_KIND // 2  # a kind of a few rows is its noise
        if error < self.record.best_error and bool((by_kind <= self.best_by_kind + slack)[counted].all()):
            self.record.best_error, self.record.best_step = error, self.steps
            self.best_by_kind = by_kind
            self._write()
            self._follow_widths(misses)
        return error

    def _errors_by_kind(self, misses: torch.Tensor) -> torch.Tensor:
        """The median of `misses` `[N]` over the rows of each kind `[K]`."""
        if not len(misses):
            return torch.zeros(0, dtype=torch.float64)
        return torch.stack([misses[self.kinds == k].median() for k in range(int(self.kinds.max()) + 1)])

    @torch.no_grad()
    def _write(self) -> None:
        w, b = self.readout.weights()
        head = self.action.reg_head
        head.weight.copy_(w.to(head.weight)[None])
        head.bias.copy_(b.to(head.bias))

    def _width_state(self) -> dict[str, torch.Tensor] | None:
        """The start's width parameters the learner moves: the path's width map, or γ_Y without the path; None where
        the value has no width of its own (γ_Y = 0) or the learner was given no abduction network."""
        if self.abduction is None or self.noise == 0.0:
            return None
        path = self.abduction.context_values
        if path is not None:
            return {"weight": path.width.weight.detach().clone(), "bias": path.width.bias.detach().clone()}
        return {"log_noise": self.action.reg_log_noise.detach().clone()}

    def width_map(self, misses: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(α `[C]`, β): log ρ moves by α·x + β, the ridge regression on the rows' leading principal coordinates (at
        most `_CALIBRATION_DIMS`, one per `_ROWS_PER_MAP_DIM` rows) of the change of log ρ that gives each row the
        start's width times its miss ratio (`misses` `[N]`, the monitors', over theirs at step 0; misses below
        `_EXACT_MISS` count as that). The read-out's own spread π_0·(s·|w|) stays: where it alone is wider than
        that, ρ's part falls to `_LEAST_SHARE` of it."""
        r = self.rows
        wanted = self.start_scales * misses.clamp(min=_EXACT_MISS) / self.start_misses.clamp(min=_EXACT_MISS)
        with torch.no_grad():
            spread = r.linear_weight * (r.s @ self.readout.weights()[0].abs())
        target = (torch.maximum(wanted - spread, wanted * _LEAST_SHARE) / (self.noise * r.width)).log()
        design, gram, to_x, mean = self._width_design
        fit = torch.linalg.solve(gram, design.T @ target)
        alpha = to_x @ fit[1:]
        return alpha, float(fit[0] - (alpha * mean).sum())

    @functools.cached_property
    def _width_design(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What `width_map` regresses on, the same at every write (the rows do not change): the design `[N, 1 + d]`
        (1 and the rows' leading d principal coordinates, of unit variance so that one ridge weighs each alike), its
        penalised Gram matrix, the map from coordinates back to x's weights `[C, d]`, and x's mean `[C]`."""
        x = self.rows.x
        n = len(x)
        dims = min(_CALIBRATION_DIMS, x.shape[1], n // _ROWS_PER_MAP_DIM)
        mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
        standard = (x - mean) / std
        _, singular, vh = torch.linalg.svd(standard, full_matrices=False)
        to_coords = vh[:dims].T / (singular[:dims] / math.sqrt(n)).clamp(min=1e-12)
        design = torch.cat((torch.ones(n, 1, dtype=x.dtype), standard @ to_coords), 1)
        penalty = torch.full((dims + 1,), _CALIBRATION_RIDGE * n, dtype=x.dtype)
        penalty[0] = 0.0  # the shift is not penalised
        return design, design.T @ design + penalty.diag(), to_coords / std[:, None], mean

    @torch.no_grad()
    def _follow_widths(self, misses: torch.Tensor) -> None:
        """Write the start's widths moved by `width_map(misses)` into the model."""
        if self.start_widths is None or len(misses) < 2:
            return
        alpha, beta = self.width_map(misses)
        path = self.abduction.context_values
        if path is None:  # one width for every row: the map's mean over the rows
            shift = beta + float((self.rows.x @ alpha).mean())
            self.action.reg_log_noise.copy_(self.start_widths["log_noise"] + shift)
            return
        loc_net = self.abduction.loc_net
        weight = loc_net.weight.detach().double().cpu()  # loc_U = W·z + b
        bias = loc_net.bias.detach().double().cpu()
        start = self.start_widths
        path.width.weight.copy_((start["weight"].double().cpu() + (alpha @ weight)[None]).to(path.width.weight))
        path.width.bias.copy_((start["bias"].double().cpu() + alpha @ bias + beta).to(path.width.bias))
