"""causal_qwen: Qwen2 language models that read numbers as values and decide with One-vs-Rest Cauchy heads."""

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .configuration import CausalQwenConfig
from .modeling import CausalQwenForCausalLM, CausalQwenOutput, CausalQwenPreTrainedModel
from .pipeline import CausalQwenTextGenerationPipeline, register_pipeline
from .tokenization import CausalQwenTokenizer
from .training import CausalQwenTrainer

AutoConfig.register(CausalQwenConfig.model_type, CausalQwenConfig, exist_ok=True)
AutoModelForCausalLM.register(CausalQwenConfig, CausalQwenForCausalLM, exist_ok=True)
AutoTokenizer.register(CausalQwenConfig, tokenizer_class=CausalQwenTokenizer, exist_ok=True)
register_pipeline()
# Saved checkpoints carry the modeling code and an `auto_map`, so that `trust_remote_code=True` loads them
# where this package is not installed.
CausalQwenConfig.register_for_auto_class()
CausalQwenForCausalLM.register_for_auto_class("AutoModelForCausalLM")
CausalQwenTokenizer.register_for_auto_class("AutoTokenizer")

__all__ = [
    "CausalQwenConfig",
    "CausalQwenForCausalLM",
    "CausalQwenOutput",
    "CausalQwenPreTrainedModel",
    "CausalQwenTextGenerationPipeline",
    "CausalQwenTokenizer",
    "CausalQwenTrainer",
]
__version__ = "0.1.0"
