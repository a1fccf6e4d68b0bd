"""The widths ρ of the context-value path once its fit is kept: fitted again on the read-out's leave-one-out
locations (`_refit_widths`), and calibrated on the held-out rows (`_calibrate_width`)."""

from __future__ import annotations

import torch

from ..cauchy import nll
from ..context_values import MAX_LOG_WIDTH
from .path_rows import _descend, _read, _Rows

_MIN_CALIBRATION_ROWS = 20  # fewer held-out rows leave the widths as fitted
# The widths' calibration reads the leading principal coordinates of the query, as many as this and at most one per
# `_ROWS_PER_WIDTH_DIM` held-out rows (`_calibrate_width`).
_CALIBRATION_DIMS = 4
_ROWS_PER_WIDTH_DIM = 25
# A ridge on the calibration's shifts and map, so that one the held-out rows cannot tell stays near 0 (per row's
# NLL; a Cauchy NLL's curvature in a log width is 1/2 per row).
_CALIBRATION_RIDGE = 1e-2


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
