"""The numbers a `generate` call writes: the value of every `<NUM>` it chooses, kept aligned with the ids.

transformers' loop carries ids only. A generated `<NUM>`'s value is the regression head's prediction at its position,
which the next step feeds back through the numeric embedding and the output returns: `GeneratedNumbers` keeps those
values per row through every decoding `generate` runs (`_BeamHistory` follows beam search's hypotheses),
`shortest_float32` rounds them to the digits the heads resolve, and `StreamerWithNumbers` hands them to a text
streamer, which writes them as digits.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
from transformers.generation.streamers import BaseStreamer, TextStreamer

__all__ = ["GeneratedNumbers", "HoldsNumbers", "StreamerWithNumbers", "shortest_float32", "written_values"]

_MAX_VALUE = torch.finfo(torch.float64).max


def shortest_float32(values: torch.Tensor) -> torch.Tensor:
    """Round float64 values to the shortest decimal that reads back as the same float32.

    The heads compute in float32 (or less), so digits beyond float32 precision are noise; rounding them away
    makes a generated 18.660715 print as "18.660715" rather than "18.660715103149414". Values outside the
    float32 range are kept as they are.
    """
    rounded = [float(str(np.float32(v))) if abs(v) < 3.0e38 else v for v in values.tolist()]
    return torch.tensor(rounded, dtype=torch.float64, device=values.device)


def written_values(values: torch.Tensor) -> torch.Tensor:
    """The numbers a generation writes for predicted medians `values` (value space, float64, any shape): NaN kept,
    ±inf held at float64's largest value so that generation can go on, the rest `shortest_float32`. `generate` and
    the vLLM plugin write these."""
    values = values.nan_to_num(nan=math.nan, posinf=_MAX_VALUE, neginf=-_MAX_VALUE)
    return shortest_float32(values.reshape(-1)).reshape(values.shape)


class GeneratedNumbers:
    """The numbers of one `generate` call, kept per row and aligned with the ids.

    `numeric_values` `[R, n]` holds the values of the first n ids, and the last forward's predictions (`pending`, one
    per position it decided) give the values of the ids chosen since. `sync` is called with the ids the loop holds
    before every forward and at the end; it keeps the values of the ids before `pending_start` (the first position
    the last forward predicted) and takes each later `<NUM>` id's value from the prediction for its position. This
    covers one new token per step, several accepted at once (assisted and prompt-lookup decoding, whose rejected
    candidates are simply dropped) and steps undone at the end. Beam search reorders the rows at every step;
    `_BeamHistory` follows the hypotheses (see there).
    """

    def __init__(
        self,
        *,
        num_token_id: int | None,
        to_value: Callable[[torch.Tensor], torch.Tensor],
        num_beams: int = 1,
        prompt_length: int | None = None,
    ):
        self.num_token_id = num_token_id
        self.to_value = to_value
        self.num_beams = num_beams
        self.prompt_length = prompt_length
        self.numeric_values: torch.Tensor | None = None  # [R, n] float64, the values of the first n ids
        self.loc_y: torch.Tensor | None = None  # [R, n] the regression distribution that predicted each position
        self.scale_y: torch.Tensor | None = None
        self.has_values = False  # the model has a regression head
        self.synced_length = 0  # length of the ids of the last sync (the last forward's input)
        self.pending_start: int | None = None  # first position the last forward predicted
        self._decided_rows: int | None = None  # how many positions the last forward decided
        self._pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # value, loc_Y, scale_Y [R, k]
        self._predicted: tuple[torch.Tensor, torch.Tensor] | None = None  # loc_Y, scale_Y as the forward gave them
        self.beams: _BeamHistory | None = None
        self.overflow_warned = False

    def predicted(self, rows: int, loc_y: torch.Tensor | None, scale_y: torch.Tensor | None) -> None:
        """Take the last forward's regression distributions `[R, rows]` (None without a regression head)."""
        # Where these predictions start is worked out at the next sync: the ids' length changes at every step, and
        # a compiled forward that read it would be compiled again for each length.
        self._decided_rows = rows
        if loc_y is not None:
            self.has_values = True
            self._pending, self._predicted = None, (loc_y, scale_y)

    @property
    def pending(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`(value, loc_Y, scale_Y)` `[R, k]` of the positions the last forward decided.

        The values are made from the forward's `loc_Y` here, when the loop reads them, and not in the forward: their
        rounding (`shortest_float32`) runs in Python, which a compiled forward cannot hold.
        """
        if self._pending is None and self._predicted is not None:
            loc_y, scale_y = self._predicted
            values = written_values(self.to_value(loc_y.double()))
            self._pending, self._predicted = (values, loc_y.float(), scale_y.float()), None
        return self._pending

    @pending.setter
    def pending(self, value: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
        self._pending, self._predicted = value, None

    def sync(self, input_ids: torch.Tensor, prompt_values: torch.Tensor | None) -> torch.Tensor:
        """Return `numeric_values` `[R, L]` aligned with `input_ids` `[R, L]`, taking the new ids' values."""
        if self._decided_rows is not None:
            # The last forward read the ids of the last sync and decided its last `_decided_rows` positions.
            self.pending_start, self._decided_rows = self.synced_length - self._decided_rows + 1, None
        if self.numeric_values is None:
            self._start(input_ids, prompt_values)
        elif self.beams is not None:
            self.beams.follow(self, input_ids)
        length = input_ids.shape[1]
        start = min(self.pending_start, length)
        values = self.numeric_values[:, :start]
        loc_y, scale_y = self.loc_y[:, :start], self.scale_y[:, :start]
        new = length - start
        if new > 0:
            rows = input_ids.shape[0]
            appended = torch.zeros((rows, new), dtype=torch.float64, device=values.device)
            appended_loc = torch.full((rows, new), math.nan, dtype=loc_y.dtype, device=values.device)
            appended_scale = appended_loc.clone()
            if self.pending is not None:
                predicted, predicted_loc, predicted_scale = self.pending
                k = min(new, predicted.shape[1])
                if self.num_token_id is not None:
                    is_num = input_ids[:, start:start + k].to(values.device) == self.num_token_id
                    self._check_number_values(predicted[:, :k], is_num, start)
                    appended[:, :k] = torch.where(is_num, predicted[:, :k], appended[:, :k])
                appended_loc[:, :k] = predicted_loc[:, :k]
                appended_scale[:, :k] = predicted_scale[:, :k]
            values = torch.cat([values, appended], dim=1)
            loc_y = torch.cat([loc_y, appended_loc], dim=1)
            scale_y = torch.cat([scale_y, appended_scale], dim=1)
        self.numeric_values, self.loc_y, self.scale_y = values, loc_y, scale_y
        self.synced_length = length
        return values

    def values_of(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[R', L]` values of the ids a stopping criterion sees between two forwards.

        These are the running rows (then this is `sync`, which the next forward repeats without change), or in beam
        search the candidates that extend the running rows by one token, whose values `_BeamHistory` reads without
        changing the state.
        """
        if self.beams is not None:
            return self.beams.values_of(self, input_ids)
        return self.sync(input_ids, None)

    def _start(self, input_ids: torch.Tensor, prompt_values: torch.Tensor | None) -> None:
        rows = input_ids.shape[0]
        length = self.prompt_length if self.prompt_length is not None else input_ids.shape[1]
        if prompt_values is None:
            prompt_values = torch.zeros((rows, length), dtype=torch.float64, device=input_ids.device)
        if tuple(prompt_values.shape) != (rows, length):
            raise ValueError(
                f"numeric_values must have the shape of the prompt ids {(rows, length)}, "
                f"got {tuple(prompt_values.shape)}"
            )
        self.numeric_values = prompt_values.to(device=input_ids.device, dtype=torch.float64)
        self.loc_y = torch.full((rows, length), math.nan, dtype=torch.float32, device=input_ids.device)
        self.scale_y = self.loc_y.clone()
        self.prompt_length = self.pending_start = length
        if self.num_beams > 1:
            self.beams = _BeamHistory(rows, self.num_beams, input_ids)

    def _check_number_values(self, predicted: torch.Tensor, is_num: torch.Tensor, start: int) -> None:
        """A generated `<NUM>` needs a finite value: NaN is an error, a value clamped from ±inf a warning."""
        taken = predicted[is_num]
        if taken.numel() == 0:
            return
        if bool(torch.isnan(taken).any()):
            raise RuntimeError(
                f"the regression head predicted NaN for a generated <NUM> (at or after position {start}): the "
                "model's outputs are not finite, so the number has no value to write or to feed back"
            )
        if not self.overflow_warned and bool((taken.abs() >= _MAX_VALUE).any()):
            self.overflow_warned = True
            warnings.warn(
                "a generated <NUM>'s predicted value lies beyond the float64 range; it is written as "
                f"±{_MAX_VALUE:.17g} so that generation can go on",
                RuntimeWarning,
                stacklevel=2,
            )

    def finish(self, sequences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Values aligned with the final `sequences`, and the regression distribution of every generated position.

        Positions no step predicted (a beam hypothesis's padding) have NaN `loc_Y` and `scale_Y`.
        """
        if self.beams is not None and self.numeric_values is not None:
            values, loc_y, scale_y = self.beams.finish(self, sequences)
        else:
            values = self.sync(sequences, None)[:, : sequences.shape[1]]
            loc_y, scale_y = self.loc_y, self.scale_y
        if not self.has_values:
            return values, None, None
        start = self.prompt_length
        return values, loc_y[:, start:sequences.shape[1]], scale_y[:, start:sequences.shape[1]]

    def pending_values(self) -> torch.Tensor | None:
        """`[R, k]`: the values the last forward predicted for the positions it decided."""
        return self.pending[0] if self.pending is not None else None


class _BeamHistory:
    """The numbers of beam search's hypotheses, which it reorders, drops and finishes at every step.

    Beam search keeps `num_beams` rows per prompt and at each step rebuilds them from the best continuations of the
    previous rows (transformers reorders its cache by the same `beam_idx`, out of this model's sight). A row's
    numbers follow from its ids alone: a `<NUM>`'s value is the prediction made from the ids before it, and equal
    ids of one prompt give equal predictions. So every step matches each new row's ids, less the last token, to a
    previous row of its prompt, and takes that row's values and prediction. The predictions are also kept in a
    trie of the generated ids (one node per distinct prefix, the prompt's at the root), because a returned
    hypothesis may have left the running rows steps before the end; `finish` walks each returned sequence down it.
    """

    def __init__(self, rows: int, num_beams: int, input_ids: torch.Tensor):
        self.num_beams = num_beams
        self.groups = rows // num_beams
        self.rows_ids = input_ids
        self.nodes = [row // num_beams for row in range(rows)]  # the trie node of each row's ids
        self.children: dict[tuple[int, int], int] = {}
        self.predicted: dict[int, tuple[float, float, float]] = {}  # node → value, loc_Y, scale_Y of the next id
        self.next_node = self.groups

    def record(self, state: GeneratedNumbers) -> None:
        """Keep the last forward's prediction for each row's node."""
        if state.pending is None:
            return
        value, loc, scale = (t[:, -1].tolist() for t in state.pending)
        for row, node in enumerate(self.nodes):
            self.predicted[node] = (value[row], loc[row], scale[row])

    def follow(self, state: GeneratedNumbers, input_ids: torch.Tensor) -> None:
        """Reorder the state's rows after beam search rebuilt them; `input_ids` are the new rows."""
        previous = self.rows_ids
        if input_ids.shape[1] != previous.shape[1] + 1:
            if input_ids.shape == previous.shape and torch.equal(input_ids, previous):
                return
            raise RuntimeError(f"beam search rows went from {tuple(previous.shape)} to {tuple(input_ids.shape)} ids")
        self.record(state)
        rows = input_ids.shape[0]
        group = torch.arange(rows, device=input_ids.device) // self.num_beams
        same = (input_ids[:, None, :-1] == previous[None, :, :].to(input_ids.device)).all(-1)
        same &= group[:, None] == group[None, :]
        if not bool(same.any(1).all()):
            raise RuntimeError("a beam search row continues none of the previous rows of its prompt")
        source = same.int().argmax(1)
        state.numeric_values = state.numeric_values[source.to(state.numeric_values.device)]
        state.loc_y, state.scale_y = state.loc_y[source], state.scale_y[source]
        if state.pending is not None:
            state.pending = tuple(t[source.to(t.device)] for t in state.pending)
        tokens = input_ids[:, -1].tolist()
        self.nodes = [self._child(self.nodes[j], t) for j, t in zip(source.tolist(), tokens, strict=True)]
        self.rows_ids = input_ids

    def values_of(self, state: GeneratedNumbers, input_ids: torch.Tensor) -> torch.Tensor:
        """Values of beam search's candidates, rows that extend a running row of their prompt by one token.

        Each candidate takes the values of the running row it extends and, for a `<NUM>` as its last token, that
        row's pending prediction.
        """
        previous = state.numeric_values
        if input_ids.shape[1] == self.rows_ids.shape[1]:
            return previous
        if input_ids.shape[1] != self.rows_ids.shape[1] + 1:
            raise RuntimeError(f"beam search candidates of {input_ids.shape[1]} ids follow rows of "
                               f"{self.rows_ids.shape[1]}")
        rows, running = input_ids.shape[0], self.rows_ids.shape[0]
        group = torch.arange(rows, device=input_ids.device) // (rows // self.groups)
        running_group = torch.arange(running, device=input_ids.device) // self.num_beams
        same = (input_ids[:, None, :-1] == self.rows_ids[None, :, :].to(input_ids.device)).all(-1)
        same &= group[:, None] == running_group[None, :]
        if not bool(same.any(1).all()):
            raise RuntimeError("a beam search candidate continues none of the running rows of its prompt")
        source = same.int().argmax(1).to(previous.device)
        last = torch.zeros(rows, dtype=previous.dtype, device=previous.device)
        pending = state.pending_values()
        if pending is not None and state.num_token_id is not None:
            is_num = input_ids[:, -1].to(previous.device) == state.num_token_id
            last = torch.where(is_num, pending[source, -1].to(previous.dtype), last)
        return torch.cat([previous[source], last[:, None]], dim=1)

    def _child(self, node: int, token: int) -> int:
        found = self.children.get((node, token))
        if found is None:
            found = self.children[(node, token)] = self.next_node
            self.next_node += 1
        return found

    def finish(self, state: GeneratedNumbers, sequences: torch.Tensor):
        """Values and regression distributions of the returned sequences, read from the trie."""
        self.record(state)
        rows, length = sequences.shape
        per_prompt = rows // self.groups
        start = state.prompt_length
        prompts = torch.arange(rows) // per_prompt * self.num_beams
        values = torch.zeros((rows, length), dtype=torch.float64)
        values[:, :start] = state.numeric_values[prompts, :start].cpu()
        loc_y = torch.full((rows, length), math.nan, dtype=torch.float32)
        scale_y = loc_y.clone()
        for row, ids in enumerate(sequences[:, start:].tolist()):
            node = row // per_prompt
            for offset, token in enumerate(ids):
                predicted = self.predicted.get(node)
                if predicted is None:
                    break
                position = start + offset
                loc_y[row, position], scale_y[row, position] = predicted[1], predicted[2]
                if token == state.num_token_id:
                    if math.isnan(predicted[0]):
                        state._check_number_values(torch.tensor([math.nan]), torch.tensor([True]), position)
                    values[row, position] = predicted[0]
                node = self.children.get((node, token))
                if node is None:
                    break
        device = sequences.device
        return values.to(device), loc_y.to(device), scale_y.to(device)


class HoldsNumbers(Protocol):
    """What the hooks that write numbers read of a `generate` call's state (`generation.CausalGenerationState`).

    A protocol, so that these hooks depend on the numbers alone and not on the loop's module, which imports them.
    """

    numbers: GeneratedNumbers


class StreamerWithNumbers(BaseStreamer):
    """Give a `TextStreamer` the values of the `<NUM>` tokens it decodes.

    A text streamer decodes the ids it has cached since its last flush; a `<NUM>` among them can only be written
    as digits with its value. This wrapper keeps the values of the cached ids and hands them to the streamer's
    `decode` call. Values of new tokens come from the generation state, which holds the value of the token just
    chosen until the next step reads it. Other streamers receive the ids unchanged.
    """

    def __init__(self, streamer: BaseStreamer, state: HoldsNumbers, prompt_values: torch.Tensor | None):
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
            pending = self.state.numbers.pending_values()
            values = torch.zeros(ids.shape, dtype=torch.float64)
            if pending is not None and self.state.numbers.num_token_id is not None:
                # One row (streamers take batches of one); an assisted step may accept several ids at once.
                predicted = pending.reshape(-1)[: ids.numel()].cpu()
                values[: predicted.numel()] = predicted
                values = torch.where(ids.cpu() == self.state.numbers.num_token_id, values, torch.zeros_like(values))
        cached = len(self.streamer.token_cache)
        aligned = (self.cached_values[len(self.cached_values) - cached:] if cached else []) + values.tolist()
        self.streamer.decode_kwargs["numeric_values"] = aligned
        self.streamer.put(value)
        self.cached_values = aligned

    def end(self) -> None:
        self.streamer.end()
