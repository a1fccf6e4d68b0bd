"""What run_experiment.py and keep_start.py share: the run profiles, CausalQwen as a user builds it, and the value
measures (the median and intervals of a target, what `generate` writes, relative errors)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from causal_qwen import CausalQwenForCausalLM
from causal_qwen.data import CausalQwenDataCollator, NumericExample, tokenize_examples

QWEN_DIR = Path(os.environ.get("CAUSAL_QWEN_QWEN25_DIR", Path.home() / ".cache" / "causal_qwen" / "qwen2.5-0.5b"))


@dataclass
class Profile:
    """Sizes and the schedule of one run: `steps` optimizer steps of `batch_size` texts for every arm."""

    n_train: int
    n_validation: int
    n_test: int
    n_extrapolation: int
    n_real: int  # rows per real-data table, split 80/10/10
    steps: int
    batch_size: int
    sweep_steps: int
    learning_rate: float = 1e-4  # the documented rate of `causal-qwen train` (the 152k-row heads)
    eval_batch: int = 16
    decode_batch: int = 32
    tiny: bool = False


PROFILES = {
    # Sized from the measured step time (about 20 s per step of 16 texts for (a) on 2 CPU cores) to fit 60 minutes.
    "cpu": Profile(n_train=320, n_validation=48, n_test=96, n_extrapolation=64, n_real=160, steps=40,
                   batch_size=16, sweep_steps=8),
    # Not run here: larger sizes for one GPU.
    "gpu": Profile(n_train=20000, n_validation=1000, n_test=2000, n_extrapolation=2000, n_real=2000, steps=2000,
                   batch_size=32, sweep_steps=300, eval_batch=64, decode_batch=128),
    # A tiny random backbone with the real tokenizer: checks the pipeline end to end.
    "tiny": Profile(n_train=48, n_validation=16, n_test=16, n_extrapolation=16, n_real=20, steps=4, batch_size=8,
                    sweep_steps=2, tiny=True),
}


def with_target(examples: list[NumericExample]) -> list[NumericExample]:
    return [ex for ex in examples if ex.target_value is not None]


def load_qwen(tiny: bool, seed: int) -> Qwen2ForCausalLM:
    """The real Qwen2.5-0.5B, or a tiny random Qwen2 with its vocabulary (for checking the pipeline)."""
    if not tiny:
        return Qwen2ForCausalLM.from_pretrained(QWEN_DIR, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


def new_causal(profile: Profile, tokenizer, seed: int, **config) -> CausalQwenForCausalLM:
    """`from_qwen` with every default (the folder's tokenizer gives <NUM> and the digit rows)."""
    torch.manual_seed(seed)
    if profile.tiny:
        return CausalQwenForCausalLM.from_qwen(load_qwen(True, seed), tokenizer=tokenizer, **config)
    return CausalQwenForCausalLM.from_qwen(QWEN_DIR, **config)


@torch.no_grad()
def causal_targets(model, tokenizer, examples: list[NumericExample], batch_size: int) -> dict:
    """Median and 50% / 90% intervals of the target at the position before its `<NUM>` (teacher forcing)."""
    examples = with_target(examples)
    collator = CausalQwenDataCollator.from_tokenizer(tokenizer)
    median, low50, high50, low90, high90, true, kept, loc_y, scale_y = [], [], [], [], [], [], [], [], []
    for k in range(0, len(examples), batch_size):
        chunk = examples[k:k + batch_size]
        batch = collator(tokenize_examples(tokenizer, [ex.text for ex in chunk]))
        out = model(batch["input_ids"], numeric_values=batch["numeric_values"],
                    attention_mask=batch["attention_mask"])
        for b, ex in enumerate(chunk):
            where = (batch["input_ids"][b] == tokenizer.num_token_id).nonzero().flatten()
            if not len(where) or float(batch["numeric_values"][b, where[-1]]) != ex.target_value:
                continue  # the tokenizer did not read the target as the text's last number
            p = int(where[-1]) - 1
            m, lo, hi = model.value_interval(out.loc_Y[b, p], out.scale_Y[b, p], 0.5)
            _, lo9, hi9 = model.value_interval(out.loc_Y[b, p], out.scale_Y[b, p], 0.9)
            for store, v in ((median, m), (low50, lo), (high50, hi), (low90, lo9), (high90, hi9),
                             (loc_y, out.loc_Y[b, p]), (scale_y, out.scale_Y[b, p])):
                store.append(float(v))
            true.append(ex.target_value)
            kept.append(ex)
    return {"median": median, "low50": low50, "high50": high50, "low90": low90, "high90": high90, "true": true,
            "examples": kept, "loc_y": loc_y, "scale_y": scale_y}


@torch.no_grad()
def causal_generated(model, tokenizer, examples: list[NumericExample], batch_size: int) -> list[float | None]:
    """What `model.generate` (standard mode, greedy) writes after the text before each target: the value of its
    first `<NUM>` when that comes before any word, else None (it did not write a number)."""
    examples = with_target(examples)
    tokenizer.padding_side = "left"
    results: list[float | None] = []
    for k in range(0, len(examples), batch_size):
        prompts = [ex.text[:ex.target_char_span[0]] for ex in examples[k:k + batch_size]]
        batch = tokenizer(prompts, return_tensors="pt", padding=True)
        out = model.generate(**batch, max_new_tokens=3, return_dict_in_generate=True,
                             pad_token_id=tokenizer.pad_token_id)
        start = batch["input_ids"].shape[1]
        for row in range(len(prompts)):
            value = None
            for step, token in enumerate(out.sequences[row, start:].tolist()):
                if token == tokenizer.num_token_id:
                    value = float(out.numeric_values[row, start + step])
                    break
                if tokenizer.decode([token]).strip():
                    break
            results.append(value)
    tokenizer.padding_side = "right"
    return results


def collated(collator, features: list[dict], batch_size: int):
    """The features in order, collated `batch_size` at a time (a generator, read once)."""
    return (collator(features[k:k + batch_size]) for k in range(0, len(features), batch_size))


def interval_metrics(targets: dict) -> dict:
    true = torch.tensor(targets["true"], dtype=torch.float64)

    def inside(low: str, high: str) -> float:
        lo, hi = torch.tensor(targets[low], dtype=torch.float64), torch.tensor(targets[high], dtype=torch.float64)
        return ((true >= lo) & (true <= hi)).double().mean().item()

    return {"reg_coverage_50": inside("low50", "high50"), "reg_coverage_90": inside("low90", "high90"),
            "reg_coverage_targets": len(true)}


def relative_error(predicted: float | None, true: float) -> float:
    """|predicted − true| / |true|; a missing or non-finite prediction counts as 0."""
    predicted = predicted if predicted is not None and math.isfinite(predicted) else 0.0
    return abs(predicted - true) / max(abs(true), 1e-12)
