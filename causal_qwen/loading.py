"""What `CausalQwenForCausalLM.from_pretrained` adds to transformers' loading: the model is the one its config says.

- A config field that only fills tensors when the model is built (`FILLED_TENSORS`), given to `from_pretrained` or
  changed by a `config=` from the saved config, fills them again after loading (`load_fills`).
- A checkpoint that lacks one of CausalQwen's own tensors raises a `ValueError` naming them, instead of their being
  drawn afresh (`check_missing_keys`); the backbone's keys, a checkpoint of the backbone alone, and tensors given as
  `state_dict=` behave as in transformers.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from .configuration import CausalQwenConfig

__all__ = ["FILLED_TENSORS", "check_missing_keys", "load_fills"]

# Fields that only fill tensors when a model is built, and those tensors: an edit of the field (or a value given to
# `from_pretrained`) fills them again, so that the model is the one its config describes.
FILLED_TENSORS = {
    "ovr_threshold": ("action.threshold",),
    "noise_init": ("action.b_noise",),
    "abduction_scale_init": ("abduction.scale_net.weight", "abduction.scale_net.bias"),
    "regression_noise": ("action.reg_log_noise",),
}
# The top-level modules of CausalQwen's own tensors (the rest, `model.*`, is the Qwen2 backbone).
_OWN_MODULES = ("numeric_embedding", "abduction", "abduction_anchor", "action")
_MISSING_KEY_HINTS = {
    "action.reg_log_noise": ". A checkpoint saved without a value noise is the model of regression_noise=0.0: load it "
                            "with from_pretrained(..., regression_noise=0.0), or with a positive value to start one",
    "abduction_anchor.": ". The anchor is made by model.enable_abduction_finetuning(weight) after loading; load with "
                         "abduction_anchor_weight=0.0",
}
# The fields whose tensors the `from_pretrained` call under way fills from the config; None when it refuses no missing
# key (not under way, or given the tensors as `state_dict=` rather than a checkpoint).
_LOAD_FILLS: contextvars.ContextVar[frozenset | None] = contextvars.ContextVar("causal_qwen_load_fills", default=None)


@contextlib.contextmanager
def load_fills(args: tuple, kwargs: dict) -> Iterator[frozenset]:
    """Around a `from_pretrained(*args, **kwargs)` call: yields the fields whose tensors to fill after it."""
    given = frozenset(name for name in FILLED_TENSORS if name in kwargs)
    filled = given | _fields_changed_from_saved(args, kwargs)
    # Tensors passed as `state_dict=` are the caller's choice, partial or not, as in transformers.
    token = _LOAD_FILLS.set(filled if kwargs.get("state_dict") is None else None)
    try:
        yield filled
    finally:
        _LOAD_FILLS.reset(token)


def check_missing_keys(model, missing_keys) -> None:
    """Raise if the checkpoint being loaded into `model` lacks CausalQwen tensors that no config field fills."""
    fills = _LOAD_FILLS.get()
    if fills is None:
        return
    own = {key for key in model.state_dict() if key.split(".", 1)[0] in _OWN_MODULES}
    refilled = {key for name in fills for key in FILLED_TENSORS[name]}
    missing = sorted(key for key in missing_keys if key in own and key not in refilled)
    # A checkpoint without any causal tensor is a backbone's (Qwen2's, or CausalQwenModel's): its heads start as a
    # new model's, reported as missing, as transformers does for a base model loaded into a class with a head.
    if missing and own - set(missing_keys):
        hints = [hint for prefix, hint in _MISSING_KEY_HINTS.items() if any(k.startswith(prefix) for k in missing)]
        raise ValueError(
            f"the checkpoint lacks CausalQwen tensors the model needs: {', '.join(missing)}. They would be drawn "
            "afresh, giving another model; load a checkpoint saved by CausalQwenForCausalLM (or convert a Qwen2 "
            "one with CausalQwenForCausalLM.from_qwen) with the config that saved it" + "".join(hints)
        )


def _fields_changed_from_saved(args: tuple, kwargs: dict) -> frozenset:
    """The tensor-filling fields in which a `config=` given to `from_pretrained` differs from the checkpoint's."""
    config = kwargs.get("config")
    path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    if not isinstance(config, CausalQwenConfig) or path is None:
        return frozenset()
    hub = {key: kwargs[key] for key in ("cache_dir", "force_download", "proxies", "local_files_only", "token",
                                        "revision", "subfolder") if key in kwargs}
    try:
        saved, _ = CausalQwenConfig.get_config_dict(path, **hub)
    except OSError:  # no config.json beside the weights: nothing to compare with
        return frozenset()
    return frozenset(name for name in FILLED_TENSORS if name in saved and saved[name] != getattr(config, name))
