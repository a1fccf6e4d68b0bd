"""CausalQwen: a Qwen2 backbone with a numeric embedding, an abduction network and a Cauchy action network.

Read top to bottom: the output dataclass, the three small modules of DESIGN.md §1, the pretrained-model
base with its initialisation (§3), and `CausalQwenForCausalLM` with its forward pass and `from_qwen`.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import Qwen2ForCausalLM, Qwen2Model
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.qwen2.modeling_qwen2 import Qwen2PreTrainedModel
from transformers.utils import ModelOutput, can_return_tuple, logging

from .cauchy import kl_divergence, ovr_probability, quantile, symexp, symlog
from .cauchy import linear as cauchy_linear
from .chunked_loss import chunked_causal_qwen_loss
from .configuration import CausalQwenConfig
from .generation import (
    CausalGenerationState,
    CausalQwenGenerateOutput,
    StreamerWithNumbers,
    check_generation_options,
    global_rng_from,
)
from .loss import IGNORE_INDEX, causal_qwen_loss, safe_mean
from .modelcard import write_model_card

__all__ = ["CausalQwenOutput", "CausalQwenPreTrainedModel", "CausalQwenForCausalLM"]

logger = logging.get_logger(__name__)


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
            The same tensor as `loc_S`, so code written for Qwen2 logits keeps working.
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
        self.num_token_id = config.num_token_id
        self.w_num = nn.Parameter(torch.zeros(config.hidden_size))
        self.d_num = nn.Parameter(torch.zeros(config.hidden_size))

    def forward(
        self, inputs_embeds: torch.Tensor, input_ids: torch.Tensor, numeric_values: torch.Tensor | None
    ) -> torch.Tensor:
        """`inputs_embeds` `[B, S, H]`, `input_ids` and `numeric_values` `[B, S]` → `[B, S, H]`."""
        is_num = input_ids == self.num_token_id
        has_values = numeric_values is not None and bool((numeric_values != 0).any())
        if not has_values and not bool(is_num.any()):
            # Nothing to add; returning the embedding unchanged also keeps d_num and w_num out of the graph, so a
            # text-only training step does not backpropagate through the frozen backbone.
            return inputs_embeds
        embeds = inputs_embeds + is_num.unsqueeze(-1).to(inputs_embeds.dtype) * self.d_num.to(inputs_embeds.dtype)
        if has_values:
            # symlog in float64 keeps the 16 significant digits of the tokenizer's values.
            magnitude = symlog(numeric_values.to(torch.float64)).to(inputs_embeds.dtype)
            embeds = embeds + magnitude.unsqueeze(-1) * self.w_num.to(inputs_embeds.dtype)
        return embeds


class CausalQwenAbduction(nn.Module):
    """Infer the individual U ~ Cauchy(loc_U, scale_U) from the backbone's features z.

    loc_U = W_loc z + b_loc, scale_U = max(softplus(W_scale z + b_scale), scale_min).
    """

    def __init__(self, config: CausalQwenConfig):
        super().__init__()
        self.loc_net = nn.Linear(config.hidden_size, config.causal_size)
        self.scale_net = nn.Linear(config.hidden_size, config.causal_size)
        self.scale_min = config.scale_min

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, S, H]` → `(loc_U, scale_U)`, each `[B, S, C]`."""
        loc = self.loc_net(hidden_states)
        scale = nn.functional.softplus(self.scale_net(hidden_states)).clamp(min=self.scale_min)
        return loc, scale


class CausalQwenAction(nn.Module):
    """Act on U: add exogenous noise, then decide every class (OvR) and regress the value.

    scale_U' = scale_U + |b_noise|; (loc_S, scale_S) = (W_cls loc_U + b_cls, |W_cls| scale_U');
    (loc_Y, scale_Y) = (w_reg·loc_U + b_reg, |w_reg|·scale_U' [+ γ_Y]). P_k = P(S_k > C_k).
    γ_Y = exp(`reg_log_noise`) exists only when `config.regression_noise > 0`.
    """

    def __init__(self, config: CausalQwenConfig):
        super().__init__()
        self.cls_head = nn.Linear(config.causal_size, config.vocab_size, bias=True)
        self.reg_head = nn.Linear(config.causal_size, 1) if config.use_numeric else None
        # A log-parameter: the value's noise scale has to move over orders of magnitude at Adam's fixed step.
        self.reg_log_noise = nn.Parameter(torch.zeros(())) if config.regression_noise > 0 else None
        self.b_noise = nn.Parameter(torch.zeros(config.causal_size))
        threshold = torch.full((config.vocab_size,), float(config.ovr_threshold))
        if config.learnable_threshold:
            self.threshold = nn.Parameter(threshold)
        else:
            self.register_buffer("threshold", threshold, persistent=True)
        self.scale_min = config.scale_min
        self._abs_weight_cache: tuple[tuple, torch.Tensor] | None = None

    def noisy_scale(self, scale_u: torch.Tensor) -> torch.Tensor:
        """scale_U' = scale_U + |b_noise|: the noise is Cauchy, so its scale adds to U's."""
        return scale_u + self.b_noise.abs().to(scale_u.dtype)

    def classify(self, loc: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decision scores `(loc_S, scale_S)` `[..., V]` from a Cauchy input `[..., C]`."""
        weight = self.cls_head.weight
        if torch.is_grad_enabled() and weight.requires_grad:
            loc_s, scale_s = cauchy_linear(loc, scale, weight, self.cls_head.bias)
        else:
            loc_s = nn.functional.linear(loc, weight, self.cls_head.bias)
            scale_s = nn.functional.linear(scale, self.abs_cls_weight())
        return loc_s, scale_s.clamp(min=self.scale_min)

    def abs_cls_weight(self) -> torch.Tensor:
        """|W_cls|, kept between calls while W_cls is unchanged (generation reads it at every step).

        Building |W_cls| costs a pass over the `[V, C]` matrix and a new one of the same size; the cache is keyed
        by the weight's storage and version counter, so any in-place update (an optimiser step) rebuilds it.
        The cache outlives a `generate` call, so that the next one does not pay for it again; `clear_cache()` frees
        it, and so does switching the model to training mode.
        """
        weight = self.cls_head.weight
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        if self._abs_weight_cache is None or self._abs_weight_cache[0] != key:
            self._abs_weight_cache = (key, weight.detach().abs())
        return self._abs_weight_cache[1]

    def clear_cache(self) -> None:
        self._abs_weight_cache = None

    def regress(self, loc: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Regression output `(loc_Y, scale_Y)` `[...]` from a Cauchy input `[..., C]`."""
        loc_y, scale_y = cauchy_linear(loc, scale, self.reg_head.weight, self.reg_head.bias)
        scale_y = scale_y.squeeze(-1)
        if self.reg_log_noise is not None:
            scale_y = scale_y + self.reg_log_noise.exp().to(scale_y.dtype)
        return loc_y.squeeze(-1), scale_y.clamp(min=self.scale_min)

    def forward(
        self, loc_u: torch.Tensor, scale_u: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`(loc_U, scale_U)` `[B, S, C]` → `loc_S, scale_S` `[B, S, V]` and `loc_Y, scale_Y` `[B, S]`."""
        scale = self.noisy_scale(scale_u)
        loc_s, scale_s = self.classify(loc_u, scale)
        if self.reg_head is None:
            return loc_s, scale_s, None, None
        loc_y, scale_y = self.regress(loc_u, scale)
        return loc_s, scale_s, loc_y, scale_y

    def ovr_probability(self, loc_s: torch.Tensor, scale_s: torch.Tensor) -> torch.Tensor:
        """P_k = P(S_k > C_k), `[..., V]`."""
        return ovr_probability(loc_s, scale_s, self.threshold.to(loc_s.dtype))


def inverse_softplus(y: float) -> float:
    """softplus⁻¹(y) = log(expm1(y)), written as y + log(−expm1(−y)) so that large y cannot overflow."""
    return y + math.log(-math.expm1(-y))


class CausalQwenPreTrainedModel(Qwen2PreTrainedModel):
    config: CausalQwenConfig
    config_class = CausalQwenConfig
    _no_split_modules = ["Qwen2DecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Qwen2's initialisation, with the causal modules of DESIGN.md §3.

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


class CausalQwenForCausalLM(CausalQwenPreTrainedModel, GenerationMixin):
    """A drop-in for `Qwen2ForCausalLM` that reads numbers as values and decides with OvR Cauchy heads.

    State-dict layout (a public contract): `model.*` is the Qwen2 backbone with Qwen2's key names;
    `numeric_embedding.{w_num,d_num}`; `abduction.{loc_net,scale_net}`;
    `action.{cls_head,reg_head,b_noise,threshold}` (and `action.reg_log_noise` with `regression_noise > 0`);
    with an abduction anchor, `abduction_anchor.*`.
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

    def enable_abduction_finetuning(self, anchor_weight: float = 1.0, reset_anchor: bool = False) -> None:
        """Train the abduction network only, anchored to where it starts (DESIGN.md §7).

        Every parameter but `abduction.loc_net` and `abduction.scale_net` is frozen; a frozen copy of the current
        abduction network becomes `abduction_anchor`, and the loss gains `anchor_weight` times the mean over
        labelled positions of Σ_c KL(Cauchy(loc_U, scale_U) ‖ Cauchy(loc_U⁰, scale_U⁰)), which is 0 at the start
        and keeps U close to the base abduction (a guard against forgetting when adapting to a new domain).
        An anchor the model already has (e.g. loaded with a checkpoint saved mid-way) is kept unless
        `reset_anchor=True`.
        """
        if not anchor_weight >= 0:
            raise ValueError(f"anchor_weight must be a non-negative number, got {anchor_weight}")
        self.config.abduction_anchor_weight = float(anchor_weight)
        self.requires_grad_(False)
        self.abduction.requires_grad_(True)
        if anchor_weight == 0:
            self.abduction_anchor = None
        elif self.abduction_anchor is None or reset_anchor:
            self.abduction_anchor = copy.deepcopy(self.abduction).requires_grad_(False)

    def apply_freeze_backbone(self) -> None:
        """Set `requires_grad` of the backbone from `config.freeze_backbone`, and keep any anchor frozen."""
        self.model.requires_grad_(not self.config.freeze_backbone)
        if self.abduction_anchor is not None:
            self.abduction_anchor.requires_grad_(False)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        # Loading replaces the parameters that `__init__` froze, so freeze again once they are in place.
        model = super().from_pretrained(*args, **kwargs)
        if isinstance(model, CausalQwenForCausalLM):
            model.apply_freeze_backbone()
        return model

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`, plus a model card (README.md) when the folder has none."""
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_model_card(save_directory, self.config)
        return result

    def train(self, mode: bool = True):
        if mode:
            self.action.clear_cache()  # training steps read W_cls itself, never the cached |W_cls|
        return super().train(mode)

    def get_output_embeddings(self) -> nn.Linear:
        return self.action.cls_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.action.cls_head = new_embeddings

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
        **kwargs,
    ) -> CausalQwenOutput:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `(B, S)`): token ids, `<NUM>` where a number stands.
            numeric_values (`torch.Tensor` of shape `(B, S)`, *optional*):
                The value of each `<NUM>`, 0 elsewhere (float64 from the tokenizer keeps every digit).
            labels (`torch.LongTensor` of shape `(B, S)`, *optional*):
                Next-token targets, unshifted, −100 where no loss is wanted.
            numeric_labels (`torch.Tensor` of shape `(B, S)`, *optional*):
                True values read where a label is `<NUM>`; defaults to `numeric_values`.
            logits_to_keep (`int` or `torch.Tensor`): compute the heads at these positions only
                (`generate` passes 1). Ignored when `labels` is given.
            output_distributions (`bool`, *optional*): return `loc_S`/`scale_S` (and `logits`). By default they
                are returned except in a training step with `labels`, which then takes the fused chunked path of
                `causal_qwen.chunked_loss` (same loss and gradients, no `[B, S, V]` tensor); `loc_Y`, `scale_Y`,
                `loc_U`, `scale_U` are always returned.
            generation_state (`CausalGenerationState`, *optional*): set by `generate`; the heads then run
                at the last position only, in the generation mode, and `logits` holds that mode's
                decision scores.

        Returns:
            [`CausalQwenOutput`].
        """
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        self._check_inputs(input_ids, numeric_values, inputs_embeds, labels, numeric_labels)

        if inputs_embeds is None:
            inputs_embeds = self.model.embed_tokens(input_ids)
            if self.numeric_embedding is not None:
                inputs_embeds = self.numeric_embedding(inputs_embeds, input_ids, numeric_values)

        outputs = self.model(
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        if labels is None:
            hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)

        loc_u, scale_u = self.abduction(hidden_states)
        if generation_state is not None:
            step = generation_state.decide(self.action, loc_u, scale_u)
            return CausalQwenOutput(
                logits=step["logits"], loc_S=step["loc_S"], scale_S=step["scale_S"], loc_Y=step["loc_Y"],
                scale_Y=step["scale_Y"], loc_U=loc_u[:, -1:], scale_U=scale_u[:, -1:],
                past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states,
                attentions=outputs.attentions,
            )
        if output_distributions is None:
            # A training step needs only the loss: the fused path never builds the [B, S, V] head.
            output_distributions = labels is None or not self.training
        loc_s = scale_s = loc_y = scale_y = None
        if output_distributions:
            loc_s, scale_s, loc_y, scale_y = self.action(loc_u, scale_u)
        elif self.action.reg_head is not None:
            loc_y, scale_y = self.action.regress(loc_u, self.action.noisy_scale(scale_u))

        losses = None
        if labels is not None:
            if numeric_labels is None:
                numeric_labels = numeric_values
            options = {
                "num_token_id": self.config.num_token_id if self.config.use_numeric else None,
                "gate_alpha": self.config.gate_alpha,
                "reg_loss_weight": self.config.reg_loss_weight,
                "detach_gate": self.config.detach_gate,
                "value_transform": self.config.value_transform,
                "num_items_in_batch": num_items_in_batch,
            }
            if output_distributions:
                losses = causal_qwen_loss(loc_s, scale_s, loc_y, scale_y, labels, numeric_labels,
                                          threshold=self.action.threshold, **options)
            else:
                losses = chunked_causal_qwen_loss(loc_u, scale_u, labels, numeric_labels, action=self.action,
                                                  **options)
            if self.abduction_anchor is not None:
                anchor_loss = self._anchor_loss(hidden_states, loc_u, scale_u, labels, num_items_in_batch)
                losses.loss = losses.loss + self.config.abduction_anchor_weight * anchor_loss
            if self.training:
                losses.loss = losses.loss + self._touch_data_dependent_parameters()

        return CausalQwenOutput(
            loss=losses.loss if losses is not None else None,
            cls_loss=losses.cls_loss if losses is not None else None,
            reg_loss=losses.reg_loss if losses is not None else None,
            logits=loc_s,
            loc_S=loc_s,
            scale_S=scale_s,
            loc_Y=loc_y,
            scale_Y=scale_y,
            loc_U=loc_u,
            scale_U=scale_u,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    def _anchor_loss(
        self,
        hidden_states: torch.Tensor,
        loc_u: torch.Tensor,
        scale_u: torch.Tensor,
        labels: torch.Tensor,
        num_items_in_batch: int | torch.Tensor | None,
    ) -> torch.Tensor:
        """Mean over positions with a (shifted) label of Σ_c KL(U ‖ U⁰), U⁰ from the frozen anchor.

        With `num_items_in_batch` (Trainer with gradient accumulation or several devices) the sum is divided by
        it instead, like the classification loss, so that summing micro-batch losses gives the overall mean.
        """
        with torch.no_grad():
            anchor_loc, anchor_scale = self.abduction_anchor(hidden_states)
        kl = kl_divergence(loc_u.float(), scale_u.float(), anchor_loc.float(), anchor_scale.float()).sum(-1)
        valid = torch.zeros_like(labels, dtype=torch.bool)
        valid[:, :-1] = labels[:, 1:] != IGNORE_INDEX
        denominator = num_items_in_batch if num_items_in_batch is not None else valid.sum()
        return safe_mean(kl[valid].sum(), denominator)

    def _touch_data_dependent_parameters(self) -> torch.Tensor:
        """0 · (sum of the parameters a batch may leave unused), to add to a training loss.

        A batch without numbers leaves the numeric embedding out of the graph, and one without a `<NUM>` target
        leaves the regression head out. Distributed data parallel training waits for a gradient of every
        trainable parameter (unless told to look for unused ones, which it is not under activation
        checkpointing), so each training loss touches them; their gradient is then exactly 0, and no backward
        pass through the backbone is added.
        """
        modules = (self.numeric_embedding, self.action.reg_head)
        params = [p for m in modules if m is not None for p in m.parameters()] + [self.action.reg_log_noise]
        touched = [p.sum() for p in params if p is not None and p.requires_grad]
        return 0.0 * torch.stack(touched).sum() if touched else torch.zeros(())

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        numeric_values: torch.Tensor | None = None,
        generation_state: CausalGenerationState | None = None,
        **kwargs,
    ) -> dict:
        """Qwen2's preparation, plus the `numeric_values` of the ids this step feeds to the model."""
        model_inputs = super().prepare_inputs_for_generation(input_ids, **kwargs)
        if generation_state is not None:
            model_inputs["generation_state"] = generation_state
            numeric_values = generation_state.sync(input_ids, numeric_values)
        fed = model_inputs.get("input_ids")
        if numeric_values is not None and fed is not None:
            model_inputs["numeric_values"] = numeric_values[:, -fed.shape[1]:]
        return model_inputs

    @torch.no_grad()
    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config=None,
        *,
        numeric_values: torch.Tensor | None = None,
        mode: str = "standard",
        shared_individual: bool = False,
        shared_noise: bool = False,
        generator: torch.Generator | None = None,
        output_value_scores: bool = False,
        **kwargs,
    ) -> torch.LongTensor | CausalQwenGenerateOutput:
        r"""
        Generate with transformers' loop in one of the modes of DESIGN.md §5.

        Args:
            inputs (`torch.LongTensor` of shape `(B, S)`): the prompt ids (left-padded for batches).
            numeric_values (`torch.Tensor` of shape `(B, S)`, *optional*): the prompt's numbers.
            mode (`str`, defaults to `"standard"`):
                `"standard"`: argmax of the OvR probabilities; numbers are the median `loc_Y`.
                `"causal"`: sample the individual u = loc_U + scale_U·tan(π(ε − ½)) and decide under the
                noise alone; a fresh ε every step, or one per sequence with `shared_individual=True`.
                `"traditional"`: softmax over `loc_S` with the usual `do_sample`, `temperature`, `top_k`,
                `top_p`; greedy when `do_sample=False`, exactly as Qwen2.
            shared_individual (`bool`): `causal` mode only.
            shared_noise (`bool`): `standard` mode only; one ε_noise ~ Cauchy(0, 1) per sequence shifts U.
            generator (`torch.Generator`, *optional*): drives every random draw (ε is drawn as
                `torch.rand(B, C)` from it), so a seed reproduces a generation.
            output_value_scores (`bool`): with `return_dict_in_generate=True`, also return the per-step
                `loc_Y` and `scale_Y`.
            **kwargs: everything `GenerationMixin.generate` takes (`attention_mask`, `max_new_tokens`,
                `eos_token_id`, `streamer`, `return_dict_in_generate`, ...).

        Returns:
            The ids `(B, L)` as Qwen2 returns them, or with `return_dict_in_generate=True` a
            [`CausalQwenGenerateOutput`] that also carries `numeric_values` `(B, L)`.
        """
        check_generation_options(mode, shared_individual, shared_noise, kwargs.get("do_sample"))
        if kwargs.get("num_beams", 1) > 1 or (generation_config is not None and generation_config.num_beams > 1):
            raise ValueError("num_beams > 1 is not supported: beams would reorder the numbers of each sequence")
        if mode != "traditional":
            kwargs["do_sample"] = False
            copies = kwargs.pop("num_return_sequences", None) or getattr(generation_config, "num_return_sequences", 1)
            if copies > 1:
                # Greedy search refuses several sequences per prompt; here each copy draws its own ε (causal) or
                # noise (shared_noise), so repeat the prompts instead.
                if generation_config is not None:
                    generation_config = copy.deepcopy(generation_config)
                    generation_config.num_return_sequences = 1
                inputs, numeric_values, kwargs = _repeat_prompts(copies, inputs, numeric_values, kwargs)
        config = generation_config if generation_config is not None else self.generation_config
        return_dict = kwargs.pop("return_dict_in_generate", config.return_dict_in_generate)
        state = CausalGenerationState(
            mode, shared_individual=shared_individual, shared_noise=shared_noise, generator=generator,
            num_token_id=self.config.num_token_id if self.config.use_numeric else None, to_value=self.to_value,
        )
        if kwargs.get("streamer") is not None and state.num_token_id is not None:
            kwargs["streamer"] = StreamerWithNumbers(kwargs["streamer"], state, numeric_values)
        if state.num_token_id is not None:
            _check_numbers_have_values(inputs if inputs is not None else kwargs.get("input_ids"), numeric_values,
                                       state.num_token_id)
        sampling_rng = global_rng_from(generator if mode == "traditional" else None)
        with sampling_rng:
            output = super().generate(
                inputs, generation_config, numeric_values=numeric_values, generation_state=state,
                return_dict_in_generate=True, **kwargs,
            )
        values, loc_y, scale_y = state.finish(output.sequences)
        if not return_dict:
            return output.sequences
        if not output_value_scores:
            loc_y = scale_y = None
        return CausalQwenGenerateOutput(**output, numeric_values=values, loc_Y=loc_y, scale_Y=scale_y)

    def ovr_probabilities(self, loc_s: torch.Tensor, scale_s: torch.Tensor) -> torch.Tensor:
        """P_k = P(S_k > C_k) for decision scores `[..., V]`."""
        return self.action.ovr_probability(loc_s, scale_s)

    def value_interval(
        self, loc_y: torch.Tensor, scale_y: torch.Tensor, coverage: float = 0.9
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Median and central `coverage` interval of the predicted value, in value space.

        Quantiles commute with the monotone `value_transform`, so these are exact.

        Returns:
            `(median, lower, upper)`, each of the shape of `loc_y`.
        """
        if not 0.0 < coverage < 1.0:
            raise ValueError(f"coverage must lie in (0, 1), got {coverage}")
        tail = (1.0 - coverage) / 2.0
        bounds = (loc_y, quantile(loc_y, scale_y, tail), quantile(loc_y, scale_y, 1.0 - tail))
        return tuple(self.to_value(b) for b in bounds)

    def to_value(self, y: torch.Tensor) -> torch.Tensor:
        """Map a point of the regression head's space back to a value (the inverse of `value_transform`)."""
        return symexp(y) if self.config.value_transform == "symlog" else y

    def _check_inputs(
        self,
        input_ids: torch.Tensor | None,
        numeric_values: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        labels: torch.Tensor | None,
        numeric_labels: torch.Tensor | None,
    ) -> None:
        """Reject inputs that would otherwise give a silent wrong result or a failure deep inside torch."""
        vocab = self.config.vocab_size
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            _check_ids("input_ids", input_ids, vocab, allow_ignore=False)
        if numeric_values is not None:
            if input_ids is None:
                raise ValueError("numeric_values needs input_ids (the <NUM> positions); got inputs_embeds")
            _check_values("numeric_values", numeric_values, input_ids.shape)
            if self.numeric_embedding is None and bool((numeric_values != 0).any()):
                raise ValueError("numeric_values holds numbers but this model has use_numeric=False")
        if labels is not None:
            reference = input_ids if input_ids is not None else inputs_embeds[..., 0]
            if labels.shape != reference.shape:
                raise ValueError(f"labels must have shape {tuple(reference.shape)}, got {tuple(labels.shape)}")
            _check_ids("labels", labels, vocab, allow_ignore=True)
            if numeric_labels is not None:
                _check_values("numeric_labels", numeric_labels, labels.shape)
            elif numeric_values is None and self.config.use_numeric and bool(
                (labels == self.config.num_token_id).any()
            ):
                raise ValueError("labels contain <NUM> but neither numeric_labels nor numeric_values was given")
        if self.numeric_embedding is not None:
            _check_numbers_have_values(input_ids, numeric_values, self.config.num_token_id)

    @classmethod
    def from_qwen(
        cls,
        model_or_path: Qwen2ForCausalLM | str | os.PathLike,
        tokenizer=None,
        *,
        dtype: torch.dtype | str | None = None,
        num_row_init: str | Sequence[int] | None = None,
        seed: int = 0,
        **config_overrides,
    ) -> CausalQwenForCausalLM:
        """Build a CausalQwen from a Qwen2 causal LM, initialised as in DESIGN.md §3.

        The backbone is copied unchanged, the abduction network is the identity with scale γ0, the
        classification head is a copy of Qwen's `lm_head` (untied) with zero bias, so `loc_S` equals
        Qwen's logits; `w_num` is drawn with the standard deviation of the embedding matrix.

        Conversion is deterministic: the only random weights (`w_num`, then `action.reg_head.weight`) are drawn
        on the CPU from a generator seeded with `seed`, so the same checkpoint and arguments give the same model on
        any device, and the global RNG is left as it was. The seed is recorded as `config.conversion_seed`.

        Args:
            model_or_path: a `Qwen2ForCausalLM`, a local checkpoint folder, or a hub id.
            tokenizer: gives the `<NUM>` id (`tokenizer.num_token_id`, else `len(tokenizer)`); when
                omitted, the tokenizer saved beside a checkpoint folder is used.
            dtype: dtype to load a checkpoint in (default float32); an object keeps its own dtype.
            num_row_init: the `<NUM>` row of the classification head. `"digits"` (the default when a tokenizer is
                known): the mean of Qwen's rows of the tokens "0" … "9", so that `<NUM>` starts where Qwen expects
                a digit. `"copy"` (the seeds' choice): Qwen's row of that id, which for a reserved id was never
                trained, so P_<NUM> starts near 0 everywhere, the gated regression loss with it, and the trained
                model never writes a number. A sequence of ids averages those rows. Either way every other row is
                Qwen's, and since the mean of some logits never exceeds their maximum (ties go to the lower id),
                greedy `traditional` decoding of text still equals Qwen's. Without a tokenizer the default falls
                back to `"copy"`, with a warning.
            seed: seed of the random draws (a non-negative int, default 0).
            **config_overrides: any field of [`CausalQwenConfig`], e.g. `num_token_id`, `ovr_threshold`.
        """
        CausalQwenConfig.check_field_names(config_overrides, where="from_qwen()")
        generator = _conversion_generator(seed, config_overrides)
        source = _load_qwen(model_or_path, dtype)
        use_numeric = config_overrides.get("use_numeric", True)
        num_token_id = config_overrides.pop("num_token_id", None)
        if use_numeric and tokenizer is None and isinstance(model_or_path, (str, os.PathLike)):
            tokenizer = _load_tokenizer_beside(model_or_path)
        if use_numeric:
            num_token_id = _resolve_num_token_id(num_token_id, tokenizer)
        base_vocab = source.config.vocab_size
        if num_row_init is None:
            num_row_init = "digits" if _digit_ids(tokenizer) is not None else "copy"
            if use_numeric and num_row_init == "copy":
                logger.warning("from_qwen: no tokenizer with the digits 0-9, so the <NUM> row of the classification "
                               "head copies Qwen's row of that id (num_row_init='copy'); pass tokenizer= to start it "
                               "at the digits' mean, without which the model learns to write numbers very slowly")
        row_ids = _num_row_ids(num_row_init, tokenizer, base_vocab) if use_numeric else None
        if num_token_id is not None and num_token_id > base_vocab:
            raise ValueError(
                f"num_token_id {num_token_id} is beyond the vocabulary ({base_vocab} rows): the tokenizer does "
                "not match this checkpoint"
            )
        vocab_size = base_vocab + 1 if num_token_id == base_vocab else base_vocab

        config = _causal_config_from(source.config, vocab_size=vocab_size, num_token_id=num_token_id,
                                     overrides={**config_overrides, "conversion_seed": seed})
        with torch.device(source.device), _global_rng_kept(source.device):
            model = cls(config).to(source.dtype)
        _copy_qwen_weights(source, model, base_vocab, generator)
        if row_ids is not None:
            with torch.no_grad():
                model.action.cls_head.weight[num_token_id] = source.lm_head.weight[row_ids].float().mean(0)
        model.generation_config = copy.deepcopy(source.generation_config)
        return model.eval()  # as `from_pretrained` returns models


def _repeat_prompts(copies: int, inputs, numeric_values, kwargs: dict):
    """Repeat every prompt row `copies` times (ids, attention mask, numbers), as `num_return_sequences` would."""
    def repeat(x):
        return x.repeat_interleave(copies, dim=0) if isinstance(x, torch.Tensor) else x

    kwargs = {**kwargs, **{k: repeat(kwargs[k]) for k in ("input_ids", "attention_mask") if k in kwargs}}
    return repeat(inputs), repeat(numeric_values), kwargs


def _check_ids(name: str, ids: torch.Tensor, vocab_size: int, allow_ignore: bool) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.numel() == 0:
        return
    checked = ids[ids != IGNORE_INDEX] if allow_ignore else ids
    if checked.numel() and (int(checked.min()) < 0 or int(checked.max()) >= vocab_size):
        raise ValueError(
            f"{name} holds ids outside the vocabulary [0, {vocab_size}): min {int(checked.min())}, "
            f"max {int(checked.max())}"
        )


def _check_values(name: str, values: torch.Tensor, shape: torch.Size) -> None:
    if not isinstance(values, torch.Tensor) or not values.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {getattr(values, 'dtype', type(values))}")
    if values.shape != shape:
        raise ValueError(f"{name} must have the shape of the ids {tuple(shape)}, got {tuple(values.shape)}")
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"{name} must be finite (no NaN or inf)")


def _check_numbers_have_values(input_ids, numeric_values, num_token_id: int) -> None:
    """`<NUM>` ids without `numeric_values` would be read as 0 (a tokenizer's `encode` returns ids only)."""
    if numeric_values is None and isinstance(input_ids, torch.Tensor) and bool((input_ids == num_token_id).any()):
        raise ValueError(
            f"input_ids contain <NUM> (id {num_token_id}) but no numeric_values were given, so every number would "
            "be read as 0. Pass the numeric_values the CausalQwenTokenizer returns with the ids (`tokenizer(text)`, "
            "not `tokenizer.encode(text)`); with lm-evaluation-harness use `--model causal-qwen` "
            "(causal_qwen.integrations.lm_eval)."
        )


def _load_qwen(model_or_path, dtype) -> Qwen2ForCausalLM:
    if isinstance(model_or_path, Qwen2ForCausalLM):
        return model_or_path
    if isinstance(model_or_path, (str, os.PathLike)):
        return Qwen2ForCausalLM.from_pretrained(model_or_path, dtype=dtype or torch.float32)
    raise TypeError(
        f"model_or_path must be a Qwen2ForCausalLM, a folder or a hub id, got {type(model_or_path).__name__}"
    )


def _num_row_ids(num_row_init, tokenizer, base_vocab: int) -> list[int] | None:
    """The ids whose `lm_head` rows start the `<NUM>` row (None: keep the copied row)."""
    if isinstance(num_row_init, str):
        if num_row_init == "copy":
            return None
        if num_row_init != "digits":
            raise ValueError(f"num_row_init must be 'copy', 'digits' or a sequence of ids, got {num_row_init!r}")
        if tokenizer is None:
            raise ValueError("num_row_init='digits' needs a tokenizer (pass one, or a folder with one beside it)")
        ids = _digit_ids(tokenizer)
        if ids is None:
            raise ValueError("num_row_init='digits': the tokenizer has no single token for every digit 0-9")
    else:
        ids = list(num_row_init)
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"num_row_init must be 'copy', 'digits' or a non-empty sequence of ids, got {ids!r}")
    if not all(0 <= i < base_vocab for i in ids):
        raise ValueError(f"num_row_init ids must lie inside the checkpoint's vocabulary [0, {base_vocab})")
    return ids


def _digit_ids(tokenizer) -> list[int] | None:
    """The ids of the tokens "0" … "9", or None when the tokenizer has no single token for each."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is None:
        return None
    ids = [convert(str(d)) for d in range(10)]
    unknown = getattr(tokenizer, "unk_token_id", None)
    return None if any(not isinstance(i, int) or i == unknown for i in ids) else ids


def _resolve_num_token_id(num_token_id: int | None, tokenizer) -> int:
    """The `<NUM>` id: the override, else the tokenizer's (given, or saved beside the checkpoint)."""
    from_tokenizer = None
    if tokenizer is not None:
        from_tokenizer = getattr(tokenizer, "num_token_id", None)
        if from_tokenizer is None:
            from_tokenizer = len(tokenizer)
    if num_token_id is None and from_tokenizer is None:
        raise ValueError(
            "Cannot tell the <NUM> id: pass tokenizer= (its length gives the first spare row) or num_token_id="
        )
    if num_token_id is not None and from_tokenizer is not None and num_token_id != from_tokenizer:
        raise ValueError(f"num_token_id={num_token_id} disagrees with the tokenizer's <NUM> id {from_tokenizer}")
    return num_token_id if num_token_id is not None else from_tokenizer


def _load_tokenizer_beside(path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def _conversion_generator(seed, config_overrides: dict) -> torch.Generator:
    """A CPU generator for the random weights of a conversion: the same draws on every device."""
    if "conversion_seed" in config_overrides:
        raise ValueError("conversion_seed is recorded by from_qwen: pass seed= instead")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    return torch.Generator(device="cpu").manual_seed(seed)


def _global_rng_kept(device: torch.device):
    """Building the model draws throwaway initial weights from the global RNG; restore it afterwards."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device], device_type=device.type)


def _causal_config_from(qwen_config, *, vocab_size: int, num_token_id: int | None, overrides: dict):
    fields = qwen_config.to_dict()
    for key in ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path",
                "tie_word_embeddings", "vocab_size", "num_token_id"):
        fields.pop(key, None)
    fields.update(overrides)
    return CausalQwenConfig(**fields, vocab_size=vocab_size, num_token_id=num_token_id, tie_word_embeddings=False,
                            architectures=["CausalQwenForCausalLM"])


@torch.no_grad()
def _copy_qwen_weights(
    source: Qwen2ForCausalLM, model: CausalQwenForCausalLM, base_vocab: int, generator: torch.Generator
) -> None:
    """Backbone unchanged, lm_head → cls_head (a separate copy); a grown `<NUM>` row starts at zero.

    The weights that are not copied but drawn (w_num, w_reg) come from `generator`, in that order, in float32.
    """
    state = source.model.state_dict()
    embed_key = "embed_tokens.weight"
    if model.config.vocab_size != base_vocab:
        grown = torch.zeros_like(model.model.embed_tokens.weight)
        grown[:base_vocab] = state[embed_key]
        state = {**state, embed_key: grown}
    model.model.load_state_dict(state)
    model.action.cls_head.weight.zero_()
    model.action.cls_head.weight[:base_vocab] = source.lm_head.weight
    model.action.cls_head.bias.zero_()
    if model.numeric_embedding is not None:
        std = source.model.embed_tokens.weight.float().std().item()
        model.numeric_embedding.w_num.copy_(_normal(model.numeric_embedding.w_num.shape, std, generator))
    if model.action.reg_head is not None:
        weight = model.action.reg_head.weight
        weight.copy_(_normal(weight.shape, model.config.initializer_range, generator))


def _normal(shape: torch.Size, std: float, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std
