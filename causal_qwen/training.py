"""`Trainer` with per-module learning rates and the training metrics of docs/design.md §6.

transformers' `Trainer` trains CausalQwen as it is (the model returns `loss`). This subclass adds two things:

- **Per-module learning rates** (`LEARNING_RATE_SCALES`, `parameter_groups`). Adam moves every weight by about the
  learning rate per step, whatever its gradient, and every head weight multiplies a feature of the backbone's last
  hidden state (L1 norm ≈ 3,400 for Qwen2.5-0.5B). One rate for everything either scrambles the inherited logits
  in a few steps (the abduction layers and the noise move every logit at once) or barely moves the threshold. So
  `TrainingArguments.learning_rate` is the classification head's rate, and each other module gets a fixed
  multiple of it.
- At each logging step, the averages since the previous log of the loss parts every forward already returns,
  logged as `total_loss`, `cls_loss_mean` and `reg_loss_effective` next to Trainer's `loss`. The reporters of
  `report_to` (TensorBoard, wandb, ...) file training logs under `train/`, so they appear there as docs/design.md §6's
  `train/total_loss`, `train/cls_loss_mean` and `train/reg_loss_effective`.

`train/accuracy` is not logged: a training step takes the fused path, which never builds the `[B, S, V]` scores
that an argmax needs; `eval/accuracy` (see `metrics.py`) measures it on held-out data.
"""

from __future__ import annotations

import math
from collections.abc import Sized

import torch
from torch import nn
from transformers import Trainer
from transformers.utils import logging

from .checks import check_positive_finite
from .labels import IGNORE_INDEX, next_token_targets
from .pairing import check_tokenizer_matches
from .starts import (
    DEFAULT_VALUE_LEARNING,
    ValueHeadStartCallback,
    ValueLearning,
    parameter_path,
    readout_parameters,
    value_side_parameters,
)

__all__ = ["CausalQwenTrainer", "LEARNING_RATE_SCALES", "ValueHeadStartCallback", "parameter_groups",
           "readout_parameters", "value_side_parameters"]

logger = logging.get_logger(__name__)

# The parts of the model's loss logged beside Trainer's `loss`, in the order of their log keys.
_LOSS_PARTS = ("loss", "cls_loss", "reg_loss")

LEARNING_RATE_SCALES: dict[str, float] = {
    "action.cls_head": 1.0,
    # 1x: at 0.1x w_num moved 0.15% in 5 steps (it did not learn); at 10x its features outran the value read-out
    # (validation error 0.61 -> 0.76 in 6 steps); at 1x with the read-out at 1x, 0.61 -> 0.52 in 12 steps.
    "numeric_embedding": 1.0,
    "action.reg_head": 1.0,
    "abduction": 0.01,
    "action.b_noise": 0.01,
    "action.threshold": 100.0,  # a Parameter only with config.learnable_threshold
    "action.reg_log_noise": 100.0,  # a log-scale parameter: a step of lr moves it by a factor of only 1 + lr
}
"""Learning rate of each module as a multiple of the classification head's (`TrainingArguments.learning_rate`).

Keys are module (or parameter) paths in `CausalQwenForCausalLM.named_parameters()`; any trainable parameter under
none of them (an unfrozen backbone, LoRA adapters of the backbone, ...) trains at 1×. These are the rates of the
Qwen2.5-0.5B experiment (AdamW, no weight decay).
"""

def _scale_of(name: str, scales: dict[str, tuple[list[str], float]]) -> float:
    """Scale of the longest key whose dotted components appear, in a row, anywhere in `name` (1.0 if none)."""
    parts = parameter_path(name)
    best, best_len = 1.0, 0
    for key_parts, scale in scales.values():
        n = len(key_parts)
        if n > best_len and any(parts[i:i + n] == key_parts for i in range(len(parts) - n + 1)):
            best, best_len = scale, n
    return best


def _check_scales(scales: dict[str, float]) -> dict[str, float]:
    if not isinstance(scales, dict):
        raise TypeError(f"scales must be a dict of module prefix -> multiple, got {type(scales).__name__}")
    for key, value in scales.items():
        if not isinstance(key, str) or not key.strip("."):
            raise ValueError(f"scales keys must be non-empty module paths, got {key!r}")
        check_positive_finite(f"scales[{key!r}]", value)
    return dict(scales)


def parameter_groups(model: nn.Module, learning_rate: float, weight_decay: float = 0.0,
                     scales: dict[str, float] | None = None, no_decay: set[str] | None = None) -> list[dict]:
    """Optimizer parameter groups giving each trainable parameter of `model` its module's learning rate.

    A parameter's rate is `learning_rate` × the multiple of the longest key of `scales` (default
    `LEARNING_RATE_SCALES`; `{}` gives every parameter `learning_rate`) whose dotted components appear in a row in
    its name, after PEFT's `modules_to_save.<adapter>` and `original_module` components are dropped: so a PEFT model
    (`base_model.model.action.modules_to_save.default.cls_head.weight`) gets the same rates as the bare one, and a
    LoRA adapter gets the rate of the module it adapts (1× for the backbone). Parameters without `requires_grad`
    are left out.

    Parameters named in `no_decay` get weight decay 0 (default: Trainer's rule, biases and norms); the others get
    `weight_decay`. There is one group per (rate, weight decay), in the order their first parameters appear, except
    that the groups at `learning_rate` itself come first, so `Trainer` logs that rate as `learning_rate`.

        optimizer = torch.optim.AdamW(parameter_groups(model, 1e-4))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_positive_finite("learning_rate", learning_rate)
    if (isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float))
            or not math.isfinite(weight_decay) or weight_decay < 0):
        raise ValueError(f"weight_decay must be a non-negative finite number, got {weight_decay!r}")
    scales = _check_scales(LEARNING_RATE_SCALES if scales is None else scales)
    split = {key: ([p for p in key.split(".") if p], value) for key, value in scales.items()}
    if no_decay is None:  # Trainer's rule: biases and norms do not decay (the method reads nothing of the trainer)
        no_decay = {n for n, _ in model.named_parameters()} - set(Trainer.get_decay_parameter_names(None, model))

    groups: dict[tuple[float, float], dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        scale = _scale_of(name, split)
        decay = 0.0 if name in no_decay else float(weight_decay)
        group = groups.setdefault((scale, decay), {"params": [], "lr": learning_rate * scale, "weight_decay": decay})
        group["params"].append(param)
    return sorted(groups.values(), key=lambda group: group["lr"] != learning_rate)


def _warn_if_numbers_stay_digits(model, processing_class) -> None:
    """A tokenizer that does not read numbers (a plain Qwen2 one) trains the model as text: say so, once."""
    config = getattr(model, "config", None)
    tokenizer = getattr(processing_class, "tokenizer", processing_class)  # a processor
    if (tokenizer is None or getattr(config, "model_type", None) != "causal_qwen" or not config.use_numeric
            or getattr(tokenizer, "use_numeric", False)):
        return
    logger.warning(f"processing_class is a {type(tokenizer).__name__}, which does not read numbers: they stay digits, "
                   "the data holds no <NUM> and the value head does not train. To train the numbers, pass the "
                   "CausalQwenTokenizer saved with the model (CausalQwenTokenizer.from_pretrained).")


def _check_not_empty(name: str, data) -> None:
    """Refuse a dataset without examples by its name (Trainer's samplers fail on one deep inside torch)."""
    for key, part in (data.items() if isinstance(data, dict) else [(None, data)]):
        if isinstance(part, Sized) and len(part) == 0:
            where = name if key is None else f"{name}[{key!r}]"
            raise ValueError(f"{where} holds no examples: give the trainer at least one")


class CausalQwenTrainer(Trainer):
    """`Trainer` with per-module learning rates that also logs `total_loss`, `cls_loss_mean` and
    `reg_loss_effective` (`train/*` in TensorBoard and wandb).

    `learning_rate_scales` maps module paths to multiples of `args.learning_rate` (default `LEARNING_RATE_SCALES`;
    `{}` trains everything at one rate, as plain `Trainer` does). They apply to the optimizer `Trainer` builds
    from `args.optim` (AdamW by default) and `optimizer_cls_and_kwargs`; an optimizer passed in `optimizers` is
    used as it is, and optimizers that choose their own parameters (GaLore, LOMO, layer-wise, Muon, ...) are built
    by `Trainer` with one rate. (Trainer's special cases for expert-parallel meshes and 8-bit embedding states do
    not apply to the causal heads; pass `learning_rate_scales={}` to get Trainer's own optimizer unchanged.)

    `value_head_start=True` (the default) fits the value head on the training data before the first step
    ([`ValueHeadStartCallback`], [`fit_value_head`]): without it the median of the value head misses by ~100% for
    hundreds of steps. `False` trains from the head as it is.

    `refit_value_readout=True` (the default, with the start) keeps the value side at least as good as its start:
    the read-out (`w_reg`, `b_reg`, γ_Y, the context-value path) stays out of the optimizer and is fitted again to the
    trained loc_U before every evaluation and checkpoint and at the end of training ([`refit_value_readout`]), where
    anything loc_U reads trains. `False` trains the read-out with the other heads, as before.

    `value_learning` (a frozen [`ValueLearning`], on by default) trains the read-out from its start by gradient, one
    step of its own per optimizer step, on the value rows the start read (their features do not move while nothing
    the value reads trains), in whitened coordinates, keeping the state of least held-out error
    (`causal_qwen.starts.learning`); `None` holds the read-out at its start. `value_start_rows` is how many value
    rows the start reads (a sample of the training set, in the order of its examples' content, when it holds more).

    `train_value_features=False` (the default, with the refits) also holds the features the value reads (the
    numeric embedding, the abduction network) out of the optimizer, so that with the frozen backbone the value side
    after training is the start's; `True` trains them, and the start's come back at the end where they score worse.
    """

    def __init__(self, *args, learning_rate_scales: dict[str, float] | None = None, value_head_start: bool = True,
                 refit_value_readout: bool = True, train_value_features: bool = False,
                 value_learning: ValueLearning | None = DEFAULT_VALUE_LEARNING, value_start_rows: int = 4096, **kwargs):
        self.learning_rate_scales = _check_scales(
            LEARNING_RATE_SCALES if learning_rate_scales is None else learning_rate_scales)
        if not isinstance(value_head_start, bool):
            raise TypeError(f"value_head_start must be True or False, got {value_head_start!r}")
        for name, flag in (("refit_value_readout", refit_value_readout),
                           ("train_value_features", train_value_features)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        super().__init__(*args, **kwargs)
        check_tokenizer_matches(self.model, self.processing_class)
        _warn_if_numbers_stay_digits(self.model, self.processing_class)
        _check_not_empty("train_dataset", self.train_dataset)
        _check_not_empty("eval_dataset", self.eval_dataset)
        if self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            # ZeRO-3 partitions every parameter; the action network reads its heads' in its own forward.
            for module in self.model.modules():
                if hasattr(module, "register_zero3_heads"):
                    module.register_zero3_heads()
        # Since the last log: the sum of each loss part on the footing of Trainer's running `loss`, and the optimizer
        # steps they came from.
        self._loss_parts: dict[str, torch.Tensor | float] = dict.fromkeys(_LOSS_PARTS, 0.0)
        self._loss_part_steps: set[int] = set()
        self._num_numbers_in_batch: torch.Tensor | None = None  # the step's <NUM> targets (get_batch_samples)
        self.value_head_start = (ValueHeadStartCallback(self, max_positions=value_start_rows,
                                                        refit_readout=refit_value_readout,
                                                        train_features=train_value_features,
                                                        learning=value_learning)
                                 if value_head_start else None)
        if self.value_head_start is not None:
            self.add_callback(self.value_head_start)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        _check_not_empty("train_dataset", self.train_dataset)
        if self.value_head_start is not None:
            self.value_head_start.hold_value_side()  # before Trainer builds the optimizer (again, on a second call)
        if self.value_head_start is not None and (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            # FSDP shards the parameters, DeepSpeed copies them into its optimizer, when training starts: fit first.
            self.value_head_start.fit_unwrapped(self.model, resuming=bool(resume_from_checkpoint))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """`Trainer.create_optimizer` with the groups of `parameter_groups` (biases and norms without decay)."""
        opt_model = self.model if model is None else model
        if self.optimizer is None and self.learning_rate_scales:
            if self.optimizer_cls_and_kwargs is not None:
                optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
            else:
                optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            standard = (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)
                        and not {"params", "model", "optimizer_dict"} & optimizer_kwargs.keys())
            if not standard:
                return super().create_optimizer(model)
            optimizer_kwargs = dict(optimizer_kwargs)
            decay = set(self.get_decay_parameter_names(opt_model))
            no_decay = {name for name, _ in opt_model.named_parameters() if name not in decay}
            groups = parameter_groups(opt_model, optimizer_kwargs.pop("lr", self.args.learning_rate),
                                      self.args.weight_decay, self.learning_rate_scales, no_decay)
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        # The optimizer exists now: Trainer only wraps it where it has to (SageMaker model parallelism).
        return super().create_optimizer(model)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Trainer's, which counts the step's labelled positions, plus the count of its `<NUM>` targets.

        With both counts the regression term is the mean over every number of the optimizer step, whatever the
        micro-batches and devices hold: under data parallelism a rank whose batch has no number then weighs as it
        does in one process (docs/training.md, gradient accumulation).
        """
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._num_numbers_in_batch = None
        if num_items_in_batch is not None:
            self._num_numbers_in_batch = self._count_numbers(batch_samples, num_items_in_batch)
        return batch_samples, num_items_in_batch

    def _count_numbers(self, batch_samples: list, num_items_in_batch) -> torch.Tensor | None:
        num_token_id = getattr(self.accelerator.unwrap_model(self.model).config, "num_token_id", None)
        if num_token_id is None or not isinstance(num_items_in_batch, torch.Tensor):
            return None
        count = sum((next_token_targets(batch["labels"], shift_labels=batch.get("shift_labels"))[0]
                     == num_token_id).sum() for batch in batch_samples if "labels" in batch)
        count = torch.as_tensor(count, device=num_items_in_batch.device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            count = self.accelerator.gather(count).sum()
        # Trainer divides its count by the devices that share one batch (tensor, context, sequence parallelism).
        return count / (self.get_tp_size() * self.get_cp_size() * self.get_sp_size())

    def _loss_inputs(self, inputs: dict, num_items_in_batch) -> dict:
        if num_items_in_batch is None or self._num_numbers_in_batch is None or not self.model_accepts_loss_kwargs:
            return inputs
        return {**inputs, "num_numbers_in_batch": self._num_numbers_in_batch}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss_inputs = self._loss_inputs(inputs, num_items_in_batch)
        loss, outputs = super().compute_loss(model, loss_inputs, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        self._record_loss_parts(model, loss_inputs, outputs, loss, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def _loss_scales(self, num_items_in_batch) -> tuple[float, float]:
        """The factors by which `Trainer` turns the model's loss of a micro-batch into its share of the logged loss:
        `(processes, accumulation)`.

        With `num_items_in_batch` the model's loss is already its share of the step's mean, and `compute_loss`
        multiplies it by the processes whose shares the log averages; without, `training_step` divides it by the
        accumulation steps.
        """
        processes = accumulation = 1.0
        kwargs_loss = self.model_accepts_loss_kwargs or self.compute_loss_func is not None
        if self.args.average_tokens_across_devices and kwargs_loss and num_items_in_batch is not None:
            processes = (self.accelerator.num_processes // self.get_tp_size() if self.args.n_gpu <= 1
                         else self.args.n_gpu)
        scaled_for_accumulation = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled_for_accumulation is None:
            scaled_for_accumulation = ((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                                       or self.compute_loss_func is not None)
        if not scaled_for_accumulation:
            accumulation = 1.0 / self.current_gradient_accumulation_steps
        return processes, accumulation

    def _record_loss_parts(self, model, inputs: dict, outputs, loss: torch.Tensor, num_items_in_batch=None) -> None:
        """Add the micro-batch's parts. `loss` is what `compute_loss` returns (Trainer's scaling applied), the one
        `training_step` adds to the logged loss; `cls_loss` and `reg_loss` get the same scaling here."""
        if not (model.training and isinstance(outputs, dict) and outputs.get("cls_loss") is not None):
            return
        processes, accumulation = self._loss_scales(num_items_in_batch)
        parts = {"loss": loss.detach().float().mean() * accumulation,
                 "cls_loss": outputs["cls_loss"].detach().float().mean() * processes * accumulation,
                 "reg_loss": self._reg_loss_share(model, inputs, outputs["reg_loss"], num_items_in_batch
                                                  ).detach().float().mean() * processes * accumulation}
        for name in _LOSS_PARTS:
            self._loss_parts[name] = self._loss_parts[name] + parts[name]
        self._loss_part_steps.add(self.state.global_step)

    def _reg_loss_share(self, model, inputs: dict, reg_loss: torch.Tensor, num_items_in_batch) -> torch.Tensor:
        """The regression part as it enters the micro-batch's loss (`loss.combine_losses`).

        The model reports `reg_loss` as the micro-batch's own mean over its numbers, and `cls_loss` and `loss` as
        shares of the step's means when given the step's counts; the share of `reg_loss` is its mean times the
        micro-batch's numbers over the step's (or, given only `num_items_in_batch`, its labelled positions over
        the step's), so that the three add up over the micro-batches as `loss` does.
        """
        numbers = inputs.get("num_numbers_in_batch")
        items = num_items_in_batch if self.model_accepts_loss_kwargs else None
        if (numbers is None and items is None) or "labels" not in inputs:
            return reg_loss
        targets = next_token_targets(inputs["labels"], shift_labels=inputs.get("shift_labels"))[0]
        if numbers is not None:
            num_token_id = self.accelerator.unwrap_model(model).config.num_token_id
            mine, total = (targets == num_token_id).sum(), numbers
        else:
            mine, total = (targets != IGNORE_INDEX).sum(), items
        total = torch.as_tensor(total, device=reg_loss.device, dtype=reg_loss.dtype)
        share = reg_loss * mine.to(reg_loss) / torch.where(total > 0, total, torch.ones_like(total))
        return torch.where(total > 0, share, torch.zeros_like(share))  # an empty count gives 0, as in the loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs:
            self._log_loss_parts(logs)
            learner = self.value_head_start.learner if self.value_head_start is not None else None
            if learner is not None:  # the value's held-out curve, beside the loss
                logs["value_held_out_error"] = learner.record.curve[-1][1]
                logs["value_held_out_error_best"] = learner.record.best_error
        super().log(logs, *args, **kwargs)

    def _log_loss_parts(self, logs: dict[str, float]) -> None:
        """Add the loss parts' means since the last log to `logs`, computed as Trainer computes `loss`: each step's
        sum of micro-batch shares, averaged over the processes, then over the optimizer steps."""
        steps = len(self._loss_part_steps)
        parts = torch.stack([torch.as_tensor(self._loss_parts[name], dtype=torch.float32, device=self.args.device)
                             for name in _LOSS_PARTS] + [torch.tensor(float(steps), device=self.args.device)])
        self._loss_parts = dict.fromkeys(_LOSS_PARTS, 0.0)
        self._loss_part_steps.clear()
        if self.args.world_size > 1:  # every process logs Trainer's `loss`: each takes part in the gather
            parts = self.accelerator.gather(parts[None]).mean(0)
        steps = parts[-1].item()
        if steps == 0:
            return
        # Reporters (TensorBoard, wandb, ...) file every training log under "train/", as Trainer's "loss".
        for value, key in zip(parts[:-1].tolist(), ("total_loss", "cls_loss_mean", "reg_loss_effective"), strict=True):
            logs[key] = value / steps
