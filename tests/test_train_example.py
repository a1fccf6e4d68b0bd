"""examples/train.py runs end to end on a tiny random Qwen2 (with the real tokenizer) and writes its outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

pytestmark = pytest.mark.slow


def test_train_example_tiny(tmp_path, qwen25_dir):
    env = {**os.environ, "CAUSAL_QWEN_QWEN25_DIR": str(qwen25_dir)}
    command = [sys.executable, str(REPO_ROOT / "examples" / "train.py"), "--tiny", "--max-steps", "2",
               "--batch-size", "4", "--num-train", "16", "--num-eval", "8", "--output", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    for name in ("loss.png", "plots_test/predictions.png", "plots_test/u_scale.png",
                 "plots_extrapolation/predictions.png", "plots_extrapolation/u_scale.png",
                 "model/config.json", "model/model.safetensors", "model/tokenizer_config.json"):
        assert (tmp_path / name).is_file(), name
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert {"test", "extrapolation"} <= set(metrics)
    assert "eval/accuracy" in metrics["test"] and "eval/reg_mdae" in metrics["test"]
