"""The generation modes (docs/design.md §5): one decision rule per mode, in one registry.

A rule says how a step decides from the individual's representation U ~ Cauchy(loc_U, scale_U): which random draw
it makes (none, one per step, or one per sequence with its `shared_option`), which Cauchy input the heads read, and
which scores the loop ranks (loc_S itself, or the rule's own). What the rest of generation may do follows from that:
only scores that are logits of a softmax can be sampled and summed by beam search, and a rule that draws anew at
every step cannot verify several positions in one forward (assisted decoding).

`generation_options` (the checks of `generate` and of the `causal-qwen generate` command), `generation` (the loop)
and the command's `--mode` choices read this registry. It imports no torch: the command checks its options before
it loads a model. The heads themselves are the model's (`CausalQwenAction`); a rule only chooses how to call them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DECISION_RULES", "DEFAULT_MODE", "SAMPLING_MODE", "DecisionRule"]


class DecisionRule:
    """The rule of one generation mode; the registry holds one instance per mode.

    Attributes:
        name: the mode's name (`generate(mode=...)`, `causal-qwen generate --mode`).
        summary: one line for the command's help.
        softmax: its scores are loc_S, the logits of a softmax: sampling (`do_sample`), beam search and an
            assistant's speculative sampling apply. Otherwise its scores are its own (`scores`).
        shared_option: the `generate` option that makes its draw one per sequence (None: it has none).
        shared_summary: what that option does, for the command's help.
        shared_reason: why that option belongs to this mode, for the error that names it in another mode.
        assistant_mode: the mode an assistant CausalQwen proposes candidates in (the rule without its draws).
    """

    name: str = ""
    summary: str = ""
    softmax: bool = False
    shared_option: str | None = None
    shared_summary: str = ""
    shared_reason: str = ""
    assistant_mode: str = "standard"

    def draws(self, shared: bool) -> str | None:
        """How often the rule draws ε ~ U(0, 1)^C: `"step"`, `"sequence"` (shared), or None (no draw)."""
        return None

    def draws_each_step(self, shared: bool) -> bool:
        """Whether a decision belongs to one step (so one forward decides only its last position)."""
        return self.draws(shared) == "step"

    def head_inputs(self, action, loc_u: Any, scale_u: Any, eps: Any) -> tuple[Any, Any]:
        """The Cauchy input `(loc, scale)` of the heads, given the step's draw `eps` (None when it draws none)."""
        return action.head_inputs(loc_u, scale_u)

    def scores(self, action, loc_s: Any, scale_s: Any) -> Any:
        """The scores the loop ranks, `[..., V]`, when they are not loc_S itself (None: they are loc_S)."""
        return None

    def __repr__(self) -> str:
        return f"DecisionRule({self.name!r})"


class StandardRule(DecisionRule):
    """Argmax of the OvR probabilities P_k = 1/2 + atan(z_k)/π, ranked by the standardised margins z_k.

    z_k = (loc_S,k − C_k)/scale_S,k is increasing in P_k, so the argmax is the same, without the transcendental
    function and without P's loss of resolution near 1. With `shared_noise` one noise draw per sequence shifts U.
    """

    name = "standard"
    summary = "argmax of the One-vs-Rest probabilities (the default without sampling)"
    shared_option = "shared_noise"
    shared_summary = "one noise draw per text"
    shared_reason = "with 'causal' the decision would keep no uncertainty"

    def draws(self, shared: bool) -> str | None:
        return "sequence" if shared else None

    def head_inputs(self, action, loc_u, scale_u, eps):
        return action.head_inputs(loc_u, scale_u, noise=eps) if eps is not None else action.head_inputs(loc_u, scale_u)

    def scores(self, action, loc_s, scale_s):
        return action.margin(loc_s, scale_s)


class CausalRule(StandardRule):
    """Standard mode's argmax for a sampled individual u = loc_U + scale_U·tan(π(ε − ½)), under the noise alone.

    A fresh ε every step, or one per sequence with `shared_individual`.
    """

    name = "causal"
    summary = "sample an individual, then decide under the noise alone"
    shared_option = "shared_individual"
    shared_summary = "one individual per text"
    shared_reason = "it fixes the sampled individual"

    def draws(self, shared: bool) -> str | None:
        return "sequence" if shared else "step"

    def head_inputs(self, action, loc_u, scale_u, eps):
        return action.head_inputs(loc_u, scale_u, individual=eps)


class TraditionalRule(DecisionRule):
    """The softmax over loc_S, exactly as Qwen2: greedy, sampling, beam search."""

    name = "traditional"
    summary = "softmax over loc_S as in Qwen2 (the default with sampling or beam search)"
    softmax = True
    assistant_mode = "traditional"


DECISION_RULES: dict[str, DecisionRule] = {rule.name: rule for rule in (StandardRule(), CausalRule(),
                                                                        TraditionalRule())}
"""The modes by name, in the order the documentation and the command list them."""

DEFAULT_MODE = "standard"
"""The mode of a call that names none and neither samples nor runs beam search."""

SAMPLING_MODE = next(name for name, rule in DECISION_RULES.items() if rule.softmax)
"""The mode that sampling or beam search implies when no mode is named: the one whose scores are a softmax's."""
