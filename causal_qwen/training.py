"""`Trainer` with the training metrics of DESIGN.md §6.

transformers' `Trainer` trains CausalQwen as it is (the model returns `loss`). This subclass only adds, at each
logging step, the averages since the previous log of the loss parts every forward already returns:
`train/total_loss`, `train/cls_loss_mean` and `train/reg_loss_effective`. They go wherever `report_to` sends
Trainer's own logs (TensorBoard, wandb, ...).

`train/accuracy` is not logged: a training step takes the fused path, which never builds the `[B, S, V]` scores
that an argmax needs; `eval/accuracy` (see `metrics.py`) measures it on held-out data.
"""

from __future__ import annotations

from transformers import Trainer

__all__ = ["CausalQwenTrainer"]


class CausalQwenTrainer(Trainer):
    """`Trainer` that also logs `train/total_loss`, `train/cls_loss_mean` and `train/reg_loss_effective`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._loss_parts: dict[str, list[float]] = {"cls_loss": [], "reg_loss": [], "loss": []}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if model.training and isinstance(outputs, dict) and outputs.get("cls_loss") is not None:
            for name in self._loss_parts:
                self._loss_parts[name].append(float(outputs[name].detach()))
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and self._loss_parts["loss"]:
            for name, key in (("loss", "train/total_loss"), ("cls_loss", "train/cls_loss_mean"),
                              ("reg_loss", "train/reg_loss_effective")):
                values = self._loss_parts[name]
                logs[key] = sum(values) / len(values)
                values.clear()
        super().log(logs, *args, **kwargs)
