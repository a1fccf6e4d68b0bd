"""Configuration of CausalQwen: a Qwen2 configuration plus the fields of the causal heads."""

from __future__ import annotations

import dataclasses

from huggingface_hub.dataclasses import strict
from transformers import Qwen2Config

from .config_fields import CHECKED_FIELDS, INIT_KEYWORDS, check_field, check_names, check_relations

# γ_Y's start in symlog units (an interval of about ×e around the median) until `fit_value_head` measures it.
DEFAULT_REGRESSION_NOISE = 1.0


@strict
class CausalQwenConfig(Qwen2Config):
    r"""
    Configuration of [`CausalQwenForCausalLM`]: every field of [`Qwen2Config`] (the backbone) plus
    the fields of the numeric embedding, the abduction network and the action network.

    A config is plain data, as transformers' are: it knows no model. Three kinds of field: those read at every use
    (`scale_min`, the loss's), which an edit changes at once; those that fill tensors when a model is built
    (`ovr_threshold`, `noise_init`, `abduction_scale_init`, `regression_noise`), which are the tensors' start, so
    that an edit of them changes no tensor ([`CausalQwenForCausalLM.set_initial_values`] sets them and fills the
    tensors again); and those that decide the modules (`use_numeric`, `causal_size`, `learnable_threshold`, the
    `context_values*` fields, whether `regression_noise` is 0, a positive `abduction_anchor_weight`, which needs
    the anchor), with which a built model refuses to run or to be saved once they no longer describe it.

    Args:
        num_token_id (`int`, *optional*):
            Id of the `<NUM>` token. It must lie inside the vocabulary (`0 <= num_token_id < vocab_size`);
            for Qwen2.5 it is the first reserved row, 151,665. A model with `use_numeric=True` requires it.
        use_numeric (`bool`, defaults to `True`):
            Numeric embedding and regression head on. `False` gives the text-only model.
        freeze_backbone (`bool`, defaults to `True`):
            The Qwen2 backbone (`model.*`) gets no gradient.
        causal_size (`int`, *optional*):
            Size C of the individual representation U; must equal `hidden_size` (defaults to it).
        abduction_scale_init (`float`):
            Initial scale of U (γ0), the same at every position.
        noise_init (`float`):
            Initial value of every entry of `b_noise`, the exogenous noise scale.
        ovr_threshold (`float`):
            The One-vs-Rest decision threshold C_k, the same for every class at initialisation.
        learnable_threshold (`bool`):
            Make the threshold a trainable parameter of shape `[vocab_size]`.
        gate_alpha (`float`, defaults to 0.0):
            α in `gate = α + (1 - α) · P_<NUM>`; 1.0 turns the gate off.
        reg_loss_weight (`float`, defaults to 1.0):
            λ, the weight of the regression loss in the total loss.
        detach_gate (`bool`, defaults to `True`):
            The `<NUM>` probability in the gate carries no gradient, so the regression loss cannot
            teach the classifier to stop predicting numbers.
        scale_min (`float`, defaults to 1e-6):
            Floor on every Cauchy scale that enters a decision or a loss.
        value_transform (`str`):
            `"identity"`: the regression head models the value itself; `"symlog"`: it models
            `sign(v)·ln(1 + |v|)`, and values are mapped back by the inverse.
        regression_noise (`float`, *optional*, defaults to 1.0 with `use_numeric`, else 0.0):
            Initial scale γ_Y of an exogenous Cauchy noise on the value, Y = w_reg·U' + b_reg + η with
            η ~ Cauchy(0, γ_Y), so that `scale_Y = |w_reg|·scale_U' + γ_Y`, in the space of `value_transform`.
            γ_Y is learnable through its logarithm (`action.reg_log_noise`): it lets the value's interval widen to
            the errors of the regression without widening the class decisions, whose scale must stay of order 1/V.
            Without it the value's interval is ~1e-3 wide where the errors are ~1 and covers ~1% of the targets
            (docs/experiments.md). [`fit_value_head`] restarts it at the read-out's residual scale. 0 gives the
            seeds' model exactly (no noise, no parameter).
        value_head_fit (`dict`, *optional*):
            Set by [`fit_value_head`] when the value head was started from data (positions, penalty, residual
            scale); a model that has it is not fitted again by `CausalQwenTrainer`.
        abduction_anchor_weight (`float`, defaults to 0.0):
            β of the abduction anchor (docs/design.md §4, §7): when positive, the model keeps a frozen copy of its
            abduction network (`abduction_anchor`) and the loss adds β times the mean over labelled positions of
            Σ_c KL(U ‖ U⁰). Set by [`CausalQwenForCausalLM.enable_abduction_finetuning`].
        conversion_seed (`int`, *optional*):
            The seed of the random weights drawn by [`CausalQwenForCausalLM.from_qwen`] (`w_num`, `w_reg`), recorded
            by it so that a checkpoint tells how to rebuild it; `None` for a model that was not converted.
        context_values (`bool`, defaults to `False`):
            The abduction network reads the values of the earlier `<NUM>` tokens of the text (a pointer that copies
            one, a log-space and a raw-space combination of them, and an input-dependent width of the value's
            noise; docs/design.md §1b). On for new conversions ([`CausalQwenForCausalLM.from_qwen`]); off, the model
            is the one without the path exactly, and checkpoints saved without it load with it off.
        context_values_rank (`int`, defaults to 16):
            The rank r of the path's scores and weights.
        context_values_log (`str`, defaults to `"symlog"`):
            The logarithm of the earlier values that the path's log-space combination sums (docs/math.md):
            `"symlog"`, sign(v)·ln(1 + |v|), or `"log"`, ln|v|, with which products, ratios and powers of positive
            values are exact in form. The start from data fits `"symlog"` better today (docs/experiments.md,
            "The log of the values"), hence the default; checkpoints saved before this field load with it.

    Example:

    ```python
    >>> from causal_qwen import CausalQwenConfig, CausalQwenForCausalLM
    >>> config = CausalQwenConfig(
    ...     vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...     num_attention_heads=4, num_key_value_heads=2, num_token_id=999,
    ... )
    >>> model = CausalQwenForCausalLM(config)
    ```
    """

    model_type = "causal_qwen"

    # Qwen2Config's default would otherwise tie the head to the embedding; the causal head is its own copy.
    tie_word_embeddings: bool = False

    num_token_id: int | None = None
    use_numeric: bool = True
    freeze_backbone: bool = True
    causal_size: int | None = None
    abduction_scale_init: float = 1e-5
    noise_init: float = 1e-5
    ovr_threshold: float = 15.0
    learnable_threshold: bool = False
    gate_alpha: float = 0.0
    reg_loss_weight: float = 1.0
    detach_gate: bool = True
    scale_min: float = 1e-6
    value_transform: str = "symlog"
    abduction_anchor_weight: float = 0.0
    regression_noise: float | None = None
    value_head_fit: dict | None = None
    conversion_seed: int | None = None
    context_values: bool = False
    context_values_rank: int = 16
    context_values_log: str = "symlog"

    def __post_init__(self, **kwargs):
        if self.causal_size is None:
            self.causal_size = self.hidden_size
        if self.regression_noise is None:
            self.regression_noise = DEFAULT_REGRESSION_NOISE if self.use_numeric else 0.0
        # Checked here rather than in a `validate_*` hook so that users get a plain ValueError/TypeError.
        self._check_causal_fields()
        super().__post_init__(**kwargs)

    def __setattr__(self, name, value):
        # Every assignment of a causal field is checked on its own, during `__init__` (transformers sets each field
        # with setattr), in `update`, in `from_pretrained(..., field=value)` and by hand (`config.ovr_threshold = -1`).
        # The checks that relate two fields (causal_size = hidden_size, regression_noise needs use_numeric) run
        # once the config is built, in `__post_init__` and when the model is built, so that `update` may change
        # both fields in any order. The annotations above are strings (`from __future__ import annotations`),
        # which `@strict` does not check: these checks raise a plain TypeError/ValueError that names the field.
        if name in CHECKED_FIELDS:
            self.check_field(name, value)
        super().__setattr__(name, value)

    def check_field(self, name: str, value) -> None:
        """Raise a TypeError or ValueError naming `name` if `value` is not one the field takes (on its own)."""
        # Only as the field's first value, set by the dataclass __init__, is regression_noise=None taken:
        # __post_init__ resolves it from use_numeric. Every later None (by hand, `update`) is refused.
        check_field(name, value, vocab_size=self.__dict__.get("vocab_size"), first_value=name not in self.__dict__)

    def _check_causal_fields(self) -> None:
        """Check every causal field and the relations between fields; a plain ValueError/TypeError names the field."""
        for name in sorted(CHECKED_FIELDS):
            self.check_field(name, getattr(self, name))
        if self.regression_noise is None:
            raise TypeError("regression_noise must be a number, got NoneType")
        if self.causal_size != self.hidden_size:
            raise ValueError(
                f"causal_size must equal hidden_size ({self.hidden_size}): the abduction network starts as "
                f"the identity map, got causal_size={self.causal_size}"
            )
        if self.num_token_id is not None and not 0 <= self.num_token_id < self.vocab_size:
            raise ValueError(
                f"num_token_id must lie inside the vocabulary [0, {self.vocab_size}), got {self.num_token_id}"
            )
        check_relations({name: getattr(self, name) for name in ("use_numeric", "regression_noise", "context_values")})
        if self.context_values_rank is None:
            raise TypeError("context_values_rank must be an int, got NoneType")

    def validate_causal_fields(self) -> None:
        """Part of `@strict` validation (`save_pretrained` runs it): every field and the relations between them."""
        self._check_causal_fields()

    @classmethod
    def check_field_names(cls, names, where: str = "CausalQwenConfig") -> None:
        """Raise a TypeError naming every name that is neither a field of the config nor one of its init keywords.

        `PretrainedConfig` keeps unknown keywords as plain attributes, so a misspelt field (`ovr_treshold=3.0`)
        would otherwise be ignored without a word; callers that take config fields as `**kwargs` check them here.
        """
        known = {field.name for field in dataclasses.fields(cls)} | set(cls.attribute_map) | set(INIT_KEYWORDS)
        check_names(names, known, where, owner=cls.__name__)


__all__ = ["CausalQwenConfig"]
