"""Metrics of docs/design.md §6, from one place: standalone, or as `compute_metrics` for `Trainer`.

Everything is computed per valid position first (a handful of numbers per position, never a
`[B, S, V]` tensor kept across batches), then summarised:

- `eval/accuracy` (argmax of the OvR probabilities, i.e. `standard` mode), `eval/ppl_softmax`
  (softmax over `loc_S`), `eval/ppl_ovr` (P_y / Σ_k P_k), `eval/num_{precision,recall,f1}`;
- `eval/reg_*` at positions whose target is `<NUM>`: errors of the median, R² (also on
  sign·log10(1+|x|)), median relative error, coverage of the central 50% / 90% Cauchy intervals;
- `dist/*`: U statistics, |b_noise|, the threshold when learnable, and the median per-position sum of
  OvR probabilities in standard mode and in causal mode (one sampled individual per position).

`dist/U_loc_*` and `dist/U_scale_*` are statistics over valid positions of the per-position mean over
the C dimensions of `loc_U` and `scale_U`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from . import cauchy
from .labels import IGNORE_INDEX, next_token_targets

__all__ = ["position_statistics", "summarize", "point_errors", "evaluate", "CausalQwenMetrics"]

# Columns of the packed per-position statistics (see `position_statistics`).
FIELDS = (
    "valid", "correct", "pred_is_num", "target_is_num", "nll_softmax", "nll_ovr", "ovr_sum", "ovr_sum_causal",
    "loc_y", "scale_y", "true_value", "u_loc", "u_scale",
)


@torch.no_grad()
def position_statistics(
    model,
    loc_s: torch.Tensor,
    scale_s: torch.Tensor,
    loc_y: torch.Tensor | None,
    scale_y: torch.Tensor | None,
    loc_u: torch.Tensor,
    scale_u: torch.Tensor,
    labels: torch.Tensor,
    numeric_labels: torch.Tensor | None,
    generator: torch.Generator | None = None,
    chunk_size: int = 256,
) -> torch.Tensor:
    """Per-position statistics `[B, S, len(FIELDS)]` (float64) from one forward's unshifted outputs.

    Position i is scored against label i + 1; the last position and positions whose target is −100
    get `valid = 0` and zeros elsewhere. The `[*, V]` work is done `chunk_size` positions at a time.
    """
    batch, seq = labels.shape
    out = torch.zeros(batch, seq, len(FIELDS), dtype=torch.float64, device=labels.device)
    targets, true_values = next_token_targets(labels, numeric_labels)
    valid = targets != IGNORE_INDEX
    idx = valid.nonzero(as_tuple=True)
    if idx[0].numel() == 0:
        return out
    num_id = model.config.num_token_id if model.config.use_numeric else None
    action = model.action
    tgt = targets[idx]
    rows = []
    for start in range(0, tgt.numel(), chunk_size):
        sel = tuple(i[start:start + chunk_size] for i in idx)
        rows.append(_chunk_statistics(action, loc_s[sel].float(), scale_s[sel].float(), loc_u[sel].float(),
                                      scale_u[sel].float(), tgt[start:start + chunk_size], num_id, generator))
    stats = torch.cat(rows, 0)
    out[idx] = stats
    if loc_y is not None and num_id is not None:
        out[..., FIELDS.index("loc_y")][idx] = loc_y[idx].double()
        out[..., FIELDS.index("scale_y")][idx] = scale_y[idx].double()
        if true_values is not None:
            out[..., FIELDS.index("true_value")][idx] = true_values[idx].double()
    return out


def _chunk_statistics(action, loc_s, scale_s, loc_u, scale_u, targets, num_id, generator) -> torch.Tensor:
    """`[n, len(FIELDS)]` for n valid positions; regression columns are filled by the caller."""
    threshold = action.threshold.float()
    p = cauchy.ovr_probability(loc_s, scale_s, threshold)
    log_p_target = cauchy.ovr_log_probs(
        loc_s.gather(-1, targets[:, None]), scale_s.gather(-1, targets[:, None]),
        threshold.expand_as(loc_s).gather(-1, targets[:, None]),
    )[0].squeeze(-1)
    ovr_sum = p.sum(-1)
    pred = p.argmax(-1)
    nll_softmax = -torch.log_softmax(loc_s, -1).gather(-1, targets[:, None]).squeeze(-1)

    # Causal mode: one individual u per position, the decision then carries the noise alone.
    eps = cauchy.uniform(loc_u.shape, loc_u.device, generator)
    loc_c, scale_c = action.classify(*action.head_inputs(loc_u, scale_u, individual=eps))
    ovr_sum_causal = cauchy.ovr_probability(loc_c.float(), scale_c.float(), threshold).sum(-1)

    is_num = targets == num_id if num_id is not None else torch.zeros_like(targets, dtype=torch.bool)
    pred_num = pred == num_id if num_id is not None else torch.zeros_like(targets, dtype=torch.bool)
    columns = {
        "valid": torch.ones_like(ovr_sum),
        "correct": (pred == targets).float(),
        "pred_is_num": pred_num.float(),
        "target_is_num": is_num.float(),
        "nll_softmax": nll_softmax,
        "nll_ovr": -log_p_target + torch.log(ovr_sum),
        "ovr_sum": ovr_sum,
        "ovr_sum_causal": ovr_sum_causal,
        "u_loc": loc_u.mean(-1),
        "u_scale": scale_u.mean(-1),
    }
    n = targets.numel()
    stats = torch.zeros(n, len(FIELDS), dtype=torch.float64, device=targets.device)
    for name, column in columns.items():
        stats[:, FIELDS.index(name)] = column.double()
    return stats


def summarize(stats: torch.Tensor, model, prefix: str = "eval/") -> dict[str, float]:
    """Summarise packed statistics `[..., len(FIELDS)]` (rows with `valid != 1` are ignored)."""
    stats = stats.reshape(-1, len(FIELDS)).double()
    stats = stats[stats[:, FIELDS.index("valid")] == 1.0]
    col = {name: stats[:, i] for i, name in enumerate(FIELDS)}
    metrics: dict[str, float] = {}
    if stats.shape[0] == 0:
        return metrics
    # How many positions were scored: with prompt/completion data, only the completions'.
    metrics[f"{prefix}positions"] = float(stats.shape[0])
    metrics[f"{prefix}num_targets"] = col["target_is_num"].sum().item()
    metrics[f"{prefix}accuracy"] = col["correct"].mean().item()
    metrics[f"{prefix}ppl_softmax"] = math.exp(min(col["nll_softmax"].mean().item(), 700.0))
    metrics[f"{prefix}ppl_ovr"] = math.exp(min(col["nll_ovr"].mean().item(), 700.0))
    tp = (col["pred_is_num"] * col["target_is_num"]).sum().item()
    predicted, actual = col["pred_is_num"].sum().item(), col["target_is_num"].sum().item()
    precision = tp / predicted if predicted else 0.0
    recall = tp / actual if actual else 0.0
    metrics[f"{prefix}num_precision"] = precision
    metrics[f"{prefix}num_recall"] = recall
    metrics[f"{prefix}num_f1"] = 2 * precision * recall / (precision + recall) if precision + recall else 0.0

    num_rows = col["target_is_num"] == 1.0
    if model.config.use_numeric and bool(num_rows.any()):
        metrics.update(regression_metrics(model, col["loc_y"][num_rows], col["scale_y"][num_rows],
                                          col["true_value"][num_rows], prefix))

    metrics["dist/ovr_prob_sum_median"] = col["ovr_sum"].median().item()
    metrics["dist/ovr_prob_sum_median_causal"] = col["ovr_sum_causal"].median().item()
    for name in ("u_loc", "u_scale"):
        metrics.update(_spread(f"dist/U_{name[2:]}", col[name]))
    metrics["dist/b_noise_abs_mean"] = model.action.b_noise.detach().abs().mean().item()
    if model.config.learnable_threshold:
        threshold = model.action.threshold.detach().double()
        metrics["dist/threshold_mean"] = threshold.mean().item()
        metrics["dist/threshold_std"] = threshold.std().item()
    return metrics


def regression_metrics(
    model, loc_y: torch.Tensor, scale_y: torch.Tensor, true: torch.Tensor, prefix: str = "eval/"
) -> dict[str, float]:
    """Errors of the predicted median and coverage of its Cauchy intervals, in value space."""
    metrics = point_errors(model.to_value(loc_y), true, prefix)
    for coverage in (0.5, 0.9):
        _, low, high = model.value_interval(loc_y, scale_y, coverage=coverage)
        inside = (true >= low) & (true <= high)
        metrics[f"{prefix}reg_coverage_{round(coverage * 100)}"] = inside.double().mean().item()
    return metrics


def point_errors(predicted: torch.Tensor, true: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """Errors of point predictions of values: mean and median absolute error, R² (also on sign·log10(1+|x|)) and
    the median relative error."""
    err = (predicted - true).abs()
    return {
        f"{prefix}reg_mae": err.mean().item(),
        f"{prefix}reg_mdae": err.median().item(),
        f"{prefix}reg_r2": _r2(predicted, true),
        f"{prefix}reg_r2_symlog": _r2(_symlog10(predicted), _symlog10(true)),
        f"{prefix}reg_rel_err_median": (err / true.abs().clamp(min=1e-12)).median().item(),
    }


def _r2(pred: torch.Tensor, true: torch.Tensor) -> float:
    ss_tot = (true - true.mean()).square().sum()
    if ss_tot.item() == 0.0:
        return float("nan")
    return (1.0 - (pred - true).square().sum() / ss_tot).item()


def _symlog10(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.log10(1.0 + x.abs())


def _spread(name: str, values: torch.Tensor) -> dict[str, float]:
    q1, q3 = torch.quantile(values, torch.tensor([0.25, 0.75], dtype=values.dtype, device=values.device))
    return {
        f"{name}_mean": values.mean().item(),
        f"{name}_median": values.median().item(),
        f"{name}_std": values.std().item() if values.numel() > 1 else 0.0,
        f"{name}_iqr": (q3 - q1).item(),
    }


@torch.no_grad()
def evaluate(
    model,
    batches: Iterable[dict[str, torch.Tensor]],
    generator: torch.Generator | None = None,
    return_statistics: bool = False,
) -> dict[str, float] | tuple[dict[str, float], torch.Tensor]:
    """Run the model over `batches` (dicts as the data collator makes them) and summarise every metric.

    With `return_statistics=True` also return the packed per-position statistics `[N, len(FIELDS)]`, e.g. for
    `causal_qwen.plots.plot_evaluation`. Batches may be wrapped in a progress bar by the caller.
    """
    was_training = model.training
    model.eval()
    collected = []
    for batch in batches:
        batch = {k: v.to(model.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        labels = batch.pop("labels")
        numeric_labels = batch.pop("numeric_labels", None)
        if numeric_labels is None:
            numeric_labels = batch.get("numeric_values")
        out = model(**batch)
        collected.append(position_statistics(model, out.loc_S, out.scale_S, out.loc_Y, out.scale_Y, out.loc_U,
                                             out.scale_U, labels, numeric_labels, generator).reshape(-1, len(FIELDS)))
    model.train(was_training)
    stats = torch.cat(collected, 0)
    metrics = summarize(stats, model)
    return (metrics, stats) if return_statistics else metrics


class CausalQwenMetrics:
    """The metrics as `Trainer` hooks: pass `preprocess_logits_for_metrics` and `compute_metrics`.

    `preprocess_logits_for_metrics` shrinks each evaluation batch's outputs to the packed per-position
    statistics, so `Trainer` never gathers `[B, S, V]` tensors across the evaluation set.

    Example:

    ```python
    metrics = CausalQwenMetrics(model)
    trainer = Trainer(model=model, ..., compute_metrics=metrics.compute_metrics,
                      preprocess_logits_for_metrics=metrics.preprocess_logits_for_metrics)
    ```
    """

    def __init__(self, model, seed: int = 0):
        self.model = model
        self.seed = seed

    def preprocess_logits_for_metrics(self, outputs, labels) -> torch.Tensor:
        named = self._name_outputs(outputs)
        label_ids, numeric_labels = (labels if isinstance(labels, tuple) else (labels, None))[:2]
        generator = torch.Generator(device=label_ids.device).manual_seed(self.seed)
        return position_statistics(self.model, named["loc_S"], named["scale_S"], named.get("loc_Y"),
                                   named.get("scale_Y"), named["loc_U"], named["scale_U"], label_ids, numeric_labels,
                                   generator)

    def _name_outputs(self, outputs) -> dict[str, torch.Tensor]:
        """Trainer hands over the output's non-None tensors in field order, without `loss`: put names back."""
        tensors = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        while tensors and tensors[0].dim() == 0:  # cls_loss, reg_loss
            tensors.pop(0)
        names = ["logits", "loc_S", "scale_S"]
        if self.model.config.use_numeric:
            names += ["loc_Y", "scale_Y"]
        names += ["loc_U", "scale_U"]
        if len(tensors) < len(names):
            raise ValueError(
                "compute_metrics needs the model's distributions (loc_S, scale_S, loc_Y, scale_Y, loc_U, scale_U); "
                f"got {len(tensors)} output tensors"
            )
        return dict(zip(names, tensors, strict=False))

    def compute_metrics(self, eval_prediction) -> dict[str, float]:
        stats = torch.as_tensor(eval_prediction.predictions)
        return {key.removeprefix("eval/"): value for key, value in summarize(stats, self.model).items()}
