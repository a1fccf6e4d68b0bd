"""Integrations of CausalQwen with other libraries; each module imports its library and is imported only on demand.

- `causal_qwen.integrations.lm_eval`: the lm-evaluation-harness model `causal-qwen` (extra `lm-eval`).
- `causal_qwen.integrations.trl`: `CausalQwenSFTTrainer`, TRL's `SFTTrainer` training CausalQwen's own loss with its
  numbers (extra `trl`).
- `causal_qwen.integrations.vllm`: the vLLM plugin that serves `CausalQwenForCausalLM` (extra `vllm`, in an environment
  of its own; docs/serving.md).
"""
