"""The start of a model whose value side was fitted before, on new data ([`start_on_new_data`]): its value side, or
one fitted afresh on the new rows, whichever reads them better on held-out folds."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from transformers.utils import logging

from .learning import ValueLearning, start_score
from .readout import (
    PENALTIES,
    ValueHeadFit,
    ValueStart,
    _fit_value_side,
    _learning_rows,
    _leaves_random_state,
    _read_rows_in_eval,
)

__all__ = ["start_on_new_data"]

logger = logging.get_logger(__name__)


def _value_side_state(model) -> dict[str, torch.Tensor]:
    """A copy of what [`_fit_value_side`] writes: the read-out (`w_reg`, `b_reg`, γ_Y) and the context-value path."""
    parts = {"reg_head": model.action.reg_head, "context_values": getattr(model.abduction, "context_values", None)}
    state = {f"{owner}.{name}": tensor.detach().clone() for owner, module in parts.items() if module is not None
             for name, tensor in module.state_dict().items()}
    if model.action.reg_log_noise is not None:
        state["reg_log_noise"] = model.action.reg_log_noise.detach().clone()
    return state


@torch.no_grad()
def _load_value_side_state(model, state: dict[str, torch.Tensor]) -> None:
    def part(owner: str) -> dict[str, torch.Tensor]:
        return {name.split(".", 1)[1]: value for name, value in state.items() if name.startswith(f"{owner}.")}

    model.action.reg_head.load_state_dict(part("reg_head"))
    path = getattr(model.abduction, "context_values", None)
    if path is not None:
        path.load_state_dict(part("context_values"))
    if "reg_log_noise" in state:
        model.action.reg_log_noise.copy_(state["reg_log_noise"])


@_leaves_random_state
@torch.no_grad()
def start_on_new_data(model, batches: Iterable[Mapping[str, torch.Tensor]], *, learning: ValueLearning | None = None,
                      max_positions: int = 4096, penalties: Sequence[float] = PENALTIES,
                      context_starts: int | None = None) -> ValueStart:
    """The start of a model whose value side was fitted before (a checkpoint trained on one table, fine-tuned on
    another): its value side as it is, or one fitted afresh on the rows of `batches` (the read-out and the
    context-value path, as [`fit_value_head`] fits them; the `<NUM>` decision stays as trained), whichever reads
    those rows better on the folds (`learning.start_score`: the median miss of read-outs on the rows they did not
    see, every kind of row alike).

    A checkpoint's path chose its candidates on its own table: one that copies a stated number where that table's
    answer was one reads another table's prices as a stated measurement, and steps of the read-out cannot undo the
    path's choice (docs/experiments.md, "A checkpoint on another table"). The fresh path is scored on rows its fit saw
    (four fifths of them), so on rows like its own table's the checkpoint's is kept only where it reads them better by
    more than that favour. Where the fresh fit is kept, `config.value_head_fit` records it (the `<NUM>` decision's
    fields stay the checkpoint's). Leaves the global random state as it was."""
    rows = _read_rows_in_eval(model, batches, max_positions, 0, "start_on_new_data")
    settings = ValueLearning() if learning is None else learning
    before = dict(model.config.value_head_fit or {})
    kept_penalty = float(before.get("penalty", penalties[len(penalties) // 2]))
    kept_rows = _learning_rows(model, rows)
    kept_score = start_score(model.action, kept_rows, settings, kept_penalty, fitted_on_rows=False)
    kept_state = _value_side_state(model)
    fields = _fit_value_side(model, rows, penalties, context_starts)
    fresh_rows = _learning_rows(model, rows)
    fresh_score = start_score(model.action, fresh_rows, settings, fields["penalty"], fitted_on_rows=True)
    logger.info(f"start_on_new_data: the value side fitted before reads the new rows at {kept_score:.4g}, one fitted "
                f"on them at {fresh_score:.4g} (median miss on the rows each fold did not see, head space)")
    if fresh_score < kept_score:
        decision = {name: value for name, value in before.items() if name.startswith("num_")}
        fit = ValueHeadFit(**{**decision, **fields})
        model.config.value_head_fit = fit.to_dict()
        return ValueStart(fit, fresh_rows, fitted_on_rows=True)
    _load_value_side_state(model, kept_state)
    fit = ValueHeadFit(positions=int(rows.x.shape[0]), penalty=kept_penalty, loo_median_abs_error=math.nan,
                       regression_noise=None)
    return ValueStart(fit, kept_rows, fitted_on_rows=False)
