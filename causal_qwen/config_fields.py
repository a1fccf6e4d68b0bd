"""The causal fields of `CausalQwenConfig` and the checks of their values, importable without torch.

`CausalQwenConfig` runs these checks on every assignment of a causal field; `causal-qwen convert --set` runs them on
its options before anything heavy is imported (transformers' config module imports torch, seconds on a small
machine), so that a misspelt field or a value of the wrong type stops in one line at once. `QWEN2_FIELDS` names the
fields `CausalQwenConfig` inherits from `Qwen2Config` for the same early check; a test keeps it equal to the installed
transformers' (tests/test_configuration.py).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping

VALUE_TRANSFORMS = ("identity", "symlog")
# The logs the context-value path's log-space combination can sum (`context_values_log`; docs/math.md).
CONTEXT_VALUES_LOGS = ("symlog", "log")
FLOAT_FIELDS = (
    "abduction_scale_init", "noise_init", "ovr_threshold", "gate_alpha", "reg_loss_weight", "scale_min",
    "abduction_anchor_weight", "regression_noise",
)
BOOL_FIELDS = ("use_numeric", "freeze_backbone", "learnable_threshold", "detach_gate", "tie_word_embeddings",
               "context_values")
# Integer fields that may be None, with their smallest allowed value.
INT_FIELDS = {"num_token_id": 0, "causal_size": 1, "conversion_seed": 0, "context_values_rank": 1}
CHECKED_FIELDS = frozenset((*FLOAT_FIELDS, *BOOL_FIELDS, *INT_FIELDS, "value_transform", "value_head_fit",
                            "context_values_log"))
# Keywords that `PretrainedConfig` takes without a field of that name (it pops or converts them).
INIT_KEYWORDS = ("attn_implementation", "experts_implementation", "output_attentions", "num_labels", "torch_dtype",
                 "rope_theta", "rope_scaling", "name_or_path")
# The dataclass fields and attribute-map names of transformers' `Qwen2Config`.
QWEN2_FIELDS = frozenset((
    "architectures", "attention_dropout", "bos_token_id", "chunk_size_feed_forward", "dtype", "eos_token_id",
    "hidden_act", "hidden_size", "id2label", "initializer_range", "intermediate_size", "is_encoder_decoder",
    "label2id", "layer_types", "max_position_embeddings", "max_window_layers", "num_attention_heads",
    "num_hidden_layers", "num_key_value_heads", "output_hidden_states", "pad_token_id", "problem_type", "return_dict",
    "rms_norm_eps", "rope_parameters", "sliding_window", "tie_word_embeddings", "transformers_version", "use_cache",
    "use_sliding_window", "vocab_size",
))


def check_field(name: str, value, vocab_size: int | None = None, first_value: bool = False) -> None:
    """Raise a TypeError or ValueError naming `name` if `value` is not one the causal field takes (on its own).
    `first_value`: the dataclass's own first assignment, where `regression_noise=None` means "from use_numeric"."""
    if name in BOOL_FIELDS:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}")
    elif name in INT_FIELDS:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r}")
        if value < INT_FIELDS[name]:
            raise ValueError(f"{name} must be at least {INT_FIELDS[name]}, got {value}")
        if name == "num_token_id" and isinstance(vocab_size, int) and value >= vocab_size:
            raise ValueError(f"num_token_id must lie inside the vocabulary [0, {vocab_size}), got {value}")
    elif name in FLOAT_FIELDS:
        if value is None and name == "regression_noise" and first_value:
            return
        _check_float(name, value)
    elif name == "value_transform":
        if value not in VALUE_TRANSFORMS:
            raise ValueError(f"value_transform must be one of {VALUE_TRANSFORMS}, got {value!r}")
    elif name == "context_values_log":
        if value not in CONTEXT_VALUES_LOGS:
            raise ValueError(f"context_values_log must be one of {CONTEXT_VALUES_LOGS}, got {value!r}")
    elif name == "value_head_fit" and value is not None and not isinstance(value, dict):
        raise TypeError(f"value_head_fit must be a dict or None, got {type(value).__name__}")


def check_relations(fields: Mapping) -> None:
    """The checks between causal fields that need no backbone field: what `use_numeric=False` rules out. `fields`
    holds the fields set (a missing one takes its default)."""
    use_numeric = fields.get("use_numeric", True)
    regression_noise = fields.get("regression_noise")
    if regression_noise is not None and regression_noise > 0 and not use_numeric:
        raise ValueError("regression_noise needs the regression head: use_numeric=False has none")
    if fields.get("context_values", False) and not use_numeric:
        raise ValueError("context_values needs the numeric embedding and the regression head: use_numeric=False "
                         "has neither")


def check_names(names: Iterable[str], known: Iterable[str], where: str, owner: str = "CausalQwenConfig") -> None:
    """Raise a TypeError naming every name of `names` not in `known`, with the closest known name where one is."""
    known = sorted(set(known))
    unknown = [name for name in names if name not in known]
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise TypeError(f"{where} got unexpected keyword argument(s) {', '.join(hints)}: not fields of {owner}")


def _check_float(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if name in ("abduction_scale_init", "scale_min"):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite positive number, got {value}")
    elif name in ("noise_init", "reg_loss_weight", "abduction_anchor_weight", "regression_noise"):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite non-negative number, got {value}")
    elif name == "ovr_threshold":
        if not math.isfinite(value):
            raise ValueError(f"ovr_threshold must be finite, got {value}")
    elif name == "gate_alpha" and not 0.0 <= value <= 1.0:
        raise ValueError(f"gate_alpha must lie in [0, 1], got {value}")
