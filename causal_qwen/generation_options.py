"""Which generation options go together (docs/design.md §5), read from the modes' rules, without importing torch.

`CausalQwenForCausalLM.generate` and the `causal-qwen generate` command both apply these rules: the command checks
its options while parsing them, before a model is loaded.
"""

from __future__ import annotations

from .generation_modes import DECISION_RULES, DEFAULT_MODE, SAMPLING_MODE

GENERATION_MODES = tuple(DECISION_RULES)
"""The names of the modes, as the registry lists them (`generation_modes.DECISION_RULES`)."""

__all__ = ["GENERATION_MODES", "GenerationOptionError", "resolve_mode", "check_generation_options"]


class GenerationOptionError(ValueError):
    """A generation option that its mode does not allow; `argument` names it (`"shared_noise"`, ...)."""

    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument = argument


def resolve_mode(mode: str | None, do_sample: bool | None) -> str:
    """The mode a `generate` call runs in: `mode` when named, else `traditional` when sampling, else `standard`.

    Sampling draws from the softmax over loc_S, which is what `traditional` mode is, so `do_sample=True` alone
    implies it; without sampling the default is `standard` (argmax of the OvR probabilities).
    """
    if mode is None:
        return SAMPLING_MODE if do_sample else DEFAULT_MODE
    if mode not in DECISION_RULES:
        raise GenerationOptionError("mode", f"mode must be one of {tuple(DECISION_RULES)} or None, got {mode!r}")
    return mode


def check_generation_options(
    mode: str | None, shared_individual: bool, shared_noise: bool, do_sample: bool | None
) -> str:
    """Reject combinations docs/design.md §5 leaves undefined, naming the argument; return the resolved mode.

    `do_sample` is what the caller asked for (`None`: not said). A named mode whose scores are not a softmax's
    (`standard`, `causal`) with `do_sample=True` is an error: those modes decide by an argmax and never sample.
    """
    resolved = resolve_mode(mode, do_sample)
    for option, asked in (("shared_individual", shared_individual), ("shared_noise", shared_noise)):
        owner = next(rule for rule in DECISION_RULES.values() if rule.shared_option == option)
        if asked and resolved != owner.name:
            raise GenerationOptionError(
                option, f"{option}=True needs mode={owner.name!r} ({owner.shared_reason}), got {resolved!r}")
    if do_sample and not DECISION_RULES[resolved].softmax:
        raise GenerationOptionError(
            "do_sample",
            f"do_sample=True samples from the softmax, which is mode={SAMPLING_MODE!r} (the default when sampling), "
            f"but mode={resolved!r} was named: drop mode, or drop do_sample",
        )
    return resolved
