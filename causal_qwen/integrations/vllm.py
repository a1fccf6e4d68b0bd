"""Serving CausalQwen on vLLM (docs/serving.md): a plugin that registers `CausalQwenForCausalLM` with vLLM.

Installed with the `vllm` extra, the entry point `vllm.general_plugins` calls [`register`] in every vLLM process, so
`vllm serve DIR` and `vllm.LLM(DIR)` load a folder saved by `save_pretrained` with nothing else from the user.

The model is vLLM's own Qwen2 backbone (its attention, KV cache and batching) with the library's numeric embedding,
abduction and action modules around it, loading the same safetensors keys; the heads run through the same functions
as the library's `generate`, so the decisions are the library's:

- `traditional` mode: the logits are loc_S, and every vLLM sampling parameter works as for Qwen2;
- `standard` mode: the logits are the margins (loc_S − C)/scale_S, monotone in P_k, so greedy decoding is the OvR
  argmax; it is a decision, not a distribution, so it takes greedy requests only (`temperature=0`).

The mode is the deployment's (environment `CAUSAL_QWEN_VLLM_MODE`, default `traditional`) or the request's
(`SamplingParams(extra_args={"causal_qwen_mode": ...})`, `vllm_xargs` on the OpenAI-compatible server).

Numbers travel per request, beside the token ids: the prompt's values are `extra_args["numeric_values"]`, aligned with
the prompt ids as the tokenizer returns them ([`number_prompt`] builds both). Where the model writes `<NUM>`, the value
head's median at that step is the value fed back through the numeric embedding at the next step, as in the library.
The per-request state lives in the worker: [`CausalQwenRequests`], a logits processor (vLLM's per-request hook, which
sees every request enter, leave and move in the batch) shares it with the model.

With the context-value path (`config.context_values`, docs/design.md §1b) the state of a request also holds the path's
keys and entries of its `<NUM>` positions, which the library keeps as a layer of its generation cache (with the map of
its last position, which the key of a `<NUM>` read at the next step needs): the value head reads them at every step
through the library's own `CausalQwenContextValues.entries` and `read`. Prefix caching would
skip the prompt positions whose keys the path needs, so it is turned off for such a checkpoint.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_LOG = logging.getLogger(__name__)

MODES = ("traditional", "standard")
MODE_ENV = "CAUSAL_QWEN_VLLM_MODE"
MODE_ARG = "causal_qwen_mode"
VALUES_ARG = "numeric_values"
KEY_ARG = "causal_qwen_request"
ARCHITECTURE = "CausalQwenForCausalLM"

__all__ = [
    "CausalQwenForVLLM", "CausalQwenRequests", "GeneratedNumber", "generated_numbers", "number_prompt", "register",
]


def register() -> None:
    """The `vllm.general_plugins` entry point: register the architecture, the config and the tokenizer."""
    from vllm import ModelRegistry

    import causal_qwen

    # The config and tokenizer with transformers' Auto classes (the `causal-qwen` command imports the package
    # without registering them until it needs them: `causal-qwen serve` does here).
    causal_qwen.register()

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:CausalQwenForVLLM")
    _register_renderer()
    _register_config_check()


def _register_config_check() -> None:
    """vLLM's per-architecture hook on the engine's configuration, run where the configuration is built (before the
    scheduler and the workers get it): [`check_engine_config`]."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    class CausalQwenEngineConfig(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_config(vllm_config) -> None:
            check_engine_config(vllm_config)

    if ARCHITECTURE not in MODELS_CONFIG_MAP:
        MODELS_CONFIG_MAP[ARCHITECTURE] = CausalQwenEngineConfig


def check_engine_config(vllm_config) -> None:
    """Turn prefix caching off for a checkpoint with the context-value path.

    A prompt position found in the prefix cache is not computed again, and its `<NUM>` keys, which the path reads at
    every later position, would be missing. vLLM turns prefix caching on by default, so a request for it cannot be
    told from the default here: it is turned off either way, with a warning naming the option.
    """
    cache = vllm_config.cache_config
    if getattr(vllm_config.model_config.hf_config, "context_values", False) and cache.enable_prefix_caching:
        _LOG.warning(
            "enable_prefix_caching is turned off: this checkpoint has context_values=True, whose read of the earlier "
            "<NUM> values needs every prompt position computed (docs/serving.md)"
        )
        cache.enable_prefix_caching = False


def _register_renderer() -> None:
    """vLLM's `hf` renderer, refusing text prompts whose numbers the CausalQwen tokenizer would leave without values.

    vLLM tokenizes a text prompt into ids alone: the values of its numbers could not reach the model, and a `<NUM>`
    without its value is refused rather than read as 0. The renderer is the same for every other tokenizer.
    """
    from vllm.renderers.registry import RENDERER_REGISTRY

    if RENDERER_REGISTRY.renderers.get("hf") != (__name__, "NumberCheckingRenderer"):
        RENDERER_REGISTRY.register("hf", __name__, "NumberCheckingRenderer")


def __getattr__(name: str):
    # The renderer subclasses vLLM's, which is imported only when vLLM asks for it.
    if name == "NumberCheckingRenderer":
        from vllm.renderers.hf import HfRenderer

        class NumberCheckingRenderer(HfRenderer):
            def _tokenize_prompt(self, prompt, params):
                tokens = super()._tokenize_prompt(prompt, params)
                tokenizer = self.get_tokenizer()
                if getattr(tokenizer, "use_numeric", False) and getattr(tokenizer, "num_token", None):
                    if tokenizer.num_token_id in tokens["prompt_token_ids"]:
                        raise ValueError(
                            "this text prompt has numbers, which vLLM's tokenization would pass without their "
                            "values: send the prompt as token ids with extra_args['numeric_values'] (vllm_xargs on "
                            "the server), as causal_qwen.integrations.vllm.number_prompt builds them"
                        )
                return tokens

        globals()[name] = NumberCheckingRenderer
        return NumberCheckingRenderer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def deployment_mode() -> str:
    """The mode of requests that name none: `CAUSAL_QWEN_VLLM_MODE`, else `traditional`."""
    mode = os.environ.get(MODE_ENV, "traditional")
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV} must be one of {MODES}, got {mode!r}")
    return mode


def request_mode(extra_args: dict | None) -> str:
    """The mode of one request: its `extra_args["causal_qwen_mode"]`, else the deployment's."""
    mode = (extra_args or {}).get(MODE_ARG)
    if mode is None:
        return deployment_mode()
    if mode not in MODES:
        unsupported = " (causal mode is the library's generate alone)" if mode == "causal" else ""
        raise ValueError(f"{MODE_ARG} must be one of {MODES}, got {mode!r}{unsupported}")
    return mode


def number_prompt(tokenizer, text: str, **sampling: Any) -> tuple[dict, Any]:
    """A vLLM prompt with its numbers: `(TokensPrompt, SamplingParams)` for `LLM.generate`.

    The text is tokenized by the CausalQwen tokenizer (each number one `<NUM>`); the ids go in the prompt and their
    values in `SamplingParams.extra_args["numeric_values"]`. `sampling` holds `SamplingParams` fields; its
    `extra_args` are kept (e.g. `{"causal_qwen_mode": "standard"}`). The request gets a key under which an in-process
    engine keeps the numbers it writes ([`generated_numbers`]).
    """
    from vllm import SamplingParams, TokensPrompt

    encoded = tokenizer(text)
    extra_args = dict(sampling.pop("extra_args", None) or {})
    extra_args[VALUES_ARG] = [float(v) for v in encoded["numeric_values"]]
    extra_args.setdefault(KEY_ARG, uuid.uuid4().hex)
    return TokensPrompt(prompt_token_ids=list(encoded["input_ids"])), SamplingParams(extra_args=extra_args, **sampling)


@dataclass(frozen=True)
class GeneratedNumber:
    """A `<NUM>` the model wrote: its index among the generated ids, its value (the median fed back), the central
    90% (`lower`, `upper`) and 50% (`lower_50`, `upper_50`) intervals of the value head's Cauchy distribution, and
    the value as the text writes it (`written`: rounded to the digits its 50% interval supports, as `generate`'s
    text does)."""

    index: int
    value: float
    lower: float
    upper: float
    lower_50: float
    upper_50: float
    written: float


def generated_numbers(sampling_params, *, every_step: bool = False) -> list[GeneratedNumber]:
    """The numbers written for a finished request of an engine in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`).

    With `every_step`, the value head's prediction at every generated position, `<NUM>` or not: the value a `<NUM>`
    written there would have had.

    The request is known by the key that [`number_prompt`] put in its `extra_args`. An engine in another process
    keeps them there: vLLM's outputs have no per-token field to carry them back (docs/serving.md).
    """
    key = (sampling_params.extra_args or {}).get(KEY_ARG)
    if key is None:
        raise ValueError(f"sampling_params has no extra_args[{KEY_ARG!r}]: build the request with number_prompt")
    if key not in _KEPT:
        raise KeyError(f"no request {key!r} ran in this process: its engine runs in another process")
    request, batch = _KEPT[key]
    return request.numbers(batch.num_token_id, batch.value_transform, every_step=every_step)


# ----------------------------------------------------------------------------------------------------------------
# Per-request state, shared by the logits processor and the model of one worker
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class RequestNumbers:
    """The numbers of one running request: its prompt's values and the values predicted at generated positions."""

    prompt_ids: list[int]
    output_ids: list[int]  # vLLM's live list of the request's generated ids
    mode: str
    prompt_values: list[float] | None
    key: str | None = None
    predicted: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # position → value, loc_Y, scale_Y
    context: ContextEntries | None = None  # the context-value path's entries of the request's `<NUM>` positions
    # (position, K'·z) of the request's last position so far: the key of a `<NUM>` that starts the next forward reads it
    last_before: tuple[int, torch.Tensor] | None = None

    def predict(self, position: int, value: float, loc: float, scale: float) -> None:
        """Record the value head's prediction for `position`. The first stands: a preempted request computes its
        positions again, and a `<NUM>` written there keeps the value it was written and fed back with."""
        self.predicted.setdefault(position, (value, loc, scale))

    def value_at(self, position: int, num_token_id: int) -> float:
        """The value of the `<NUM>` at `position` (of the prompt, or written by the model at an earlier step)."""
        if position < len(self.prompt_ids):
            if self.prompt_values is None:
                raise ValueError(
                    f"the prompt has <NUM> (id {num_token_id}) at position {position} but no "
                    f"extra_args[{VALUES_ARG!r}]: pass the tokenizer's values with the ids (number_prompt)"
                )
            return self.prompt_values[position]
        if position not in self.predicted:
            raise RuntimeError(f"no value was predicted for the generated <NUM> at position {position}")
        return self.predicted[position][0]


    def numbers(self, num_token_id: int, value_transform: str, *, every_step: bool = False) -> list[GeneratedNumber]:
        """The `<NUM>`s of the output (every position with `every_step`) with their values, 90% and 50% intervals."""
        from ..cauchy import value_interval
        from ..numbers import round_to_interval

        start = len(self.prompt_ids)
        indices = [index for index, token in enumerate(list(self.output_ids))
                   if (token == num_token_id or every_step) and start + index in self.predicted]
        if not indices:
            return []
        value, loc, scale = zip(*(self.predicted[start + index] for index in indices), strict=True)
        # The library's intervals of the heads' float32 distribution, for all the numbers at once.
        loc_t, scale_t = (torch.tensor(x, dtype=torch.float64) for x in (loc, scale))
        (lower, upper), (lower_50, upper_50) = (
            value_interval(loc_t, scale_t, coverage, value_transform)[1:] for coverage in (0.9, 0.5))
        found = []
        for k, index in enumerate(indices):
            low, high = float(lower_50[k]), float(upper_50[k])
            found.append(GeneratedNumber(index, value[k], float(lower[k]), float(upper[k]), low, high,
                                         round_to_interval(value[k], low, high)))
        return found


@dataclass
class ContextEntries:
    """The context-value path's keys `[n, 3r]` and entries `[n, 4]` (y, v, is `<NUM>`, follows; float64, as
    `CausalQwenContextValues.entries` gives them) of one request's `<NUM>` positions `[n]`, in position order."""

    positions: torch.Tensor
    keys: torch.Tensor
    entries: torch.Tensor

    @classmethod
    def empty(cls, width: int, device: torch.device) -> ContextEntries:
        return cls(torch.zeros(0, dtype=torch.long, device=device),
                   torch.zeros(0, width, dtype=torch.float64, device=device),
                   torch.zeros(0, 4, dtype=torch.float64, device=device))

    def update(self, first: int, positions: torch.Tensor, keys: torch.Tensor, entries: torch.Tensor) -> None:
        """The entries of a forward over the positions from `first` on: those kept from positions at or after
        `first` are dropped first, so that positions computed again (a preempted request) replace their entries."""
        if self.positions.numel() and int(self.positions[-1]) >= first:
            kept = self.positions < first
            self.positions, self.keys, self.entries = self.positions[kept], self.keys[kept], self.entries[kept]
        if positions.numel():
            self.positions = torch.cat((self.positions, positions))
            self.keys = torch.cat((self.keys, keys))
            self.entries = torch.cat((self.entries, entries))


class _Batch:
    """The rows of vLLM's persistent batch, in its order, as the logits processor sees them.

    A request's state is found again by its `SamplingParams`: the worker holds the same object from the request's
    arrival to its end, and a preempted request leaves the batch and comes back with it, its numbers kept (the values
    it wrote, the path's entries), as its positions are computed again."""

    def __init__(self) -> None:
        self.rows: dict[int, RequestNumbers] = {}
        self._states: dict[int, tuple[weakref.ref, RequestNumbers]] = {}  # id of the params → (the params, state)
        self.num_token_id: int | None = None  # set by the model; None: no numbers to keep
        self.value_transform = "identity"
        self.last_positions: list[int] | None = None  # per row, the position the last forward decided from

    def apply(self, batch_update) -> None:
        from vllm.v1.sample.logits_processor import MoveDirectionality

        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            request = self._state_of(params)
            if request is None:
                extra = params.extra_args if params is not None else None
                values = (extra or {}).get(VALUES_ARG)
                request = RequestNumbers(
                    prompt_ids=list(prompt_ids or []), output_ids=output_ids, mode=request_mode(extra),
                    prompt_values=[float(v) for v in values] if values is not None else None,
                    key=(extra or {}).get(KEY_ARG),
                )
                self._hold(params, request)
            request.output_ids = output_ids  # vLLM may give a resumed request a new list
            self.rows[index] = request
            self._keep(request)
        for first, second, direction in batch_update.moved:
            a, b = self.rows.pop(first, None), self.rows.pop(second, None)
            if a is not None:
                self.rows[second] = a
            if b is not None and direction == MoveDirectionality.SWAP:
                self.rows[first] = b


    def _state_of(self, params) -> RequestNumbers | None:
        """The state of the request of these `SamplingParams`, if it was in the batch before."""
        held = self._states.get(id(params)) if params is not None else None
        return held[1] if held is not None and held[0]() is params else None

    def _hold(self, params, request: RequestNumbers) -> None:
        """Hold the state while vLLM holds the params (a weak reference: it is dropped with them)."""
        if params is None:
            return
        key = id(params)
        states = self._states

        def forget(ref: weakref.ref) -> None:
            if key in states and states[key][0] is ref:
                del states[key]

        states[key] = (weakref.ref(params, forget), request)

    def _keep(self, request: RequestNumbers) -> None:
        """Keep a request with a key (the latest `KEPT_REQUESTS`), so that its numbers can be read once it is done."""
        if request.key is not None and self.num_token_id is not None:
            _KEPT[request.key] = (request, self)
            while len(_KEPT) > KEPT_REQUESTS:
                _KEPT.popitem(last=False)


_BATCHES: dict[str, _Batch] = {}
KEPT_REQUESTS = 4096
_KEPT: OrderedDict[str, tuple[RequestNumbers, _Batch]] = OrderedDict()


def _batch_of(vllm_config) -> _Batch:
    """The batch state of one engine (its worker's logits processor and model share it)."""
    return _BATCHES.setdefault(vllm_config.instance_id, _Batch())


def _is_causal_qwen(vllm_config) -> bool:
    return ARCHITECTURE in (getattr(vllm_config.model_config.hf_config, "architectures", None) or [])


def _vllm_logits_processor_base():
    from vllm.v1.sample.logits_processor import LogitsProcessor

    return LogitsProcessor


class CausalQwenRequests(_vllm_logits_processor_base()):
    """vLLM's per-request hook, used to follow the requests of the batch; it changes no logits.

    vLLM calls `update_state` before every forward with the requests that entered, left or moved in its persistent
    batch (with their `SamplingParams` and live output ids); the model reads the batch state this keeps. For a model
    that is not CausalQwen it does nothing. `validate_params` refuses, per request, what the plugin does not support.
    """

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.batch = _batch_of(vllm_config) if _is_causal_qwen(vllm_config) else None

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        extra = sampling_params.extra_args or {}
        mode = request_mode(extra)
        values = extra.get(VALUES_ARG)
        if values is not None:
            if not isinstance(values, (list, tuple)) or not all(_is_number(v) for v in values):
                raise ValueError(f"extra_args[{VALUES_ARG!r}] must be a list of finite numbers, one per prompt id")
        if mode == "standard":
            if sampling_params.temperature != 0:
                raise ValueError(
                    "causal_qwen_mode='standard' decides by the OvR argmax: it takes greedy requests only "
                    f"(temperature=0), got temperature={sampling_params.temperature}; sample in 'traditional' mode"
                )
            if sampling_params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs are not supported in causal_qwen_mode='standard'")

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        if self.batch is not None:
            self.batch.apply(batch_update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ----------------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------------


class CausalQwenForVLLM(nn.Module):
    """CausalQwen in vLLM: vLLM's Qwen2 backbone, the library's numeric embedding, abduction and action modules.

    Parameter names are the library's state-dict keys (`model.*`, `numeric_embedding.*`, `abduction.*`, `action.*`),
    so a folder saved by `save_pretrained` loads as it is.
    """

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        from vllm.model_executor.models.qwen2 import Qwen2Model
        from vllm.model_executor.models.utils import maybe_prefix

        from ..modeling import CausalQwenAbduction, CausalQwenAction, CausalQwenNumericEmbedding

        config = vllm_config.model_config.hf_config
        if getattr(config, "context_values", False) and vllm_config.cache_config.enable_prefix_caching:
            # `check_engine_config` turns it off where the engine's configuration is built; an engine built without
            # the plugin's hook would read the path's entries of prompt positions it never computed.
            raise ValueError("enable_prefix_caching must be off for a checkpoint with context_values=True: its read "
                             "of the earlier <NUM> values needs every prompt position computed")
        self.config = config
        self.model = Qwen2Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.numeric_embedding = CausalQwenNumericEmbedding(config) if config.use_numeric else None
        self.abduction = CausalQwenAbduction(config)
        self.action = CausalQwenAction(config)
        # The class head is the model's one vocabulary-sized matmul per step: it goes through vLLM's own head method,
        # as Qwen2's lm_head does, so that vLLM prepares its fast matmul for the weight after loading (oneDNN on
        # CPU) and keeps the weight itself, which standard mode's |W_cls| reads.
        self.action.cls_head.quant_method = _head_method()
        self.num_token_id = config.num_token_id if config.use_numeric else None
        self.batch = _batch_of(vllm_config)
        self.batch.num_token_id = self.num_token_id
        self.batch.value_transform = config.value_transform
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows = self._row_starts()
        self.batch.last_positions = None
        if rows is not None:
            ends = torch.tensor(rows[1:], dtype=torch.long, device=positions.device) - 1
            self.batch.last_positions = positions[ends].tolist()
        values = None
        if inputs_embeds is None:
            inputs_embeds = self.model.embed_input_ids(input_ids)
            if self.numeric_embedding is not None:
                values = self._numeric_values(input_ids, positions, rows)
                inputs_embeds = self.numeric_embedding(inputs_embeds, input_ids, values)
        hidden_states = self.model(None, positions, intermediate_tensors, inputs_embeds=inputs_embeds)
        if self.abduction.context_values is not None and rows is not None:
            self._keep_context(hidden_states, input_ids, positions, values, rows)
        return hidden_states

    def _keep_context(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None, positions: torch.Tensor,
                      values: torch.Tensor | None, rows: list[int]) -> None:
        """Add the path's keys and entries of this forward's `<NUM>` positions to their requests' (the backbone's
        final features, as the library's forward passes them to `read_context`). A key reads the number's features
        and those of the position before it, which the previous forward computed where the number starts this one."""
        path = self.abduction.context_values
        if values is not None:  # the forward has numbers
            index = (input_ids == self.num_token_id).nonzero().flatten()
        else:
            index = positions.new_zeros(0, dtype=torch.long)
        is_num = torch.ones(1, index.numel(), dtype=torch.bool, device=index.device)
        values = values[index] if values is not None else torch.zeros(0, dtype=torch.float64, device=index.device)
        maps, entries = path.entries(hidden_states[None, index], is_num, values[None], self.config.value_transform)
        own = maps[0, :, :maps.shape[-1] // 2]
        before = path.key_before(hidden_states[(index - 1).clamp(min=0)]).double()
        number_positions = positions[index]
        starts = torch.tensor(rows, device=index.device)
        owners = torch.searchsorted(starts, index, right=True) - 1
        firsts = positions[starts[:-1]].tolist()
        for row, first in enumerate(firsts):
            request = self.batch.rows.get(row)
            if request is None:
                continue
            if request.context is None:
                request.context = ContextEntries.empty(own.shape[-1], own.device)
            mine = owners == row
            leading = mine & (index == starts[row])  # a number that starts this forward: its position before is older
            if bool(leading.any()) and first > 0:
                if request.last_before is None or request.last_before[0] != first - 1:
                    raise RuntimeError(f"the features of position {first - 1}, before a <NUM> at {first}, were not "
                                       "kept: the request's positions did not run in order")
                before[leading] = request.last_before[1]
            elif bool(leading.any()):
                before[leading] = 0.0  # nothing before the text's start
            request.context.update(first, number_positions[mine], own[mine] + before[mine], entries[0, mine])
            end = rows[row + 1] - 1
            request.last_before = (int(positions[end]), path.key_before(hidden_states[end]).double())

    def _row_starts(self) -> list[int] | None:
        """Where each request's tokens start in the flat batch (`query_start_loc`), None outside a real step."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return None
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):
            metadata = metadata[0] if metadata else None
        if isinstance(metadata, dict):
            metadata = next(iter(metadata.values()), None)
        starts = getattr(metadata, "query_start_loc", None)
        if starts is None:
            return None
        starts = starts.tolist()
        if len(starts) - 1 > len(self.batch.rows):
            return None  # a profiling or warm-up run: no requests behind it
        return starts

    def _numeric_values(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: list[int] | None):
        """The value of every `<NUM>` of the flat batch, 0 elsewhere (float64, as the tokenizer gives them)."""
        is_num = input_ids == self.num_token_id
        if rows is None or not bool(is_num.any()):
            return None
        values = torch.zeros(input_ids.shape, dtype=torch.float64)
        for index in is_num.nonzero().flatten().tolist():
            row = bisect.bisect_right(rows, index) - 1
            values[index] = self.batch.rows[row].value_at(int(positions[index]), self.num_token_id)
        return values.to(input_ids.device)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The scores vLLM samples from, per request's mode; records the value predicted for each request."""
        from ..cauchy import untransform_values
        from ..generated_numbers import written_values
        from ..generation_modes import DECISION_RULES

        loc_u, scale_u = self.abduction(hidden_states)
        loc_in, scale_in = self.action.head_inputs(loc_u, scale_u)
        modes = self._row_modes(hidden_states.shape[0])
        standard = [row for row, mode in enumerate(modes) if mode == "standard"]
        head = self.action.cls_head
        # loc_S = W_cls loc + b_cls, the formula of `CausalQwenAction.classify(loc, None)`, through vLLM's matmul.
        logits = head.quant_method.apply(head, loc_in.to(head.weight.dtype), bias=head.bias).float()
        if standard:
            rows = torch.tensor(standard, device=hidden_states.device)
            std_loc, std_scale = self.action.classify(loc_in[rows], scale_in[rows])
            logits[rows] = DECISION_RULES["standard"].scores(self.action, std_loc, std_scale)
        last = self.batch.last_positions
        if self.action.reg_head is not None and last is not None and len(last) == hidden_states.shape[0]:
            context = self._read_context(hidden_states, last) if self.abduction.context_values is not None else None
            loc_y, scale_y = self.action.regress(loc_in, scale_in, context)
            values = written_values(untransform_values(loc_y.double(), self.config.value_transform))
            values = values.reshape(-1).tolist()
            for row, (position, value, loc, scale) in enumerate(
                zip(last, values, loc_y.float().tolist(), scale_y.float().tolist(), strict=True)
            ):
                request = self.batch.rows.get(row)
                if request is not None:
                    request.predict(position + 1, value, loc, scale)
        return logits

    def _read_context(self, hidden_states: torch.Tensor, last: list[int]):
        """The path's read at each row's position `last` (its request's last of this forward) over the entries of
        its request's `<NUM>` positions up to there: a `ContextRead` of one position per row, `[R]`."""
        from torch.nn.utils.rnn import pad_sequence

        from ..context_values import ContextRead, visible_entries

        path = self.abduction.context_values
        width = 3 * path.rank
        device = hidden_states.device
        stored = []
        for row in range(hidden_states.shape[0]):
            request = self.batch.rows.get(row)
            context = request.context if request is not None else None
            stored.append(context if context is not None else ContextEntries.empty(width, device))
        keys = pad_sequence([c.keys for c in stored], batch_first=True)
        entries = pad_sequence([c.entries for c in stored], batch_first=True)  # padding: is_num 0, never visible
        key_positions = pad_sequence([c.positions for c in stored], batch_first=True)
        query_positions = torch.tensor(last, device=device)[:, None]  # one query per row
        visible = visible_entries(entries, key_positions, query_positions)
        read = path.read(hidden_states[:, None], keys, entries, visible, self.config.value_transform)
        return ContextRead(read.linear_weight[:, 0], read.offset[:, 0], read.width[:, 0])

    def _row_modes(self, count: int) -> list[str]:
        """The mode of each row of the logits: its request's, when the rows are the batch's requests."""
        default = deployment_mode()
        if self.batch.last_positions is None or len(self.batch.last_positions) != count:
            return [default] * count
        return [self.batch.rows[row].mode if row in self.batch.rows else default for row in range(count)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm.model_executor.models.utils import AutoWeightsLoader

        from ..migrations import upgraded_weights

        loader = AutoWeightsLoader(self, ignore_unexpected_prefixes=["abduction_anchor."])
        return loader.load_weights(upgraded_weights(weights))


def _head_method():
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return UnquantizedEmbeddingMethod()

