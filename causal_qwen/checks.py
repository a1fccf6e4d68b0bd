"""Checks of what callers pass, so that a bad argument fails at once with its name, not deep inside torch.

Under `torch.compile` and `torch.export` (`torch.compiler.is_compiling()`), the checks that read tensor values
(ids in range, finite values, `<NUM>` with values) are skipped: a traced graph cannot branch on data. The type
and shape checks still run while tracing.
"""

from __future__ import annotations

import math
import sys

import torch

from .cauchy import transform_values
from .labels import IGNORE_INDEX

__all__ = [
    "check_positive_finite", "check_ids", "check_values", "check_numbers_have_values", "check_forward_inputs",
    "check_values_at_numbers", "check_batch_shape", "check_values_in_range",
]

# symlog of the largest finite float64: the most the numeric embedding and a symlog head's space ever hold.
_SYMLOG_OF_FLOAT64_MAX = math.log1p(sys.float_info.max)


def check_positive_finite(name: str, value) -> float:
    """`value` as a float, when it is a real number in (0, ∞); a `ValueError` naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def check_ids(name: str, ids: torch.Tensor, vocab_size: int, allow_ignore: bool) -> None:
    """An integer tensor of ids in [0, vocab_size) (and `IGNORE_INDEX` where `allow_ignore`)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.numel() == 0 or torch.compiler.is_compiling():
        return
    checked = ids[ids != IGNORE_INDEX] if allow_ignore else ids
    if checked.numel() and (int(checked.min()) < 0 or int(checked.max()) >= vocab_size):
        raise ValueError(
            f"{name} holds ids outside the vocabulary [0, {vocab_size}): min {int(checked.min())}, "
            f"max {int(checked.max())}"
        )


def check_values(name: str, values: torch.Tensor, shape: torch.Size) -> None:
    """A finite floating-point tensor of the ids' shape."""
    if not isinstance(values, torch.Tensor) or not values.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {getattr(values, 'dtype', type(values))}")
    if values.shape != shape:
        raise ValueError(f"{name} must have the shape of the ids {tuple(shape)}, got {tuple(values.shape)}")
    if not torch.compiler.is_compiling() and not bool(torch.isfinite(values).all()):
        raise ValueError(f"{name} must be finite (no NaN or inf)")


def check_batch_shape(name: str, tensor: torch.Tensor, layout: str) -> None:
    """A tensor of the `layout` ("[batch, sequence]" or "[batch, sequence, hidden]") with at least one position.

    The backbone cannot run an empty batch or a zero-length sequence: it fails in a reshape of the attention,
    which names neither the argument nor the cause."""
    dims = layout.count(",") + 1
    if tensor.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, {layout}, got shape {tuple(tensor.shape)}")
    if tensor.shape[0] == 0 or tensor.shape[1] == 0:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)}: an empty batch or a zero-length sequence has no position to "
            f"run; pass at least one sequence of at least one token, {layout}"
        )


def check_values_in_range(numeric_values: torch.Tensor, value_transform: str, dtype: torch.dtype,
                          raw_gradient: bool) -> None:
    """Values the model can carry in `dtype` (its parameters'), so that its loss and gradients stay finite.

    A value v enters the model as symlog(v) in the numeric embedding, at most ln(1 + 1.8e308) = 709.8, finite in
    every floating dtype, and as T(v) (`config.value_transform`) in the regression head's space: the heads write
    loc_Y in the model's dtype and the loss takes T(v) in float32. A T(v) that rounds to ±inf in the narrower of the
    two makes the loss and its gradients inf or NaN without an error; symlog keeps every finite float64 within 709.8,
    so only `"identity"` has values to refuse there. With `raw_gradient` (autograd records a forward of the
    context-value path) v itself must fit too: the path's raw-space combination Σ_j w_j·v_j hands each v_j to the
    gradient of its weight w_j, which reaches the model's parameters in their dtype.
    """
    if torch.compiler.is_compiling() or numeric_values.numel() == 0:
        return
    held = dtype if torch.finfo(dtype).max < torch.finfo(torch.float32).max else torch.float32
    largest = torch.finfo(held).max
    in_head_space = not (value_transform == "symlog" and _SYMLOG_OF_FLOAT64_MAX < largest)
    if not in_head_space and not raw_gradient:
        return
    values = numeric_values.double()
    # The cast the model makes, so that the bound is the dtype's own rounding to ±inf, not a constant near it.
    checked = transform_values(values, value_transform) if in_head_space else values
    beyond = ~torch.isfinite(checked.to(held))
    if not bool(beyond.any()):
        return
    found = (f"numeric_values holds {int(beyond.sum())} value(s) beyond what the model can carry (the largest in "
             f"magnitude {float(values[beyond].abs().max()):.4g})")
    if in_head_space:
        raise ValueError(
            f"{found}: with value_transform={value_transform!r} a value v is held in the regression head's space as "
            f"T(v) in {held} (the narrower of the model's dtype and the loss's float32), which holds at most "
            f"±{largest:.4g}; past it the loss and its gradients are inf or NaN. Rescale the values (a larger unit), "
            "or use value_transform='symlog', whose T(v) = symlog(v) is at most 709.8 for every finite float64 v."
        )
    raise ValueError(
        f"{found} in a forward that records gradients: the context-value path's raw-space combination Σ_j w_j·v_j "
        f"hands each v_j to the gradient of its weight, and that gradient reaches the parameters in {held}, which "
        f"holds at most ±{largest:.4g}; past it the gradients are inf or NaN. Rescale the values (a larger unit) to "
        "train on them; run inference under torch.no_grad(), where every finite float64 value is read."
    )


def check_numbers_have_values(input_ids, numeric_values: torch.Tensor | None, num_token_id: int) -> None:
    """`<NUM>` ids without `numeric_values` would be read as 0 (a tokenizer's `encode` returns ids only)."""
    if torch.compiler.is_compiling() or numeric_values is not None or not isinstance(input_ids, torch.Tensor):
        return
    if bool((input_ids == num_token_id).any()):
        raise ValueError(
            f"input_ids contain <NUM> (id {num_token_id}) but no numeric_values were given, so every number would "
            "be read as 0. Pass the numeric_values the CausalQwenTokenizer returns with the ids (`tokenizer(text)`, "
            "not `tokenizer.encode(text)`); with lm-evaluation-harness use `--model causal-qwen` "
            "(causal_qwen.integrations.lm_eval)."
        )


def _check_shift_labels(config, shape, shift_labels, shift_numeric_labels, has_values: bool) -> None:
    """Already-shifted targets: ids of the inputs' shape; a `<NUM>` target needs its value."""
    if shift_labels.shape != shape:
        raise ValueError(f"shift_labels must have shape {tuple(shape)}, got {tuple(shift_labels.shape)}")
    check_ids("shift_labels", shift_labels, config.vocab_size, allow_ignore=True)
    if shift_numeric_labels is not None:
        check_values("shift_numeric_labels", shift_numeric_labels, shift_labels.shape)
        return
    if not config.use_numeric or shift_labels.numel() == 0:
        return
    is_num = shift_labels == config.num_token_id
    if bool(is_num.any()) and not has_values:
        raise ValueError("shift_labels contain <NUM> but none of shift_numeric_labels, numeric_labels and "
                         "numeric_values was given")
    if bool(is_num[:, -1].any()):
        # Shifting numeric_labels leaves the last position without a value: its target lies beyond the sequence
        # (the next shard, under context parallelism).
        raise ValueError("shift_labels has a <NUM> target at the last position, whose value lies beyond the "
                         "sequence: pass shift_numeric_labels (the values of shift_labels, already shifted)")


def check_forward_inputs(
    config,
    input_ids: torch.Tensor | None,
    numeric_values: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    labels: torch.Tensor | None,
    numeric_labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None = None,
    shift_numeric_labels: torch.Tensor | None = None,
    logits_to_keep: int | torch.Tensor = 0,
) -> None:
    """Reject inputs of `CausalQwenForCausalLM.forward` that would otherwise give a silent wrong result."""
    vocab = config.vocab_size
    if (labels is not None or shift_labels is not None) and not (isinstance(logits_to_keep, int) and
                                                                  logits_to_keep == 0):
        # Qwen2 fails deep in its loss here; the loss reads every position, which only 0 keeps.
        raise ValueError("logits_to_keep must be 0 (every position) when labels or shift_labels are given, got "
                         f"{logits_to_keep if isinstance(logits_to_keep, int) else 'a tensor of positions'}")
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of input_ids and inputs_embeds")
    if input_ids is not None:
        check_ids("input_ids", input_ids, vocab, allow_ignore=False)
        check_batch_shape("input_ids", input_ids, "[batch, sequence]")
    else:
        check_batch_shape("inputs_embeds", inputs_embeds, "[batch, sequence, hidden]")
    if numeric_values is not None:
        if input_ids is None:
            raise ValueError("numeric_values needs input_ids (the <NUM> positions); got inputs_embeds")
        check_values("numeric_values", numeric_values, input_ids.shape)
        if not config.use_numeric and not torch.compiler.is_compiling() and bool((numeric_values != 0).any()):
            raise ValueError("numeric_values holds numbers but this model has use_numeric=False")
    reference = input_ids if input_ids is not None else inputs_embeds[..., 0]
    if labels is not None:
        if labels.shape != reference.shape:
            raise ValueError(f"labels must have shape {tuple(reference.shape)}, got {tuple(labels.shape)}")
        check_ids("labels", labels, vocab, allow_ignore=True)
        if numeric_labels is not None:
            check_values("numeric_labels", numeric_labels, labels.shape)
        elif (numeric_values is None and config.use_numeric and not torch.compiler.is_compiling()
              and bool((labels == config.num_token_id).any())):
            raise ValueError("labels contain <NUM> but neither numeric_labels nor numeric_values was given")
    if numeric_labels is not None and labels is None:
        check_values("numeric_labels", numeric_labels, reference.shape)
    if shift_labels is not None:
        _check_shift_labels(config, reference.shape, shift_labels, shift_numeric_labels,
                            has_values=numeric_labels is not None or numeric_values is not None)
    elif shift_numeric_labels is not None:
        raise ValueError("shift_numeric_labels are the values of shift_labels; pass shift_labels with them")
    if config.use_numeric:
        check_numbers_have_values(input_ids, numeric_values, config.num_token_id)
        if numeric_values is not None:
            check_values_at_numbers(input_ids, numeric_values, config.num_token_id)


def check_values_at_numbers(input_ids: torch.Tensor, numeric_values: torch.Tensor, num_token_id: int) -> None:
    """Values only at `<NUM>` ids, 0 elsewhere (docs/design.md §1).

    The numeric embedding adds every value, so one off a `<NUM>` would move the output silently; the tokenizer,
    the collator and `generate` write 0 there. A value elsewhere means the values do not belong to these ids
    (shifted, truncated or padded apart), and then the `<NUM>` positions' values are wrong too: refused.
    """
    if torch.compiler.is_compiling():
        return
    stray = (numeric_values != 0) & (input_ids != num_token_id)
    if bool(stray.any()):
        first = [int(i) for i in stray.nonzero()[0]]
        raise ValueError(
            f"numeric_values holds a value at {int(stray.sum())} position(s) whose id is not <NUM> (id "
            f"{num_token_id}), the first at {first}: values belong to <NUM> positions and are 0 elsewhere, so "
            "numeric_values is not aligned with input_ids (pass the ids and values the CausalQwenTokenizer returns "
            "together, padded and truncated together)."
        )
