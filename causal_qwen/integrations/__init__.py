"""Integrations of CausalQwen with other libraries; each module imports its library and is imported only on demand.

- `causal_qwen.integrations.lm_eval`: the lm-evaluation-harness model `causal-qwen` (extra `lm-eval`).
- `causal_qwen.integrations.trl`: `CausalQwenSFTTrainer`, TRL's `SFTTrainer` training CausalQwen's own loss with its
  numbers (extra `trl`).
"""
