"""Generation modes of CausalQwen (docs/design.md §5) on top of transformers' `GenerationMixin`.

`GenerationMixin` runs the loop (KV cache, stopping criteria, streamers, logits processors). What this
module adds is decided per step at the last position only:

- which decision scores the loop sees as `logits`: `loc_S` in `traditional` mode (softmax as in Qwen2),
  and in `standard` and `causal` mode the standardised margins z_k = (loc_S,k − C_k) / scale_S,k: P_k =
  1/2 + atan(z_k)/π is increasing in z_k, so argmax z is exactly argmax P, without the transcendental
  functions and without P's loss of resolution near 1;
- the random draws of `causal` mode and of `shared_noise`, from the caller's `torch.Generator`;
- the numbers: when the chosen token is `<NUM>`, the mode's predicted value becomes its
  `numeric_values` entry and enters the next step through the numeric embedding.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from transformers.generation import GenerationMixin
from transformers.generation.streamers import BaseStreamer, TextStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cauchy import uniform
from .checks import check_numbers_have_values
from .generation_options import GENERATION_MODES, check_generation_options

__all__ = [
    "GENERATION_MODES", "CausalQwenGenerateOutput", "CausalGenerationState", "CausalQwenGenerationMixin",
    "StreamerWithNumbers", "check_generation_options",
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


class CausalGenerationState:
    """What one `generate` call carries from step to step: the mode, its random draws and the numbers so far."""

    def __init__(
        self,
        mode: str,
        *,
        shared_individual: bool,
        shared_noise: bool,
        generator: torch.Generator | None,
        num_token_id: int | None,
        to_value: Callable[[torch.Tensor], torch.Tensor],
    ):
        self.mode = mode
        self.shared_individual = shared_individual
        self.shared_noise = shared_noise
        self.generator = generator
        self.num_token_id = num_token_id
        self.to_value = to_value
        self.numeric_values: torch.Tensor | None = None  # [B, L] float64, aligned with the ids seen so far
        self.prompt_length: int | None = None
        self.pending_value: torch.Tensor | None = None  # [B] value predicted at the last step
        self.shared_draw: torch.Tensor | None = None  # [B, C]: ε (shared individual) or ε_noise (shared noise)
        self.step_loc_y: list[torch.Tensor] = []
        self.step_scale_y: list[torch.Tensor] = []

    def sync(self, input_ids: torch.Tensor, prompt_values: torch.Tensor | None) -> torch.Tensor:
        """Return `numeric_values` `[B, L]` aligned with `input_ids` `[B, L]`, appending the new tokens' values."""
        if self.numeric_values is None:
            if prompt_values is None:
                prompt_values = torch.zeros(input_ids.shape, dtype=torch.float64, device=input_ids.device)
            if prompt_values.shape != input_ids.shape:
                raise ValueError(
                    f"numeric_values must have the shape of the prompt ids {tuple(input_ids.shape)}, "
                    f"got {tuple(prompt_values.shape)}"
                )
            self.numeric_values = prompt_values.to(device=input_ids.device)
            self.prompt_length = input_ids.shape[1]
        new = input_ids.shape[1] - self.numeric_values.shape[1]
        if new > 0:
            appended = torch.zeros((input_ids.shape[0], new), dtype=self.numeric_values.dtype, device=input_ids.device)
            if self.pending_value is not None and self.num_token_id is not None:
                is_num = input_ids[:, -new] == self.num_token_id
                appended[:, 0] = torch.where(is_num, self.pending_value.to(appended.dtype), appended[:, 0])
            self.numeric_values = torch.cat([self.numeric_values, appended], dim=1)
            self.pending_value = None
        return self.numeric_values

    def finish(self, sequences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Values aligned with the final `sequences`, and the per-step regression outputs of the kept steps."""
        values = self.sync(sequences, None)[:, : sequences.shape[1]]
        kept = sequences.shape[1] - (self.prompt_length or 0)
        if not self.step_loc_y:
            return values, None, None
        return values, torch.stack(self.step_loc_y, 1)[:, :kept], torch.stack(self.step_scale_y, 1)[:, :kept]

    def decide(
        self, action, loc_u: torch.Tensor, scale_u: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
        """The mode's decision scores and distributions at the last position.

        Args:
            action: the model's `CausalQwenAction`.
            loc_u, scale_u: `[B, n, C]`; only the last position is used.

        Returns:
            `logits` `[B, 1, V]`, the scores the generation loop ranks (`loc_S` in `traditional` mode, else the
            standardised margin `action.margin`), and the distributions `loc_S`, `scale_S` `[B, 1, V]` (`scale_S`
            is None in `traditional` mode, which ranks loc_S alone), `loc_Y`, `scale_Y` `[B, 1]` (None without a
            regression head).
        """
        loc_u, scale_u = loc_u[:, -1:], scale_u[:, -1:]
        if self.mode == "causal":
            loc_in, scale_in = action.head_inputs(loc_u, scale_u, individual=self._draw(loc_u).unsqueeze(1))
        elif self.shared_noise:
            loc_in, scale_in = action.head_inputs(loc_u, scale_u, noise=self._draw(loc_u).unsqueeze(1))
        else:
            loc_in, scale_in = action.head_inputs(loc_u, scale_u)
        traditional = self.mode == "traditional"
        # The softmax needs loc_S only: skip the pass over |W_cls| that scale_S would cost.
        loc_s, scale_s = action.classify(loc_in, None if traditional else scale_in)
        loc_y = scale_y = None
        if action.reg_head is not None:
            loc_y, scale_y = action.regress(loc_in, scale_in)
            self.pending_value = shortest_float32(self.to_value(loc_y[:, -1].double()))
            self.step_loc_y.append(loc_y[:, -1])
            self.step_scale_y.append(scale_y[:, -1])
        logits = loc_s if traditional else action.margin(loc_s, scale_s)
        return logits, {"loc_S": loc_s, "scale_S": scale_s, "loc_Y": loc_y, "scale_Y": scale_y}

    def _draw(self, like: torch.Tensor) -> torch.Tensor:
        """ε ~ U(0, 1)^[B, C]: fresh each step, or drawn once and reused when the mode shares it."""
        shared = self.shared_individual or self.shared_noise
        if shared and self.shared_draw is not None:
            return self.shared_draw
        shape = (like.shape[0], like.shape[-1])
        eps = uniform(shape, like.device, self.generator)
        if shared:
            self.shared_draw = eps
        return eps


class CausalQwenGenerationMixin(GenerationMixin):
    """transformers' `GenerationMixin` with CausalQwen's modes and numbers; `CausalQwenForCausalLM` inherits it."""

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
        Generate with transformers' loop in one of the modes of docs/design.md §5.

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
            check_numbers_have_values(inputs if inputs is not None else kwargs.get("input_ids"), numeric_values,
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


def _repeat_prompts(copies: int, inputs, numeric_values, kwargs: dict):
    """Repeat every prompt row `copies` times (ids, attention mask, numbers), as `num_return_sequences` would."""
    def repeat(x):
        return x.repeat_interleave(copies, dim=0) if isinstance(x, torch.Tensor) else x

    kwargs = {**kwargs, **{k: repeat(kwargs[k]) for k in ("input_ids", "attention_mask") if k in kwargs}}
    return repeat(inputs), repeat(numeric_values), kwargs




def shortest_float32(values: torch.Tensor) -> torch.Tensor:
    """Round float64 values to the shortest decimal that reads back as the same float32.

    The heads compute in float32 (or less), so digits beyond float32 precision are noise; rounding them away
    makes a generated 18.660715 print as "18.660715" rather than "18.660715103149414". Values outside the
    float32 range are kept as they are.
    """
    rounded = [float(str(np.float32(v))) if abs(v) < 3.0e38 else v for v in values.tolist()]
    return torch.tensor(rounded, dtype=torch.float64, device=values.device)


class StreamerWithNumbers(BaseStreamer):
    """Give a `TextStreamer` the values of the `<NUM>` tokens it decodes.

    A text streamer decodes the ids it has cached since its last flush; a `<NUM>` among them can only be written
    as digits with its value. This wrapper keeps the values of the cached ids and hands them to the streamer's
    `decode` call. Values of new tokens come from the generation state, which holds the value of the token just
    chosen until the next step reads it. Other streamers receive the ids unchanged.
    """

    def __init__(self, streamer: BaseStreamer, state: CausalGenerationState, prompt_values: torch.Tensor | None):
        self.streamer = streamer
        self.state = state
        self.prompt_values = prompt_values
        self.cached_values: list[float] = []
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not isinstance(self.streamer, TextStreamer):
            self.streamer.put(value)
            return
        ids = value.reshape(-1)
        if not self.seen_prompt:
            self.seen_prompt = True
            values = self.prompt_values.reshape(-1) if self.prompt_values is not None else torch.zeros(ids.shape)
        else:
            pending = self.state.pending_value
            values = torch.zeros(ids.shape, dtype=torch.float64)
            if pending is not None and self.state.num_token_id is not None:
                values = torch.where(ids.cpu() == self.state.num_token_id, pending.reshape(-1).cpu(), values)
        cached = len(self.streamer.token_cache)
        aligned = (self.cached_values[len(self.cached_values) - cached:] if cached else []) + values.tolist()
        self.streamer.decode_kwargs["numeric_values"] = aligned
        self.streamer.put(value)
        self.cached_values = aligned

    def end(self) -> None:
        self.streamer.end()


@contextlib.contextmanager
def global_rng_from(generator: torch.Generator | None) -> Iterator[None]:
    """Seed the global RNG from `generator` for the duration, restoring it afterwards.

    The generation loop samples with `torch.multinomial` on the global RNG; seeding it from the caller's
    generator makes `traditional` sampling reproducible too, without disturbing the caller's global state.
    Only `traditional` mode uses it, so that in the other modes the generator's first draws are the ε.
    """
    if generator is None:
        yield
        return
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
    # torch.manual_seed seeds every CUDA device too: fork them all so that the caller's states come back.
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
