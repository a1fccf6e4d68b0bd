"""Generation modes of CausalQwen (DESIGN.md §5) on top of transformers' `GenerationMixin`.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from transformers.generation.streamers import BaseStreamer, TextStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cauchy import standard_from_uniform, uniform
from .generation_options import GENERATION_MODES, check_generation_options

__all__ = [
    "GENERATION_MODES", "CausalQwenGenerateOutput", "CausalGenerationState", "StreamerWithNumbers",
    "check_generation_options",
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

    def decide(self, action, loc_u: torch.Tensor, scale_u: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """The mode's distributions and decision scores at the last position.

        Args:
            action: the model's `CausalQwenAction`.
            loc_u, scale_u: `[B, n, C]`; only the last position is used.

        Returns:
            `logits` `[B, 1, V]` (the scores the generation loop ranks), `loc_S`, `scale_S` `[B, 1, V]` (None in
            `traditional` mode, which ranks loc_S alone),
            `loc_Y`, `scale_Y` `[B, 1]` (None without a regression head).
        """
        loc_u, scale_u = loc_u[:, -1:], scale_u[:, -1:]
        if self.mode == "causal":
            u = loc_u + scale_u * standard_from_uniform(self._draw(loc_u)).unsqueeze(1)
            noise = action.b_noise.abs().to(u.dtype).expand_as(u)
            loc_in, scale_in = u, noise
        elif self.shared_noise:
            eps_noise = standard_from_uniform(self._draw(loc_u)).unsqueeze(1)
            loc_in, scale_in = loc_u + action.b_noise.abs().to(loc_u.dtype) * eps_noise, scale_u
        else:
            loc_in, scale_in = loc_u, action.noisy_scale(scale_u)
        if self.mode == "traditional":
            # The softmax needs loc_S only: skip the pass over |W_cls| that scale_S would cost.
            loc_s, scale_s = torch.nn.functional.linear(loc_in, action.cls_head.weight, action.cls_head.bias), None
        else:
            loc_s, scale_s = action.classify(loc_in, scale_in)
        loc_y = scale_y = None
        if action.reg_head is not None:
            loc_y, scale_y = action.regress(loc_in, scale_in)
            self.pending_value = shortest_float32(self.to_value(loc_y[:, -1].double()))
            self.step_loc_y.append(loc_y[:, -1])
            self.step_scale_y.append(scale_y[:, -1])
        if self.mode == "traditional":
            logits = loc_s
        else:
            logits = (loc_s.float() - action.threshold.float()) / scale_s.float()
        return {"logits": logits, "loc_S": loc_s, "scale_S": scale_s, "loc_Y": loc_y, "scale_Y": scale_y}

    def _draw(self, like: torch.Tensor) -> torch.Tensor:
        """ε ~ U(0, 1)^[B, C]: fresh each step, or drawn once and reused when the mode shares it."""
        shared = self.shared_individual or self.shared_noise
        if shared and self.shared_draw is not None:
            return self.shared_draw
        shape = (like.shape[0], like.shape[-1])
        eps = uniform(shape, like.device, self.generator).to(like.dtype)
        if shared:
            self.shared_draw = eps
        return eps


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
