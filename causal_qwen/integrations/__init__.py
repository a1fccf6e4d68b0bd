"""Integrations of CausalQwen with other libraries; each module imports its library and is imported only on demand.

- `causal_qwen.integrations.lm_eval`: the lm-evaluation-harness model `causal-qwen` (extra `lm-eval`).
"""
