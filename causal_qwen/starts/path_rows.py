"""The rows of the context-value path's fit in principal coordinates (`_Rows`), the path's read of them, and the
descent that the fits of its locations, its choice and its widths share (`_descend`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

_STEPS = 3000
_PATIENCE = 200  # steps without a better held-out value before the fit stops
_LEARNING_RATE = 1e-2


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


def _value(path, transform, rows: _Rows, noise):
    """The value's `(loc, scale)` `[N]` through `path` on coordinates (`ContextRead.apply`)."""
    loc, scale = _read(path, transform, rows).apply(rows.loc_linear[:, None], rows.spread[:, None], noise)
    return loc[:, 0], scale[:, 0]


def _read(path, transform, rows: _Rows):
    own, before = rows.keys.chunk(2, dim=-1)
    return path.read(rows.queries[:, None], path.keys(own, before), rows.entries, rows.present[:, None], transform)


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


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
