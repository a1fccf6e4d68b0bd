"""Which generation options go together (docs/design.md §5), checked without importing torch.

`CausalQwenForCausalLM.generate` and the `causal-qwen generate` command both apply these rules: the command checks
its options while parsing them, before a model is loaded.
"""

from __future__ import annotations

GENERATION_MODES = ("standard", "causal", "traditional")

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
        return "traditional" if do_sample else "standard"
    if mode not in GENERATION_MODES:
        raise GenerationOptionError("mode", f"mode must be one of {GENERATION_MODES} or None, got {mode!r}")
    return mode


def check_generation_options(
    mode: str | None, shared_individual: bool, shared_noise: bool, do_sample: bool | None
) -> str:
    """Reject combinations docs/design.md §5 leaves undefined, naming the argument; return the resolved mode.

    `do_sample` is what the caller asked for (`None`: not said). A named `standard` or `causal` mode with
    `do_sample=True` is an error: those modes decide by an argmax and never sample from the softmax.
    """
    resolved = resolve_mode(mode, do_sample)
    if shared_individual and resolved != "causal":
        raise GenerationOptionError(
            "shared_individual",
            f"shared_individual=True needs mode='causal' (it fixes the sampled individual), got {resolved!r}",
        )
    if shared_noise and resolved != "standard":
        raise GenerationOptionError(
            "shared_noise",
            f"shared_noise=True needs mode='standard' (with 'causal' the decision would keep no uncertainty), "
            f"got {resolved!r}",
        )
    if do_sample and resolved != "traditional":
        raise GenerationOptionError(
            "do_sample",
            f"do_sample=True samples from the softmax, which is mode='traditional' (the default when sampling), but "
            f"mode={resolved!r} was named: drop mode, or drop do_sample",
        )
    return resolved
