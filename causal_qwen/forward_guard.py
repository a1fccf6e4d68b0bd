"""The model keeps its own forward: TRL's fused LM head, assigned as `model.forward`, is refused.

TRL's trainers (SFT, DPO, GRPO, ...) replace the forward with one that runs the bare backbone and a softmax
cross-entropy over `get_output_embeddings()`. On CausalQwen that skips the numeric embedding, the abduction network
and the OvR and regression losses: only `cls_head` would train, as a softmax classifier, `<NUM>` as a class without
its value (docs/design.md §10). `causal_qwen.integrations.trl` builds its trainer inside `keeping_own_forward`, where
the fused head is left out instead (the trainer never asks for it).
"""

from __future__ import annotations

import contextlib
import contextvars
from pathlib import Path

__all__ = ["KeepsOwnForward", "check_forward_replacement", "keeping_own_forward"]

_KEEP_OWN_FORWARD = contextvars.ContextVar("causal_qwen_keep_own_forward", default=False)


@contextlib.contextmanager
def keeping_own_forward():
    """Within this block a TRL fused LM head assigned to a CausalQwen model is skipped instead of refused."""
    token = _KEEP_OWN_FORWARD.set(True)
    try:
        yield
    finally:
        _KEEP_OWN_FORWARD.reset(token)


def _is_trl_fused_forward(value) -> bool:
    """TRL's `add_fused_lm_head` installs a bound `_fused_forward` (wrapped to look like the model's forward)."""
    code = getattr(getattr(value, "__func__", value), "__code__", None)
    return code is not None and code.co_name == "_fused_forward" and "trl" in Path(code.co_filename).parts


def check_forward_replacement(value) -> bool:
    """Whether `model.forward = value` may go ahead (False: skip it); raise for TRL's fused LM head."""
    if not _is_trl_fused_forward(value):
        return True
    if _KEEP_OWN_FORWARD.get():
        return False
    raise ValueError(
        "TRL's trainer replaces the model's forward with a fused softmax LM head, which skips CausalQwen's numeric "
        "embedding, abduction network and One-vs-Rest/regression loss (only cls_head would train, and numbers would "
        "lose their values). Use causal_qwen.integrations.trl.CausalQwenSFTTrainer (SFTTrainer's arguments) instead "
        "of trl.SFTTrainer; other TRL trainers are not supported."
    )


class KeepsOwnForward:
    """A module mixin: an assignment of `forward` goes through `check_forward_replacement`."""

    def __setattr__(self, name: str, value) -> None:
        if name == "forward" and not check_forward_replacement(value):
            return
        super().__setattr__(name, value)
