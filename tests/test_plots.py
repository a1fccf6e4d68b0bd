"""The evaluation plots are written for any prediction the model makes, one past float64's range included, and
their value axes carry round values a reader can read off."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from causal_qwen import CausalQwenForCausalLM
from causal_qwen.metrics import FIELDS
from causal_qwen.plots import _round_value_ticks, _tick_label, plot_loss_curves, plot_predictions

pytest.importorskip("matplotlib")


def _stats(true_value, loc_y, scale_y) -> torch.Tensor:
    stats = torch.zeros(len(true_value), len(FIELDS))
    for name, column in (("valid", [1] * len(true_value)), ("target_is_num", [1] * len(true_value)),
                         ("true_value", true_value), ("loc_y", loc_y), ("scale_y", scale_y)):
        stats[:, FIELDS.index(name)] = torch.tensor(column, dtype=torch.float32)
    return stats


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


def test_an_interval_near_float64s_largest_value_is_plotted_without_a_warning(tiny_qwen, tmp_path):
    """A bound near 1e300 once pushed the axis's own margin past float64 (numpy's "overflow encountered in exp"):
    the plot's limits come from the values it shows, and an interval is drawn up to the edge."""
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=120)
    stats = _stats([3.0, 40.0, 900.0], [1.4, 3.7, 6.8], [0.1, 0.2, 108.0])
    low, high = model.value_interval(*(stats[:, FIELDS.index(n)].double() for n in ("loc_y", "scale_y")))[1:]
    assert low[2] < -1e290 and 1e290 < high[2] < float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_predictions(model, stats, tmp_path / "predictions.png").is_file()


def _symlog_transform():
    from matplotlib.scale import SymmetricalLogTransform

    return SymmetricalLogTransform(base=10, linthresh=2, linscale=1)  # plot_predictions' axes


def _log_transform():
    from matplotlib.scale import LogTransform

    return LogTransform(10)


@pytest.mark.parametrize("transform", [_symlog_transform, _log_transform])
def test_a_range_within_one_decade_carries_several_labels(transform):
    """A table's column of miles per gallon, 9 to 46: matplotlib's log axes label only 10 there."""
    major, minor = _round_value_ticks(transform(), 8.5, 48.0)
    assert {10, 20, 30, 40} <= set(major) and len(major) <= 12
    assert 15 not in major and all(8.5 <= v <= 48 for v in major + minor) and not set(major) & set(minor)


@pytest.mark.parametrize("transform", [_symlog_transform, _log_transform])
def test_an_end_far_from_every_round_label_gets_one(transform):
    """Miles per gallon from 10.5 to 50: 20, 30, 40, 50 leave two fifths of the axis below 20 without a label."""
    major, _ = _round_value_ticks(transform(), 10.5, 50.0)
    assert {20, 30, 40, 50} <= set(major) and min(major) < 20 and all(10.5 <= v <= 50 for v in major)
    at = sorted(transform().transform([[v] for v in [10.5, *major]]).ravel())
    assert max(b - a for a, b in zip(at, at[1:], strict=False)) <= 3 / 12 * (at[-1] - at[0]) * 1.5
    negative, _ = _round_value_ticks(_symlog_transform(), -50.0, -10.5)
    assert max(negative) > -20


@pytest.mark.parametrize("transform", [_symlog_transform, _log_transform])
def test_a_range_of_decades_is_labelled_one_two_five(transform):
    major, minor = _round_value_ticks(transform(), 9.0, 5100.0)
    assert major == [10, 20, 50, 100, 200, 500, 1000, 2000, 5000]
    assert {30, 40, 300, 3000} <= set(minor)


def test_a_range_across_zero_is_labelled_on_both_sides():
    major, _ = _round_value_ticks(_symlog_transform(), -60.0, 60.0)
    assert 0 in major and {-10, 10, -1, 1} <= set(major)
    assert sorted(-v for v in major) == major  # symmetric
    assert not [v for v in major if 0 < abs(v) < 1]  # nothing crowds 0 in the linear part


def test_many_decades_label_some_powers_of_ten_and_nothing_between():
    major, _ = _round_value_ticks(_symlog_transform(), -1e10, 1e18)
    assert len(major) <= 12 and 0 in major
    assert all(v == 0 or abs(v) == 10 ** round(math.log10(abs(v))) for v in major)


def test_a_narrow_range_gets_evenly_spaced_values():
    major, _ = _round_value_ticks(_log_transform(), 21.0, 29.0)  # no 1, 2 or 5 times a power of ten inside
    assert len(major) >= 3 and all(21 <= v <= 29 for v in major)
    steps = {round(b - a, 9) for a, b in zip(major, major[1:], strict=False)}
    assert len(steps) == 1


@pytest.mark.parametrize(("value", "label"), [(0, "0"), (20, "20"), (0.5, "0.5"), (5000, "5000"), (-200, "-200"),
                                             (1e6, "$10^{6}$"), (-1e8, "$-10^{8}$"), (2e7, "$2\\times10^{7}$"),
                                             (1e-5, "$10^{-5}$")])
def test_tick_labels_are_plain_numbers(value, label):
    assert _tick_label(value) == label


def test_a_log_scaled_loss_curve_is_labelled_with_round_values(tmp_path, monkeypatch):
    import matplotlib.figure

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *args, **kwargs: saved.append(fig))
    history = [{"step": step, "loss": 14.0 / step} for step in range(1, 21)]  # 14 down to 0.7
    plot_loss_curves(history, tmp_path / "loss.png")
    (ax,) = saved[0].axes
    assert ax.get_yscale() == "log"
    labels = [tick.get_text() for tick in ax.get_yticklabels() if tick.get_text()]
    assert {"1", "2", "5", "10"} <= set(labels)


def test_predictions_within_one_decade_can_be_read_off(tiny_qwen, tmp_path, monkeypatch):
    """Miles per gallon, 9 to 46, predicted near the truth: both axes label 10, 20, 30 and 40 (a symlog axis of
    matplotlib labels 10 alone)."""
    import matplotlib.figure

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *args, **kwargs: saved.append(fig))
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=120)
    true = torch.linspace(9, 46, 30)
    plot_predictions(model, _stats(true.tolist(), torch.log1p(true * 1.1).tolist(), [0.1] * 30),
                     tmp_path / "predictions.png")
    (ax,) = saved[0].axes
    for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
        assert {"10", "20", "30", "40"} <= {label.get_text() for label in labels}
