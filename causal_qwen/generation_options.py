"""Which generation options go together (docs/design.md §5), checked without importing torch.

`CausalQwenForCausalLM.generate` and the `causal-qwen generate` command both apply this rule: the command checks
its options while parsing them, before a model is loaded.
"""

from __future__ import annotations

GENERATION_MODES = ("standard", "causal", "traditional")

__all__ = ["GENERATION_MODES", "GenerationOptionError", "check_generation_options"]


class GenerationOptionError(ValueError):
    """A generation option that its mode does not allow; `argument` names it (`"shared_noise"`, ...)."""

    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument = argument


def check_generation_options(mode: str, shared_individual: bool, shared_noise: bool, do_sample: bool | None) -> None:
    """Reject combinations docs/design.md §5 leaves undefined, naming the argument."""
    if mode not in GENERATION_MODES:
        raise GenerationOptionError("mode", f"mode must be one of {GENERATION_MODES}, got {mode!r}")
    if shared_individual and mode != "causal":
        raise GenerationOptionError(
            "shared_individual",
            f"shared_individual=True needs mode='causal' (it fixes the sampled individual), got {mode!r}",
        )
    if shared_noise and mode != "standard":
        raise GenerationOptionError(
            "shared_noise",
            f"shared_noise=True needs mode='standard' (with 'causal' the decision would keep no uncertainty), "
            f"got {mode!r}",
        )
    if do_sample and mode != "traditional":
        raise GenerationOptionError(
            "do_sample", f"do_sample=True samples from the softmax and needs mode='traditional', got {mode!r}"
        )
