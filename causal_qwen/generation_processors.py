"""The logits processors and the stopping criterion that `generate` adds to transformers' loop.

- `DecisionScores`, first: the scores a mode ranks, in place of the forward's loc_S;
- `GeneratorSampling`, last: traditional sampling from the caller's `torch.Generator`, not torch's global RNG;
- `StopStringsWithNumbers`: stop strings matched in the text with each `<NUM>` written as its value.

Each reads the call's state (`generation.CausalGenerationState`) through a protocol, so that the loop's module
imports this one and not the reverse.
"""

from __future__ import annotations

import math
import os
from typing import Protocol

import torch
from transformers.generation import LogitsProcessor
from transformers.generation.stopping_criteria import StoppingCriteria

from .generated_numbers import HoldsNumbers

__all__ = ["DecisionScores", "GeneratorSampling", "HoldsDecisionScores", "StopStringsWithNumbers"]


class HoldsDecisionScores(Protocol):
    """What `DecisionScores` reads of a `generate` call's state (`generation.CausalGenerationState`)."""

    def decision_scores(self, length: int) -> torch.Tensor:
        """`[R, V]`: the rule's scores for the id at index `length`."""


class DecisionScores(LogitsProcessor):
    """The first logits processor of a mode that ranks scores of its own: those scores, in place of loc_S.

    The forward's `logits` are loc_S in every mode, and transformers returns them as `output_logits`. In `standard`
    and `causal` mode the forward also computes the standardised margins z_k = (loc_S,k − C_k)/scale_S,k that the
    mode ranks; this processor hands them to the loop, so every later processor, the argmax and `output_scores`
    see them, as transformers' split of raw logits and processed scores intends.
    """

    def __init__(self, state: HoldsDecisionScores):
        self.state = state

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        decided = self.state.decision_scores(input_ids.shape[1])
        return decided.to(device=scores.device, dtype=scores.dtype, copy=True)


class GeneratorSampling(LogitsProcessor):
    """Draw the next token from the softmax of the processed scores with a `torch.Generator`.

    transformers samples with `torch.multinomial` on torch's global RNG. Placed last, this processor draws the
    token from the caller's generator instead and returns scores that are −inf except at that token, so that the
    loop, run greedily, takes it: the global RNG is neither read nor changed, and concurrent calls on one model do
    not share a random stream. The scores it saw are kept so that `output_scores` returns them rather than the mask.
    """

    def __init__(self, generator: torch.Generator, keep_scores: bool):
        self.generator = generator
        self.keep_scores = keep_scores
        self.scores: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        probs = torch.softmax(scores.float(), dim=-1).to(self.generator.device)
        tokens = torch.multinomial(probs, num_samples=1, generator=self.generator).to(scores.device)
        if self.keep_scores:
            self.scores.append(scores.clone())
        chosen = torch.full_like(scores, -math.inf)
        return chosen.scatter_(1, tokens, 0.0)


class StopStringsWithNumbers(StoppingCriteria):
    """Stop strings matched in the text as the tokenizer writes it, each `<NUM>` as its value's digits.

    transformers' `StopStringCriteria` matches the strings against the strings of the tokens, and a `<NUM>` token's
    string is "<NUM>": "." would never stop after a generated 12.25, and ">" would stop after every number. This
    criterion decodes the end of every row with the values the generation state holds and applies the same rule:
    a row stops when a stop string occurs in its text and reaches into the text of the tokens added since the last
    check (the last token, or the tokens assisted decoding accepted at once). `generate` uses it in place of
    `StopStringCriteria` whenever `stop_strings` is set on a model with numbers.

    Args:
        stop_strings: one string or several.
        tokenizer: a `CausalQwenTokenizer` with the model's `<NUM>` id (its `decode` writes the values).
        state: the generation state of the `generate` call.
    """

    def __init__(self, stop_strings: str | list[str], tokenizer, state: HoldsNumbers):
        strings = [stop_strings] if isinstance(stop_strings, str) else stop_strings
        if not isinstance(strings, (list, tuple)) or not strings or not all(
                isinstance(x, str) and x for x in strings):
            raise ValueError(f"stop_strings must be a non-empty string or a list of them, got {stop_strings!r}")
        from .tokenization import CausalQwenTokenizer

        if not isinstance(tokenizer, CausalQwenTokenizer):
            raise ValueError(
                "stop_strings on a model that writes numbers need the CausalQwenTokenizer as tokenizer=, whose decode "
                f"writes each <NUM> as its value; got {type(tokenizer).__name__}"
            )
        if tokenizer.num_token_id != state.numbers.num_token_id:
            raise ValueError(f"tokenizer's <NUM> id {tokenizer.num_token_id} is not the model's num_token_id "
                             f"{state.numbers.num_token_id}")
        self.stop_strings = list(strings)
        self.tokenizer = tokenizer
        self.state = state
        # Tokens decoded before the new ones: a stop string of n characters spans at most 4n byte-level tokens.
        self.context = 4 * max(len(x) for x in self.stop_strings)
        self.checked_length: int | None = None

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        length = input_ids.shape[1]
        checked = self.checked_length if self.checked_length is not None else self.state.numbers.prompt_length
        new = max(1, length - (checked or 0))
        self.checked_length = length
        window = min(length, new + self.context)
        ids = input_ids[:, length - window:].tolist()
        values = self.state.numbers.values_of(input_ids)[:, length - window:].tolist()
        texts = self.tokenizer.batch_decode(ids, numeric_values=values)
        before = self.tokenizer.batch_decode([row[:-new] for row in ids], numeric_values=[v[:-new] for v in values])
        stops = [self._reaches_new_text(old, text) for old, text in zip(before, texts, strict=True)]
        return torch.tensor(stops, dtype=torch.bool, device=input_ids.device)

    def _reaches_new_text(self, before: str, text: str) -> bool:
        """Whether a stop string occurs in `text` and ends past what `text` shares with `before`."""
        # Byte-level tokens of a split character decode apart as U+FFFD: the text shared is the common prefix.
        shared = len(os.path.commonprefix([before, text]))
        return any(text.find(stop, max(0, shared - len(stop) + 1)) >= 0 for stop in self.stop_strings)
