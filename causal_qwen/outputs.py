"""What the model returns: the output of `CausalQwenForCausalLM` and that of its heads-and-loss step.

Shapes: B batch, S positions kept, V vocabulary, C causal size.
"""

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput

__all__ = ["CausalQwenActionOutput", "CausalQwenOutput", "keep_positions"]


@dataclass
class CausalQwenOutput(ModelOutput):
    r"""
    Output of [`CausalQwenForCausalLM`].

    Args:
        loss (`torch.FloatTensor` of shape `()`, *optional*, returned when `labels` is given):
            `cls_loss + reg_loss_weight · reg_loss`.
        cls_loss (`torch.FloatTensor` of shape `()`, *optional*):
            One-vs-Rest classification loss, averaged over positions with a label.
        reg_loss (`torch.FloatTensor` of shape `()`, *optional*):
            Gated Cauchy NLL, averaged over positions whose label is `<NUM>` (0 when there is none).
        logits (`torch.FloatTensor` of shape `(B, S, V)`):
            The same tensor as `loc_S`, so code written for Qwen2 logits keeps working; None where `loc_S` is (a
            training step's fused loss, which never builds it). Inside `generate` too, where `loc_S` is the mode's
            (given the sampled individual in `causal` mode, the noise draw with `shared_noise`); the scores a mode
            ranks when they are not `loc_S` (the standardised margins) travel as generation scores.
        loc_S, scale_S (`torch.FloatTensor` of shape `(B, S, V)`):
            Location and scale of the Cauchy decision score of every class.
        loc_Y, scale_Y (`torch.FloatTensor` of shape `(B, S)`, *optional*):
            Location (median) and scale of the Cauchy regression output, in the space of
            `config.value_transform`; [`CausalQwenForCausalLM.value_interval`] maps them to values.
        loc_U, scale_U (`torch.FloatTensor` of shape `(B, S, C)`):
            The individual's causal representation U ~ Cauchy(loc_U, scale_U).
        past_key_values (`Cache`, *optional*), hidden_states, attentions (`tuple(torch.FloatTensor)`, *optional*):
            as in Qwen2.
    """

    loss: torch.FloatTensor | None = None
    cls_loss: torch.FloatTensor | None = None
    reg_loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    loc_S: torch.FloatTensor | None = None
    scale_S: torch.FloatTensor | None = None
    loc_Y: torch.FloatTensor | None = None
    scale_Y: torch.FloatTensor | None = None
    loc_U: torch.FloatTensor | None = None
    scale_U: torch.FloatTensor | None = None
    past_key_values: Cache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class CausalQwenActionOutput(ModelOutput):
    r"""
    Output of [`CausalQwenAction`], the heads-and-loss step; its fields as in [`CausalQwenOutput`]. `loc_S` and
    `scale_S` are None when `output_distributions` is off (the loss is then fused, without any `[B, S, V]` tensor),
    `loc_Y` and `scale_Y` without a regression head.
    """

    loss: torch.FloatTensor | None = None
    cls_loss: torch.FloatTensor | None = None
    reg_loss: torch.FloatTensor | None = None
    loc_S: torch.FloatTensor | None = None
    scale_S: torch.FloatTensor | None = None
    loc_Y: torch.FloatTensor | None = None
    scale_Y: torch.FloatTensor | None = None


def keep_positions(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions of `hidden_states` [B, S, H] whose heads are computed, as Qwen2ForCausalLM keeps them.

    An int keeps the last `logits_to_keep` positions (0 keeps all); an integer tensor holds positions, 1D for every
    row or 2D `[B, n]` for each. Ours, not transformers' helper for it, which only transformers 5.20 and later have.
    """
    if isinstance(logits_to_keep, int):
        return hidden_states[:, -logits_to_keep:] if logits_to_keep else hidden_states
    if logits_to_keep.dtype == torch.bool or logits_to_keep.ndim not in (1, 2):
        # A boolean mask keeps a different count per row, which the [B, S] heads cannot hold.
        raise ValueError(f"logits_to_keep must be an int or a 1D/2D integer tensor of positions, got "
                         f"{logits_to_keep.dtype} of shape {tuple(logits_to_keep.shape)}")
    if logits_to_keep.ndim == 2:
        return torch.take_along_dim(hidden_states, logits_to_keep[..., None], dim=1)
    return hidden_states[:, logits_to_keep]
