"""CausalQwen: a Qwen2 backbone with a numeric embedding, an abduction network and a Cauchy action network.

Read top to bottom, as Qwen2's modeling file: the three small modules of docs/design.md §1 (the action network owns
every use of the heads, and hands them with the targets to `loss.causal_qwen_loss`), the pretrained-model base with
its initialisation (§3), the bare backbone, and `CausalQwenForCausalLM`, whose forward reads embed → backbone →
abduction → heads and loss. What is not the model lives beside it: `distributed` (DDP, FSDP, DeepSpeed), `loading`
(`from_pretrained`, `save_pretrained`, `set_initial_values`), `migrations` (older checkpoints), `finetuning` (what
trains), `forward_guard` (TRL's fused head).
"""

# No `from __future__ import annotations` here: transformers reads the forward's `**kwargs: Unpack[TransformersKwargs]`
# annotation at run time (e.g. to tell whether the model can return attentions), which a string would hide.
import math
import re

import torch
from torch import nn
from transformers import Qwen2Model
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.models.qwen2.modeling_qwen2 import Qwen2PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple

from . import cauchy
from .cauchy import symlog, untransform_values
from .checks import check_forward_inputs, check_values_in_range
from .configuration import CausalQwenConfig
from .context_values import CausalQwenContextValues, ContextRead, count_numbers
from .conversion import convert_qwen
from .distributed import (
    check_zero3_heads,
    deepspeed_zero3_enabled,
    keep_in_graph,
    register_zero3_heads,
    sharded_training,
)
from .finetuning import apply_freeze_backbone, enable_abduction_finetuning
from .forward_guard import KeepsOwnForward
from .generation import CausalQwenGenerationMixin, register_mode_hooks
from .labels import LossTargets
from .loading import CausalQwenLoadingMixin, check_config_matches_modules, inverse_softplus, module_fields
from .loss import AnchorTerm, DecisionScores, FusedHead, LossOptions, Tiling, causal_qwen_loss
from .migrations import ADDED, register_checkpoint_conversions, upgrade_state_dict
from .next_value import next_values
from .numbers import round_to_interval
from .outputs import CausalQwenActionOutput, CausalQwenOutput, keep_positions

# The loss's keywords of the forward, which `Trainer` (the counts) and context parallelism (the shifted labels) pass.
_LOSS_KEYWORDS = ("num_items_in_batch", "num_numbers_in_batch", "shift_labels", "shift_numeric_labels")

__all__ = [
    "CausalQwenNumericEmbedding", "CausalQwenAbduction", "CausalQwenAction", "CausalQwenPreTrainedModel",
    "CausalQwenModel", "CausalQwenForCausalLM",
]


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
        self.context_values = (CausalQwenContextValues(config.hidden_size, config.context_values_rank,
                                                       config.context_values_log)
                               if config.context_values else None)
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

    def count_numbers(
        self, input_ids: torch.Tensor | None, cache: Cache | None
    ) -> tuple[torch.Tensor | None, int | None]:
        """Where the new positions are `<NUM>` `[B, S]` and the most numbers of any row of the context the path will
        read (`context_values.count_numbers`), or `(None, None)` where there is nothing to count. Called
        before the backbone runs: on a GPU a count waits for the device, which then has only the inputs' work queued,
        where after the backbone it would wait for all of it."""
        if self.context_values is None or input_ids is None or torch.compiler.is_compiling():
            return None, None
        is_num = input_ids == self.config.num_token_id
        return is_num, count_numbers(is_num, cache)

    def read_context(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor | None,
        numeric_values: torch.Tensor | None,
        logits_to_keep: int | torch.Tensor,
        cache: Cache | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        is_num: torch.Tensor | None = None,
        numbers: int | None = None,
    ) -> ContextRead | None:
        """The read of the earlier `<NUM>` values (docs/design.md §1b) at the new positions `logits_to_keep` keeps
        (`keep_positions`), or None without the path. `hidden_states` `[B, S, H]` are the new positions' features;
        `position_ids` `[B, S]` (or `[1, S]`) mark where a text starts (0), whose key reads nothing before it;
        `is_num` and `numbers` are what `count_numbers` gave before the backbone ran (None: counted here)."""
        if self.context_values is None:
            return None
        if is_num is None:
            is_num = (hidden_states.new_zeros(hidden_states.shape[:2], dtype=torch.bool) if input_ids is None
                      else input_ids == self.config.num_token_id)
        values = numeric_values if numeric_values is not None else torch.zeros(is_num.shape, dtype=torch.float64,
                                                                              device=is_num.device)
        starts = None
        if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2:
            starts = (position_ids == 0).expand(is_num.shape)
        return ContextRead(*self.context_values(hidden_states, is_num, values, self.config.value_transform,
                                                logits_to_keep=logits_to_keep, cache=cache, starts=starts,
                                                numbers=numbers))


class CausalQwenAction(nn.Module):
    """Act on U: add exogenous noise, then decide every class (OvR) and regress the value; score them.

    scale_U' = scale_U + |b_noise|; (loc_S, scale_S) = (W_cls loc_U + b_cls, |W_cls| scale_U');
    (loc_Y, scale_Y) = (w_reg·loc_U + b_reg, |w_reg|·scale_U' [+ γ_Y]). P_k = P(S_k > C_k).
    γ_Y = exp(`reg_log_noise`) exists only when `config.regression_noise > 0`.

    Every use of the heads goes through this module: the forward pass and its loss (`forward`), generation and
    metrics (`head_inputs`, `classify`, `regress`, `margin`), so that each formula is written once. `forward` reads
    the heads' weights without calling the heads, so sharding engines gather them with this module (`distributed`).
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
        if deepspeed_zero3_enabled():
            self.register_zero3_heads()

    @property
    def scale_min(self) -> float:
        """`config.scale_min`, read at every use: an edit of the config applies at once."""
        return self.config.scale_min

    def register_zero3_heads(self) -> None:
        """`distributed.register_zero3_heads` (done when the model is built under ZeRO-3 and by `CausalQwenTrainer`;
        call it again after replacing a head)."""
        register_zero3_heads(self)

    def forward(
        self,
        loc_u: torch.Tensor,
        scale_u: torch.Tensor,
        targets: LossTargets | None = None,
        *,
        output_distributions: bool = True,
        loss_options: LossOptions | None = None,
        anchor: AnchorTerm | None = None,
        tiling: Tiling | None = None,
        context: ContextRead | None = None,
    ) -> CausalQwenActionOutput:
        """The heads on `(loc_U, scale_U)` `[B, S, C]`, and with the shifted `targets` the loss of docs/design.md §4.

        Off, `output_distributions` runs the classification loss fused and tiled (`loss.FusedHead`): the same loss
        and gradients without any `[B, S, V]` tensor. `loss_options` default to the config's; `anchor` is U and the
        abduction anchor's U⁰ (`loss.AnchorTerm`), `context` the abduction's read of the context's values (`regress`).
        """
        check_zero3_heads(self)
        scale = self.noisy_scale(scale_u)
        loc_s = scale_s = loc_y = scale_y = losses = None
        if output_distributions:
            loc_s, scale_s = self.classify(loc_u, scale)
        if self.reg_head is not None:
            loc_y, scale_y = self.regress(loc_u, self.value_noisy_scale(scale_u, scale), context)
        if targets is not None:
            head = (DecisionScores(loc_s, scale_s, self.threshold) if output_distributions else
                    FusedHead(loc_u, scale, self.cls_head.weight, self.cls_head.bias, self.threshold, self.scale_min,
                              tiling or Tiling()))
            losses = causal_qwen_loss(head, loc_y, scale_y, targets,
                                      loss_options or LossOptions.from_config(self.config), anchor)
            if self.training:
                # Read here, in the module's own forward, where sharding engines have gathered the value head; and
                # the context-value path's layers, for a batch without a value term.
                losses.loss = losses.loss + keep_in_graph(self.reg_head, self.reg_log_noise)
                if context is not None and getattr(context.in_graph, "requires_grad", False):  # else a constant 0
                    losses.loss = losses.loss + context.in_graph.to(losses.loss.dtype)
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

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        upgrade_state_dict("action", state_dict, prefix)  # checkpoints of earlier versions
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def noisy_scale(self, scale_u: torch.Tensor) -> torch.Tensor:
        """scale_U' = scale_U + |b_noise|: the noise is Cauchy, so its scale adds to U's."""
        return scale_u + self.b_noise.abs().to(scale_u.dtype)

    def value_noisy_scale(self, scale_u: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
        """scale_U' as the value reads it: `noisy` (= `noisy_scale(scale_u)`) with b_noise out of the value's graph.

        b_noise is the decisions' noise and the class loss alone trains it; the value's width has its own parameters
        (γ_Y, the context path's ρ). Shared, the value's loss moved the class decisions through it, and text then
        depended on whether the value reads the context (docs/design.md §1). The forward values are the same.
        """
        if not (torch.is_grad_enabled() and self.b_noise.requires_grad):
            return noisy
        return scale_u + self.b_noise.detach().abs().to(scale_u.dtype)

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

    def regress(
        self, loc: torch.Tensor, scale: torch.Tensor, context: ContextRead | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Regression output `(loc_Y, scale_Y)` `[...]` from a Cauchy input `[..., C]`.

        With the abduction's `context` read (docs/design.md §1b), the linear law is weighted by π_0 and the read's
        offset and width enter: loc_Y = π_0·(w_reg·loc + b_reg) + m, scale_Y = π_0·|w_reg|·scale + γ_Y·ρ.
        """
        loc_y, spread = cauchy.linear(loc, scale, self.reg_head.weight, self.reg_head.bias)
        loc_y, spread = loc_y.squeeze(-1), spread.squeeze(-1)
        noise = self.reg_log_noise.exp().to(spread.dtype).reshape(()) if self.reg_log_noise is not None else 0.0
        if context is not None:
            loc_y, scale_y = context.apply(loc_y, spread, noise)
        else:
            scale_y = spread + noise
        return loc_y, scale_y.clamp(min=self.scale_min)

    def margin(self, loc_s: torch.Tensor, scale_s: torch.Tensor) -> torch.Tensor:
        """The standardised margin z_k = (loc_S,k − C_k) / scale_S,k in fp32, `[..., V]`.

        P_k = 1/2 + atan(z_k)/π is increasing in z_k, so ranking z is ranking P, without the transcendental
        function and without P's loss of resolution near 1.
        """
        return (loc_s.float() - self.threshold.float()) / scale_s.float()


class CausalQwenPreTrainedModel(Qwen2PreTrainedModel):
    config: CausalQwenConfig
    config_class = CausalQwenConfig
    _no_split_modules = ["Qwen2DecoderLayer"]
    # Read as their start from checkpoints saved before they existed (migrations.py): not tensors drawn afresh.
    _keys_to_ignore_on_load_missing = [rf"{module}\.{re.escape(name)}$" for module, name in ADDED]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Qwen2's initialisation, with the causal modules of docs/design.md §3.

        The abduction's two `nn.Linear`s are recognised by identity and set to the identity map and the constant
        scale γ0 *instead of* the generic Linear initialisation (which would mark them initialised). The helpers of
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
        elif isinstance(module, CausalQwenContextValues):
            module.reset_parameters(linear_only=True)
        elif any(module is a.context_values.key_before for a in abductions if a.context_values is not None):
            init.zeros_(module.weight)  # as the path starts it; and a checkpoint saved before K' existed reads it as 0
        elif any(module in a.context_values.children() for a in abductions if a.context_values is not None):
            pass  # the path's layers start with the path (above), not as generic Linear layers
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


class CausalQwenForCausalLM(CausalQwenGenerationMixin, CausalQwenLoadingMixin, KeepsOwnForward,
                            CausalQwenPreTrainedModel):
    """A drop-in for `Qwen2ForCausalLM` that reads numbers as values and decides with OvR Cauchy heads.

    State-dict layout (a public contract): `model.*` is the Qwen2 backbone with Qwen2's key names;
    `numeric_embedding.{w_num,d_num}`; `abduction.{loc_net,scale_net}`;
    `action.{cls_head,reg_head,b_noise,threshold}` (and `action.reg_log_noise` with `regression_noise > 0`);
    with an abduction anchor, `abduction_anchor.*`. Generation lives in [`CausalQwenGenerationMixin`], loading and
    saving in [`loading.CausalQwenLoadingMixin`], conversion from Qwen in `causal_qwen.conversion`.
    """

    _backbone_class = CausalQwenModel

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
        register_mode_hooks(self.action)  # the heads in generate's modes (generation.py)
        self.abduction_anchor = CausalQwenAbduction(config) if config.abduction_anchor_weight > 0 else None
        # What the config said of the modules when they were built: an edit of it since stops the forward and the save.
        self.built_module_fields = module_fields(config)
        self.post_init()
        self.apply_freeze_backbone()

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
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalQwenOutput:
        r"""Qwen2's forward, with the numbers' values in and the causal heads out ([docs/api.md](docs/api.md#forward)).

        `numeric_values` `[B, S]`: the value of each `<NUM>`, 0 elsewhere. `labels`: unshifted, −100 where no loss is
        wanted; `numeric_labels` (default `numeric_values`): the values read where a label is `<NUM>`. A training
        step's loss is fused (`loc_S`, `scale_S`, `logits` None) unless `output_distributions`; it reads every position
        (`logits_to_keep` 0). `kwargs` go to the backbone, but for the loss's keywords."""
        # Keywords, not parameters: Trainer takes each forward parameter named "*label*" for a label it must be given.
        loss_kwargs = {name: kwargs.pop(name, None) for name in _LOSS_KEYWORDS}
        if not torch.compiler.is_compiling():
            check_config_matches_modules(self)  # the config is plain data: a field edited since the build stops here
        check_forward_inputs(self.config, input_ids, numeric_values, inputs_embeds, labels, numeric_labels,
                             loss_kwargs["shift_labels"], loss_kwargs["shift_numeric_labels"], logits_to_keep)
        if numeric_values is not None and self.config.use_numeric and not torch.compiler.is_compiling():
            # Autograd records the context-value path's raw-space combination, whose weights' gradient carries v.
            raw_gradient = torch.is_grad_enabled() and self.abduction.context_values is not None
            check_values_in_range(numeric_values, self.config.value_transform, self.model.embed_tokens.weight.dtype,
                                  raw_gradient)
        has_targets = labels is not None or loss_kwargs["shift_labels"] is not None
        numeric_labels = numeric_labels if numeric_labels is not None else numeric_values
        targets = LossTargets.from_labels(labels, numeric_labels, **loss_kwargs) if has_targets else None
        # Every rank of a sharding engine must run the same collectives: every training batch takes the embedding.
        training_step = self.training and has_targets
        same_graph = training_step and sharded_training()
        if inputs_embeds is None:
            inputs_embeds = self._embed(input_ids, numeric_values, same_graph)
        is_num, numbers = self.abduction.count_numbers(input_ids, past_key_values)
        outputs = self.model(inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, use_cache=use_cache, **kwargs)
        hidden_states = keep_positions(outputs.last_hidden_state, logits_to_keep)
        loc_u, scale_u = self.abduction(hidden_states)
        cache = outputs.past_key_values if outputs.past_key_values is not None else past_key_values
        context = self.abduction.read_context(outputs.last_hidden_state, input_ids, numeric_values, logits_to_keep,
                                              cache, position_ids, is_num=is_num, numbers=numbers)
        full = output_distributions if output_distributions is not None else not training_step
        anchor = self._anchor(hidden_states, loc_u, scale_u) if has_targets else None
        heads = self.action(loc_u, scale_u, targets, output_distributions=full, anchor=anchor, context=context)
        if training_step and not same_graph:
            # A batch without numbers leaves the numeric embedding out of the graph (docs/design.md §4); under a
            # sharding engine it is in it already, and its parameters are not read outside its forward.
            heads.loss = heads.loss + keep_in_graph(self.numeric_embedding)

        return CausalQwenOutput(
            loss=heads.loss, cls_loss=heads.cls_loss, reg_loss=heads.reg_loss, logits=heads.loc_S, loc_S=heads.loc_S,
            scale_S=heads.scale_S, loc_Y=heads.loc_Y, scale_Y=heads.scale_Y, loc_U=loc_u, scale_U=scale_u,
            past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )

    def _embed(self, input_ids: torch.Tensor, numeric_values: torch.Tensor | None, same_graph: bool) -> torch.Tensor:
        """The input embedding `[B, S, H]`: the backbone's token embedding, plus the numbers' (when `use_numeric`);
        `same_graph` keeps the numeric embedding in the graph of a batch without numbers."""
        inputs_embeds = self.model.embed_tokens(input_ids)
        if self.numeric_embedding is None:
            return inputs_embeds
        return self.numeric_embedding(inputs_embeds, input_ids, numeric_values, keep_in_graph=same_graph)

    def _anchor(self, hidden_states: torch.Tensor, loc_u: torch.Tensor, scale_u: torch.Tensor) -> AnchorTerm | None:
        """U and U⁰ of the frozen abduction anchor, for the anchor term (docs/design.md §7); None without one."""
        with torch.no_grad():
            anchor = self.abduction_anchor(hidden_states) if self.abduction_anchor is not None else None
        return AnchorTerm(loc_u, scale_u, *anchor) if anchor is not None else None

    def enable_abduction_finetuning(self, anchor_weight: float = 1.0, reset_anchor: bool = False) -> None:
        """Train the abduction network only, anchored by a KL term to a frozen copy of where it starts (docs/design.md
        §7; `finetuning.enable_abduction_finetuning`). An anchor the model has is kept unless `reset_anchor`."""
        enable_abduction_finetuning(self, anchor_weight, reset_anchor)

    def apply_freeze_backbone(self) -> None:
        """Set `requires_grad` of the backbone from `config.freeze_backbone`, and keep any anchor frozen."""
        apply_freeze_backbone(self)

    def ovr_probabilities(self, loc_s: torch.Tensor, scale_s: torch.Tensor) -> torch.Tensor:
        """P_k = P(S_k > C_k) for decision scores `[..., V]`."""
        return cauchy.ovr_probability(loc_s, scale_s, self.action.threshold.to(loc_s.dtype))

    def value_interval(
        self, loc_y: torch.Tensor, scale_y: torch.Tensor, coverage: float = 0.9
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(median, lower, upper)`: the median and central `coverage` interval of the value, float64 tensors of the
        shape of `loc_y`, in value space.

        Quantiles commute with the monotone `value_transform`, so these are exact. They are computed in float64
        whatever the dtype of `loc_y` (a bf16 quantile is off by a factor of two at 99%): a bound past float64's
        range is ±inf, and every coverage in (0, 1) gives lower ≤ median ≤ upper.
        """
        # MPS has no float64: such tensors are moved to the CPU for the interval.
        device = loc_y.device if loc_y.device.type != "mps" else torch.device("cpu")
        loc, scale = loc_y.to(device, torch.float64), scale_y.to(device, torch.float64)
        return cauchy.value_interval(loc, scale, coverage, self.config.value_transform)

    @torch.no_grad()
    def round_generated_numbers(self, sequences: torch.Tensor, numeric_values: torch.Tensor, loc_y: torch.Tensor,
                                scale_y: torch.Tensor) -> torch.Tensor:
        """`numeric_values` `[B, L]` of `generate`'s `sequences` `[B, L]`, with each generated number rounded to the
        digits its 50% interval supports ([`numbers.round_to_interval`]), as `causal-qwen generate` and the
        text-generation pipeline write them. `loc_y`, `scale_y` `[B, T]` are `generate`'s (`output_value_scores=True`)
        for the last T positions of `sequences`; a sampled value outside its interval is rounded to the digits of the
        interval stretched to hold it. Prompt numbers and positions without a finite interval keep every digit."""
        if sequences.shape != numeric_values.shape or loc_y.shape != scale_y.shape or loc_y.dim() != 2 \
                or loc_y.shape[0] != sequences.shape[0] or loc_y.shape[1] > sequences.shape[1]:
            raise ValueError(f"round_generated_numbers needs sequences and numeric_values [B, L] and loc_y, scale_y "
                             f"[B, T ≤ L]; got {tuple(sequences.shape)}, {tuple(numeric_values.shape)}, "
                             f"{tuple(loc_y.shape)}, {tuple(scale_y.shape)}")
        values = numeric_values.clone()
        steps = loc_y.shape[1]
        generated = values[:, values.shape[1] - steps:]  # a view: rounding it rounds `values`
        where = (sequences[:, sequences.shape[1] - steps:] == self.config.num_token_id) & loc_y.isfinite()
        _, low, high = self.value_interval(loc_y, scale_y, 0.5)
        for row, step in where.nonzero().tolist():
            generated[row, step] = round_to_interval(float(generated[row, step]), float(low[row, step]),
                                                     float(high[row, step]))
        return values

    def next_value(self, tokenizer, prompts, levels=(0.5, 0.9), batch_size: int = 16):
        """The value each prompt asks for next: a [`next_value.NextValue`] (median, central intervals at `levels`)
        per prompt, read at the position before `<NUM>` (a separator the model writes first, such as a trailing
        space, is appended; a prompt whose next token is not `<NUM>` warns).

            >>> model.next_value(tokenizer, "A car of 2300 pounds gets")[0].median
        """
        return next_values(self, tokenizer, prompts, levels, batch_size)

    def to_value(self, y: torch.Tensor) -> torch.Tensor:
        """Map a point of the regression head's space back to a value (the inverse of `value_transform`)."""
        return untransform_values(y, self.config.value_transform)

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


register_checkpoint_conversions(CausalQwenForCausalLM.__name__)
