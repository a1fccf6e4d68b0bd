"""The defaults in code are the ones docs/experiments.md records with the evidence for them."""

import ast
import inspect
import re
from pathlib import Path

from causal_qwen import CausalQwenConfig, CausalQwenForCausalLM
from causal_qwen.training import LEARNING_RATE_SCALES, CausalQwenTrainer

DOC = Path(__file__).resolve().parents[1] / "docs" / "experiments.md"
ROW = re.compile(r"^\| `([\w.\[\]\"]+)`[^|]*\| \*\*(.+?)\*\* \|")


def recorded_defaults() -> dict[str, object]:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("<!-- defaults -->"):]
    section = section[:section.index("<!-- /defaults -->")]
    return {m.group(1): ast.literal_eval(m.group(2)) for line in section.splitlines() if (m := ROW.match(line))}


def code_defaults() -> dict[str, object]:
    config = CausalQwenConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, num_token_id=15)
    fields = ("ovr_threshold", "abduction_scale_init", "noise_init", "learnable_threshold", "value_transform",
              "regression_noise", "gate_alpha")
    values = {name: getattr(config, name) for name in fields}
    values["num_row_init"] = "digits"  # what from_qwen does when the tokenizer has the digits (its default)
    assert inspect.signature(CausalQwenForCausalLM.from_qwen).parameters["num_row_init"].default is None
    trainer = inspect.signature(CausalQwenTrainer.__init__).parameters
    for name in ("value_head_start", "refit_value_readout", "train_value_features"):
        values[name] = trainer[name].default
    values.update({f'LEARNING_RATE_SCALES["{k}"]': v for k, v in LEARNING_RATE_SCALES.items()})
    return values


def test_code_defaults_equal_the_recorded_ones():
    recorded, code = recorded_defaults(), code_defaults()
    assert recorded.keys() == code.keys()
    for name, value in recorded.items():
        assert code[name] == value, name
