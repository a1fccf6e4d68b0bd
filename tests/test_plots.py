"""The evaluation plots are written for any prediction the model makes, one past float64's range included."""

from __future__ import annotations

import pytest
import torch

from causal_qwen import CausalQwenForCausalLM
from causal_qwen.metrics import FIELDS
from causal_qwen.plots import plot_predictions

pytest.importorskip("matplotlib")


def test_a_median_past_the_range_is_plotted(tiny_qwen, tmp_path):
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=120)
    stats = torch.zeros(3, len(FIELDS))
    for name, column in (("valid", [1, 1, 1]), ("target_is_num", [1, 1, 1]), ("true_value", [3.0, 40.0, 31943.0]),
                         ("loc_y", [1.0, 3.5, 1312.8]), ("scale_y", [0.1, 0.2, 2e14])):
        stats[:, FIELDS.index(name)] = torch.tensor(column)
    # symexp(1312.8) is past float64's largest value: the median is inf, and the plot keeps its finite limits.
    loc, scale = (stats[:, FIELDS.index(name)].double() for name in ("loc_y", "scale_y"))
    median = model.value_interval(loc, scale)[0]
    assert torch.isinf(median[2]) and median[:2].isfinite().all()
    path = plot_predictions(model, stats, tmp_path / "predictions.png")
    assert path.is_file() and path.stat().st_size > 0
