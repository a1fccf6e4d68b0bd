"""The model's tensors and its config: a built or loaded model stays the one its config says.

The config is plain data and knows no model; the model reads it.

- A field that decides the model's modules, edited on a built model's config, stops its forward and its save with a
  `ValueError` naming the field (`check_config_matches_modules`); a field that fills tensors is their start, filled
  again by the explicit `CausalQwenForCausalLM.set_initial_values` (`fill_from_config`).
- A config field that only fills tensors when the model is built (`FILLED_TENSORS`), given to `from_pretrained` or
  changed by a `config=` from the saved config, fills them again after loading (`load_fills`).
- A checkpoint that lacks one of CausalQwen's own tensors raises a `ValueError` naming them, instead of their being
  drawn afresh (`check_missing_keys`); the backbone's keys, a checkpoint of the backbone alone, and tensors given as
  `state_dict=` behave as in transformers.

`CausalQwenLoadingMixin` puts these on the model class, with the model card and the backbone's `auto_map` entry that
`save_pretrained` writes.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from .configuration import CausalQwenConfig
from .migrations import ADDED
from .modelcard import write_model_card

__all__ = ["FILLED_TENSORS", "CausalQwenLoadingMixin", "check_config_matches_modules", "check_missing_keys",
           "fill_from_config", "inverse_softplus", "load_fills", "module_fields", "restore_weight_modes"]

# Fields that decide a model's modules when it is built: a built model cannot follow an edit of them.
_MODULE_FIELDS = {
    "use_numeric": "whether the model has a numeric embedding and a regression head",
    "causal_size": "the size of the abduction and action layers",
    "learnable_threshold": "whether action.threshold is a trainable parameter",
    "context_values": "whether the abduction network reads the context's values (abduction.context_values)",
    "context_values_rank": "the size of abduction.context_values",
    "context_values_log": "the logarithm abduction.context_values sums (its weights were fitted to it)",
}
# Fields that only fill tensors when a model is built, and those tensors: a value given to `from_pretrained` (or to
# `set_initial_values`) fills them again, so that the model is the one its config describes.
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


def inverse_softplus(y: float) -> float:
    """softplus⁻¹(y) = log(expm1(y)), written as y + log(−expm1(−y)) so that large y cannot overflow."""
    return y + math.log(-math.expm1(-y))


def module_fields(config: CausalQwenConfig) -> dict:
    """What the fields that decide the modules say of them (`regression_noise`: whether it is positive).

    A model keeps what its config said when it was built (`CausalQwenForCausalLM.__init__`), for
    `check_config_matches_modules`: a record rather than a look at the modules, which wrappers (PEFT's
    `modules_to_save`) and sharding engines replace.
    """
    fields = {name: getattr(config, name) for name in _MODULE_FIELDS}
    fields["regression_noise"] = config.regression_noise > 0
    return fields


def check_config_matches_modules(model) -> None:
    """Raise a `ValueError` naming the field when `model.config` no longer describes the modules `model` was built with.

    The config knows no model, so an edit of a field that decides the modules is stored; the model refuses it here,
    at its forward and its save, rather than computing or writing another model than its config says.
    """
    config = model.config
    now = module_fields(config)
    for name, built in model.built_module_fields.items():
        if now[name] != built:
            what = _MODULE_FIELDS.get(name, "whether action.reg_log_noise exists (0 or not)")
            value = getattr(config, name)
            raise ValueError(
                f"config.{name} is {value!r}, which does not describe this model: {name} decides {what} when the "
                f"model is built. Set it back, or build the model with {name}={value!r} "
                f"(CausalQwenForCausalLM.from_qwen(..., {name}=...), or from_pretrained(..., {name}=...))"
            )
    weight = config.abduction_anchor_weight
    if weight > 0 and model.abduction_anchor is None:
        raise ValueError(f"config.abduction_anchor_weight is {weight!r}, which needs the frozen anchor copy of the "
                         f"abduction network that this model has not got: call "
                         f"model.enable_abduction_finetuning({weight!r})")


@torch.no_grad()
def fill_from_config(model, name: str) -> None:
    """Fill the tensors of `model` that `config.<name>` initialises (`FILLED_TENSORS`) from its current value."""
    config = model.config
    if name == "ovr_threshold":
        model.action.threshold.fill_(float(config.ovr_threshold))
    elif name == "noise_init":
        model.action.b_noise.fill_(config.noise_init)
    elif name == "abduction_scale_init":
        model.abduction.scale_net.weight.zero_()
        model.abduction.scale_net.bias.fill_(inverse_softplus(config.abduction_scale_init))
    elif name == "regression_noise" and model.action.reg_log_noise is not None:
        model.action.reg_log_noise.fill_(math.log(config.regression_noise))


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
    # Tensors added since, read as their start from a checkpoint without them (migrations.py).
    added = {key for key in own if any(key.endswith(f"{module}.{name}") for module, name in ADDED)}
    missing = sorted(key for key in missing_keys if key in own and key not in refilled | added)
    # A checkpoint without any causal tensor is a backbone's (Qwen2's, or CausalQwenModel's): its heads start as a
    # new model's, reported as missing, as transformers does for a base model loaded into a class with a head.
    if missing and own - set(missing_keys) - added:
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


class CausalQwenLoadingMixin:
    """The loading and saving of `CausalQwenForCausalLM`, and the explicit refill of the tensors its config starts."""

    # The bare backbone, which `AutoModel` gives for the config: saved remote code names it in the `auto_map`.
    _backbone_class: type | None = None

    def set_initial_values(self, **fields: float) -> None:
        """Set config fields that start tensors when the model is built, and fill those tensors again from them.

        The fields are `ovr_threshold` (`action.threshold`, every class), `noise_init` (`action.b_noise`),
        `abduction_scale_init` (`abduction.scale_net`: the constant scale γ0 at every position) and
        `regression_noise` (γ_Y, `action.reg_log_noise`). What training learned in those tensors is overwritten.
        Assigning such a field to `model.config` instead changes the config alone, as in transformers, where a
        config is plain data: `model.set_initial_values(ovr_threshold=20.0)` is the edit that reaches the model.

        Raises:
            TypeError: a name that is not one of these fields, or a value of the wrong type (naming the field).
            ValueError: a value the field refuses, or a `regression_noise` that would create or remove γ_Y (0 on a
                model that has it, or positive on one without it: that decides the modules); nothing is changed.
        """
        unknown = sorted(set(fields) - set(FILLED_TENSORS))
        if unknown:
            raise TypeError(f"set_initial_values takes {', '.join(FILLED_TENSORS)}, got {', '.join(unknown)}: "
                            "other fields are read at every use, or decide the modules when the model is built")
        for name, value in fields.items():
            self.config.check_field(name, value)
        noise = fields.get("regression_noise")
        if noise is not None and (noise > 0) != (self.action.reg_log_noise is not None):
            raise ValueError(f"regression_noise={noise!r} would {'create' if noise > 0 else 'remove'} "
                             "action.reg_log_noise, which is decided when the model is built: build the model with "
                             f"regression_noise={noise!r} instead (from_qwen(..., regression_noise=...), or "
                             "from_pretrained(..., regression_noise=...))")
        for name, value in fields.items():
            setattr(self.config, name, value)
            fill_from_config(self, name)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, keeping the model the one its config says.

        A field that only fills tensors when the model is built (`FILLED_TENSORS`), given here or changed by a
        `config=` from the saved config, fills them over the checkpoint's; a checkpoint that lacks one of
        CausalQwen's own tensors raises a `ValueError` naming them, instead of their being drawn afresh.
        """
        with load_fills(args, kwargs) as filled:
            result = super().from_pretrained(*args, **kwargs)
        model = result[0] if isinstance(result, tuple) else result
        if isinstance(model, cls):
            # Loading replaces the parameters that `__init__` froze, so freeze again once they are in place.
            model.apply_freeze_backbone()
            for name in sorted(filled):
                fill_from_config(model, name)
        return result

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        super()._adjust_missing_and_unexpected_keys(loading_info)
        check_missing_keys(self, loading_info.missing_keys)

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`, plus a model card (README.md) when the folder has none.

        A config whose fields no longer describe the model's modules raises a `ValueError` naming the field, before
        anything is written (`check_config_matches_modules`).

        A model whose code is saved beside the weights (`register_for_auto_class`, done by `import causal_qwen`)
        also names its backbone for `AutoModel` in the config's `auto_map`, as the registered `AutoModel` does.
        """
        check_config_matches_modules(self)
        if self._auto_class is not None and self._backbone_class is not None:
            auto_map = dict(getattr(self.config, "auto_map", None) or {})
            backbone = self._backbone_class
            auto_map.setdefault("AutoModel", f"{backbone.__module__.rsplit('.', 1)[-1]}.{backbone.__name__}")
            self.config.auto_map = auto_map
        modes = _weight_modes(Path(save_directory))
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_model_card(save_directory, self.config)
            restore_weight_modes(Path(save_directory), modes)
        return result


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a saved model: the one file, or the shards its index names."""
    index = folder / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        names = set(json.loads(index.read_text())["weight_map"].values())
        return [folder / name for name in sorted(names)]
    return [folder / SAFE_WEIGHTS_NAME]


def _weight_modes(folder: Path) -> dict[Path, int]:
    """The permission bits of the weight files already in `folder`, which a save replaces."""
    if not folder.is_dir():
        return {}
    return {path: stat.S_IMODE(path.stat().st_mode) for path in _weight_files(folder) if path.is_file()}


def _umask() -> int:
    """The process's umask (read by setting it, to a restrictive value for the instant it is set)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def restore_weight_modes(folder: Path, modes: dict[Path, int]) -> None:
    """Give the saved weight files the mode a plain `open()` would have: the replaced file's, or 0o666 less the umask.

    safetensors 0.8 writes a file through a temporary one, created 0o600, that it renames into place
    (safetensors#764; safetensors#782), so `model.safetensors` came out readable by its owner alone where every other
    file of the folder is 0o644 under umask 022: another user, or a container that runs as one, could not load it.
    """
    if os.name == "nt":  # no POSIX permission bits to mend
        return
    new_mode = 0o666 & ~_umask()
    for path in _weight_files(folder):
        if path.is_file():
            path.chmod(modes.get(path, new_mode))
