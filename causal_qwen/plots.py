"""Plots of training and evaluation, saved as PNG files (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import torch

from .metrics import FIELDS

__all__ = ["plot_loss_curves", "plot_predictions", "plot_u_scale", "plot_evaluation"]


def _pyplot():
    try:
        import matplotlib
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("plots need matplotlib: pip install 'causal_qwen[plots]'") from error
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
        order = torch.argsort(true)
        t = true[order].numpy()
        for low, high, alpha, label in ((low90, high90, 0.2, "90% interval"), (low50, high50, 0.5, "50% interval")):
            # Say how often the interval holds the truth: a too narrow interval is invisible on the plot.
            covered = ((true >= low) & (true <= high)).double().mean().item()
            ax.vlines(t, low[order].numpy(), high[order].numpy(), color="tab:blue", alpha=alpha, lw=3,
                      label=f"{label} (covers {covered:.0%})")
        ax.scatter(t, median[order].numpy(), s=10, color="tab:red", zorder=3, label="predicted median")
        lo, hi = float(true.min()), float(true.max())
        ax.plot([lo, hi], [lo, hi], color="k", lw=1, ls="--", label="y = x")
        ax.set_xscale("symlog")
        ax.set_yscale("symlog")
        # A median past the dtype's range (a value the model puts beyond it) is inf: the limits read the finite ones.
        finite = median[median.isfinite()]
        low_limit = min(lo, float(finite.min())) if finite.numel() else lo
        high_limit = max(hi, float(finite.max())) if finite.numel() else hi
        ax.set_ylim(low_limit - 1, high_limit * 2 + 1)
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
