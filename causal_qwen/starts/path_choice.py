"""The choice among the context-value path's candidates once its locations are fitted: the mean's score, fitted to
say where the mean of the earlier numbers is the target (`_fit_choice`), and the candidates the kept fit does not
use, switched off (`_switch_off_unused`)."""

from __future__ import annotations

import torch

from ..cauchy import transform_values
from ..context_values import CANDIDATES
from .path_rows import _descend, _read, _Rows, _state, _value

# The mean of the earlier values is the target where it is within this distance of it in the head's space (about 2%
# of a value in symlog space), and its score is fitted to say so (`_fit_choice`), kept where the held-out error of the
# other rows rises by at most `_CHOICE_SLACK` of itself.
_CHOICE_TOLERANCE = 0.02
_CHOICE_SLACK = 0.02
# A combination or the mean whose removal raises the held-out NLL by at most this is switched off: its score is this
# constant, whose weight in the float64 softmax is exactly 0 at every position.
_UNUSED_TOLERANCE = 1e-3
_OFF_SCORE = -1e4


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
