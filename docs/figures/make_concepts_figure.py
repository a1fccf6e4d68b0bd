"""Draw docs/figures/concepts.png: OvR decisions in standard and causal mode, and a regression interval."""

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def cauchy_pdf(x: np.ndarray, loc: float, scale: float) -> np.ndarray:
    return scale / (math.pi * ((x - loc) ** 2 + scale**2))


def ovr(loc: float, scale: float, threshold: float) -> float:
    return 0.5 + math.atan((loc - threshold) / scale) / math.pi


def main() -> None:
    x = np.linspace(-6, 10, 2000)
    threshold = 3.0
    classes = [("'cat'", 4.0), ("'dog'", 2.0), ("'<NUM>'", 0.5)]
    colors = ["tab:blue", "tab:orange", "tab:green"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))

    ax = axes[0]
    for (name, loc), color in zip(classes, colors, strict=True):
        scale = 1.2
        y = cauchy_pdf(x, loc, scale)
        ax.plot(x, y, color=color, label=f"S {name}: P = {ovr(loc, scale, threshold):.2f}")
        ax.fill_between(x, y, where=x > threshold, color=color, alpha=0.25)
    ax.axvline(threshold, color="k", ls="--", lw=1)
    ax.text(threshold + 0.1, 0.27, "threshold C", fontsize=9)
    ax.set_title("standard mode: U as a distribution\nP_k = P(S_k > C), each class decided on its own")
    ax.set_xlabel("decision score S_k")
    ax.legend(fontsize=8, loc="upper left")

    ax = axes[1]
    # One sampled individual moves each class's score by its own amount W_k·(u − loc_U).
    shifts = [-4.3, 4.4, -4.4]
    for (name, loc), shift, color in zip(classes, shifts, colors, strict=True):
        scale, noise = 1.2, 0.35
        ax.plot(x, cauchy_pdf(x, loc, scale), color=color, alpha=0.25)
        y = cauchy_pdf(x, loc + shift, noise)
        ax.plot(x, y, color=color, label=f"S {name} | u: P = {ovr(loc + shift, noise, threshold):.2f}")
        ax.fill_between(x, y, where=x > threshold, color=color, alpha=0.25)
    ax.axvline(threshold, color="k", ls="--", lw=1)
    ax.set_title("causal mode: sample one individual u\nonly the exogenous noise |b_noise| stays uncertain")
    ax.set_xlabel("decision score S_k given u")
    ax.legend(fontsize=8, loc="upper left")

    ax = axes[2]
    loc_y, scale_y = 42.0, 3.0
    xr = np.linspace(20, 65, 2000)
    ax.plot(xr, cauchy_pdf(xr, loc_y, scale_y), color="tab:purple")
    for p, alpha in ((0.9, 0.15), (0.5, 0.35)):
        tail = (1 - p) / 2
        low = loc_y + scale_y * math.tan(math.pi * (tail - 0.5))
        high = loc_y + scale_y * math.tan(math.pi * (0.5 - tail))
        mask = (xr >= low) & (xr <= high)
        ax.fill_between(xr[mask], cauchy_pdf(xr[mask], loc_y, scale_y), color="tab:purple", alpha=alpha,
                        label=f"{int(p * 100)}% interval [{low:.1f}, {high:.1f}]")
    ax.axvline(loc_y, color="k", lw=1)
    ax.text(loc_y + 0.5, 0.1, "median loc_Y", fontsize=9)
    ax.set_title("regression: the value after <NUM>\nY ~ Cauchy(loc_Y, scale_Y): a median and intervals")
    ax.set_xlabel("value")
    ax.legend(fontsize=8, loc="upper left")

    fig.tight_layout()
    out = Path(__file__).with_name("concepts.png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
