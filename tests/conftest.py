"""Shared fixtures: tiny Qwen2 models built in-process, and the folder of the real Qwen2.5-0.5B.

The real Qwen2.5-0.5B (weights and tokenizer) comes from the fixture `qwen25_dir`, and every test that asks for it,
directly or through another fixture, must be marked `slow`: collection stops otherwise, so that
`python -m pytest -m "not slow"` runs on a clone of the repository alone. When the folder (CAUSAL_QWEN_QWEN25_DIR,
or ~/.cache/causal_qwen/qwen2.5-0.5b) holds no checkpoint, those tests skip with a message that says how to get
it; with CAUSAL_QWEN_REQUIRE_REAL=1 (set by CI) they fail instead, so that they cannot pass unrun.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
QWEN25_DIR = Path(os.environ.get("CAUSAL_QWEN_QWEN25_DIR", Path.home() / ".cache" / "causal_qwen" / "qwen2.5-0.5b"))
QWEN25_FIXTURE = "qwen25_dir"
REQUIRE_REAL = os.environ.get("CAUSAL_QWEN_REQUIRE_REAL", "") not in ("", "0")


# Markers of transformers' test tree, which tests/test_transformers_generic.py runs (registered to keep them quiet).
TRANSFORMERS_TREE_MARKERS = (
    "accelerate_tests", "executorch_export_test", "flash_attn_3_test", "flash_attn_4_test", "flash_attn_test",
    "generate", "is_fsdp_test", "is_pipeline_test", "is_tensor_parallel_test", "is_training_test", "onnx_export_test",
    "timeout", "torch_compile_test", "torch_export_test",
)


def pytest_configure(config) -> None:
    for marker in TRANSFORMERS_TREE_MARKERS:
        config.addinivalue_line("markers", f"{marker}: a marker of transformers' test tree")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Stop collection when a test reads the real checkpoint without the `slow` marker (before `-m` deselects)."""
    unmarked = [item.nodeid for item in items
                if QWEN25_FIXTURE in getattr(item, "fixturenames", ()) and item.get_closest_marker("slow") is None]
    if unmarked:
        raise pytest.UsageError(
            f"these tests use the real Qwen2.5-0.5B (fixture {QWEN25_FIXTURE}) and must be marked slow:\n  "
            + "\n  ".join(unmarked)
        )


def _qwen25_is_built(folder: Path) -> bool:
    """Built by the tool (its completion record), or a Hugging Face folder with config, weights and tokenizer."""
    if (folder / ".get-qwen25-0.5b.done").exists():
        return True
    return all((folder / name).exists() for name in ("config.json", "model.safetensors", "tokenizer.json"))


@pytest.fixture(scope="session")
def qwen25_dir() -> Path:
    """Folder of the real Qwen2.5-0.5B (weights + tokenizer): CAUSAL_QWEN_QWEN25_DIR, or the default cache folder."""
    if _qwen25_is_built(QWEN25_DIR):
        return QWEN25_DIR
    message = (
        f"the real Qwen2.5-0.5B is not at {QWEN25_DIR}: point CAUSAL_QWEN_QWEN25_DIR at a Qwen2.5-0.5B folder "
        "(config.json, model.safetensors, tokenizer files), for example one written by "
        "`Qwen2ForCausalLM.from_pretrained(...).save_pretrained(DIR)` and its tokenizer's `save_pretrained(DIR)`"
    )
    if REQUIRE_REAL:
        pytest.fail(f"CAUSAL_QWEN_REQUIRE_REAL is set and {message}")
    pytest.skip(message)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def tiny_qwen2_config(vocab_size: int = 128, **overrides):
    """A Qwen2 small enough for unit tests, with every architectural feature of the real one."""
    from transformers import Qwen2Config

    fields = dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
    )
    fields.update(overrides)
    return Qwen2Config(**fields)


@pytest.fixture
def tiny_qwen():
    """A randomly initialised tiny Qwen2ForCausalLM in eval mode (vocab 128; ids ≥ 120 are spare rows)."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2_config()).eval()
