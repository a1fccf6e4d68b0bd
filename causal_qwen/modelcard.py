"""The model card written beside every saved CausalQwen checkpoint."""

from __future__ import annotations

from pathlib import Path

CAUSAL_FIELDS = (
    "num_token_id", "use_numeric", "freeze_backbone", "abduction_scale_init", "noise_init", "ovr_threshold",
    "learnable_threshold", "gate_alpha", "reg_loss_weight", "detach_gate", "scale_min", "value_transform",
    "regression_noise", "conversion_seed", "context_values", "context_values_rank", "context_values_log",
)


def model_card(config, name: str = "causal-qwen") -> str:
    """Markdown with Hub metadata: what the model is, its causal configuration, how to load it."""
    rows = "\n".join(f"| `{field}` | `{getattr(config, field, None)}` |" for field in CAUSAL_FIELDS)
    return f"""---
library_name: transformers
license: apache-2.0
pipeline_tag: text-generation
tags:
- causal_qwen
- qwen2
- cauchy
- numbers
---

# {name}

A **CausalQwen** model: a Qwen2 backbone ({config.num_hidden_layers} layers, hidden size {config.hidden_size},
vocabulary {config.vocab_size}) extended to read numbers as values (each number is one `<NUM>` token whose
value enters the embedding), to decide each next token with independent One-vs-Rest Cauchy decisions, and to
predict numbers with a Cauchy regression head (a median and an interval).

## Causal configuration

| field | value |
|---|---|
{rows}

## How to load

With the `causal_qwen` package installed:

```python
from causal_qwen import CausalQwenForCausalLM, CausalQwenTokenizer
model = CausalQwenForCausalLM.from_pretrained("{name}")
tokenizer = CausalQwenTokenizer.from_pretrained("{name}")
```

Without it, the modeling code saved beside the weights loads with remote code:

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)
```

Generation modes: `model.generate(..., mode="standard" | "causal" | "traditional")`; numbers come back in
`numeric_values` with `return_dict_in_generate=True`.
"""


def write_model_card(save_directory: str | Path, config, overwrite: bool = False) -> None:
    """Write README.md unless one is there already (a card the user wrote is never replaced)."""
    path = Path(save_directory) / "README.md"
    if path.exists() and not overwrite:
        return
    path.write_text(model_card(config, name=Path(save_directory).name or "causal-qwen"), encoding="utf-8")
