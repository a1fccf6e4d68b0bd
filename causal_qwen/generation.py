"""Generation modes of CausalQwen (docs/design.md §5) on top of transformers' `GenerationMixin`.

`GenerationMixin` runs the loop (KV cache, stopping criteria, streamers, logits processors, beam search, assisted
decoding). What this module adds is decided per step at the last position (at every candidate position when
assisted decoding verifies candidates):

- how a step decides, by its mode's rule (`generation_modes`): the forward's `logits` are always `loc_S`, which
  transformers returns as `output_logits`; a mode that ranks scores of its own (`standard` and `causal`: the
  standardised margins z_k = (loc_S,k − C_k) / scale_S,k, whose argmax is the argmax of the OvR probabilities P_k =
  1/2 + atan(z_k)/π, without the transcendental function and without P's loss of resolution near 1) hands them to
  the loop through its first logits processor ([`DecisionScores`]), so that later processors, the argmax and
  `output_scores` see them;
- the random draws of `causal` mode, of `shared_noise` and of `traditional` sampling, from the caller's
  `torch.Generator` when one is given, without reading or changing torch's global RNG;
- the numbers: when the chosen token is `<NUM>`, the mode's predicted value becomes its
  `numeric_values` entry and enters the next step through the numeric embedding.

The numbers' bookkeeping lives in `generated_numbers`, the logits processors and stopping criterion the loop is given
in `generation_processors`; this module holds what ties them to a call: its options, its state and the mixin.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from transformers.generation import GenerationConfig, GenerationMixin, LogitsProcessorList
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput

from .cauchy import uniform
from .checks import check_numbers_have_values, check_values
from .generated_numbers import GeneratedNumbers, StreamerWithNumbers
from .generation_modes import DECISION_RULES, SAMPLING_MODE, DecisionRule
from .generation_options import GENERATION_MODES, check_generation_options, resolve_mode
from .generation_processors import DecisionScores, GeneratorSampling, StopStringsWithNumbers
from .outputs import CausalQwenActionOutput

__all__ = [
    "GENERATION_MODES", "CausalQwenGenerateOutput", "CausalQwenGenerateBeamOutput", "CausalGenerationState",
    "CausalQwenGenerationMixin", "ModeDecisions", "check_generation_options",
]


@dataclass
class CausalQwenGenerateOutput(GenerateDecoderOnlyOutput):
    r"""
    [`GenerateDecoderOnlyOutput`] plus the numbers.

    Args:
        numeric_values (`torch.DoubleTensor` of shape `(B, L)`):
            The value of every `<NUM>` of `sequences` (prompt and generated), 0 elsewhere.
        loc_Y, scale_Y (`torch.FloatTensor` of shape `(B, L - prompt_length)`, *optional*):
            Per generated step, the regression distribution of the mode that was used (in the space of
            `config.value_transform`); returned with `output_value_scores=True`. Pass them to
            `model.value_interval` for a median and an interval.
    """

    numeric_values: torch.Tensor | None = None
    loc_Y: torch.Tensor | None = None
    scale_Y: torch.Tensor | None = None


class ModeDecisions:
    """The decisions of one `generate` call: its mode's rule, the rule's random draws and the scores it ranks.

    The draws come from the caller's `torch.Generator` when one is given, without reading or changing torch's global
    RNG: ε of a step, or one ε per sequence kept in `shared_draw` when the rule shares it.
    """

    def __init__(self, rule: DecisionRule, *, shared: bool, generator: torch.Generator | None,
                 sample_with_generator: bool = False):
        self.rule = rule
        self.shared = shared  # the rule's `shared_option` was set
        self.generator = generator
        # Traditional sampling with a generator: the loop takes the argmax of scores in which `GeneratorSampling`
        # has kept the token it drew from the generator (CausalQwenGenerationMixin._sample).
        self.sample_with_generator = sample_with_generator
        self.shared_draw: torch.Tensor | None = None  # [R, C]: ε (shared individual) or ε_noise (shared noise)
        self.scores: torch.Tensor | None = None  # [R, k, V] the rule's scores where the last forward decided

    @property
    def draws_each_step(self) -> bool:
        """Whether a decision draws anew at every step (`causal` mode without a shared individual)."""
        return self.rule.draws_each_step(self.shared)

    def decide(self, action, loc_u: torch.Tensor, scale_u: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The heads' input `(loc, scale)` `[R, k, C]` and the decision distribution `(loc_S, scale_S)` `[R, k, V]`.

        Every position of `loc_u`, `scale_u` `[R, n, C]` is decided (k = n), except by a rule that draws anew at
        every step, which decides the last one only (its draw belongs to one step). The rule's own scores, if it
        ranks any but loc_S, are kept in `scores` for `DecisionScores`.
        """
        if self.draws_each_step:
            loc_u, scale_u = loc_u[:, -1:], scale_u[:, -1:]
        eps = self._draw(loc_u).unsqueeze(1) if self.rule.draws(self.shared) else None
        loc_in, scale_in = self.rule.head_inputs(action, loc_u, scale_u, eps)
        # The softmax needs loc_S only: skip the pass over |W_cls| that scale_S would cost.
        loc_s, scale_s = action.classify(loc_in, None if self.rule.softmax else scale_in)
        self.scores = self.rule.scores(action, loc_s, scale_s)
        return loc_in, scale_in, loc_s, scale_s

    def _draw(self, like: torch.Tensor) -> torch.Tensor:
        """ε ~ U(0, 1)^[R, C]: fresh each step, or drawn once and reused when the mode shares it."""
        if self.shared and self.shared_draw is not None:
            return self.shared_draw
        eps = uniform((like.shape[0], like.shape[-1]), like.device, self.generator)
        if self.shared:
            self.shared_draw = eps
        return eps


class CausalGenerationState:
    """What one `generate` call carries from step to step: its decisions and its numbers.

    While the loop runs, the model's action module decides in the mode (`deciding_in_mode`: the forward itself knows
    nothing of generation); `prepare_inputs_for_generation`, the stopping criteria, the streamer and the
    candidate generator read the numbers (`numbers`).
    """

    def __init__(self, decisions: ModeDecisions, numbers: GeneratedNumbers):
        self.decisions = decisions
        self.numbers = numbers

    @property
    def rule(self) -> DecisionRule:
        return self.decisions.rule

    def decide(
        self, action, loc_u: torch.Tensor, scale_u: torch.Tensor, context=None
    ) -> dict[str, torch.Tensor | None]:
        """The mode's distributions at the positions the loop reads.

        Args:
            action: the model's `CausalQwenAction`.
            loc_u, scale_u: `[R, n, C]`, the positions kept by `logits_to_keep` (1 in a plain step, the candidates
                and one more when assisted decoding verifies candidates); see `ModeDecisions.decide`.
            context: the abduction's read of the context's values at those positions (`ContextRead`), or None.

        Returns:
            `loc_S`, `scale_S` `[R, k, V]` (`scale_S` is None in `traditional` mode, which ranks loc_S alone), `loc_Y`,
            `scale_Y` `[R, k]` (None without a regression head). The scores the mode ranks, when they are not
            loc_S, wait in `decisions.scores` for the first logits processor ([`DecisionScores`]).
        """
        loc_in, scale_in, loc_s, scale_s = self.decisions.decide(action, loc_u, scale_u)
        loc_y = scale_y = None
        if action.reg_head is not None:
            # The positions the mode decided are the last ones of those kept.
            loc_y, scale_y = action.regress(loc_in, scale_in, context.last(loc_s.shape[1]) if context else None)
        self.numbers.predicted(loc_s.shape[1], loc_y, scale_y)
        return {"loc_S": loc_s, "scale_S": scale_s, "loc_Y": loc_y, "scale_Y": scale_y}

    def decision_scores(self, length: int) -> torch.Tensor:
        """`[R, V]`: the rule's scores for the id at index `length`, from the last forward's decided positions."""
        scores = self.decisions.scores
        if scores is None:
            raise RuntimeError(f"mode {self.rule.name!r} has no scores of its own, or no forward decided yet")
        # The last forward read `synced_length` ids and decided its last k positions, which predict the ids from
        # index synced_length − k + 1 on.
        index = length - (self.numbers.synced_length - scores.shape[1] + 1)
        if not 0 <= index < scores.shape[1]:
            raise RuntimeError(f"the last forward decided the ids before {self.numbers.synced_length + 1}, not the "
                               f"id at index {length}")
        return scores[:, index]

    def sync(self, input_ids: torch.Tensor, prompt_values: torch.Tensor | None) -> torch.Tensor:
        return self.numbers.sync(input_ids, prompt_values)


_RUNNING = threading.local()
"""Per thread, the `(action module, state)` of each `generate` running, the innermost last (an assistant's own
`generate` runs inside its model's): the state whose module it is decides; another thread's calls are not seen."""


def register_mode_hooks(action: torch.nn.Module) -> None:
    """torch forward hooks on the model's action module: within `generate`, on its thread, the heads are the mode's
    (`CausalGenerationState.decide`), so that the model's forward knows nothing of generation; outside, they do
    nothing. Registered once, when the model is built (registering per call would race another thread's forward)."""
    action.register_forward_pre_hook(_skip_own_distributions, with_kwargs=True)
    # First of the forward hooks: a sharding engine's own, registered later, may release the heads' weights.
    action.register_forward_hook(_decide_in_mode, with_kwargs=True, prepend=True)


@contextlib.contextmanager
def deciding_in_mode(action: torch.nn.Module, state: CausalGenerationState) -> Iterator[None]:
    """Within the block, on this thread, `action`'s forward gives `state`'s heads (`register_mode_hooks`)."""
    running = _RUNNING.__dict__.setdefault("stack", [])
    running.append((action, state))
    try:
        yield
    finally:
        running.pop()


def _state_deciding(module: torch.nn.Module) -> CausalGenerationState | None:
    running = getattr(_RUNNING, "stack", None)
    return running[-1][1] if running and running[-1][0] is module else None


def _skip_own_distributions(module, args, kwargs):
    """The mode computes its own decision distributions: the module's are not needed."""
    return (args, {**kwargs, "output_distributions": False}) if _state_deciding(module) is not None else None


def _decide_in_mode(module, args, kwargs, output):
    state = _state_deciding(module)
    # The model's forward passes loc_U and scale_U first, and the context by keyword.
    return None if state is None else CausalQwenActionOutput(
        **state.decide(module, args[0], args[1], kwargs.get("context")))


_SOFTMAX_DECODINGS = (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE)
"""Decoding strategies that only `traditional` mode can run, implied by them when no mode is named."""


class CausalQwenGenerationMixin(GenerationMixin):
    """transformers' `GenerationMixin` with CausalQwen's modes and numbers; `CausalQwenForCausalLM` inherits it."""

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        numeric_values: torch.Tensor | None = None,
        generation_state: CausalGenerationState | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> dict:
        """Qwen2's preparation, plus the `numeric_values` of the ids this step feeds to the model.

        A prompt given as `inputs_embeds` is fed as embeddings at the first step (the ids generated after it carry
        their values as usual); `inputs_embeds` is named here because transformers looks for it in this signature.
        """
        model_inputs = super().prepare_inputs_for_generation(input_ids, inputs_embeds=inputs_embeds, **kwargs)
        if generation_state is not None:
            numeric_values = generation_state.sync(input_ids, numeric_values)
        fed = model_inputs.get("input_ids")
        if numeric_values is not None and fed is not None:
            # Standard strides, as transformers gives the ids: a compiled forward is specialised on them.
            model_inputs["numeric_values"] = numeric_values[:, -fed.shape[1]:].clone(
                memory_format=torch.contiguous_format)
        return model_inputs

    @torch.no_grad()
    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config=None,
        *,
        numeric_values: torch.Tensor | None = None,
        mode: str | None = None,
        shared_individual: bool = False,
        shared_noise: bool = False,
        generator: torch.Generator | None = None,
        output_value_scores: bool = False,
        **kwargs,
    ) -> torch.LongTensor | CausalQwenGenerateOutput | CausalQwenGenerateBeamOutput:
        r"""
        Generate with transformers' loop in one of the modes of docs/design.md §5.

        Args:
            inputs (`torch.LongTensor` of shape `(B, S)`): the prompt ids (left-padded for batches). A prompt of
                embeddings goes in as `inputs_embeds=` (a keyword), without `numeric_values`.
            numeric_values (`torch.Tensor` of shape `(B, S)`, *optional*): the prompt's numbers, float, checked as
                the forward checks them.
            mode (`str`, *optional*):
                `"standard"`: argmax of the OvR probabilities; numbers are the median `loc_Y`.
                `"causal"`: sample the individual u = loc_U + scale_U·tan(π(ε − ½)) and decide under the
                noise alone; a fresh ε every step, or one per sequence with `shared_individual=True`.
                `"traditional"`: softmax over `loc_S` with the usual `do_sample`, `temperature`, `top_k`,
                `top_p`, beam search and assisted decoding; greedy when `do_sample=False`, exactly as Qwen2.
                By default `"traditional"` when the call samples (`do_sample=True` in the keyword arguments, the
                `generation_config` or the model's `generation_config`) or runs beam search (`num_beams > 1`), else
                `"standard"`. Assisted and prompt-lookup decoding run in any mode but `causal` without
                `shared_individual`, and give the mode's own output.
            shared_individual (`bool`): `causal` mode only.
            shared_noise (`bool`): `standard` mode only; one ε_noise ~ Cauchy(0, 1) per sequence shifts U.
            generator (`torch.Generator`, *optional*; a bare seed is a `TypeError`): drives every random draw
                (ε is drawn as `torch.rand(B, C)` from it, and traditional sampling draws its tokens from it), so a
                seed reproduces a generation; torch's global RNG is left untouched.
            output_value_scores (`bool`): with `return_dict_in_generate=True`, also return the per-step
                `loc_Y` and `scale_Y`.
            **kwargs: everything `GenerationMixin.generate` takes (`attention_mask`, `max_new_tokens`,
                `eos_token_id`, `streamer`, `return_dict_in_generate`, `num_beams`, `assistant_model`, ...).
                `stop_strings` (with `tokenizer=` the `CausalQwenTokenizer`) are matched in the text with the
                generated numbers written as digits ([`StopStringsWithNumbers`]).

        Returns:
            The ids `(B, L)` as Qwen2 returns them, or with `return_dict_in_generate=True` a
            [`CausalQwenGenerateOutput`] (beam search: [`CausalQwenGenerateBeamOutput`]) that also carries
            `numeric_values` `(B, L)`.
        """
        _check_prompt_arguments(inputs, kwargs, numeric_values, generator)
        resolved = _resolve_options(self, generation_config, kwargs)
        rule = _choose_rule(resolved, generation_config, kwargs, mode, shared_individual, shared_noise, generator)
        if not rule.softmax:
            generation_config, kwargs, inputs, numeric_values = _by_argmax(
                resolved.num_return_sequences or 1, generation_config, kwargs, inputs, numeric_values)
        prompt_ids = inputs if inputs is not None else kwargs.get("input_ids")
        prompt_ids = prompt_ids if isinstance(prompt_ids, torch.Tensor) and prompt_ids.dim() == 2 else None
        return_dict = kwargs.pop("return_dict_in_generate", resolved.return_dict_in_generate)
        # The numbers come back with the output object: ask for it (on a copy of a config passed, so that transformers
        # does not warn about a config passed together with generation keywords).
        generation_config, kwargs = _override(generation_config, kwargs, return_dict_in_generate=True)
        state = _new_state(self, rule, resolved, shared_individual or shared_noise, generator, prompt_ids)
        kwargs = _with_number_hooks(state, resolved.stop_strings, prompt_ids, numeric_values, kwargs)
        with deciding_in_mode(self.action, state):
            output = super().generate(
                inputs, generation_config, numeric_values=numeric_values, generation_state=state, **kwargs,
            )
        values, loc_y, scale_y = state.numbers.finish(output.sequences)
        if not return_dict:
            return output.sequences
        if not output_value_scores:
            loc_y = scale_y = None
        kind = CausalQwenGenerateBeamOutput if isinstance(output, GenerateBeamDecoderOnlyOutput) else \
            CausalQwenGenerateOutput
        return kind(**output, numeric_values=values, loc_Y=loc_y, scale_Y=scale_y)

    def _get_logits_processor(self, generation_config, *args, model_kwargs: dict | None = None, **kwargs):
        """transformers' processors, after [`DecisionScores`] when the mode ranks scores of its own."""
        processors = super()._get_logits_processor(generation_config, *args, model_kwargs=model_kwargs, **kwargs)
        state = (model_kwargs or {}).get("generation_state")
        if state is not None and not state.rule.softmax:
            processors.insert(0, DecisionScores(state))
        return processors

    def _get_stopping_criteria(self, generation_config, stopping_criteria, tokenizer=None, **kwargs):
        """transformers' criteria, less its `StopStringCriteria` where `StopStringsWithNumbers` takes its place."""
        if generation_config.stop_strings is not None and any(
                isinstance(c, StopStringsWithNumbers) for c in stopping_criteria or []):
            generation_config = copy.copy(generation_config)
            generation_config.stop_strings = None
        return super()._get_stopping_criteria(generation_config, stopping_criteria, tokenizer, **kwargs)

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        """transformers' greedy and sampling loop; with a generator, traditional sampling uses `GeneratorSampling`."""
        state = model_kwargs.get("generation_state")
        if state is None or not state.decisions.sample_with_generator or not generation_config.do_sample:
            return super()._sample(input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs)
        # The warpers (temperature, top-k, top-p, ...) were built for sampling; the loop now takes the argmax of the
        # scores the sampler leaves, which is the token it drew.
        generation_config = copy.deepcopy(generation_config)
        generation_config.do_sample = False
        keep = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
        sampler = GeneratorSampling(state.decisions.generator, keep_scores=keep)
        processors = LogitsProcessorList([*logits_processor, sampler])
        output = super()._sample(input_ids, processors, stopping_criteria, generation_config, **model_kwargs)
        if keep and not isinstance(output, torch.Tensor) and output.scores is not None:
            output.scores = tuple(sampler.scores[: len(output.scores)])
        return output

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
        """transformers' candidate generator, kept off this model's numbers and stopped before any `<NUM>`.

        The assistant receives the ids without this model's generation state (a Qwen2 assistant would refuse it; a
        CausalQwen assistant gets its own, in `traditional` mode, and the values of the ids so far). Candidates are
        cut before their first `<NUM>`: its value is this model's prediction at that position, which the verifying
        forward only computes, so the ids after it would be verified against a wrong value. A `<NUM>` is then
        always this model's own next token, with its own value, and the output equals plain greedy decoding.
        """
        state = model_kwargs.get("generation_state")
        if state is None:
            return super()._get_candidate_generator(
                generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, assistant_model,
                target_tokenizer, assistant_tokenizer,
            )
        prompt_values = model_kwargs.get("numeric_values")
        shared = {k: v for k, v in model_kwargs.items() if k not in ("generation_state", "numeric_values")}
        numeric_assistant = isinstance(assistant_model, CausalQwenGenerationMixin) and bool(
            getattr(assistant_model.config, "use_numeric", False))
        if isinstance(assistant_model, CausalQwenGenerationMixin):
            # The assistant proposes by the rule that verifies: the softmax, or the OvR probabilities (without this
            # model's draws, which it does not share).
            shared["mode"] = state.rule.assistant_mode
        # The assistant's own generate applies these processors to its own scores: this model's are not for it.
        logits_processor = LogitsProcessorList(p for p in logits_processor if not isinstance(p, DecisionScores))
        candidates = super()._get_candidate_generator(
            generation_config, input_ids, inputs_tensor, logits_processor, shared, assistant_model,
            target_tokenizer, assistant_tokenizer,
        )
        propose = candidates.get_candidates

        def get_candidates(ids: torch.LongTensor, **kwargs):
            values = state.sync(ids, prompt_values)
            if numeric_assistant:
                candidates.assistant_kwargs["numeric_values"] = values.to(assistant_model.device)
            proposed, logits = propose(ids, **kwargs)
            return _cut_before_number(proposed, logits, ids.shape[1], state.numbers.num_token_id)

        candidates.get_candidates = get_candidates
        return candidates


@dataclass
class CausalQwenGenerateBeamOutput(GenerateBeamDecoderOnlyOutput):
    r"""
    [`GenerateBeamDecoderOnlyOutput`] plus the numbers of the returned hypotheses, as in
    [`CausalQwenGenerateOutput`] (`loc_Y`, `scale_Y` are NaN at positions after a hypothesis ended).
    """

    numeric_values: torch.Tensor | None = None
    loc_Y: torch.Tensor | None = None
    scale_Y: torch.Tensor | None = None


_SUPPORTED_DECODING = {
    GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE,
    GenerationMode.ASSISTED_GENERATION,
}


@functools.cache
def _generation_fields() -> tuple[str, ...]:
    return tuple(GenerationConfig().to_dict())


def _resolve_options(model, generation_config, kwargs: dict) -> SimpleNamespace:
    """The generation options this call runs with, merged as transformers merges them, without validating them.

    Keyword arguments first, then the `generation_config` passed, then the model's `generation_config` (as a
    checkpoint's generation_config.json sets it), then transformers' defaults (an unset field is None in each).
    Validation is left to transformers' own call: some combinations (several greedy sequences per prompt) are
    valid here because this method rewrites them before passing them on.
    """
    names = _generation_fields()
    values = dict(GenerationConfig._get_default_generation_params())
    for source in (model.generation_config, generation_config):
        if source is not None:
            values.update({k: v for k, v in source.to_dict().items() if v is not None})
    values.update({k: v for k, v in kwargs.items() if k in names})
    return SimpleNamespace(**{name: values.get(name) for name in names})


def _check_prompt_arguments(inputs, kwargs: dict, numeric_values, generator) -> None:
    """Refuse, naming the argument, a prompt or generator that would fail deep in the loop or be silently ignored.

    `numeric_values` gets the forward's own check (`check_values`) against the prompt ids, before generation
    repeats or rewrites the prompt.
    """
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator (a seed goes in as torch.Generator().manual_seed(seed)), got "
            f"{type(generator).__name__}"
        )
    if numeric_values is None:
        return
    if kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "numeric_values cannot go with inputs_embeds: the prompt enters the model as embeddings, so its numbers "
            "must be in them already (model.numeric_embedding(embeds, input_ids, numeric_values) adds them)"
        )
    prompt_ids = inputs if inputs is not None else kwargs.get("input_ids")
    if not isinstance(prompt_ids, torch.Tensor):
        raise ValueError("numeric_values are the values of the prompt ids: pass the ids as inputs or input_ids")
    check_values("numeric_values", numeric_values, prompt_ids.shape)


def _choose_rule(resolved: SimpleNamespace, generation_config, kwargs: dict, mode: str | None,
                 shared_individual: bool, shared_noise: bool, generator) -> DecisionRule:
    """The rule of the mode this call runs in, once its options and decoding strategy are checked together."""
    sampling = resolved.do_sample is True
    asked = kwargs["do_sample"] if "do_sample" in kwargs else getattr(generation_config, "do_sample", None)
    assistant_model = kwargs.get("assistant_model")
    decoding = GenerationConfig.get_generation_mode(resolved, assistant_model)
    if mode is None and decoding in _SOFTMAX_DECODINGS:
        # Beam search ranks log-probabilities of the softmax over loc_S, which is what `traditional` mode gives:
        # asked for without a mode, it implies it, as sampling does.
        mode = SAMPLING_MODE
    mode = check_generation_options(mode if mode is not None else resolve_mode(None, sampling),
                                    shared_individual, shared_noise, asked)
    rule = DECISION_RULES[mode]
    _check_decoding(decoding, rule, shared_individual or shared_noise, sampling, resolved.num_beams or 1, generator,
                    assistant_model, resolved.prefill_chunk_size)
    return rule


def _new_state(model, rule: DecisionRule, resolved: SimpleNamespace, shared: bool, generator,
               prompt_ids: torch.Tensor | None) -> CausalGenerationState:
    """The state of one call: its mode's decisions and the numbers of its rows."""
    sampling = rule.softmax and resolved.do_sample is True
    return CausalGenerationState(
        ModeDecisions(rule, shared=shared, generator=generator,
                      sample_with_generator=sampling and generator is not None),
        GeneratedNumbers(num_token_id=model.config.num_token_id if model.config.use_numeric else None,
                         to_value=model.to_value, num_beams=resolved.num_beams or 1,
                         prompt_length=prompt_ids.shape[1] if prompt_ids is not None else None),
    )


def _check_decoding(decoding, rule: DecisionRule, shared: bool, sampling: bool, num_beams: int, generator,
                    assistant_model, prefill_chunk_size: int | None) -> None:
    """Refuse, naming the argument, the decoding strategies that the mode cannot run with its numbers."""
    if decoding not in _SUPPORTED_DECODING:
        raise ValueError(
            f"CausalQwen generates by greedy search, sampling, beam search and assisted decoding; the generation "
            f"options select {decoding.value}"
        )
    if prefill_chunk_size is not None:
        raise ValueError(
            f"prefill_chunk_size={prefill_chunk_size} is not supported: the numbers are aligned with the whole ids, "
            "and a chunked prefill feeds the prompt in pieces"
        )
    if decoding == GenerationMode.ASSISTED_GENERATION:
        argument = "assistant_model" if assistant_model is not None else "prompt_lookup_num_tokens"
        if rule.draws_each_step(shared):
            others = " or ".join(repr(name) for name, other in DECISION_RULES.items()
                                 if not other.draws_each_step(False))
            raise ValueError(
                f"{argument} (assisted decoding) verifies several positions in one forward, and mode={rule.name!r} "
                f"draws anew at every step: pass {rule.shared_option}=True (one draw per sequence), or use mode="
                f"{others}"
            )
        if sampling and generator is not None:
            raise ValueError(
                f"generator cannot drive sampled assisted decoding ({argument}, do_sample=True): transformers draws "
                "its tokens from torch's global RNG; seed it with torch.manual_seed instead"
            )
    if num_beams > 1:
        if not rule.softmax:
            raise ValueError(
                f"num_beams={num_beams} needs mode={SAMPLING_MODE!r}, got {rule.name!r}: beam search ranks "
                f"hypotheses by summed log-probabilities, and only {SAMPLING_MODE} mode's softmax gives them (the "
                "scores of the other modes are standardised OvR margins)"
            )
        if sampling and generator is not None:
            raise ValueError(
                f"generator cannot drive beam sampling (num_beams={num_beams}, do_sample=True): transformers draws "
                "the beams from torch's global RNG; seed it with torch.manual_seed instead"
            )


def _with_number_hooks(state: CausalGenerationState, stop_strings, prompt_ids: torch.Tensor | None,
                       numeric_values: torch.Tensor | None, kwargs: dict) -> dict:
    """The generate keywords with the stop strings and the streamer that write numbers, for a model with numbers."""
    num_token_id = state.numbers.num_token_id
    if num_token_id is None:
        return kwargs
    kwargs = dict(kwargs)
    if stop_strings is not None:
        if kwargs.get("tokenizer") is None:
            raise ValueError("stop_strings need the tokenizer: pass tokenizer= (the CausalQwenTokenizer) to generate")
        stop = StopStringsWithNumbers(stop_strings, kwargs["tokenizer"], state)
        kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), stop])
    if kwargs.get("streamer") is not None:
        kwargs["streamer"] = StreamerWithNumbers(kwargs["streamer"], state, numeric_values)
    check_numbers_have_values(prompt_ids, numeric_values, num_token_id)
    return kwargs


def _override(generation_config, kwargs: dict, **fields):
    """Set generation fields for this call without touching the caller's objects."""
    kwargs = dict(kwargs)
    if generation_config is None:
        kwargs.update(fields)
        return None, kwargs
    generation_config = copy.deepcopy(generation_config)
    for name, value in fields.items():
        setattr(generation_config, name, value)
        if name in kwargs:
            kwargs[name] = value
    return generation_config, kwargs


def _cut_before_number(candidates: torch.Tensor, logits: torch.Tensor | None, length: int, num_token_id: int | None):
    """Keep the candidate ids after the first `length` up to, not including, their first `<NUM>`."""
    if num_token_id is None or candidates.shape[1] <= length:
        return candidates, logits
    is_num = (candidates[0, length:] == num_token_id).nonzero()
    if is_num.numel() == 0:
        return candidates, logits
    keep = int(is_num[0, 0])
    if logits is not None:
        logits = logits[:, :keep] if keep > 0 else None
    return candidates[:, : length + keep], logits


def _by_argmax(copies: int, generation_config, kwargs: dict, inputs, numeric_values):
    """The call's options for a rule that decides by an argmax: greedy search, `copies` repeated prompts."""
    generation_config, kwargs = _override(generation_config, kwargs, do_sample=False, num_return_sequences=1)
    if copies > 1:
        # Greedy search refuses several sequences per prompt; here each copy draws its own ε (causal) or noise
        # (shared_noise), so repeat the prompts instead.
        inputs, numeric_values, kwargs = _repeat_prompts(copies, inputs, numeric_values, kwargs)
    return generation_config, kwargs, inputs, numeric_values


def _repeat_prompts(copies: int, inputs, numeric_values, kwargs: dict):
    """Repeat every prompt row `copies` times (ids, attention mask, numbers), as `num_return_sequences` would."""
    def repeat(x):
        return x.repeat_interleave(copies, dim=0) if isinstance(x, torch.Tensor) else x

    kwargs = {**kwargs, **{k: repeat(kwargs[k]) for k in ("input_ids", "inputs_embeds", "attention_mask")
                           if k in kwargs}}
    return repeat(inputs), repeat(numeric_values), kwargs
