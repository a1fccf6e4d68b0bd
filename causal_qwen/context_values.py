"""The abduction's read of the values stated earlier in the text (docs/design.md §1b, docs/math.md).

At position t the value Y_t has, besides the seeds' linear read-out of U, candidates built from the values y_j of
the `<NUM>` tokens j ≤ t of the same sequence (y = T(v), T the `value_transform`):

- a copy of each y_j, weighted by a pointer (rank-r scores of z_t and of the key k_j below);
- a log-space combination ℓ_t = Σ_j b_tj·L(v_j) (products, ratios, rates, powers), as the value L⁻¹(ℓ_t), where L is
  symlog and L⁻¹ symexp by default, or ln|v| (0 for v = 0) and exp (`context_values_log="log"`);
- a raw-space combination r_t = Σ_j c_tj·v_j (sums, differences, unit factors), as the value r_t;
- the mean of the earlier values ū_t = (1/n_t)·Σ_j v_j (n_t of them), as the value ū_t;

with b_tj, c_tj rank-r bilinear weights of z_t and k_j. One softmax over the linear read-out, the copies, the two
combinations and the mean gives their weights π (the linear read-out is the pointer's sink: with no earlier number
π_0 = 1). The value stays Cauchy given the context, the action network's linear law weighted by π_0:

    loc_Y = π_0·(w_reg·loc_U + b_reg) + m_t,  m_t = Σ_j π_j·y_j + π_ℓ·T(L⁻¹(ℓ_t)) + π_r·T(r_t) + π_μ·T(ū_t)
    scale_Y = π_0·|w_reg|·scale_U' + γ_Y·ρ_t,  ρ_t = exp(a·z_t + β·π̄_t) > 0

where π̄_t = (π_0, Σ_j π_j, π_ℓ, π_r, π_μ): the width of the value's own noise depends on the input and on what the path
chose, so a copy can get a narrow interval and a guess a wide one. With no earlier number and a, β at 0 this is the
model without the path exactly.

Why a mean of its own: an average is a raw-space combination of weights 1/n_t, which a rank-r bilinear weight writes
only where the query knows n_t, and a soft copy averages in the head's space (symlog: a geometric mean, 0.35 off on
the corpus's averages); the mean is exact for any n_t and at any scale (docs/experiments.md, "The mean of the
earlier numbers"). The choice decides where it applies. Its score and its entry of β are tensors of their own
(`mean_score`, `mean_width`) rather than one more row of `choice` and of `width_by_choice`, so that a checkpoint saved
before it loads with them absent (migrations.py) and no saved tensor changes shape.

Which log: a product is a sum of logarithms, ln(p·q) = ln p + ln q, but symlog(p·q) is not a sum of symlogs where a
factor is small (ln 3 for q = 2 against ln 2), so with symlog no weights write a price times a quantity of 2 to 9, or
a price per carat of 0.2 to 3 carats, closer than 10-20%; with ln|v| weights (1, 1) and (1, −1) write them exactly. Yet
the start from data fits the symlog form better (docs/experiments.md, "The log of the values"), which is why it is
the default. The log of a value carries no sign, so the ln|v| candidate is positive; a zero has no logarithm and
that combination leaves it out.

The keys of number j are rank-r maps of its own features and of the features of the position before it,
k_j = K·z_j + b_K + K'·z_{j−1}: causally, z_{j−1} has read the words that introduce the number but not its value, so
the key can say which number it is (its role) whatever its size, and a copy is chosen at scales never seen
(docs/experiments.md has the table that chose this). K' = 0 is the path of checkpoints saved without it.

The maps of every position (K·z_t + b_K and K'·z_t) and its entries (y_t, v_t, whether t is a `<NUM>`, and whether
it follows a position of its own text) are held as one more layer of the generation cache, so beams reorder it,
assisted decoding crops it and a static cache preallocates it as it does the backbone's layers; they are kept in
float64, which holds the tokenizer's values to every digit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer

from .cauchy import symexp, symlog, transform_values
from .config_fields import CONTEXT_VALUES_LOGS
from .distributed import sharded_training
from .migrations import ADDED
from .outputs import keep_positions

# The scores of the candidates that are not copies, in this order (the first three `choice`'s, the mean's
# `mean_score`), and the score each starts from: the linear read-out at 0, the others well below it, so that a start
# from data moves them only where they help.
CANDIDATES = ("linear", "log", "raw", "mean")
_START_SCORES = (0.0, -4.0, -4.0, -4.0)
# The linear read-out's score where the path is to leave the value to it: every other candidate below e^-40.
LINEAR_ONLY_SCORE = 40.0
# The mean's score there: its weight in the float64 softmax is exactly 0, as in a checkpoint saved before it existed.
_MEAN_ABSENT_SCORE = -1e4
# A log-space combination beyond this is past float64's range once exponentiated.
_MAX_LOG = 700.0
# What the read-out's guard adds to its score at most (§1c): above any score a fit gives a copy.
GUARD_SCORE = 1e4
# ρ stays within e^±40.
MAX_LOG_WIDTH = 40.0


@dataclass
class ContextRead:
    """What the path read at each kept position, `[B, S]` each, float64.

    `linear_weight` is π_0, `offset` is m_t and `width` is ρ_t of the module's formulas.
    """

    linear_weight: torch.Tensor
    offset: torch.Tensor
    width: torch.Tensor
    # 0 times the path's layers' outputs, for a training loss to add: a batch whose loss has no value term leaves the
    # path out of the graph, and data-parallel and sharding engines wait for a gradient of every trainable parameter
    # (exactly 0 here).
    in_graph: torch.Tensor | float = 0.0
    # π̄_t = (π_0, Σ_j π_j, π_ℓ, π_r, π_μ) `[B, S, 5]`, what the width ρ_t reads of the choice.
    choice: torch.Tensor | None = None

    def apply(
        self, loc_linear: torch.Tensor, spread_linear: torch.Tensor, noise_scale: torch.Tensor | float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(loc_Y, scale_Y)` from the linear law's location and its spread |w_reg|·scale_U' (without γ_Y), both of
        one dtype, which the two keep."""
        if spread_linear.dtype != loc_linear.dtype:
            raise TypeError(f"loc_linear and spread_linear must share a dtype, got {loc_linear.dtype} and "
                            f"{spread_linear.dtype}")
        # Stacked, the two are computed and saturated by one operation each (each a kernel launch on a GPU).
        linear = torch.stack((loc_linear, spread_linear)).double()
        terms = torch.addcmul(torch.stack((self.offset, self.width * noise_scale)), self.linear_weight, linear)
        loc, scale = _saturated(terms, loc_linear.dtype)
        return loc, scale

    def last(self, rows: int) -> ContextRead:
        """The read of the last `rows` positions."""
        choice = None if self.choice is None else self.choice[:, -rows:]
        return ContextRead(self.linear_weight[:, -rows:], self.offset[:, -rows:], self.width[:, -rows:], self.in_graph,
                           choice)


def _saturated(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` (float64) in `dtype`, a finite one past its range at its largest value rather than ±inf: a combination
    of values near float32's limit can land past it, and an inf location gives the value's loss no gradient. An
    infinite input (the read-out's own overflow) stays infinite."""
    limit = torch.finfo(dtype).max
    # |v| < inf rather than `isfinite`, which is four operations (each a kernel launch on a GPU); a NaN fails both.
    return torch.where(values.abs() < math.inf, values.clamp(-limit, limit), values).to(dtype)


class CausalQwenContextValues(nn.Module):
    """The pointer, the two combinations and the mean over the earlier `<NUM>` values, and the width ρ (module
    docstring)."""

    def __init__(self, hidden_size: int, rank: int, log_values: str = "symlog"):
        super().__init__()
        if log_values not in CONTEXT_VALUES_LOGS:
            raise ValueError(f"log_values must be one of {CONTEXT_VALUES_LOGS}, got {log_values!r}")
        self.rank = rank
        # How the log-space combination takes the log of the values: "symlog" or "log" (ln|v|; module docstring).
        self.log_values = log_values
        # Queries and keys of the copy scores, the log-space and the raw-space weights: three rank-r maps each.
        self.query = nn.Linear(hidden_size, 3 * rank)
        self.key = nn.Linear(hidden_size, 3 * rank)
        # K', read at the position before each number; no bias, so that no position before the text's start adds one.
        self.key_before = nn.Linear(hidden_size, 3 * rank, bias=False)
        self.choice = nn.Linear(hidden_size, len(CANDIDATES) - 1)
        self.mean_score = nn.Linear(hidden_size, 1)
        self.width = nn.Linear(hidden_size, 1)
        # The read-out's guard g(z_t): where it is positive the read-out's score rises by up to `GUARD_SCORE`
        # (docs/design.md §1c). 0 (weight and bias) leaves the choice as fitted, as in a checkpoint saved before it.
        self.guard = nn.Linear(hidden_size, 1)
        # β of π̄ = (π_0, Σ_j π_j, π_ℓ, π_r), and of π_μ.
        self.width_by_choice = nn.Parameter(torch.zeros(len(CANDIDATES)))
        self.mean_width = nn.Parameter(torch.zeros(1))
        self.register_load_state_dict_post_hook(_read_added_as_before)

    @torch.no_grad()
    def reset_parameters(
        self, generator: torch.Generator | None = None, *, keep_loaded: bool = True, linear_only: bool = False
    ) -> None:
        """Write `start_tensors`; with `keep_loaded`, through transformers' init helpers, which leave a tensor
        loaded from a checkpoint as it is."""
        params = dict(self.named_parameters())
        for name, tensor in start_tensors(self, generator, linear_only).items():
            if keep_loaded:
                init.copy_(params[name], tensor)
            else:
                params[name].copy_(tensor)

    def entries(
        self,
        hidden_states: torch.Tensor,
        is_num: torch.Tensor,
        values: torch.Tensor,
        value_transform: str,
        starts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The key maps `[B, S, 6r]` (K·z_t + b_K, then K'·z_t) and entries `[B, S, 4]` (y, v, is `<NUM>`, and 1
        unless `starts` `[B, S]` marks the position as a text's first, whose key reads nothing before it) of new
        positions, float64; [`keys_of`] makes the keys of them."""
        maps = torch.cat((self.key(hidden_states), self.key_before(hidden_states)), -1).double()
        return maps, entry_values(is_num, values, value_transform, starts)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # For `_read_added_as_before`, which torch calls without the prefix. The tensors are not filled here: under
        # ZeRO-3, transformers calls this on one rank with only the checkpoint's own tensors gathered.
        self._loading_prefix = prefix
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def keys(self, own: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        """The keys `[..., 3r]` of numbers from their features `own` and those of the positions before them `before`
        (`[..., H]` each), float64: K·z_j + b_K + K'·z_{j−1}."""
        return (self.key(own) + self.key_before(before)).double()

    def forward(
        self,
        hidden_states: torch.Tensor,
        is_num: torch.Tensor,
        values: torch.Tensor,
        value_transform: str,
        *,
        logits_to_keep: int | torch.Tensor,
        cache: Cache | None = None,
        starts: torch.Tensor | None = None,
        numbers: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Read the context at the new positions `logits_to_keep` keeps: the fields of a [`ContextRead`], as a tuple of
        tensors (what DeepSpeed ZeRO-3 hooks a module's backward on; `ContextRead(*outputs)` holds them).

        Args:
            hidden_states: `[B, S, H]`, the backbone's features of the new positions.
            is_num, values: `[B, S]`, where the new positions are `<NUM>` and their values (0 elsewhere).
            value_transform: the config's transform T.
            logits_to_keep: the new positions whose value is read, those the heads keep (`keep_positions`): an
                int keeps the last ones (0: all) as a view, positions `[S']` or `[B, S']` are gathered.
            cache: the generation cache; one layer after the backbone's holds the path's entries.
            starts: `[B, S]`, where a new position is the first of its text (position id 0: after left padding, or
                a packed sequence's next text); None: only the sequence's first.
            numbers: [`count_numbers`] of `is_num` and `cache`, counted before the backbone ran; None: counted here.
        """
        graph = self._needs_graph(hidden_states)
        # Without zero terms to add, and not under a sharding engine (which gathers a layer's parameters when it is
        # called, every rank calling the same layers), a context without numbers skips what no query reads: on a GPU
        # each small operation is a kernel launch, which is what a step of small batches or a token of decoding costs.
        lean = not graph and not sharded_training()
        compiling = torch.compiler.is_compiling()  # a traced graph (export, compile) keeps every position
        count = None
        if cache is None and not compiling:
            count = numbers if numbers is not None else _count_numbers(is_num)
            if count == 0 and lean:  # nor are the keys of this batch kept for a later one
                read = self.read_without_numbers(keep_positions(hidden_states, logits_to_keep), graph=False)
                return read.linear_weight, read.offset, read.width, read.width.new_zeros(())
        maps, entries = self.entries(hidden_states, is_num, values, value_transform, starts)
        new_maps = maps
        new = torch.arange(hidden_states.shape[1], device=maps.device)
        key_positions = new[None]
        static = False
        if cache is not None:
            layer = context_layer(cache)
            before = layer.get_seq_length()
            before = before.clone() if isinstance(before, torch.Tensor) else before  # `update` adds to it in place
            maps, entries = (t[:, 0] for t in layer.update(maps[:, None], entries[:, None]))
            key_positions = torch.arange(maps.shape[1], device=maps.device)[None]
            new = new + before
            static = isinstance(layer, StaticLayer)  # a static cache keeps its shapes for a compiled forward
            if not (static or compiling):  # in the whole context, the cache's too
                count = numbers if numbers is not None else _count_numbers(entries[..., 2])
        if static or compiling:
            keys = keys_of(maps, entries)
        elif count == 0 and lean:
            keys = maps.new_zeros(maps.shape[0], 0, maps.shape[-1] // 2)  # no number in the whole context
        else:
            keys, entries, key_positions = _numbers_only(keys_of(maps, entries), entries, count)
        query_positions = keep_positions(new[None, :, None], logits_to_keep)[..., 0]
        queries = keep_positions(hidden_states, logits_to_keep)
        short = keys.shape[1] == 0  # no number anywhere in the batch's context
        if short:
            read = self.read_without_numbers(queries, graph=graph)
        else:
            visible = visible_entries(entries, key_positions, query_positions)
            read = self.read(queries, keys, entries, visible, value_transform, graph=graph)
        in_graph = read.in_graph + 0.0 * new_maps.sum() if graph else 0.0
        linear, offset = read.linear_weight, read.offset
        if short and isinstance(in_graph, torch.Tensor):
            # The short read's π_0 and m_t are constants; in training they join the graph as the whole read's do
            # (exactly 1 and 0 still), since ZeRO-3 hooks the backward of each output of a module that needs a
            # gradient, and a rank without numbers must hook as many as one with them.
            linear, offset = linear + in_graph, offset + in_graph
        zero = keys.new_zeros(())
        return linear, offset, read.width, zero + in_graph if graph else zero

    def _needs_graph(self, hidden_states: torch.Tensor) -> bool:
        """Whether this forward adds the zero terms of `ContextRead.in_graph`: in training, where a gradient can
        flow through the path (its parameters train, or the features it reads carry a gradient). Elsewhere they
        would be zeros that nothing differentiates."""
        if not (self.training and torch.is_grad_enabled()):
            return False
        return hidden_states.requires_grad or any(param.requires_grad for param in self.parameters())

    def _scores(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queries `[B, T, 3r]`, the scores of the candidates that are not copies `[B, T, 4]` and the width map
        a·z_t `[B, T]` of queries `[B, T, H]`, float64."""
        scores = torch.cat((self.query(queries), self.choice(queries), self.mean_score(queries), self.guard(queries),
                            self.width(queries)), -1).double()  # one conversion rather than four
        q, choice, guard, raw_width = scores.split((3 * self.rank, len(CANDIDATES), 1, 1), dim=-1)
        # §1c: where the guard says the read-out beats the path for this kind of query, its score rises by up to
        # 10⁴ (every other candidate's weight is then exactly 0 in float64, however far a copy's score was above the
        # read-out's); where the guard is ≤ 0 the choice is the fit's. The guard is fitted on held-out misses
        # (`starts.path_guard._fit_guard`), not by gradient: a step has none worth following, and 10⁴ times the
        # choice's would move it far in one step wherever the path trains (FSDP, DeepSpeed); it stays in the graph at 0
        # so that every engine reduces it as it does the other parameters.
        veto = GUARD_SCORE * guard.detach().clamp(0.0, 1.0) + 0.0 * guard
        choice = torch.cat((choice[..., :1] + veto, choice[..., 1:]), -1)
        return q, choice, raw_width.squeeze(-1)

    def _width(self, raw_width: torch.Tensor, summary: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ρ_t from a·z_t `[B, T]` and π̄_t `[B, T, 5]`, and β."""
        # Bounded: a width map fitted on the value rows can reach far past them at other positions, and exp of it
        # would be inf there, with a NaN gradient through a loss that does not read those positions.
        by_choice = torch.cat((self.width_by_choice, self.mean_width)).double()
        return (raw_width + summary @ by_choice).clamp(-MAX_LOG_WIDTH, MAX_LOG_WIDTH).exp(), by_choice

    def _in_graph(self, read: ContextRead, q: torch.Tensor, choice: torch.Tensor, raw_width: torch.Tensor,
                  by_choice: torch.Tensor, graph: bool) -> ContextRead:
        """`read` with its `in_graph` term where `graph` (`_needs_graph`)."""
        if graph:
            # Every layer's output (not its parameters: a sharding engine releases a layer's parameters once the
            # layer has run) times 0, so that a loss without a value term still reaches every parameter.
            read.in_graph = 0.0 * (q.sum() + choice.nan_to_num(neginf=0.0).sum() + raw_width.sum()
                                   + by_choice.sum())
        return read

    def read_without_numbers(self, queries: torch.Tensor, graph: bool | None = None) -> ContextRead:
        """`read` where no number is visible, in a few operations rather than the whole read: π_0 = 1, m_t = 0 and
        π̄_t = (1, 0, 0, 0, 0), so ρ_t = exp(a·z_t + β_0), bit for bit what `read` gives there. (Each small operation
        is a kernel launch on a GPU, which is what a step of small batches or one token of decoding costs.) The
        scores are computed only for `in_graph`'s zero terms, where `graph` (None: in training, with gradients on)."""
        graph = self.training and torch.is_grad_enabled() if graph is None else graph
        if graph or sharded_training():  # every rank calls the layers a rank with numbers calls (`forward`)
            q, choice, raw_width = self._scores(queries)
        else:
            raw_width = self.width(queries).double().squeeze(-1)
        linear = torch.ones_like(raw_width)
        summary = nn.functional.pad(linear[..., None], (0, len(CANDIDATES)))
        width, by_choice = self._width(raw_width, summary)
        read = ContextRead(linear, torch.zeros_like(raw_width), width, choice=summary)
        return self._in_graph(read, q, choice, raw_width, by_choice, graph) if graph else read

    def read(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        entries: torch.Tensor,
        visible: torch.Tensor,
        value_transform: str,
        graph: bool | None = None,
    ) -> ContextRead:
        """The read of queries `[B, T, H]` over keys `[B, L, 3r]` and entries `[B, L, 4]`, `visible` `[B, T, L]`;
        with `in_graph`'s zero terms where `graph` (None: in training, with gradients on)."""
        graph = self.training and torch.is_grad_enabled() if graph is None else graph
        r = self.rank
        q, choice, raw_width = self._scores(queries)
        copy_q, log_q, raw_q = q.split(r, dim=-1)
        copy_k, log_k, raw_k = keys.split(r, dim=-1)
        y, v = entries[..., 0], entries[..., 1]
        mask = visible.double()
        # α·(q @ kᵀ) in one product (`mask` is only its shape: with β = 0 the input is not read).
        copy_scores = torch.baddbmm(mask, copy_q, copy_k.transpose(1, 2), beta=0.0, alpha=r ** -0.5)
        copy_scores = torch.where(visible, copy_scores, float("-inf"))
        # Σ_j v_j and the count n_t in one product, from the entries' v and `<NUM>` columns (1 at a number). Values
        # near float64's limit (a generated number clamped there) would sum to inf, and inf times a weight of exactly
        # 0 (the mean of a checkpoint without it) is NaN. Scaled by 2^-k with 2^k ≥ L first, no sum of L values
        # overflows; a power of 2 commutes with every rounding above the subnormals, so the ratio is Σv/n.
        scale = 2.0 ** -math.ceil(math.log2(max(mask.shape[-1], 1)))
        sums = (mask * scale) @ entries[..., 1:3]
        # The combinations and the mean exist only where there is an earlier number: without one the read is the
        # linear law's.
        choice = torch.cat((choice[..., :1], torch.where(sums[..., 1:] > 0, choice[..., 1:], float("-inf"))), -1)
        weights = torch.cat((choice, copy_scores), -1).softmax(-1)
        linear, log_weight, raw_weight, mean_weight = weights[..., :4].unbind(-1)
        copies = weights[..., 4:]
        limit = torch.finfo(torch.float64).max
        mean = (sums[..., 0] / sums[..., 1].clamp(min=scale)).clamp(-limit, limit)
        # L(v) is y where both are symlog (the default), which the entries hold already.
        log_v = y if self.log_values == "symlog" == value_transform else log_of_values(v, self.log_values)
        log_combination = ((log_q @ log_k.transpose(1, 2)) * mask) @ log_v[..., None]
        raw_combination = ((raw_q @ raw_k.transpose(1, 2)) * mask) @ v[..., None]
        # The raw combination and the mean into the head's space together: one transform rather than two.
        raw, mean = transform_values(torch.cat((raw_combination, mean[..., None]), -1), value_transform).unbind(-1)
        offset = (copies @ y[..., None]).squeeze(-1)  # a copy that is not visible has weight exactly 0
        offset = torch.addcmul(offset, log_weight,
                               _log_candidate(log_combination.squeeze(-1), value_transform, self.log_values))
        offset = torch.addcmul(offset, raw_weight, raw)
        offset = torch.addcmul(offset, mean_weight, mean)
        summary = torch.stack((linear, copies.sum(-1), log_weight, raw_weight, mean_weight), -1)
        width, by_choice = self._width(raw_width, summary)
        read = ContextRead(linear, offset, width, choice=summary)
        return self._in_graph(read, q, choice, raw_width, by_choice, graph)


def start_tensors(
    path: CausalQwenContextValues, generator: torch.Generator | None = None, linear_only: bool = False
) -> dict[str, torch.Tensor]:
    """The start of a new `path`, by parameter name: small copy scores, combinations of weight 0 whose gradient
    is not (a gain at 0 on both factors would be a saddle, so their queries start constant and their keys at
    0), the linear read-out's score above the combinations', and ρ = 1. Random draws from `generator`.

    With `linear_only` (a model's path before its start from data), the copy queries are 0 and the linear
    read-out's score is 40 above every other and the mean's weight is 0, so that the value is the linear law's
    to within e^-40 until `fit_value_head` fits the path."""
    r, hidden = path.rank, path.query.in_features
    tensors = {}
    for name in ("query", "key"):
        weight = torch.randn((3 * r, hidden), generator=generator, device="cpu") * hidden ** -0.5
        weight[r:] = 0.0
        if linear_only and name == "query":
            weight.zero_()
        tensors[f"{name}.weight"] = weight
    # 0: the key is the number's own until a start from data fits it (and a checkpoint without it is read as 0).
    tensors["key_before.weight"] = torch.zeros(path.key_before.weight.shape)
    tensors["query.bias"] = torch.cat((torch.zeros(r), torch.full((2 * r,), r ** -0.5)))
    tensors["key.bias"] = torch.zeros(3 * r)
    tensors["choice.weight"] = torch.zeros(path.choice.weight.shape)
    tensors["choice.bias"] = torch.tensor(_START_SCORES[:-1])
    tensors["mean_score.weight"] = torch.zeros(path.mean_score.weight.shape)
    tensors["mean_score.bias"] = torch.tensor(_START_SCORES[-1:])
    if linear_only:
        tensors["choice.bias"][0] = LINEAR_ONLY_SCORE
        tensors["mean_score.bias"][0] = _MEAN_ABSENT_SCORE
    tensors["guard.weight"] = torch.zeros(path.guard.weight.shape)
    tensors["guard.bias"] = torch.zeros(1)
    tensors["width.weight"] = torch.zeros(path.width.weight.shape)
    tensors["width.bias"] = torch.zeros(1)
    tensors["width_by_choice"] = torch.zeros(len(CANDIDATES))
    tensors["mean_width"] = torch.zeros(1)
    return tensors


def count_numbers(is_num: torch.Tensor, cache: Cache | None) -> int | None:
    """The most `<NUM>` positions of any row of the context that a forward of new positions `is_num` `[B, S]`
    reads, the cache's entries and the new positions, as `CausalQwenContextValues.forward` would count them after
    the cache's update; None where `forward` counts nothing (a static cache, whose forward reads every position) or
    where the cache's rows are not the input's (`forward` then counts, or rejects the batch, as without this count)."""
    owner = getattr(cache, "self_attention_cache", cache)
    index = getattr(owner, "_context_values_layer", None)
    if index is None:  # no cache, or one the path has not written yet: the new positions are the context
        layers = getattr(owner, "layers", None)
        return None if layers and isinstance(layers[0], StaticLayer) else _count_numbers(is_num)
    layer = owner.layers[index]
    if isinstance(layer, StaticLayer):
        return None
    if not layer.is_initialized or layer.values.numel() == 0:
        return _count_numbers(is_num)
    before = layer.values[:, 0, :, 2]
    if before.shape[0] != is_num.shape[0]:
        return None
    return _count_numbers(torch.cat((before, is_num.to(before.dtype)), -1))


@torch.no_grad()
def _read_added_as_before(path: CausalQwenContextValues, incompatible_keys) -> None:
    """After torch's `load_state_dict` of a checkpoint saved before some of the path's tensors existed
    (migrations.py `ADDED`): each one it lacks is written as a path before its start has it, which is the path that
    checkpoint saved, and is not reported missing.

    After the load rather than as a pre-hook that adds the tensors to the state dict: under ZeRO-3, transformers runs
    a module's `_load_from_state_dict` on one rank only and gathers the parameters of the keys each rank holds, so a
    key added on one rank makes that rank's gather differ from the others' and the collective fails.
    `from_pretrained` fills them by `_init_weights` instead."""
    prefix = getattr(path, "_loading_prefix", "")
    start = None
    for owner, name in ADDED:
        key = prefix + name
        if owner == "context_values" and key in incompatible_keys.missing_keys:
            start = start_tensors(path, torch.Generator(), linear_only=True) if start is None else start
            path.get_parameter(name).copy_(start[name])
            incompatible_keys.missing_keys.remove(key)


def visible_entries(entries: torch.Tensor, key_positions: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """Which entries `[B, L, 4]` (at positions `[B, L]`) each query (at positions `[B, T]`) reads, `[B, T, L]`: the
    `<NUM>`s at or before it. The forward and the vLLM plugin read the path through this mask."""
    return (entries[..., 2] > 0)[:, None, :] & (key_positions[:, None, :] <= query_positions[:, :, None])


def entry_values(
    is_num: torch.Tensor, values: torch.Tensor, value_transform: str, starts: torch.Tensor | None = None
) -> torch.Tensor:
    """The entries `[..., 4]` of positions `[...]`, float64: y = T(v), v, whether it is a `<NUM>`, and 1 unless
    `starts` marks it as a text's first."""
    values = torch.where(is_num, values.double(), 0.0)
    follows = torch.ones_like(values) if starts is None else (~starts).double()
    return torch.stack((transform_values(values, value_transform), values, is_num.double(), follows), dim=-1)


def keys_of(maps: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    """The keys `[B, L, 3r]` of positions whose maps `[B, L, 6r]` and entries `[B, L, 4]`
    ([`CausalQwenContextValues.entries`]) run in order from the sequence's start: k_t = (K·z_t + b_K) + K'·z_{t−1},
    without the second term at a text's first position."""
    own, before = maps.chunk(2, dim=-1)
    return own + entries[..., 3:] * nn.functional.pad(before[:, :-1], (0, 0, 1, 0))


def log_of_values(values: torch.Tensor, log_values: str) -> torch.Tensor:
    """L(v), what the log-space combination sums: ln|v| (0 for v = 0, which has no logarithm) or symlog(v)."""
    if log_values == "symlog":
        return symlog(values)
    magnitude = values.abs()
    return torch.where(magnitude > 0, magnitude.clamp(min=torch.finfo(values.dtype).tiny).log(), 0.0)


def _log_candidate(log_combination: torch.Tensor, transform: str, log_values: str) -> torch.Tensor:
    """T(L⁻¹(ℓ)), the value of a log-space combination in the head's space."""
    if log_values == "symlog":
        if transform == "symlog":
            return log_combination
        return symexp(log_combination.clamp(-_MAX_LOG, _MAX_LOG))
    if transform == "symlog":
        return torch.logaddexp(log_combination, torch.zeros_like(log_combination))  # ln(1 + e^ℓ) = symlog(e^ℓ)
    return log_combination.clamp(-_MAX_LOG, _MAX_LOG).exp()


def _count_numbers(is_num: torch.Tensor) -> int:
    """The most `<NUM>` positions of any row of `is_num` `[B, L]`, bool or 1/0 (the entries' column), a
    synchronisation on a GPU."""
    return int(is_num.sum(-1).max()) if is_num.numel() else 0


def _numbers_only(
    keys: torch.Tensor, entries: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The entries of the `<NUM>` positions only (`count`, the most of any row), with their positions `[B, K]`.

    Without a cache every position is new, and only the K ≪ S numbers can be read: scoring them alone costs
    O(S·K·r) instead of O(S²·r).
    """
    # The entries' `<NUM>` column is 1 or 0: sorted as it is, the numbers come first in their order.
    order = torch.sort(entries[..., 2], dim=-1, descending=True, stable=True).indices[:, :count]
    keys = torch.gather(keys, 1, order[..., None].expand(-1, -1, keys.shape[-1]))
    entries = torch.gather(entries, 1, order[..., None].expand(-1, -1, entries.shape[-1]))
    return keys, entries, order


def context_layer(cache: Cache) -> DynamicLayer | StaticLayer:
    """The cache layer that holds the path's entries: one after the backbone's, added on first use."""
    owner = getattr(cache, "self_attention_cache", cache)  # an encoder-decoder cache holds the decoder's
    if not hasattr(owner, "_context_values_layer"):
        reference = owner.layers[0] if owner.layers else None
        if isinstance(reference, StaticLayer):
            layer = StaticLayer(max_cache_len=reference.max_cache_len)
        else:
            layer = DynamicLayer()
        owner.layers.append(layer)
        owner._context_values_layer = len(owner.layers) - 1
    return owner.layers[owner._context_values_layer]
