"""CausalQwen: a Qwen2 backbone with a numeric embedding, an abduction network and a Cauchy action network.

Read top to bottom: the output dataclasses, the three small modules of docs/design.md §1 (the action network owns
every use of the heads, the loss included), the pretrained-model base with its initialisation (§3), and
`CausalQwenForCausalLM`, whose forward reads embed → backbone → abduction → heads and loss.
"""

# No `from __future__ import annotations` here: transformers reads the forward's `**kwargs: Unpack[TransformersKwargs]`
# annotation at run time (e.g. to tell whether the model can return attentions), which a string would hide.
import contextvars
import copy
import math
import os
from dataclasses import asdict, dataclass

import torch
from torch import nn
from transformers import Qwen2Model
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.models.qwen2.modeling_qwen2 import Qwen2PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import ModelOutput, TransformersKwargs, can_return_tuple

from . import cauchy
from .cauchy import kl_divergence, symlog, untransform_values
from .checks import check_forward_inputs, check_forward_replacement
from .configuration import CausalQwenConfig, bind_model
from .conversion import convert_qwen
from .generation import CausalGenerationState, CausalQwenGenerationMixin
from .labels import IGNORE_INDEX, next_token_targets
from .loss import LossOptions, causal_qwen_loss, fused_causal_qwen_loss, safe_mean
from .modelcard import write_model_card

# Fields that decide a model's modules when it is built: a built model cannot follow an edit of them.
_MODULE_FIELDS = {
    "use_numeric": "whether the model has a numeric embedding and a regression head",
    "causal_size": "the size of the abduction and action layers",
    "learnable_threshold": "whether action.threshold is a trainable parameter",
}
# Fields that only fill tensors when a model is built, and those tensors: an edit of the field (or a value given to
# `from_pretrained`) fills them again, so that the model is the one its config describes.
_FILLED_TENSORS = {
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

__all__ = [
    "CausalQwenOutput", "CausalQwenActionOutput", "CausalQwenNumericEmbedding", "CausalQwenAbduction",
    "CausalQwenAction", "CausalQwenPreTrainedModel", "CausalQwenModel", "CausalQwenForCausalLM",
]


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


@dataclass
class CausalQwenOutput(ModelOutput):
    r"""
    Output of [`CausalQwenForCausalLM`]. Shapes use B batch, S positions kept, V vocabulary, C causal size.

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
        past_key_values (`Cache`, *optional*): as in Qwen2.
        hidden_states (`tuple(torch.FloatTensor)`, *optional*): as in Qwen2.
        attentions (`tuple(torch.FloatTensor)`, *optional*): as in Qwen2.
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


class CausalQwenNumericEmbedding(nn.Module):
    """e = embed(id) + 1[id = <NUM>]·d_num + sign(v)·ln(1 + |v|)·w_num.

    φ(0) = 0, so positions without a number keep the backbone's own embedding. `d_num` is a learnable
    offset because the `<NUM>` row of a frozen embedding cannot learn.
    """

    def __init__(self, config: CausalQwenConfig):
        super().__init__()
        self.config = config
        self.w_num = nn.Parameter(torch.zeros(config.hidden_size))
        self.d_num = nn.Parameter(torch.zeros(config.hidden_size))

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        input_ids: torch.Tensor,
        numeric_values: torch.Tensor | None,
        *,
        keep_in_graph: bool = False,
    ) -> torch.Tensor:
        """`inputs_embeds` `[B, S, H]`, `input_ids` and `numeric_values` `[B, S]` → `[B, S, H]`.

        With `keep_in_graph`, a batch without numbers adds its zero terms all the same (the result is the same
        tensor values), so that `d_num` and `w_num` are in the autograd graph of every batch.
        """
        is_num = input_ids == self.num_token_id
        if torch.compiler.is_compiling():
            # No data-dependent branch in a traced graph: add both terms (each is 0 where there is no number).
            has_values = numeric_values is not None
        else:
            has_values = numeric_values is not None and bool((numeric_values != 0).any())
        if not keep_in_graph and not has_values and not torch.compiler.is_compiling() and not bool(is_num.any()):
            # Nothing to add; returning the embedding unchanged also keeps d_num and w_num out of the graph, so a
            # text-only training step does not backpropagate through the frozen backbone.
            return inputs_embeds
        embeds = inputs_embeds + is_num.unsqueeze(-1).to(inputs_embeds.dtype) * self.d_num.to(inputs_embeds.dtype)
        if keep_in_graph and numeric_values is None:
            numeric_values = torch.zeros(input_ids.shape, dtype=torch.float64, device=input_ids.device)
        if has_values or keep_in_graph:
            # symlog in float64 keeps the 16 significant digits of the tokenizer's values.
            magnitude = symlog(numeric_values.to(torch.float64)).to(inputs_embeds.dtype)
            embeds = embeds + magnitude.unsqueeze(-1) * self.w_num.to(inputs_embeds.dtype)
        return embeds

    @property
    def num_token_id(self) -> int | None:
        """`config.num_token_id`, read at every use so that the model follows its config."""
        return self.config.num_token_id


class CausalQwenAbduction(nn.Module):
    """Infer the individual U ~ Cauchy(loc_U, scale_U) from the backbone's features z.

    loc_U = W_loc z + b_loc, scale_U = max(softplus(W_scale z + b_scale), scale_min).
    """

    def __init__(self, config: CausalQwenConfig):
        super().__init__()
        self.loc_net = nn.Linear(config.hidden_size, config.causal_size)
        self.scale_net = nn.Linear(config.hidden_size, config.causal_size)
        self.config = config

    @property
    def scale_min(self) -> float:
        """`config.scale_min`, read at every use: an edit of the config applies at once."""
        return self.config.scale_min

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, S, H]` → `(loc_U, scale_U)`, each `[B, S, C]`."""
        loc = self.loc_net(hidden_states)
        scale = nn.functional.softplus(self.scale_net(hidden_states)).clamp(min=self.scale_min)
        return loc, scale


@dataclass
class CausalQwenActionOutput(ModelOutput):
    r"""
    Output of [`CausalQwenAction`], the heads-and-loss step. Shapes as in [`CausalQwenOutput`].

    Args:
        loss, cls_loss, reg_loss (`torch.FloatTensor` of shape `()`, *optional*): with `labels`, as in
            [`CausalQwenOutput`].
        loc_S, scale_S (`torch.FloatTensor` of shape `(B, S, V)`, *optional*): None when `output_distributions`
            is off (the loss is then fused, without any `[B, S, V]` tensor).
        loc_Y, scale_Y (`torch.FloatTensor` of shape `(B, S)`, *optional*): None without a regression head.
    """

    loss: torch.FloatTensor | None = None
    cls_loss: torch.FloatTensor | None = None
    reg_loss: torch.FloatTensor | None = None
    loc_S: torch.FloatTensor | None = None
    scale_S: torch.FloatTensor | None = None
    loc_Y: torch.FloatTensor | None = None
    scale_Y: torch.FloatTensor | None = None


class CausalQwenAction(nn.Module):
    """Act on U: add exogenous noise, then decide every class (OvR) and regress the value; score them.

    scale_U' = scale_U + |b_noise|; (loc_S, scale_S) = (W_cls loc_U + b_cls, |W_cls| scale_U');
    (loc_Y, scale_Y) = (w_reg·loc_U + b_reg, |w_reg|·scale_U' [+ γ_Y]). P_k = P(S_k > C_k).
    γ_Y = exp(`reg_log_noise`) exists only when `config.regression_noise > 0`.

    Every use of the heads goes through this module: the forward pass and its loss (`forward`), generation and
    metrics (`head_inputs`, `classify`, `regress`, `margin`), so that each formula is written once. `forward` is
    also where sharding engines gather the heads' weights. It reads `cls_head.weight` and `reg_head.weight` without
    calling those modules, so FSDP must gather them with the action network (accelerate's FSDP2 puts it in the
    root's unit, docs/training.md), and DeepSpeed ZeRO-3 must know them as external parameters of this module
    (`register_zero3_heads`, done when the model is built under ZeRO-3 and by `CausalQwenTrainer`).
    """

    def __init__(self, config: CausalQwenConfig):
        super().__init__()
        self.config = config
        self.cls_head = nn.Linear(config.causal_size, config.vocab_size, bias=True)
        self.reg_head = nn.Linear(config.causal_size, 1) if config.use_numeric else None
        # A log-parameter: the value's noise scale has to move over orders of magnitude at Adam's fixed step. Shape
        # [1], not [] (checkpoints of shape [] load): FSDP2's fully_shard and DeepSpeed take no 0-dim parameter.
        self.reg_log_noise = nn.Parameter(torch.zeros(1)) if config.regression_noise > 0 else None
        self.b_noise = nn.Parameter(torch.zeros(config.causal_size))
        threshold = torch.full((config.vocab_size,), float(config.ovr_threshold))
        if config.learnable_threshold:
            self.threshold = nn.Parameter(threshold)
        else:
            self.register_buffer("threshold", threshold, persistent=True)
        if _deepspeed_zero3_enabled():
            self.register_zero3_heads()

    @property
    def scale_min(self) -> float:
        """`config.scale_min`, read at every use: an edit of the config applies at once."""
        return self.config.scale_min

    def register_zero3_heads(self) -> None:
        """Tell DeepSpeed ZeRO-3 to gather the heads' parameters around this module's forward and backward.

        ZeRO-3 partitions every parameter and gathers a module's own parameters when the module is called;
        `forward` reads those of `cls_head` and `reg_head` without calling them, which DeepSpeed's
        `register_external_parameter` is for. Idempotent; call it again after replacing a head.
        """
        try:  # in a try block, so that the remote-code copy of this file does not require deepspeed
            from deepspeed import zero
        except ImportError as error:
            raise ImportError("register_zero3_heads is for DeepSpeed ZeRO-3 and needs deepspeed") from error
        for head in (self.cls_head, self.reg_head):
            if head is not None:
                for param in head.parameters():
                    zero.register_external_parameter(self, param)

    def _check_zero3_heads(self) -> None:
        weight = self.cls_head.weight
        if hasattr(weight, "ds_id") and id(weight) not in getattr(self, "_external_params", {}):
            raise RuntimeError(
                "DeepSpeed ZeRO-3 partitions the heads, and the action network reads them in its forward: call "
                "model.action.register_zero3_heads() before deepspeed.initialize (CausalQwenTrainer does, and so does "
                "building the model after TrainingArguments with a ZeRO-3 config)"
            )

    def forward(
        self,
        loc_u: torch.Tensor,
        scale_u: torch.Tensor,
        labels: torch.Tensor | None = None,
        numeric_labels: torch.Tensor | None = None,
        *,
        output_distributions: bool = True,
        num_items_in_batch: int | torch.Tensor | None = None,
        num_numbers_in_batch: int | torch.Tensor | None = None,
        loss_options: LossOptions | None = None,
        chunk_size: int | None = None,
        vocab_chunk_size: int | None = None,
        memory_budget: int | None = None,
        shift_labels: torch.Tensor | None = None,
        shift_numeric_labels: torch.Tensor | None = None,
    ) -> CausalQwenActionOutput:
        """The heads on `(loc_U, scale_U)` `[B, S, C]`, and with `labels` the loss of docs/design.md §4.

        Args:
            labels, numeric_labels: `[B, S]`, unshifted, as in [`CausalQwenForCausalLM.forward`].
            output_distributions: build `loc_S`, `scale_S` `[B, S, V]`. Off, the classification loss runs fused and
                tiled (`loss.fused_causal_qwen_loss`): the same loss and gradients without any `[B, S, V]` tensor.
            num_items_in_batch, num_numbers_in_batch: see `loss.causal_qwen_loss`.
            loss_options: the loss's options; by default `LossOptions.from_config(self.config)`.
            chunk_size, vocab_chunk_size, memory_budget: tiling of the fused loss (`chunked_loss.chunked_ovr_loss`).
            shift_labels, shift_numeric_labels: targets already shifted, as in [`CausalQwenForCausalLM.forward`];
                with them the loss is computed (from them) even without `labels`.
        """
        self._check_zero3_heads()
        scale = self.noisy_scale(scale_u)
        loc_s = scale_s = loc_y = scale_y = None
        if output_distributions:
            loc_s, scale_s = self.classify(loc_u, scale)
        if self.reg_head is not None:
            loc_y, scale_y = self.regress(loc_u, scale)
        losses = None
        if labels is not None or shift_labels is not None:
            options = asdict(loss_options or LossOptions.from_config(self.config))
            options.update(shift_labels=shift_labels, shift_numeric_labels=shift_numeric_labels,
                           num_numbers_in_batch=num_numbers_in_batch)
            if output_distributions:
                losses = causal_qwen_loss(loc_s, scale_s, loc_y, scale_y, labels, numeric_labels,
                                          threshold=self.threshold, num_items_in_batch=num_items_in_batch, **options)
            else:
                losses = fused_causal_qwen_loss(
                    loc_u, scale, self.cls_head.weight, self.cls_head.bias, self.threshold, loc_y, scale_y, labels,
                    numeric_labels, scale_min=self.scale_min, num_items_in_batch=num_items_in_batch,
                    chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size, memory_budget=memory_budget, **options,
                )
            if self.training:
                losses.loss = losses.loss + self._unused_value_head_zero()
        return CausalQwenActionOutput(
            loss=losses.loss if losses is not None else None,
            cls_loss=losses.cls_loss if losses is not None else None,
            reg_loss=losses.reg_loss if losses is not None else None,
            loc_S=loc_s, scale_S=scale_s, loc_Y=loc_y, scale_Y=scale_y,
        )

    def resize_threshold(self, num_classes: int) -> None:
        """Give the threshold `num_classes` entries (after the class head was resized): kept where the class stays,
        `config.ovr_threshold` for new classes."""
        old = self.threshold
        if old.shape[0] == num_classes:
            return
        with torch.no_grad():
            new = torch.full((num_classes,), float(self.config.ovr_threshold), dtype=old.dtype, device=old.device)
            kept = min(num_classes, old.shape[0])
            new[:kept] = old[:kept]
        if isinstance(old, nn.Parameter):
            self.threshold = nn.Parameter(new, requires_grad=old.requires_grad)
        else:
            self.threshold = new

    def _unused_value_head_zero(self) -> torch.Tensor | float:
        """0 · the value head's trainable parameters, which a batch without values leaves out of the loss.

        (With values, the regression sum keeps the head in the graph even when no target is `<NUM>`,
        `loss.combine_losses`; without `numeric_labels` or `numeric_values` there is no regression term at all.)

        Data-parallel and sharding engines wait for a gradient of every trainable parameter (DDP without looking
        for unused ones, as under activation checkpointing; FSDP and DeepSpeed reduce the same parameters in the
        same order on every rank), so each training loss touches them: their gradient is then exactly 0. It is
        read here, in the module's own forward, where sharding engines have gathered the parameters.
        """
        params = [p for p in (*(self.reg_head.parameters() if self.reg_head is not None else ()), self.reg_log_noise)
                  if p is not None and p.requires_grad]
        if not params:
            return 0.0
        return 0.0 * torch.stack([p.sum() for p in params]).sum()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checkpoints written before reg_log_noise became a [1] vector hold it as a 0-dim tensor.
        key = prefix + "reg_log_noise"
        if key in state_dict and state_dict[key].dim() == 0:
            state_dict[key] = state_dict[key].reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def noisy_scale(self, scale_u: torch.Tensor) -> torch.Tensor:
        """scale_U' = scale_U + |b_noise|: the noise is Cauchy, so its scale adds to U's."""
        return scale_u + self.b_noise.abs().to(scale_u.dtype)

    def head_inputs(
        self,
        loc_u: torch.Tensor,
        scale_u: torch.Tensor,
        *,
        individual: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The Cauchy input `(loc, scale)` `[..., C]` of the heads: U with the exogenous noise (docs/design.md §5).

        By default the noise is integrated out: `(loc_U, scale_U + |b_noise|)`. With `individual` (ε ~ U(0, 1),
        broadcasting against `loc_u`), U is a sampled individual u = loc_U + scale_U·tan(π(ε − ½)) and only the
        noise stays random: `(u, |b_noise|)`. With `noise` (ε), the noise is drawn instead:
        `(loc_U + |b_noise|·tan(π(ε − ½)), scale_U)`.
        """
        if individual is not None and noise is not None:
            raise ValueError("pass at most one of individual and noise")
        noise_scale = self.b_noise.abs().to(loc_u.dtype)
        if individual is not None:
            return cauchy.from_uniform(loc_u, scale_u, individual), noise_scale.expand_as(loc_u)
        if noise is not None:
            return cauchy.from_uniform(loc_u, noise_scale, noise), scale_u
        return loc_u, self.noisy_scale(scale_u)

    def classify(
        self, loc: torch.Tensor, scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decision scores `(loc_S, scale_S)` `[..., V]` from a Cauchy input `[..., C]` (scale None: loc_S only)."""
        weight = self.cls_head.weight
        loc = loc.to(weight.dtype)
        if scale is None:
            return nn.functional.linear(loc, weight, self.cls_head.bias), None
        scale = scale.to(weight.dtype)
        bias = self.cls_head.bias
        # Autograd whenever anything upstream needs a gradient, the head frozen or not (a loss on the logits must
        # reach the abduction network); the block path below runs without autograd and serves inference only.
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (loc, scale, weight, bias)):
            loc_s, scale_s = cauchy.linear(loc, scale, weight, bias)
        else:
            # |W_cls| block by block, never cached: a cache keyed on the weight's version counter went stale after
            # writes through `.data` (EMA, weight averaging), which do not bump it (docs/design.md §9).
            loc_s, scale_s = cauchy.linear_by_blocks(loc, scale, weight, bias)
        return loc_s, scale_s.clamp(min=self.scale_min)

    def clear_cache(self) -> None:
        """Nothing is cached any more (|W_cls| is built block by block, see `classify`); kept for existing callers."""

    def regress(self, loc: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Regression output `(loc_Y, scale_Y)` `[...]` from a Cauchy input `[..., C]`."""
        loc_y, scale_y = cauchy.linear(loc, scale, self.reg_head.weight, self.reg_head.bias)
        scale_y = scale_y.squeeze(-1)
        if self.reg_log_noise is not None:
            scale_y = scale_y + self.reg_log_noise.exp().to(scale_y.dtype).reshape(())
        return loc_y.squeeze(-1), scale_y.clamp(min=self.scale_min)

    def margin(self, loc_s: torch.Tensor, scale_s: torch.Tensor) -> torch.Tensor:
        """The standardised margin z_k = (loc_S,k − C_k) / scale_S,k in fp32, `[..., V]`.

        P_k = 1/2 + atan(z_k)/π is increasing in z_k, so ranking z is ranking P, without the transcendental
        function and without P's loss of resolution near 1.
        """
        return (loc_s.float() - self.threshold.float()) / scale_s.float()


def _deepspeed_zero3_enabled() -> bool:
    """transformers' flag for a model built under ZeRO-3 (TrainingArguments or HfDeepSpeedConfig made first)."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


def _sharded_training() -> bool:
    """Whether this forward runs in a process group and not inside DistributedDataParallel.

    That is: under a sharding engine (FSDP, DeepSpeed), which all-gathers parameters in the backward pass of the
    modules it goes through and reduces gradients in the order they come (DeepSpeed's buckets), so every rank must
    build the same graph; and whose parameters, outside their module's forward, are shards or empty placeholders
    (ZeRO-3 partitions them even in a single process). DDP needs only a gradient of every parameter; a single
    process without a process group needs nothing, and gets `False` from the first, cheap call.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    return nn.parallel.DistributedDataParallel._get_active_ddp_module() is None


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
    return frozenset(name for name in _FILLED_TENSORS if name in saved and saved[name] != getattr(config, name))


def inverse_softplus(y: float) -> float:
    """softplus⁻¹(y) = log(expm1(y)), written as y + log(−expm1(−y)) so that large y cannot overflow."""
    return y + math.log(-math.expm1(-y))


class CausalQwenPreTrainedModel(Qwen2PreTrainedModel):
    config: CausalQwenConfig
    config_class = CausalQwenConfig
    _no_split_modules = ["Qwen2DecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Qwen2's initialisation, with the causal modules of docs/design.md §3.

        The two layers of the abduction network are plain `nn.Linear`s; they are recognised by identity and
        set to the identity map and the constant scale γ0 *instead of* the generic Linear initialisation
        (which would mark them initialised, and the helpers would then skip them). The helpers of
        `transformers.initialization` leave tensors loaded from a checkpoint untouched.
        """
        config = self.config
        abductions = [a for a in (getattr(self, "abduction", None), getattr(self, "abduction_anchor", None)) if a]
        if any(module is a.loc_net for a in abductions):
            init.eye_(module.weight)
            init.zeros_(module.bias)
        elif any(module is a.scale_net for a in abductions):
            init.zeros_(module.weight)
            init.constant_(module.bias, inverse_softplus(config.abduction_scale_init))
        elif isinstance(module, CausalQwenNumericEmbedding):
            init.normal_(module.w_num, mean=0.0, std=config.initializer_range)
            init.zeros_(module.d_num)
        elif isinstance(module, CausalQwenAction):
            init.constant_(module.b_noise, config.noise_init)
            init.constant_(module.threshold, config.ovr_threshold)
            if module.reg_log_noise is not None:
                init.constant_(module.reg_log_noise, math.log(config.regression_noise))
        else:
            super()._init_weights(module)


class CausalQwenModel(Qwen2Model):
    """The bare Qwen2 backbone of a CausalQwen checkpoint: what `AutoModel` gives for a CausalQwen config.

    A `Qwen2Model` (as `AutoModel` gives for a Qwen2 config) that takes the CausalQwen config, so that
    `AutoModel.from_pretrained` of a CausalQwen folder loads the backbone `model.*` alone, like Qwen2's; the numeric
    embedding and the causal heads are not part of it, so a `<NUM>` input is read by its token embedding only.
    """

    config_class = CausalQwenConfig
    # The causal modules of the full checkpoint (as Qwen2's `lm_head`) are not the backbone's.
    _keys_to_ignore_on_load_unexpected = [r"^(numeric_embedding|abduction|abduction_anchor|action)\."]


class CausalQwenForCausalLM(CausalQwenGenerationMixin, CausalQwenPreTrainedModel):
    """A drop-in for `Qwen2ForCausalLM` that reads numbers as values and decides with OvR Cauchy heads.

    State-dict layout (a public contract): `model.*` is the Qwen2 backbone with Qwen2's key names;
    `numeric_embedding.{w_num,d_num}`; `abduction.{loc_net,scale_net}`;
    `action.{cls_head,reg_head,b_noise,threshold}` (and `action.reg_log_noise` with `regression_noise > 0`);
    with an abduction anchor, `abduction_anchor.*`. Generation lives in [`CausalQwenGenerationMixin`], conversion
    from Qwen in `causal_qwen.conversion`.
    """

    def __init__(self, config: CausalQwenConfig):
        super().__init__(config)
        config.validate_causal_fields()  # fields set after the config was built are checked on their own only
        if config.use_numeric and config.num_token_id is None:
            raise ValueError("config.num_token_id is required when use_numeric=True (the id of <NUM>)")
        self.model = Qwen2Model(config)
        self.vocab_size = config.vocab_size
        self.numeric_embedding = CausalQwenNumericEmbedding(config) if config.use_numeric else None
        self.abduction = CausalQwenAbduction(config)
        self.action = CausalQwenAction(config)
        self.abduction_anchor = CausalQwenAbduction(config) if config.abduction_anchor_weight > 0 else None
        self.post_init()
        self.apply_freeze_backbone()
        bind_model(config, self)

    def __setstate__(self, state) -> None:
        # A copy (copy.deepcopy, pickle) has a config of its own, whose edits must reach the copy.
        super().__setstate__(state)
        bind_model(self.config, self)

    def _config_field_changing(self, name: str, old, new) -> None:
        """Refuse an edit of `config.<name>` that the built model cannot follow: the field decides its modules."""
        if name in _MODULE_FIELDS or (name == "regression_noise" and (old > 0) != (new > 0)):
            what = _MODULE_FIELDS.get(name, "whether action.reg_log_noise exists (0 or not)")
            raise ValueError(
                f"{name} decides {what} when the model is built, and this config belongs to a built model: "
                f"build the model with {name}={new!r} instead (CausalQwenForCausalLM.from_qwen(..., {name}=...), or "
                f"from_pretrained(..., {name}=...))"
            )
        if name == "abduction_anchor_weight" and new > 0 and self.abduction_anchor is None:
            raise ValueError("abduction_anchor_weight > 0 needs the frozen anchor copy of the abduction network, which "
                             f"this model has not got: call model.enable_abduction_finetuning({new!r})")

    @torch.no_grad()
    def _config_field_changed(self, name: str) -> None:
        """Fill the tensors that `config.<name>` initialises from its new value (docs/api.md, CausalQwenConfig)."""
        config = self.config
        if name == "ovr_threshold":
            self.action.threshold.fill_(float(config.ovr_threshold))
        elif name == "noise_init":
            self.action.b_noise.fill_(config.noise_init)
        elif name == "abduction_scale_init":
            self.abduction.scale_net.weight.zero_()
            self.abduction.scale_net.bias.fill_(inverse_softplus(config.abduction_scale_init))
        elif name == "regression_noise" and self.action.reg_log_noise is not None:
            self.action.reg_log_noise.fill_(math.log(config.regression_noise))

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        numeric_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        numeric_labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_distributions: bool | None = None,
        generation_state: CausalGenerationState | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalQwenOutput:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `(B, S)`): token ids, `<NUM>` where a number stands.
            numeric_values (`torch.Tensor` of shape `(B, S)`, *optional*):
                The value of each `<NUM>`, 0 elsewhere (float64 from the tokenizer keeps every digit); a value at
                another id raises `ValueError` (the values would not be aligned with the ids).
            labels (`torch.LongTensor` of shape `(B, S)`, *optional*):
                Next-token targets, unshifted, −100 where no loss is wanted.
            numeric_labels (`torch.Tensor` of shape `(B, S)`, *optional*):
                True values read where a label is `<NUM>`; defaults to `numeric_values`.
            logits_to_keep (`int` or `torch.Tensor`): compute the heads at these positions only
                (`generate` passes 1). Ignored when `labels` (or `shift_labels`) is given.
            output_distributions (`bool`, *optional*): return `loc_S`/`scale_S` (and `logits`). By default they
                are returned except in a training step with `labels`, which then takes the fused chunked path of
                `causal_qwen.chunked_loss` (same loss and gradients, no `[B, S, V]` tensor); `loc_Y`, `scale_Y`,
                `loc_U`, `scale_U` are always returned.
            generation_state (`CausalGenerationState`, *optional*): set by `generate`; the heads then run
                in the generation mode at the positions `logits_to_keep` kept (the last one only in a mode that draws
                anew at every step), and `loc_S` (= `logits`), `scale_S`, `loc_Y`, `scale_Y` are that mode's.
            shift_labels (`torch.LongTensor` of shape `(B, S)`, *optional*, a keyword in `kwargs` as in Qwen2):
                Targets already shifted (`shift_labels[:, i]` is the target of position i), as context-parallel
                training passes them (Trainer, accelerate; transformers' `ForCausalLMLoss` takes them alike): the loss
                is computed from them instead of from the shift of `labels`.
            shift_numeric_labels (`torch.Tensor` of shape `(B, S)`, *optional*, a keyword in `kwargs`):
                The values of `shift_labels`, already shifted. By default `numeric_labels` (or `numeric_values`) is
                shifted like the labels, which cannot give the value of the last position's target: a `<NUM>` target
                there needs `shift_numeric_labels`.
            num_items_in_batch, num_numbers_in_batch (*optional*, keywords in `kwargs`): the counts of labelled
                positions and of `<NUM>` targets over the optimizer step's micro-batches and devices, which
                `Trainer` (the first) and `CausalQwenTrainer` (both) pass; see `loss.causal_qwen_loss`.

        Returns:
            [`CausalQwenOutput`].
        """
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        num_numbers_in_batch = kwargs.pop("num_numbers_in_batch", None)
        # Keywords, not parameters: Trainer takes every forward parameter named "*label*" for a label it must be given
        # (`label_names`), and these come only with context parallelism.
        shift_labels = kwargs.pop("shift_labels", None)
        shift_numeric_labels = kwargs.pop("shift_numeric_labels", None)
        check_forward_inputs(self.config, input_ids, numeric_values, inputs_embeds, labels, numeric_labels,
                             shift_labels, shift_numeric_labels)
        has_targets = labels is not None or shift_labels is not None
        # Under a sharding engine every rank must run the same collectives, so every training batch goes through
        # the numeric embedding (and so backpropagates through the backbone), numbers or not.
        same_graph = self.training and has_targets and _sharded_training()
        if inputs_embeds is None:
            inputs_embeds = self.model.embed_tokens(input_ids)
            if self.numeric_embedding is not None:
                inputs_embeds = self.numeric_embedding(inputs_embeds, input_ids, numeric_values,
                                                       keep_in_graph=same_graph)

        outputs = self.model(
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        if not has_targets:
            hidden_states = keep_positions(hidden_states, logits_to_keep)
        loc_u, scale_u = self.abduction(hidden_states)

        if generation_state is not None:
            heads = CausalQwenActionOutput(**generation_state.decide(self.action, loc_u, scale_u))
            logits = heads.loc_S  # the mode's own scores reach the loop as scores (generation.DecisionScores)
            rows = logits.shape[1]  # the positions the mode decided
            loc_u, scale_u = loc_u[:, -rows:], scale_u[:, -rows:]
        else:
            if output_distributions is None:
                # A training step needs only the loss: the fused path never builds the [B, S, V] head.
                output_distributions = not has_targets or not self.training
            heads = self.action(
                loc_u, scale_u, labels, numeric_labels if numeric_labels is not None else numeric_values,
                output_distributions=output_distributions, num_items_in_batch=num_items_in_batch,
                num_numbers_in_batch=num_numbers_in_batch,
                shift_labels=shift_labels, shift_numeric_labels=shift_numeric_labels,
            )
            logits = heads.loc_S
            if has_targets:
                heads.loss = heads.loss + self._extra_training_loss(hidden_states, loc_u, scale_u, labels,
                                                                    num_items_in_batch, shift_labels, same_graph)

        return CausalQwenOutput(
            loss=heads.loss,
            cls_loss=heads.cls_loss,
            reg_loss=heads.reg_loss,
            logits=logits,
            loc_S=heads.loc_S,
            scale_S=heads.scale_S,
            loc_Y=heads.loc_Y,
            scale_Y=heads.scale_Y,
            loc_U=loc_u,
            scale_U=scale_u,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    def _extra_training_loss(
        self,
        hidden_states: torch.Tensor,
        loc_u: torch.Tensor,
        scale_u: torch.Tensor,
        labels: torch.Tensor | None,
        num_items_in_batch: int | torch.Tensor | None,
        shift_labels: torch.Tensor | None = None,
        numeric_embedding_in_graph: bool = False,
    ) -> torch.Tensor:
        """The anchor term β·KL (docs/design.md §7), plus 0 · the numeric embedding's parameters.

        The anchor term is the mean over positions with a (shifted) label of Σ_c KL(U ‖ U⁰), U⁰ from the frozen
        anchor; with `num_items_in_batch` (Trainer with gradient accumulation or several devices) the sum is divided
        by it instead, like the classification loss, so that summing micro-batch losses gives the overall mean.

        A batch without numbers leaves the numeric embedding out of the graph (and one without a `<NUM>` target
        leaves the regression head out: `CausalQwenAction` touches that one). Distributed data parallel training
        waits for a gradient of every trainable parameter (unless told to look for unused ones, which it is not
        under activation checkpointing), so each training loss touches them; their gradient is then exactly 0,
        and no backward pass through the backbone is added. Under a sharding engine the numeric embedding is in
        the graph of every batch already (`numeric_embedding_in_graph`), and its parameters are not read here,
        outside its forward, where they may be a shard or an empty placeholder.
        """
        extra = loc_u.new_zeros((), dtype=torch.float32)
        if self.abduction_anchor is not None:
            with torch.no_grad():
                anchor_loc, anchor_scale = self.abduction_anchor(hidden_states)
            kl = kl_divergence(loc_u.float(), scale_u.float(), anchor_loc.float(), anchor_scale.float()).sum(-1)
            valid = next_token_targets(labels, shift_labels=shift_labels)[0] != IGNORE_INDEX
            denominator = num_items_in_batch if num_items_in_batch is not None else valid.sum()
            extra = extra + self.config.abduction_anchor_weight * safe_mean(kl[valid].sum(), denominator)
        if self.training and self.numeric_embedding is not None and not numeric_embedding_in_graph:
            touched = [p.sum() for p in self.numeric_embedding.parameters() if p.requires_grad]
            if touched:
                extra = extra + 0.0 * torch.stack(touched).sum()
        return extra

    def enable_abduction_finetuning(self, anchor_weight: float = 1.0, reset_anchor: bool = False) -> None:
        """Train the abduction network only, anchored to where it starts (docs/design.md §7).

        Every parameter but `abduction.loc_net` and `abduction.scale_net` is frozen; a frozen copy of the current
        abduction network becomes `abduction_anchor`, and the loss gains `anchor_weight` times the mean over
        labelled positions of Σ_c KL(Cauchy(loc_U, scale_U) ‖ Cauchy(loc_U⁰, scale_U⁰)), which is 0 at the start
        and keeps U close to the base abduction (a guard against forgetting when adapting to a new domain).
        An anchor the model already has (e.g. loaded with a checkpoint saved mid-way) is kept unless
        `reset_anchor=True`.
        """
        if not anchor_weight >= 0:
            raise ValueError(f"anchor_weight must be a non-negative number, got {anchor_weight}")
        self.requires_grad_(False)
        self.abduction.requires_grad_(True)
        if anchor_weight == 0:
            self.abduction_anchor = None
        elif self.abduction_anchor is None or reset_anchor:
            # The copy shares the model's config (the memo), so that it follows later edits of scale_min.
            self.abduction_anchor = copy.deepcopy(self.abduction, {id(self.config): self.config}).requires_grad_(False)
        self.config.abduction_anchor_weight = float(anchor_weight)

    def apply_freeze_backbone(self) -> None:
        """Set `requires_grad` of the backbone from `config.freeze_backbone`, and keep any anchor frozen."""
        self.model.requires_grad_(not self.config.freeze_backbone)
        if self.abduction_anchor is not None:
            self.abduction_anchor.requires_grad_(False)

    def ovr_probabilities(self, loc_s: torch.Tensor, scale_s: torch.Tensor) -> torch.Tensor:
        """P_k = P(S_k > C_k) for decision scores `[..., V]`."""
        return cauchy.ovr_probability(loc_s, scale_s, self.action.threshold.to(loc_s.dtype))

    def value_interval(
        self, loc_y: torch.Tensor, scale_y: torch.Tensor, coverage: float = 0.9
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Median and central `coverage` interval of the predicted value, in value space.

        Quantiles commute with the monotone `value_transform`, so these are exact. They are computed in float64
        whatever the dtype of `loc_y` (a bf16 quantile is off by a factor of two at 99%), and returned in float64:
        a bound past float64's range is ±inf, and every coverage in (0, 1) gives lower ≤ median ≤ upper.

        Returns:
            `(median, lower, upper)`, float64 tensors of the shape of `loc_y`.
        """
        # MPS has no float64: such tensors are moved to the CPU for the interval.
        device = loc_y.device if loc_y.device.type != "mps" else torch.device("cpu")
        loc, scale = loc_y.to(device, torch.float64), scale_y.to(device, torch.float64)
        lower, upper = cauchy.central_interval(loc, scale, coverage)
        return tuple(self.to_value(b) for b in (loc, lower, upper))

    def to_value(self, y: torch.Tensor) -> torch.Tensor:
        """Map a point of the regression head's space back to a value (the inverse of `value_transform`)."""
        return untransform_values(y, self.config.value_transform)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, with two differences that keep the model what its config says.

        A field that only fills tensors when the model is built (`ovr_threshold`: `action.threshold`, `noise_init`:
        `action.b_noise`, `abduction_scale_init`: `abduction.scale_net`, `regression_noise`: `action.reg_log_noise`),
        given here, fills them from the value given, over the checkpoint's; so does a `config=` whose value differs
        from the saved config's. And a checkpoint that lacks one of CausalQwen's own tensors (numeric embedding,
        abduction, anchor, heads, threshold) raises a `ValueError` naming them, instead of their being drawn afresh
        (the backbone's keys, a checkpoint of the backbone alone, and tensors given as `state_dict=` behave as in
        transformers).
        """
        given = frozenset(name for name in _FILLED_TENSORS if name in kwargs)
        filled = given | _fields_changed_from_saved(args, kwargs)
        # Tensors passed as `state_dict=` are the caller's choice, partial or not, as in transformers.
        token = _LOAD_FILLS.set(filled if kwargs.get("state_dict") is None else None)
        try:
            result = super().from_pretrained(*args, **kwargs)
        finally:
            _LOAD_FILLS.reset(token)
        model = result[0] if isinstance(result, tuple) else result
        if isinstance(model, CausalQwenForCausalLM):
            # Loading replaces the parameters that `__init__` froze, so freeze again once they are in place.
            model.apply_freeze_backbone()
            for name in sorted(filled):
                model._config_field_changed(name)
        return result

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        super()._adjust_missing_and_unexpected_keys(loading_info)
        fills = _LOAD_FILLS.get()
        if fills is None:
            return
        own = {key for key in self.state_dict() if key.split(".", 1)[0] in _OWN_MODULES}
        refilled = {key for name in fills for key in _FILLED_TENSORS[name]}
        missing = sorted(key for key in loading_info.missing_keys if key in own and key not in refilled)
        # A checkpoint without any causal tensor is a backbone's (Qwen2's, or CausalQwenModel's): its heads start as a
        # new model's, reported as missing, as transformers does for a base model loaded into a class with a head.
        if missing and own - set(loading_info.missing_keys):
            hints = [hint for prefix, hint in _MISSING_KEY_HINTS.items() if any(k.startswith(prefix) for k in missing)]
            raise ValueError(
                f"the checkpoint lacks CausalQwen tensors the model needs: {', '.join(missing)}. They would be drawn "
                "afresh, giving another model; load a checkpoint saved by CausalQwenForCausalLM (or convert a Qwen2 "
                "one with CausalQwenForCausalLM.from_qwen) with the config that saved it" + "".join(hints)
            )

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`, plus a model card (README.md) when the folder has none.

        A model whose code is saved beside the weights (`register_for_auto_class`, done by `import causal_qwen`)
        also names its backbone for `AutoModel` in the config's `auto_map`, as the registered `AutoModel` does.
        """
        if self._auto_class is not None:
            auto_map = dict(getattr(self.config, "auto_map", None) or {})
            backbone = CausalQwenModel
            auto_map.setdefault("AutoModel", f"{backbone.__module__.rsplit('.', 1)[-1]}.{backbone.__name__}")
            self.config.auto_map = auto_map
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_model_card(save_directory, self.config)
        return result

    def __setattr__(self, name: str, value) -> None:
        # TRL's trainers install a softmax LM head over the bare backbone as `forward`: refused (docs/design.md §10).
        if name == "forward" and not check_forward_replacement(value):
            return
        super().__setattr__(name, value)

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """`PreTrainedModel.resize_token_embeddings`, which resizes the embedding and the class head, and the
        per-class threshold with them (new classes start at `config.ovr_threshold`).

        A vocabulary that would no longer hold `<NUM>` (`num_token_id`) raises a `ValueError`, before anything is
        changed.
        """
        target = new_num_tokens if new_num_tokens is not None else self.get_input_embeddings().weight.shape[0]
        if isinstance(pad_to_multiple_of, int) and not isinstance(pad_to_multiple_of, bool) and pad_to_multiple_of > 0:
            target = math.ceil(target / pad_to_multiple_of) * pad_to_multiple_of
        num_token_id = self.config.num_token_id
        if self.config.use_numeric and num_token_id is not None and num_token_id >= target:
            raise ValueError(f"resizing the vocabulary to {target} tokens would drop <NUM> (num_token_id "
                             f"{num_token_id}); keep at least {num_token_id + 1} tokens")
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        self.action.resize_threshold(self.action.cls_head.out_features)
        return embeddings

    def get_output_embeddings(self) -> nn.Linear:
        return self.action.cls_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.action.cls_head = new_embeddings


    from_qwen = classmethod(convert_qwen)


class _VectorOfOne(ConversionOps):
    """Load `action.reg_log_noise` of a checkpoint written while it was 0-dim as the `[1]` vector it is now."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        (tensors,) = input_dict.values()
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        return {target_patterns[0]: tensor.reshape(1)}

    @property
    def reverse_op(self) -> ConversionOps:
        return _VectorOfOne()


register_checkpoint_conversion_mapping(
    CausalQwenForCausalLM.__name__,
    [WeightConverter("action.reg_log_noise", "action.reg_log_noise", operations=[_VectorOfOne()])],
    overwrite=True,
)
