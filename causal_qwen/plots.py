"""Plots of training and evaluation, saved as PNG files (matplotlib, no display needed)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .metrics import FIELDS

__all__ = ["plot_loss_curves", "plot_predictions", "plot_u_scale", "plot_evaluation"]


def _pyplot():
    try:
        import matplotlib
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("plots need matplotlib, a dependency of causal_qwen: pip install matplotlib") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss_curves(log_history: list[dict], path: str | Path) -> Path:
    """Training loss (and evaluation loss when logged) against the step, from `trainer.state.log_history`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    plotted: list[float] = []
    for key, label in (("loss", "train loss"), ("eval_loss", "eval loss")):
        points = [(entry["step"], entry[key]) for entry in log_history if key in entry and "step" in entry]
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker="o" if len(points) < 30 else None, label=label)
            plotted += values
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    # A log axis only where the losses span more than a factor of 10: on a narrow range it hides the trend.
    if plotted and min(plotted) > 0 and max(plotted) > 10 * min(plotted):
        ax.set_yscale("log")
        ax.set_ylim(*_padded_limits(ax.yaxis, min(plotted), max(plotted)))
        _label_round_values(ax.yaxis)
    ax.set_title("loss")
    ax.legend()
    return _save(fig, path)


def plot_predictions(model, stats: torch.Tensor, path: str | Path) -> Path:
    """Predicted median against the true value at every `<NUM>` target, with the 50% and 90% Cauchy intervals."""
    plt = _pyplot()
    col = _columns(stats)
    rows = col["target_is_num"] == 1.0
    loc_y, scale_y, true = col["loc_y"][rows], col["scale_y"][rows], col["true_value"][rows]
    fig, ax = plt.subplots(figsize=(6, 6))
    if true.numel():
        median, low90, high90 = model.value_interval(loc_y, scale_y, coverage=0.9)
        _, low50, high50 = model.value_interval(loc_y, scale_y, coverage=0.5)
        ax.set_xscale("symlog")
        ax.set_yscale("symlog")
        # The limits read the true values and the finite medians (one past the dtype's range, a value the model puts
        # beyond it, is inf); an interval is drawn up to the edge of the plot, not to its bound, which can be inf or
        # past what the axis can invert.
        lo, hi = float(true.min()), float(true.max())
        finite = median[median.isfinite()]
        x_limits = _padded_limits(ax.xaxis, lo, hi)
        y_limits = _padded_limits(ax.yaxis, min(lo, float(finite.min())) if finite.numel() else lo,
                                  max(hi, float(finite.max())) if finite.numel() else hi)
        order = torch.argsort(true)
        t = true[order].numpy()
        for low, high, alpha, label in ((low90, high90, 0.2, "90% interval"), (low50, high50, 0.5, "50% interval")):
            # Say how often the interval holds the truth: a too narrow interval is invisible on the plot.
            covered = ((true >= low) & (true <= high)).double().mean().item()
            ax.vlines(t, low[order].clamp(*y_limits).numpy(), high[order].clamp(*y_limits).numpy(),
                      color="tab:blue", alpha=alpha, lw=3, label=f"{label} (covers {covered:.0%})")
        ax.scatter(t, median[order].numpy(), s=10, color="tab:red", zorder=3, label="predicted median")
        ax.plot([lo, hi], [lo, hi], color="k", lw=1, ls="--", label="y = x")
        ax.set_xlim(*x_limits)
        ax.set_ylim(*y_limits)
        _label_round_values(ax.xaxis)
        _label_round_values(ax.yaxis)
    ax.set_xlabel("true value")
    ax.set_ylabel("predicted value")
    ax.set_title(f"numbers: predicted vs true ({int(rows.sum())} targets)")
    ax.legend(loc="upper left", fontsize=8)
    return _save(fig, path)


def plot_u_scale(stats: torch.Tensor, path: str | Path) -> Path:
    """Distribution over valid positions of the per-position mean of scale_U."""
    plt = _pyplot()
    values = _columns(stats)["u_scale"]
    fig, ax = plt.subplots(figsize=(6, 4))
    if values.numel():
        positive = values.clamp(min=1e-12).log10().numpy()
        ax.hist(positive, bins=50, color="tab:green")
    ax.set_xlabel("log10 of mean scale_U at a position")
    ax.set_ylabel("positions")
    ax.set_title("U_scale distribution")
    return _save(fig, path)


def plot_evaluation(model, stats: torch.Tensor, directory: str | Path) -> list[Path]:
    """Both evaluation plots into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return [
        plot_predictions(model, stats, directory / "predictions.png"),
        plot_u_scale(stats, directory / "u_scale.png"),
    ]


# An end of the axis this many label spacings from its nearest label gets labels of its own (`_fill_ends`).
_BARE_END = 3
# The largest magnitude an axis is given: its scale maps the limits and inverts them again, which overflows near
# float64's largest value.
_AXIS_RANGE = 1e300


def _padded_limits(axis, low: float, high: float, margin: float = 0.05) -> tuple[float, float]:
    """`(low, high)` widened by `margin` of the span on the axis's scale (log, symlog or linear), as matplotlib's
    autoscale would, and held within +-1e300."""
    transform = axis.get_transform()
    low, high = (min(max(v, -_AXIS_RANGE), _AXIS_RANGE) for v in (low, high))
    t_low, t_high = transform.transform([low, high])
    pad = margin * (t_high - t_low) if t_high > t_low else 0.5
    padded = transform.inverted().transform([t_low - pad, t_high + pad])
    if low > 0 and not padded[0] > 0:  # a log axis: below the smallest positive value there is nothing
        padded[0] = low / 2
    return float(padded[0]), float(padded[1])


def _label_round_values(axis, max_labels: int = 12) -> None:
    """Label the axis with round values (1, 2, 5 and the other digits times a power of ten, and 0), as many as fit
    without crowding, written as plain numbers; the unlabelled digits times a power of ten get minor ticks.

    matplotlib's log and symlog axes label only powers of ten, so a range within one decade carries one label, or
    none."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    low, high = sorted(axis.get_view_interval())
    major, minor = _round_value_ticks(axis.get_transform(), low, high, max_labels)
    axis.set_major_locator(FixedLocator(major))
    axis.set_major_formatter(FuncFormatter(lambda value, _position: _tick_label(value)))
    axis.set_minor_locator(FixedLocator(minor))
    axis.set_minor_formatter(NullFormatter())


def _round_value_ticks(transform, low: float, high: float, max_labels: int = 12) -> tuple[list[float], list[float]]:
    """The labelled (major) and unlabelled (minor) ticks of `_label_round_values` in `[low, high]`, whose positions
    `transform` (the axis scale's, value -> position) gives.

    Candidates are 0 and +-d * 10^k, d = 1..9. Labelled are 0, the powers of ten, then 5 and 2 times them (the largest
    magnitude first within each), each where it lies at least 1/max_labels of the axis from every one labelled
    before, a 5 or a 2 only between labelled powers of ten (or the ends of the axis), so that an axis labelled every
    few decades does not label a 500 alone. The other digits are labelled in the same way where these give fewer than
    four labels (a range within a decade: 10, 20, 30, 40), and evenly spaced round values where even they give fewer
    than three. The other candidates are minor ticks, at least 1/(8 max_labels) of the axis apart."""
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [], []

    def position(values: list[float]) -> np.ndarray:
        return np.asarray(transform.transform(np.asarray(values, dtype=float).reshape(-1, 1))).reshape(-1)

    t_low, t_high = position([low, high])
    gap = (t_high - t_low) / max_labels
    crosses = low <= 0 <= high
    top = math.ceil(math.log10(max(abs(low), abs(high))))
    bottom = max(top - 330 if crosses else math.floor(math.log10(min(abs(low), abs(high)))), -300)
    rank = {1: 1, 5: 2, 2: 3}
    candidates = [(0, 0.0, ())] if crosses else []
    candidates += [(rank.get(d, 4), sign * d * 10.0 ** k, () if d == 1 else (sign * 10.0 ** k, sign * 10.0 ** (k + 1)))
                   for k in range(bottom, top + 1) for d in range(1, 10) for sign in (1, -1)
                   if low <= sign * d * 10.0 ** k <= high]
    at = position([value for _, value, _ in candidates]) if candidates else np.zeros(0)
    if crosses:  # the magnitudes that crowd 0 (a symlog axis's linear part squeezes every small one onto it)
        keep = (np.abs(at - position([0.0])[0]) >= gap / 8) | np.array([value == 0 for _, value, _ in candidates])
        candidates, at = [c for c, kept in zip(candidates, keep, strict=True) if kept], at[keep]
    order = sorted(range(len(candidates)), key=lambda i: (candidates[i][0], -abs(candidates[i][1])))

    def spread(indices: list[int], spacing: float, kept: dict[float, float], between: bool) -> dict[float, float]:
        kept = dict(kept)
        for i in indices:
            _, value, ends = candidates[i]
            if between and any(low <= end <= high and end not in kept for end in ends):
                continue
            if all(abs(at[i] - other) >= spacing for other in kept.values()):
                kept[value] = float(at[i])
        return kept

    labelled = spread([i for i in order if candidates[i][0] <= 3], gap, {}, between=True)
    if len(labelled) < 4:
        labelled = spread([i for i in order if candidates[i][0] == 4], gap, labelled, between=True)
    major = sorted(labelled)
    if len(major) < 3:
        major = [float(v) for v in MaxNLocator(nbins=max_labels // 2, steps=[1, 2, 2.5, 5, 10]).tick_values(low, high)
                 if low <= v <= high]
    major = _fill_ends(major, low, high, position, gap)
    minor = spread([i for i in order if candidates[i][1] not in major], gap / 8, {}, between=False)
    return major, sorted(minor)


def _fill_ends(major: list[float], low: float, high: float, position, gap: float) -> list[float]:
    """`major` with round values added where an end of the axis lies more than `_BARE_END` gaps from its nearest
    label (an axis from 10.5 to 50 labelled 20, 30, 40, 50 gets 15: values there are read off a label), each at least
    a gap from the others."""
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    if not major:
        return major
    kept = list(major)
    for start, end in ((low, major[0]), (major[-1], high)):
        if float(np.diff(position([start, end]))[0]) <= _BARE_END * gap:
            continue
        for value in MaxNLocator(nbins=2, steps=[1, 2, 2.5, 5, 10]).tick_values(start, end):
            at = position([float(value)])[0]
            if start <= value <= end and all(abs(at - other) >= gap for other in position(kept)):
                kept.append(float(value))
    return sorted(kept)


def _tick_label(value: float) -> str:
    """A tick's value as a plain number (`20`, `0.5`, `5000`), in powers of ten past 10^6 or below 10^-4."""
    if value == 0:
        return "0"
    if 1e-4 <= abs(value) < 1e6:
        return f"{value:g}"
    mantissa, exponent = f"{value:.3g}".split("e")
    power = f"10^{{{int(exponent)}}}"
    if mantissa in ("1", "-1"):
        return f"${mantissa[:-1]}{power}$"
    return f"${mantissa}\\times{power}$"


def _columns(stats: torch.Tensor) -> dict[str, torch.Tensor]:
    stats = stats.detach().reshape(-1, len(FIELDS)).double().cpu()  # matplotlib reads host memory
    stats = stats[stats[:, FIELDS.index("valid")] == 1.0]
    return {name: stats[:, i] for i, name in enumerate(FIELDS)}


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
