"""The model's tensors and its config: a built or loaded model stays the one its config says.

- A field that decides the model's modules cannot be edited on a built model's config (`check_config_edit`); a field
  that fills tensors fills them again when edited (`fill_from_config`).
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

from .configuration import CausalQwenConfig, bind_model
from .migrations import ADDED
from .modelcard import write_model_card

__all__ = ["FILLED_TENSORS", "CausalQwenLoadingMixin", "check_config_edit", "check_missing_keys", "fill_from_config",
           "inverse_softplus", "load_fills", "restore_weight_modes"]

# Fields that decide a model's modules when it is built: a built model cannot follow an edit of them.
_MODULE_FIELDS = {
    "use_numeric": "whether the model has a numeric embedding and a regression head",
    "causal_size": "the size of the abduction and action layers",
    "learnable_threshold": "whether action.threshold is a trainable parameter",
    "context_values": "whether the abduction network reads the context's values (abduction.context_values)",
    "context_values_rank": "the size of abduction.context_values",
    "context_values_log": "the logarithm abduction.context_values sums (its weights were fitted to it)",
}
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


def inverse_softplus(y: float) -> float:
    """softplus⁻¹(y) = log(expm1(y)), written as y + log(−expm1(−y)) so that large y cannot overflow."""
    return y + math.log(-math.expm1(-y))


def check_config_edit(model, name: str, old, new) -> None:
    """Refuse an edit of `config.<name>` that the built `model` cannot follow: the field decides its modules."""
    if name in _MODULE_FIELDS or (name == "regression_noise" and (old > 0) != (new > 0)):
        what = _MODULE_FIELDS.get(name, "whether action.reg_log_noise exists (0 or not)")
        raise ValueError(
            f"{name} decides {what} when the model is built, and this config belongs to a built model: "
            f"build the model with {name}={new!r} instead (CausalQwenForCausalLM.from_qwen(..., {name}=...), or "
            f"from_pretrained(..., {name}=...))"
        )
    if name == "abduction_anchor_weight" and new > 0 and model.abduction_anchor is None:
        raise ValueError("abduction_anchor_weight > 0 needs the frozen anchor copy of the abduction network, which "
                         f"this model has not got: call model.enable_abduction_finetuning({new!r})")


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
    """The loading and saving of `CausalQwenForCausalLM`, and its bond to its config (`configuration.bind_model`)."""

    # The bare backbone, which `AutoModel` gives for the config: saved remote code names it in the `auto_map`.
    _backbone_class: type | None = None

    def __setstate__(self, state) -> None:
        # A copy (copy.deepcopy, pickle) has a config of its own, whose edits must reach the copy.
        super().__setstate__(state)
        bind_model(self.config, self)

    def _config_field_changing(self, name: str, old, new) -> None:
        check_config_edit(self, name, old, new)  # refuses an edit of a field that decides the model's modules

    def _config_field_changed(self, name: str) -> None:
        fill_from_config(self, name)  # fills the tensors the field initialises

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

        A model whose code is saved beside the weights (`register_for_auto_class`, done by `import causal_qwen`)
        also names its backbone for `AutoModel` in the config's `auto_map`, as the registered `AutoModel` does.
        """
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
