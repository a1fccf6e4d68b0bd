"""`convert`, `train`, `eval` and `generate`, each run as a user runs it (a process of its own), print no third-party
warning: not DeepSpeed's "Setting accelerator to CPU" (accelerate imports DeepSpeed, where it is installed, when
`save_pretrained` or `Trainer` unwraps the model), nor a warning of transformers, torch or matplotlib. The runs read
the real tokenizer (slow); the rule that names DeepSpeed's accelerator is tested alone."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT, tiny_qwen2_config
from transformers import Qwen2ForCausalLM

from causal_qwen import cli

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
# Python's warnings ("UserWarning: ..."), logged ones ("[WARNING]"), deprecations, transformers' "You are using ...".
THIRD_PARTY_WARNING = re.compile(r"warn|deprecat|you are using", re.IGNORECASE)
TEXTS = ["A car of 2300 pounds with 78 horsepower does 31 miles per gallon.",
         "The flight left at 14 hours and flew 1040 miles in 150 minutes.",
         "It was 12.5 degrees at noon and 3 degrees at midnight.",
         "The order of 4 boxes of 24 cans cost 35.99 dollars."]


def run_command(*argv: str) -> str:
    """Run `causal-qwen ARGV` in a new process, as a user would (no `DS_ACCELERATOR`, no warning filters); return
    its output, stdout and stderr together, after checking that it succeeded."""
    env = {key: value for key, value in os.environ.items() if key not in ("DS_ACCELERATOR", "PYTHONWARNINGS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"  # a tiny model: one thread is fastest
    done = subprocess.run([sys.executable, "-m", "causal_qwen.cli", *argv], capture_output=True, text=True, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def warning_lines(output: str) -> list[str]:
    return [line for line in output.replace("\r", "\n").splitlines() if THIRD_PARTY_WARNING.search(line)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory, qwen25_dir):
    """A tiny random Qwen2 with the real tokenizer, converted by the command; the folder and the command's output."""
    folder = tmp_path_factory.mktemp("commands")
    torch.manual_seed(0)
    Qwen2ForCausalLM(tiny_qwen2_config(vocab_size=151936)).save_pretrained(folder / "qwen")
    for name in TOKENIZER_FILES:
        shutil.copy(qwen25_dir / name, folder / "qwen" / name)
    (folder / "texts.jsonl").write_text("\n".join(json.dumps({"text": text}) for text in TEXTS), encoding="utf-8")
    output = run_command("convert", str(folder / "qwen"), str(folder / "cq"))
    return folder, output


@pytest.mark.slow
def test_convert_prints_no_third_party_warning(converted):
    _, output = converted
    assert "saved CausalQwen" in output
    assert warning_lines(output) == []


@pytest.mark.slow
def test_train_prints_no_third_party_warning(converted):
    folder, _ = converted
    output = run_command("train", str(folder / "cq"), str(folder / "trained"), "--data", str(folder / "texts.jsonl"),
                         "--max-steps", "1", "--batch-size", "2", "--max-length", "32")
    assert (folder / "trained" / "loss.png").is_file()
    assert "value start: reading value rows" in output  # the start's progress, under the weights' quiet
    assert warning_lines(output) == []


@pytest.mark.slow
def test_eval_with_plots_prints_no_third_party_warning(converted):
    folder, _ = converted
    output = run_command("eval", str(folder / "cq"), "--data", str(folder / "texts.jsonl"), "--plots",
                         str(folder / "plots"))
    assert (folder / "plots" / "predictions.png").is_file()
    assert warning_lines(output) == []


@pytest.mark.slow
def test_generate_prints_no_third_party_warning(converted):
    folder, _ = converted
    output = run_command("generate", str(folder / "cq"), "A kilo of apples costs 3.5 dollars, so 4 kilos cost",
                         "--max-new-tokens", "4", "--intervals")
    assert output.startswith("A kilo of apples costs 3.5 dollars, so 4 kilos cost")
    assert warning_lines(output) == []


@pytest.mark.parametrize(("deepspeed", "accelerator", "set_before", "inside"), [
    (True, False, None, "cpu"),      # DeepSpeed would guess, and warn: it is told
    (True, False, "cuda", "cuda"),   # the user's choice stays
    (True, True, None, None),        # DeepSpeed finds the accelerator itself, silently
    (False, False, None, None),      # nothing to tell
])
def test_deepspeed_is_told_the_cpu_only_where_it_would_guess(monkeypatch, deepspeed, accelerator, set_before, inside):
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "deepspeed":
            return object() if deepspeed else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(cli, "_has_accelerator", lambda: accelerator)
    if set_before is None:
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    else:
        monkeypatch.setenv("DS_ACCELERATOR", set_before)
    with cli.deepspeed_accelerator_named():
        assert os.environ.get("DS_ACCELERATOR") == inside
    assert os.environ.get("DS_ACCELERATOR") == set_before
