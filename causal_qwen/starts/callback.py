"""The value side through training: the start before the first step, the read-out's learning, the refits, and the
end-of-training check ([`ValueHeadStartCallback`]), for `CausalQwenTrainer`, the CLI, TRL and plain `Trainer`.

Which parameters are the value side ([`readout_parameters`], [`value_side_parameters`]) is read off their names,
through PEFT's `modules_to_save` wrapping, `torch.compile` and FSDP1's wrappers ([`parameter_path`]).
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import has_length
from transformers.utils import is_datasets_available, logging

from ..cauchy import nll as cauchy_nll
from ..cauchy import transform_values
from ..labels import next_token_targets
from .learning import ValueLearner, ValueLearning
from .new_data import start_on_new_data
from .path import held_out_rows
from .readout import NotEnoughNumbersError, read_value_rows, refit_value_readout, start_value_side

__all__ = ["DEFAULT_VALUE_LEARNING", "ValueHeadStartCallback", "parameter_path", "readout_parameters",
           "value_side_parameters"]

logger = logging.get_logger(__name__)

# Name components that wrappers insert between a module and its parameters: PEFT's `modules_to_save` copies
# (`action.modules_to_save.default.cls_head.weight`; the next component is the adapter's name) and frozen originals,
# torch.compile and FSDP1 / activation-checkpointing wrappers.
_WRAPPER_WITH_ADAPTER = "modules_to_save"
_WRAPPERS = {"original_module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}

# The read-out's training from its start, on by default (a frozen object: one shared default is safe).
DEFAULT_VALUE_LEARNING = ValueLearning()

# Fewer held-out values than this cannot tell trained features from the start's (the path's fit on a few rows is as
# chaotic as its difference): the end-of-training check is then not made and trained features are kept.
_MIN_CHECK_ROWS = 20
# The trained features' score counts as worse than the start's only beyond this many nats per value (relative to a
# score above 1): features that moved by nothing the value can see refit to the start's score within 10⁻⁷ of it by
# the summation order, and such a difference restored them by the machine's arithmetic.
_SCORE_TIE = 1e-6



def parameter_path(name: str) -> list[str]:
    """The components of a parameter's name without the wrappers' (`action.modules_to_save.default.cls_head.weight`
    is `["action", "cls_head", "weight"]`)."""
    out, skip = [], False
    for part in name.split("."):
        if skip:
            skip = False
        elif part == _WRAPPER_WITH_ADAPTER:
            skip = True
        elif part not in _WRAPPERS:
            out.append(part)
    return out





_READOUT = (("action", "reg_head", "weight"), ("action", "reg_head", "bias"), ("action", "reg_log_noise"))


def _is_readout(name: str) -> bool:
    """Whether the parameter `name` is the value read-out's (`w_reg`, `b_reg`, γ_Y's `reg_log_noise`, and the
    context-value path's), through PEFT's `modules_to_save` wrapping and `torch.compile`."""
    parts = tuple(parameter_path(name))
    # The context-value path (docs/design.md §1b) is started and refitted with the read-out, not trained by Adam.
    in_path = any(parts[i:i + 2] == ("abduction", "context_values") for i in range(len(parts)))
    return in_path or any(parts[-len(key):] == key for key in _READOUT)


def readout_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The value read-out's parameters (`w_reg`, `b_reg`, γ_Y's `reg_log_noise`, and the context-value path's) that
    train, through PEFT's `modules_to_save` wrapping and `torch.compile`; PEFT's frozen originals are left out."""
    return [param for name, param in model.named_parameters() if param.requires_grad and _is_readout(name)]


def value_side_parameters(model: nn.Module, features: bool = True) -> list[nn.Parameter]:
    """What `CausalQwenTrainer` holds out of the optimizer by default: the read-out ([`readout_parameters`]) and,
    with `features`, the trainable parameters that loc_U reads beside the backbone (the numeric embedding and the
    abduction network)."""
    return readout_parameters(model) + ([param for _, param in _feature_parameters(model)] if features else [])


class ValueHeadStartCallback(TrainerCallback):
    """The value side through training (docs/training.md, "The value side learns"): the start from the training data
    when training begins, the read-out's learning from it, the refits and the end-of-training check.

    - **The start**, at step 0: a model not fitted yet gets `start_value_side` (the read-out, the path and the `<NUM>`
      decision); one fitted before (`config.value_head_fit`, a checkpoint on new data) keeps its value side or gets
      one fitted afresh, whichever reads the data better on held-out folds (`start_on_new_data`). A resumed run
      (global step > 0) keeps its checkpoint's. The rows are the training set read in an order of their content (the
      evaluation loader, so the random state that shuffles training is untouched); under several processes process
      0's fit is broadcast. Data with fewer than 3 `<NUM>` targets skips the start and the refits, with a warning.
    - **Held out of the optimizer** (`refit_readout`, from this callback's construction, so build it before
      `trainer.train()`): the read-out (`w_reg`, `b_reg`, γ_Y, the path), whose least-squares fit Adam's steps undo,
      and unless `train_features` the features it reads (the numeric embedding, the abduction network).
    - **Learning**: where nothing the value reads trains, the read-out trains by its own whitened steps on the
      start's rows, the state the held-out folds prefer kept (`ValueLearner`, settings `learning`); where the
      features move (`train_features`, LoRA, an unfrozen backbone), the value side is fitted again to them before
      every evaluation and save and at the end ([`refit_value_readout`]), and trained features that score worse
      than the start's at the end are restored (`kept_trained_features` False). Under FSDP and DeepSpeed the
      read-out trains as the other heads do, and `CausalQwenTrainer.train` calls `fit_unwrapped` on the bare model
      before the engine wraps it.

        trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator)
        trainer.add_callback(ValueHeadStartCallback(trainer))     # plain Trainer: the start, learning and refits
        trainer.train()
    """

    def __init__(self, trainer: Trainer, max_positions: int = 4096, refit_readout: bool = True,
                 train_features: bool = False, learning: ValueLearning | None = DEFAULT_VALUE_LEARNING):
        for name, flag in (("refit_readout", refit_readout), ("train_features", train_features)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if learning is not None and not isinstance(learning, ValueLearning):
            raise TypeError(f"learning must be a ValueLearning or None, got {type(learning).__name__}")
        if not isinstance(max_positions, int) or isinstance(max_positions, bool) or max_positions < 3:
            raise ValueError(f"max_positions must be an int of at least 3, got {max_positions!r}")
        self.trainer = trainer
        self.max_positions = max_positions
        self.learning = learning
        # The read-out's training from its start on the rows the start read (starts/learning.py), where nothing
        # the value reads trains; None: not (yet) learning.
        self.learner: ValueLearner | None = None
        self._start, self.fit = None, None  # the start's rows (from the fit to the learner), and its record
        self._started = False  # once per run: `fit_unwrapped` starts a model before a sharding engine wraps it
        sharded = bool(getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False))
        self.refit_readout = refit_readout and not sharded
        self.train_features = train_features
        self.refits: list[tuple[int, object]] = []  # (global step, ValueHeadFit) of each refit
        # Whether the trained features were kept at the end (None: not decided, e.g. no refit or a resumed run).
        self.kept_trained_features: bool | None = None
        self._start_features: dict[str, torch.Tensor] | None = None
        self._start_score: float | None = None
        self._start_fit = None  # the ValueHeadFit of the start, which a restore brings back
        self._held: list[nn.Parameter] = []
        self._refitted_step: int | None = None
        self._features_train = True  # whether anything loc_U reads trains in this run (set when training begins)
        self.hold_value_side()

    def hold_value_side(self) -> None:
        """Hold the read-out, and unless `train_features` its features, out of training until `on_train_end`."""
        if not self.refit_readout or not _has_value_head(self.trainer.model):
            return
        for param in value_side_parameters(self.trainer.model, features=not self.train_features):
            param.requires_grad_(False)
            self._held.append(param)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model = self.trainer.model if model is None else model
        self._fit(model, state.global_step > 0)
        # Where nothing loc_U reads trains, the rows' features stay what the start read: the read-out learns on them
        # (causal_qwen.starts.learning). Where they move, the refits keep the read-out fitted to them instead.
        self._features_train = _value_features_train(model)
        self._start_learning(model)
        if state.global_step == 0:
            self._keep_start_features(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.learner is not None:
            self.learner.step()
            _broadcast_readout(self.trainer.model if model is None else model)
        if control.should_evaluate or control.should_save or state.global_step >= state.max_steps:
            self._refit(self.trainer.model if model is None else model, state.global_step)

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        if control.should_evaluate or control.should_save:
            self._refit(self.trainer.model if model is None else model, state.global_step)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        model = self.trainer.model if model is None else model
        if self.learner is not None and self.trainer.is_world_process_zero():
            logger.warning(f"value side: {self.learner.record.summary(self.learner.steps)}")
        if self._refitted_step != state.global_step or args.load_best_model_at_end:
            self._refit(model, state.global_step)
        self._restore_start_features_if_worse(model, state.global_step)
        for param in self._held:
            param.requires_grad_(True)
        self._held.clear()

    def fit_unwrapped(self, model, resuming: bool) -> None:
        """The fit of `on_train_begin`, on the model before a sharding engine wraps it."""
        _check_not_partitioned(model)
        self._fit(model, resuming)

    def _train_rows(self):
        loader = self.trainer.get_eval_dataloader(_start_order(self.trainer.train_dataset, self.trainer.args))
        # With persistent workers Trainer keeps the loader under "eval"; evaluation must not find this one there.
        getattr(self.trainer, "_eval_dataloaders", {}).pop("eval", None)
        return loader

    def _start_learning(self, model) -> None:
        """The read-out's learner, on the start's rows (a resumed run's read now); none where the features move, under
        several processes or a sharding engine (each would learn from its shard), or without `learning`."""
        if (self.learning is None or self._features_train or not self.refit_readout or not _has_value_head(model)
                or self.trainer.args.world_size > 1):
            self._start = None
            return
        start = getattr(self, "_start", None)
        if start is None:
            try:
                start = read_value_rows(model, self._train_rows(), max_positions=self.max_positions)
            except NotEnoughNumbersError:
                return
        self.learner = ValueLearner(model.action, start.rows, self.learning, start.fit.penalty,
                                    fitted_on_rows=start.fitted_on_rows, abduction=model.abduction)
        self._start = None  # the rows live in the learner now
        if self.trainer.is_world_process_zero():
            logger.warning(f"value side: {len(start.rows.y)} rows train the read-out from its start, each held out of "
                           f"one of {len(self.learner.monitors)} monitors; median absolute error (head space) on the "
                           f"rows they did not see {self.learner.record.start_error:.4g} at the start")

    def _fit(self, model, resuming: bool) -> None:
        if not _has_value_head(model) or resuming or self._started:
            return
        self._started = True
        if model.config.value_head_fit is not None:
            self._start_fitted(model)
            return
        try:
            start = start_value_side(model, self._train_rows(), max_positions=self.max_positions)
            fit, reason = start.fit, None
            self._start = start
        except NotEnoughNumbersError as error:  # text-only data: train without the start, from the head as it is
            fit, reason = None, str(error)
        # Process 0's head is broadcast, fitted or not (another process's shard may hold numbers where its does
        # not, or none where its does): every replica starts from the same head.
        reason = _from_process_zero(reason)
        _broadcast_value_head(model)
        if reason is not None:
            self._skip_refits(f"value head start skipped: the training data is too short of numbers ({reason}); the "
                              "value head trains from where it is")
            return
        self.fit = fit

    def _start_fitted(self, model) -> None:
        """A model fitted before (a checkpoint) at step 0: its value side, or one fitted afresh on this data where
        that reads it better (`start_on_new_data`). Data without numbers leaves it as it is."""
        rows, start = self._train_rows(), None
        try:
            start = start_on_new_data(model, rows, learning=self.learning, max_positions=self.max_positions)
        except NotEnoughNumbersError:
            pass  # text only: the value side stays as it is
        _broadcast_value_head(model)
        self._start = start
        if start is not None and self.trainer.is_world_process_zero():
            kept = "fitted afresh, which reads" if start.fitted_on_rows else "the checkpoint's, which reads"
            logger.warning(f"value side: {kept} this data better than the other on held-out folds (start_on_new_data)")

    def _refit(self, model, step: int) -> None:
        if (not self.refit_readout or not self._features_train or not _has_value_head(model)
                or self._refitted_step == step):
            return
        try:
            fit, reason = refit_value_readout(model, self._train_rows(), max_positions=self.max_positions), None
        except NotEnoughNumbersError as error:
            fit, reason = None, str(error)
        reason = _from_process_zero(reason)
        _broadcast_readout(model)
        if reason is not None:
            self._skip_refits(f"value read-out refit skipped: the training data is too short of numbers ({reason})")
            return
        self.refits.append((step, fit))
        self._refitted_step = step

    def _keep_start_features(self, model) -> None:
        """Keep a copy of the features the value side reads, and the start's held-out score, to compare at the end."""
        features = _feature_parameters(model)
        # Held features are the start's at the end: nothing to compare.
        if not self.refit_readout or not _has_value_head(model) or not features:
            return
        if self.fit is None:  # fitted before training (config.value_head_fit): the start's score is a refit's
            self._refit(model, 0)
        fit = self.fit if self.fit is not None else (self.refits[-1][1] if self.refits else None)
        if fit is None:
            return
        # Scored on rows the features never train on where the trainer has them (its evaluation data).
        evaluated = _eval_value_nll(self.trainer, model)
        score, rows = evaluated if evaluated is not None else _held_out_score(fit)
        if rows < _MIN_CHECK_ROWS:
            if self.trainer.is_world_process_zero():
                logger.warning(f"train_value_features: {rows} held-out values are too few to check the trained "
                               f"features against the start's (at least {_MIN_CHECK_ROWS}); they are kept as trained.")
            return
        self._start_score, self._start_fit = score, fit
        self._start_features = {name: param.detach().to("cpu", copy=True)
                                for name, param in features + _start_value_side(model)}
        if evaluated is None and self.trainer.is_world_process_zero():
            logger.warning("train_value_features: without an eval_dataset the trained features are checked on held-out "
                           "rows of the training data, which they train on; pass one to check them on rows never seen.")

    def _restore_start_features_if_worse(self, model, step: int) -> None:
        """Where the final refit of trained features scores worse on the held-out rows than the start did, the start's
        features come back with its whole value side (read-out and path), so the model predicts the start's medians;
        training moves the features by what the whole loss asks of them (docs/experiments.md). With evaluation data
        the value side is then fitted again to them, and that refit is kept only where it scores no worse there than
        the start's (a refit fits the path again, which can read new rows worse)."""
        if self._start_features is None or not self.refits or self.refits[-1][0] != step:
            return
        evaluated = _eval_value_nll(self.trainer, model)
        score, _ = evaluated if evaluated is not None else _held_out_score(self.refits[-1][1])
        worse = _from_process_zero(score - self._start_score > _SCORE_TIE * max(1.0, abs(self._start_score)))
        self.kept_trained_features = not worse
        if not worse:
            return
        self._restore_start(model)
        self.refits[-1] = (step, self._start_fit)  # this step's record is the fit the model now holds
        if self.trainer.is_world_process_zero():
            logger.warning("The trained numeric embedding and abduction network predicted the held-out values worse "
                           "than at the start: they were restored to the start's, with its value side.")
        if evaluated is None:
            return
        restored = _from_process_zero(_eval_value_nll(self.trainer, model)[0])
        self._refitted_step, refits = None, len(self.refits)
        self._refit(model, step)
        if len(self.refits) == refits:
            return
        del self.refits[-2]
        if _from_process_zero(_eval_value_nll(self.trainer, model)[0] > restored):
            self._restore_start(model)
            self.refits[-1] = (step, self._start_fit)

    @torch.no_grad()
    def _restore_start(self, model) -> None:
        """The features and the value side (read-out and path) as they were right after the start."""
        for name, param in _feature_parameters(model) + _start_value_side(model):
            param.copy_(self._start_features[name].to(param.device, param.dtype))

    def _skip_refits(self, message: str) -> None:
        """Data without numbers has no read-out to fit: say so once, and refit nothing more."""
        self.refit_readout = False
        if self.trainer.is_world_process_zero():
            logger.warning(message)


def _check_not_partitioned(model) -> None:
    head = getattr(getattr(model, "action", None), "reg_head", None)
    if head is not None and hasattr(head.weight, "ds_id"):
        raise RuntimeError(
            "The model is partitioned by DeepSpeed ZeRO-3 (built after TrainingArguments), so the value head "
            "cannot be fitted before training: fit it first (fit_value_head on a model built before "
            "TrainingArguments, then save_pretrained), or pass value_head_start=False"
        )


def _start_order(dataset, args):
    """The training data in the order the start and the refits read it, up to their `max_positions` rows: the order
    of a digest of each example's own content (its ids and values).

    They stop reading once the cap is in, so in the dataset's own order they would fit the head to its first examples
    alone, which for data concatenated from several sources is one source; a digest's order is as mixed as a random
    one. And it is the same whatever order the dataset holds its examples in and whatever the seeds: the batches the
    start reads, so their padding and the backbone's features to the last bit, and so the start's fit, depend on the
    data alone (the fit of the path is not convex, and features that differed in their last bits, read in batches of
    another composition, moved it to another minimum). The random state that shuffles training is left alone. A
    dataset without a length (a stream) is read in its own order.
    """
    if not has_length(dataset) or isinstance(dataset, torch.utils.data.IterableDataset):
        return dataset
    datasets = None
    if is_datasets_available():
        import datasets
    if datasets is not None and isinstance(dataset, datasets.Dataset) and "input_ids" in dataset.column_names:
        columns = [dataset[name] for name in ("input_ids", "numeric_values") if name in dataset.column_names]
        examples = [dict(zip(("input_ids", "numeric_values"), row, strict=False)) for row in zip(*columns, strict=True)]
    else:
        examples = (dataset[i] for i in range(len(dataset)))
    keys = [_content_key(example) for example in examples]
    order = sorted(range(len(keys)), key=keys.__getitem__)
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        return dataset.select(order, keep_in_memory=True)
    return torch.utils.data.Subset(dataset, order)


def _content_key(example) -> bytes:
    """A digest of an example's ids and values (any order-free identity of its content would do)."""
    digest = hashlib.sha256()
    if isinstance(example, dict):
        for name in ("input_ids", "numeric_values", "labels"):
            value = example.get(name)
            if value is not None:
                digest.update(name.encode())
                digest.update(repr(value.tolist() if isinstance(value, torch.Tensor) else list(value)).encode())
    else:
        digest.update(repr(example).encode())
    return digest.digest()


def _held_out_score(fit) -> tuple[float, int]:
    """What a start or a refit scores on the rows it held out, and how many: the value's NLL with the context-value
    path on the rows as read (which chose the path it kept; with the scaled copies in a record that has no other),
    else the read-out's leave-one-out median absolute error. Lower is better."""
    if fit.context_nll is not None:
        score = fit.context_nll_as_read if fit.context_nll_as_read is not None else fit.context_nll
        return score, held_out_rows(fit.context_rows)
    return fit.loo_median_abs_error, fit.positions


@torch.no_grad()
def _eval_value_nll(trainer, model) -> tuple[float, int] | None:
    """The value's mean Cauchy NLL over the trainer's evaluation data, at its `<NUM>` targets, and their number; None
    without evaluation data or without a target in it.

    The NLL of the value alone, not the loss's `reg_loss`, which weighs each target by the gate α + (1 − α)·P(`<NUM>`):
    as training teaches the `<NUM>` decision, the gate grows and `reg_loss` with it, the value unchanged (0.018 at the
    start and 0.225 after 24 steps on a tiny model, with the start's value side)."""
    if getattr(trainer, "eval_dataset", None) is None:
        return None
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for batch in trainer.get_eval_dataloader():
            batch = trainer._prepare_inputs(batch)
            labels = batch.get("labels")
            if labels is None:
                continue
            inputs = {k: v for k, v in batch.items() if k not in ("labels", "numeric_labels")}
            out = model(**inputs)
            if out.loc_Y is None:
                continue
            targets, values = next_token_targets(labels, batch.get("numeric_labels", batch.get("numeric_values")))
            where = targets == model.config.num_token_id
            if where.any():
                y = transform_values(values[where].double(), model.config.value_transform)
                total += float(cauchy_nll(y, out.loc_Y[where].double(), out.scale_Y[where].double()).sum())
                count += int(where.sum())
    finally:
        model.train(was_training)
    return (total / count, count) if count else None


def _value_features_train(model) -> bool:
    """Whether any parameter that loc_U depends on trains: anything outside the action network (the backbone or its
    adapters, the numeric embedding, the abduction network) with `requires_grad`."""
    return any(param.requires_grad and "action" not in parameter_path(name) for name, param in model.named_parameters())


def _feature_parameters(model) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters of the features the value side reads: the numeric embedding and the abduction
    network, without the context-value path (which every refit fits again)."""
    return [(name, param) for name, param in model.named_parameters()
            if param.requires_grad and ".context_values." not in f".{name}"
            and any(f".{owner}." in f".{name}" for owner in ("numeric_embedding", "abduction"))]


def _start_value_side(model) -> list[tuple[str, nn.Parameter]]:
    """The read-out's parameters and the context-value path's, trainable or held. They come back with the start's
    features: a refit fits the path again from where it is, and from the path fitted to the trained features it
    landed in a minimum that predicted the start's features' held-out values worse than the start's path did (NLL
    1.30 against 1.25 on a tiny model with the mean of the earlier numbers as a candidate, docs/experiments.md)."""
    return [(name, param) for name, param in model.named_parameters() if _is_readout(name)]


def _from_process_zero(value):
    """`value` of process 0, on every process (as it is without several processes)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _has_value_head(model) -> bool:
    config = getattr(model, "config", None)
    return (config is not None and getattr(config, "use_numeric", False)
            and getattr(model, "action", None) is not None)


def _broadcast_readout(model) -> None:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    action = model.action
    path = getattr(model.abduction, "context_values", None)
    for param in (action.reg_head.weight, action.reg_head.bias, action.reg_log_noise,
                  *(path.parameters() if path is not None else ())):
        if param is not None:
            torch.distributed.broadcast(param.data, src=0)


def _broadcast_value_head(model) -> None:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    action = model.action
    _broadcast_readout(model)
    torch.distributed.broadcast(action.cls_head.bias.data, src=0)
    # The start changes one row of the [V, C] class head: broadcast that row only.
    row = action.cls_head.weight.data[model.config.num_token_id].clone()
    torch.distributed.broadcast(row, src=0)
    action.cls_head.weight.data[model.config.num_token_id] = row
    fit = [model.config.value_head_fit]
    torch.distributed.broadcast_object_list(fit, src=0)
    model.config.value_head_fit = fit[0]
