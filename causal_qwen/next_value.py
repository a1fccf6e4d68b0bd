"""The value a prompt asks for next, in one call: its median and central intervals (`model.next_value`).

The value head predicts, at every position, the number that would come next if the next token were `<NUM>`. At the
natural end of a prompt ("… a weight of 2300 pounds gets") the next token is often a separator (a space), and the
number comes one position later: reading the value at the prompt's end then reads a position that was never trained
to hold that number. So the read follows standard mode's own decision: where the model's next token at the prompt's
end is whitespace and the prompt does not end in whitespace already, that separator is appended and the value is read
after it; where the next token there is still not `<NUM>`, a warning says so (the value read is the one the model
would give if it wrote a number there).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["NextValue", "next_values"]


@dataclass(frozen=True)
class NextValue:
    """The value a prompt asks for next: its `median`, its central `intervals` by coverage (`{0.9: (low, high)}`),
    the `separator` appended to the prompt before reading it ("" for none), and whether standard mode writes
    `<NUM>` there (`writes_number`)."""

    median: float
    intervals: dict[float, tuple[float, float]]
    separator: str
    writes_number: bool


def _check_levels(levels: Sequence[float]) -> tuple[float, ...]:
    if isinstance(levels, (int, float)):
        levels = (levels,)
    levels = tuple(levels)
    for level in levels:
        if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0.0 < level < 1.0:
            raise ValueError(f"levels must be coverages in (0, 1), got {level!r}")
    return levels


@torch.no_grad()
def _read_ends(model, tokenizer, prompts: list[str], batch_size: int) -> list[tuple[int, float, float]]:
    """(standard mode's next token, loc_Y, scale_Y) at the end of each prompt."""
    device = next(model.parameters()).device
    ends = []
    for lo in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[lo:lo + batch_size], return_tensors="pt", padding=True, padding_side="left")
        mask = batch["attention_mask"].to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=batch["input_ids"].to(device), numeric_values=batch["numeric_values"].to(device),
                    attention_mask=mask, position_ids=positions, logits_to_keep=1)
        chosen = model.ovr_probabilities(out.logits[:, -1].float(), out.scale_S[:, -1].float()).argmax(-1)
        ends += list(zip(chosen.tolist(), out.loc_Y[:, -1].double().tolist(), out.scale_Y[:, -1].double().tolist(),
                         strict=True))
    return ends


def next_values(model, tokenizer, prompts: str | Sequence[str], levels: Sequence[float] = (0.5, 0.9),
                batch_size: int = 16) -> list[NextValue]:
    """The value each of `prompts` asks for next (module docstring): a [`NextValue`] per prompt, in order."""
    if not getattr(model.config, "use_numeric", False):
        raise ValueError("next_value needs a CausalQwen model with use_numeric=True (it has a value head)")
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = list(prompts)
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"prompts[{i}] must be a non-empty string, got {prompt!r}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    levels = _check_levels(levels)
    num_id = model.config.num_token_id
    was_training = model.training
    model.eval()
    try:
        ends = _read_ends(model, tokenizer, prompts, batch_size)
        separators = [""] * len(prompts)
        again = []
        for i, (token, _, _) in enumerate(ends):
            text = tokenizer.decode([token]) if token != num_id else ""
            if token != num_id and text and not text.strip() and not prompts[i][-1].isspace():
                separators[i] = text
                again.append(i)
        if again:
            for i, end in zip(again, _read_ends(model, tokenizer, [prompts[i] + separators[i] for i in again],
                                                batch_size), strict=True):
                ends[i] = end
    finally:
        model.train(was_training)
    results = []
    for i, (token, loc, scale) in enumerate(ends):
        loc_t, scale_t = torch.tensor(loc, dtype=torch.float64), torch.tensor(scale, dtype=torch.float64)
        intervals = {}
        median = float(model.to_value(loc_t))
        for level in levels:
            _, low, high = model.value_interval(loc_t, scale_t, level)
            intervals[level] = (float(low), float(high))
        if token != num_id:
            warnings.warn(f"prompts[{i}]: the next token is {tokenizer.decode([token])!r}, not <NUM>: the value read "
                          "is the one the model would give if it wrote a number there", UserWarning, stacklevel=2)
        results.append(NextValue(median, intervals, separators[i], token == num_id))
    return results
