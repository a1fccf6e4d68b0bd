"""causal_qwen: Qwen2 language models that read numbers as values and decide with One-vs-Rest Cauchy heads.

`import causal_qwen` imports the classes and registers them with transformers' `Auto*` factories and the
`"text-generation"` pipeline, so that `AutoModelForCausalLM.from_pretrained` of a saved folder works right after it.
That needs torch and transformers. The `causal-qwen` command is the one exception: it starts without them, so that
`causal-qwen --help` answers at once, and each subcommand imports the classes (and registers them) when it needs
them, through the same names, which this module resolves on first access.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "CausalQwenConfig": ".configuration",
    "CausalQwenForCausalLM": ".modeling",
    "CausalQwenModel": ".modeling",
    "CausalQwenOutput": ".outputs",
    "CausalQwenPreTrainedModel": ".modeling",
    "CausalQwenTextGenerationPipeline": ".pipeline",
    "CausalQwenTokenizer": ".tokenization",
    "CausalQwenTrainer": ".training",
}
__all__ = [
    "CausalQwenConfig",
    "CausalQwenForCausalLM",
    "CausalQwenModel",
    "CausalQwenOutput",
    "CausalQwenPreTrainedModel",
    "CausalQwenTextGenerationPipeline",
    "CausalQwenTokenizer",
    "CausalQwenTrainer",
]

if TYPE_CHECKING:
    from .configuration import CausalQwenConfig
    from .modeling import CausalQwenForCausalLM, CausalQwenModel, CausalQwenPreTrainedModel
    from .outputs import CausalQwenOutput
    from .pipeline import CausalQwenTextGenerationPipeline
    from .tokenization import CausalQwenTokenizer
    from .training import CausalQwenTrainer

_registered = False


def register() -> None:
    """Import the public classes and register them with transformers (once; later calls do nothing)."""
    global _registered
    if _registered:
        return
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    namespace = globals()
    for name, module in _EXPORTS.items():
        namespace[name] = getattr(importlib.import_module(module, __name__), name)
    config, model, tokenizer = namespace["CausalQwenConfig"], namespace["CausalQwenForCausalLM"], namespace[
        "CausalQwenTokenizer"]
    AutoConfig.register(config.model_type, config, exist_ok=True)
    AutoModelForCausalLM.register(config, model, exist_ok=True)
    # `AutoModel` gives the bare Qwen2 backbone, as it does for a Qwen2 config.
    backbone = namespace["CausalQwenModel"]
    AutoModel.register(config, backbone, exist_ok=True)
    AutoTokenizer.register(config, tokenizer_class=tokenizer, exist_ok=True)
    importlib.import_module(".pipeline", __name__).register_pipeline()
    # Saved checkpoints carry the modeling code and an `auto_map`, so that `trust_remote_code=True` loads them
    # where this package is not installed.
    config.register_for_auto_class()
    model.register_for_auto_class("AutoModelForCausalLM")
    backbone.register_for_auto_class("AutoModel")
    tokenizer.register_for_auto_class("AutoTokenizer")
    _registered = True


def __getattr__(name: str):
    if name in _EXPORTS:
        register()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


def _started_as_the_command() -> bool:
    """Whether this process runs the `causal-qwen` command: its console script, or `python -m causal_qwen.cli`."""
    program = sys.argv[0] if sys.argv else ""
    if Path(program).stem.removesuffix("-script") == "causal-qwen":
        return True
    # While `-m` locates its module (importing this package first), argv[0] is "-m"; orig_argv names the module.
    original = list(getattr(sys, "orig_argv", []))
    run_as_module = any(
        flag == "-m" and module == "causal_qwen.cli" for flag, module in zip(original, original[1:], strict=False)
    ) or "-mcausal_qwen.cli" in original
    return program == "-m" and run_as_module


if not _started_as_the_command():
    register()
