"""Checkpoints written by earlier versions, read as the model is now.

Each change of the saved tensors is listed once here.
- A tensor that changed form is rewritten on both loading paths: transformers' `from_pretrained` (a weight conversion
  registered for the model class) and torch's `load_state_dict` (`upgrade_state_dict`, called by the module that
  owns the tensor). The two do not share a hook.
- A tensor that is new keeps its name apart from the saved ones, so no saved tensor changes shape. A checkpoint
  without it reads it as the model's own start gives it (`from_pretrained`'s `_init_weights`, and the owning module's
  hook after `load_state_dict`). That start is the model the checkpoint saved.

The changes:
- `action.reg_log_noise` was 0-dim and is a `[1]` vector now (FSDP2's `fully_shard` and DeepSpeed take no 0-dim
  parameter).
- `abduction.context_values.key_before.weight` (K', the keys' read of the position before each number) is new. Its
  start is 0, the path saved without it.
- `abduction.context_values.mean_score.*` and `mean_width` (the mean of the earlier values as a candidate) are new.
  Their start puts the mean's score at −10⁴, whose weight in the softmax (computed in float64) is exactly 0: the path
  saved without them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import ConversionOps, WeightConverter

__all__ = ["ADDED", "register_checkpoint_conversions", "upgrade_state_dict", "upgraded_weights"]

# Tensors saved 0-dim by earlier versions that are [1] vectors now: (owning module in the model, tensor name).
_VECTORS_OF_ONE = (("action", "reg_log_noise"),)
# Tensors that earlier versions did not have, read as their start: (owning module, tensor name).
ADDED = (
    ("context_values", "key_before.weight"),
    ("context_values", "mean_score.weight"),
    ("context_values", "mean_score.bias"),
    ("context_values", "mean_width"),
    ("context_values", "guard.weight"),
    ("context_values", "guard.bias"),
)


class _VectorOfOne(ConversionOps):
    """Load a tensor of `_VECTORS_OF_ONE` written while it was 0-dim as the `[1]` vector it is now."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        (tensors,) = input_dict.values()
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        return {target_patterns[0]: tensor.reshape(1)}

    @property
    def reverse_op(self) -> ConversionOps:
        return _VectorOfOne()


def register_checkpoint_conversions(model_class_name: str) -> None:
    """Register the conversions of `from_pretrained` for the model class of that name."""
    converters = [WeightConverter(f"{module}.{name}", f"{module}.{name}", operations=[_VectorOfOne()])
                  for module, name in _VECTORS_OF_ONE]
    register_checkpoint_conversion_mapping(model_class_name, converters, overwrite=True)


def upgrade_state_dict(module_name: str, state_dict: dict, prefix: str) -> None:
    """Rewrite, in place, the tensors of module `module_name` (of the model) under `prefix` in `state_dict`."""
    for owner, name in _VECTORS_OF_ONE:
        key = prefix + name
        if owner == module_name and key in state_dict and state_dict[key].dim() == 0:
            state_dict[key] = state_dict[key].reshape(1)


def upgraded_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights by full name, as a loader streams them (vLLM's), rewritten as `upgrade_state_dict`
    rewrites a state dict."""
    vectors = {f"{owner}.{name}" for owner, name in _VECTORS_OF_ONE}
    for name, tensor in weights:
        yield name, (tensor.reshape(1) if name in vectors and tensor.dim() == 0 else tensor)
