"""Does CausalQwen learn numbers better than Qwen?

One frozen Qwen2.5-0.5B backbone, one corpus (`causal_qwen.data.make_splits`), the same examples and the same
number of optimizer steps for every arm:

  (a)  CausalQwen: numbers as values (one `<NUM>` each), One-vs-Rest Cauchy classification, Cauchy regression;
  (a+) as (a), built with `num_row_init="digits"` and `regression_noise` (PLUS_OPTIONS; `--skip-plus` leaves it out);
  (b)  Qwen2 with a trainable untied lm_head (a copy of the tied embedding), cross-entropy on numbers as digits;
  (b2) as (b), plus the Number Token Loss of the `ntloss` package (CE + 0.3 · NTL, the authors' recommendation);
  (c)  the trivial baseline: the training mean / median of each template's target (`template_baselines`).

The cost is dominated by the 152k-class heads, so the frozen backbone's last hidden states are computed once
and cached, and the heads are trained on the cached features:

- (b)/(b2): the backbone's input does not depend on anything trained, so training the lm_head on cached
  features gives exactly the loss and gradients of the full model.
- (a): the numeric embedding (w_num, d_num) feeds the backbone, so caching requires freezing it at its
  initial value (w_num ~ N(0, σ²) from `from_qwen`, d_num = 0). Only the abduction and action networks train.

Targets: (a) predicts the target number by the median loc_Y at the position before the target's `<NUM>`
(with its 50% / 90% Cauchy intervals); (b)/(b2) by greedy decoding of digits after the text that precedes the
target, parsed with `causal_qwen.numbers.find_numbers`.

Run `python experiments/run_experiment.py --profile cpu --output runs/experiment` (see docs/experiments.md for the
numbers it produced); `--profile tiny` runs the whole pipeline in about a minute on a tiny random backbone.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
from transformers.cache_utils import DynamicCache

from causal_qwen import CausalQwenForCausalLM, CausalQwenTokenizer
from causal_qwen.cauchy import symlog
from causal_qwen.chunked_loss import chunked_causal_qwen_loss
from causal_qwen.data import NumericExample, make_splits, template_baselines
from causal_qwen.loss import IGNORE_INDEX
from causal_qwen.metrics import FIELDS, position_statistics, regression_metrics, summarize
from causal_qwen.numbers import find_numbers
from causal_qwen.plots import plot_loss_curves, plot_predictions, plot_u_scale
from causal_qwen.training import parameter_groups

QWEN_DIR = Path(os.environ.get("CAUSAL_QWEN_QWEN25_DIR", Path.home() / ".cache" / "causal_qwen" / "qwen2.5-0.5b"))
NTL_WEIGHT = 0.3  # CE + 0.3·NTL, as the ntloss authors recommend
MAX_NEW_DIGITS = 20  # the longest target (extrapolation, up to 1e14) has 15 digits
# The configuration the code ships with (DESIGN §8); the sweep varies one field at a time around it.
# `warm_start` is not a model field but the recipe's least-squares start of the regression head.
BASE_CONFIG = {"ovr_threshold": 15.0, "abduction_scale_init": 1e-5, "noise_init": 1e-5, "learnable_threshold": False,
               "value_transform": "symlog", "warm_start": True}
SWEEP = {
    "ovr_threshold": [10.0, 20.0],
    "abduction_scale_init": [1e-4],
    "noise_init": [1e-4],
    "learnable_threshold": [True],
    "value_transform": ["identity"],
}
# Arm (a+): the two opt-in options that answer the findings of the (a) runs (docs/experiments.md): the `<NUM>` row
# of the classification head starts as the mean of Qwen's digit rows (`from_qwen(num_row_init=...)`), so that the
# gate P_<NUM> is open where Qwen expects a number, and the value gets its own noise scale (`regression_noise`,
# started at the warm start's median absolute residual), so that its intervals can be as wide as its errors.
PLUS_OPTIONS = {"num_row_init": "digits", "regression_noise": 1.0}


@dataclass
class Profile:
    """Sizes and learning rates of one run. Steps count optimizer steps of `batch_size` texts, the same for every arm.

    `head_lr` is the rate of the 152k-row heads (CausalQwen's cls_head, Qwen's lm_head); the other modules of
    CausalQwen train at the package's multiples of it (`causal_qwen.training.LEARNING_RATE_SCALES`). Adam moves
    every weight by about the learning rate per step whatever its gradient, and a weight multiplies a feature of
    Qwen's last hidden state, whose L1 norm is about 3,400: a step of lr on every weight of a row moves that row's
    output by about 3,400·lr. The rates keep that move small.
    """

    n_train: int
    n_validation: int
    n_test: int
    n_extrapolation: int
    steps: int
    sweep_steps: int
    batch_size: int
    sweep_batch_size: int
    head_lr: float = 1e-4  # about 0.3 logit per step; the same in every arm
    feature_batch: int = 32
    eval_batch: int = 16
    decode_batch: int = 64
    tiny: bool = False


PROFILES = {
    # Sized from the measured backbone throughput so that the whole table fits in 45 minutes on 2 CPU cores.
    "cpu": Profile(n_train=320, n_validation=48, n_test=96, n_extrapolation=64, steps=40, sweep_steps=8,
                   batch_size=16, sweep_batch_size=8),
    # Not run here: larger sizes for one GPU.
    "gpu": Profile(n_train=20000, n_validation=1000, n_test=2000, n_extrapolation=2000, steps=2000, sweep_steps=300,
                   batch_size=32, sweep_batch_size=32, feature_batch=128, eval_batch=64, decode_batch=256),
    # A tiny random backbone with the real tokenizer: checks the pipeline end to end in about a minute.
    "tiny": Profile(n_train=64, n_validation=16, n_test=16, n_extrapolation=16, steps=6, sweep_steps=2,
                    batch_size=8, sweep_batch_size=8, tiny=True),
}


# ----------------------------------------------------------------------------------------------------------------
# Data: tokenized splits with cached backbone features
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Encoded:
    """One split, tokenized for one arm, with the frozen backbone's last hidden state of every text."""

    examples: list[NumericExample]
    ids: list[torch.Tensor]  # [L] each
    values: list[torch.Tensor]  # [L] float64 each (zeros for the digit arms)
    features: list[torch.Tensor] = field(default_factory=list)  # [L, H] each
    target_index: list[int] = field(default_factory=list)  # index of the target's <NUM>, −1 when there is none

    def batch(self, rows: list[int], device: torch.device) -> dict[str, torch.Tensor]:
        """Right-padded features, labels (−100 on padding) and numeric labels of `rows`."""
        length = max(len(self.ids[i]) for i in rows)
        hidden = self.features[rows[0]].shape[-1]
        feats = torch.zeros(len(rows), length, hidden)
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        values = torch.zeros(len(rows), length, dtype=torch.float64)
        for b, i in enumerate(rows):
            n = len(self.ids[i])
            feats[b, :n], labels[b, :n], values[b, :n] = self.features[i], self.ids[i], self.values[i]
        return {"features": feats.to(device), "labels": labels.to(device), "numeric_labels": values.to(device)}

    def tokens(self) -> int:
        return sum(len(x) for x in self.ids)


def encode_numeric(tokenizer: CausalQwenTokenizer, examples: list[NumericExample]) -> Encoded:
    """Numbers as `<NUM>` + value; the target is the last `<NUM>` (the corpus puts it last)."""
    enc = tokenizer([ex.text for ex in examples])
    ids = [torch.tensor(x) for x in enc["input_ids"]]
    values = [torch.tensor(v, dtype=torch.float64) for v in enc["numeric_values"]]
    targets = []
    for ex, row, vals in zip(examples, ids, values, strict=True):
        where = (row == tokenizer.num_token_id).nonzero().flatten()
        ok = ex.target_value is not None and len(where) and float(vals[where[-1]]) == ex.target_value
        targets.append(int(where[-1]) if ok else -1)
    return Encoded(examples, ids, values, target_index=targets)


def encode_digits(tokenizer, examples: list[NumericExample]) -> Encoded:
    """Numbers written as digits, tokenized by the plain Qwen2 tokenizer."""
    enc = tokenizer([ex.text for ex in examples])
    ids = [torch.tensor(x) for x in enc["input_ids"]]
    return Encoded(examples, ids, [torch.zeros(len(x), dtype=torch.float64) for x in ids],
                   target_index=[-1] * len(ids))


@torch.no_grad()
def cache_features(backbone, enc: Encoded, batch_size: int, embed=None, desc: str = "features") -> float:
    """Fill `enc.features` with the backbone's last hidden states; returns tokens per second.

    `embed(ids, values)` builds the input embeddings (CausalQwen's numeric embedding); by default the token
    embedding. Texts are batched by length so that little compute goes to padding; right padding leaves every
    real position's causal attention unchanged.
    """
    order = sorted(range(len(enc.ids)), key=lambda i: len(enc.ids[i]))
    enc.features = [None] * len(enc.ids)
    start = time.perf_counter()
    for k in tqdm(range(0, len(order), batch_size), desc=desc, leave=False):
        rows = order[k:k + batch_size]
        length = max(len(enc.ids[i]) for i in rows)
        ids = torch.full((len(rows), length), 0, dtype=torch.long)
        values = torch.zeros(len(rows), length, dtype=torch.float64)
        mask = torch.zeros(len(rows), length, dtype=torch.long)
        for b, i in enumerate(rows):
            n = len(enc.ids[i])
            ids[b, :n], values[b, :n], mask[b, :n] = enc.ids[i], enc.values[i], 1
        embeds = embed(ids, values) if embed is not None else backbone.embed_tokens(ids)
        hidden = backbone(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
        for b, i in enumerate(rows):
            enc.features[i] = hidden[b, :len(enc.ids[i])].clone()
    return enc.tokens() / (time.perf_counter() - start)


def batches_of(n: int, batch_size: int, steps: int, seed: int):
    """`steps` batches of indices, epoch after epoch of a seeded shuffle (the same order for every arm)."""
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(steps):
        if len(order) < batch_size:
            fresh = list(range(n))
            rng.shuffle(fresh)
            order += fresh
        yield order[:batch_size]
        order = order[batch_size:]


# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------


def load_qwen(tiny: bool, seed: int) -> Qwen2ForCausalLM:
    """The real Qwen2.5-0.5B, or a tiny random Qwen2 with its vocabulary (for checking the pipeline)."""
    if not tiny:
        return Qwen2ForCausalLM.from_pretrained(QWEN_DIR, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


def causal_heads(qwen: Qwen2ForCausalLM, num_token_id: int, seed: int, num_row_init="copy",
                 **overrides) -> CausalQwenForCausalLM:
    """A CausalQwen initialised by `from_qwen` (DESIGN §3) whose backbone has no layers.

    The heads are trained on cached features, so the 24 layers would only be copied for nothing: `from_qwen` is
    given a Qwen2 that shares the real embedding, final norm and lm_head but has zero decoder layers. Every head
    (identity abduction with scale γ0, cls_head = lm_head copy, b_noise, threshold, w_num) is then exactly what
    `from_qwen` builds for the full model.
    """
    config = copy.deepcopy(qwen.config)
    config.num_hidden_layers, config.layer_types = 0, []
    stub = Qwen2ForCausalLM(config)
    stub.model.embed_tokens, stub.model.norm, stub.lm_head = qwen.model.embed_tokens, qwen.model.norm, qwen.lm_head
    torch.manual_seed(seed)  # w_num and the regression head are drawn: the same seed gives the same draw
    heads = CausalQwenForCausalLM.from_qwen(stub, num_token_id=num_token_id, num_row_init=num_row_init, **overrides)
    heads.requires_grad_(False)
    for module in (heads.abduction, heads.action):
        module.requires_grad_(True)
    if not heads.config.learnable_threshold:
        heads.action.threshold.requires_grad_(False)
    return heads


def causal_optimizer(heads: CausalQwenForCausalLM, profile: Profile) -> torch.optim.Optimizer:
    """AdamW without weight decay over the trainable heads, with the package's per-module learning rates.

    With `head_lr` = 1e-4: cls_head 1e-4, w_reg/b_reg 1e-5, abduction and b_noise 1e-6, a learnable threshold and
    log γ_Y 1e-2 (the numeric embedding is frozen here: the features are cached).
    """
    return torch.optim.AdamW(parameter_groups(heads, profile.head_lr), weight_decay=0.0)


# ----------------------------------------------------------------------------------------------------------------
# Arm (a): CausalQwen on cached features
# ----------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def warm_start_regression(heads: CausalQwenForCausalLM, train: Encoded, validation: Encoded) -> dict:
    """Start the regression head at the ridge-regression fit of the transformed value on loc_U (a linear probe).

    With a frozen backbone the regression head is a linear read-out of loc_U, and Adam needs hundreds of steps to
    find a linear read-out of Qwen's features (a few directions of huge variance dominate every step), far more
    than a CPU budget allows; least squares finds it at once. The fit uses every position whose next token is
    `<NUM>` (what the regression loss trains on), in the space of `value_transform`; the ridge penalty is chosen
    on the validation split. Training then continues from there with the model's own loss.
    """

    def rows(data: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = [], []
        for feats, ids, values in zip(data.features, data.ids, data.values, strict=True):
            where = (ids[1:] == heads.config.num_token_id).nonzero().flatten()
            if len(where):
                xs.append(heads.abduction(feats[where].to(heads.device))[0].double().cpu())
                ys.append(values[where + 1])
        x, y = torch.cat(xs), torch.cat(ys)
        return x, (symlog(y) if heads.config.value_transform == "symlog" else y)

    x, y = rows(train)
    x_val, y_val = rows(validation)
    mean, std = x.mean(0), x.std(0) + 1e-3
    a = (x - mean) / std
    gram, rhs = a.T @ a, a.T @ (y - y.mean())
    best = None
    for penalty in (0.1, 1.0, 10.0, 100.0, 1000.0):
        w = torch.linalg.solve(gram + penalty * torch.eye(a.shape[1], dtype=a.dtype), rhs) / std
        b = y.mean() - (w * mean).sum()
        error = (x_val @ w + b - y_val).abs().median().item()
        if best is None or error < best[0]:
            best = (error, penalty, w, b)
    error, penalty, w, b = best
    heads.action.reg_head.weight.copy_(w.to(heads.action.reg_head.weight)[None])
    heads.action.reg_head.bias.fill_(b.item())
    if heads.action.reg_log_noise is not None:
        # The median |Y − median| of a Cauchy is its scale: start the value's noise at the fit's residuals.
        heads.action.reg_log_noise.fill_(math.log(max(error, 1e-3)))
    return {"penalty": penalty, "validation_median_abs_error": error, "n_positions": len(y)}


def train_causal(heads: CausalQwenForCausalLM, data: Encoded, profile: Profile, steps: int, seed: int,
                 desc: str, batch_size: int | None = None) -> list[dict]:
    """Train abduction + action with the fused chunked loss (the model's own training path) on cached features."""
    heads.train()
    cfg = heads.config
    optimizer = causal_optimizer(heads, profile)
    history = []
    batch_size = batch_size or profile.batch_size
    bar = tqdm(batches_of(len(data.ids), batch_size, steps, seed), total=steps, desc=desc)
    for step, rows in enumerate(bar, start=1):
        batch = data.batch(rows, heads.device)
        loc_u, scale_u = heads.abduction(batch["features"])
        losses = chunked_causal_qwen_loss(
            loc_u, scale_u, batch["labels"], batch["numeric_labels"], action=heads.action,
            num_token_id=cfg.num_token_id, gate_alpha=cfg.gate_alpha, reg_loss_weight=cfg.reg_loss_weight,
            detach_gate=cfg.detach_gate, value_transform=cfg.value_transform,
        )
        optimizer.zero_grad(set_to_none=True)
        losses.loss.backward()
        optimizer.step()
        entry = {"step": step, "loss": losses.loss.item(), "cls_loss": losses.cls_loss.item(),
                 "reg_loss": losses.reg_loss.item(), "positions": int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())}
        history.append(entry)
        bar.set_postfix(loss=f"{entry['loss']:.3f}", reg=f"{entry['reg_loss']:.3f}")
    heads.eval()
    return history


@torch.no_grad()
def evaluate_causal(heads: CausalQwenForCausalLM, data: Encoded, profile: Profile, seed: int,
                    desc: str) -> tuple[dict, dict, torch.Tensor, torch.Tensor]:
    """All-position metrics (DESIGN §6, standard mode) and target metrics, from cached features.

    Returns `(position_metrics, target_metrics, target_stats, all_stats)`: packed per-position statistics
    (`causal_qwen.metrics.FIELDS`) of the positions that predict a target, and of every position, for the plots.
    """
    generator = torch.Generator().manual_seed(seed)
    collected, targets = [], []
    for k in tqdm(range(0, len(data.ids), profile.eval_batch), desc=desc, leave=False):
        rows = list(range(k, min(k + profile.eval_batch, len(data.ids))))
        batch = data.batch(rows, heads.device)
        loc_u, scale_u = heads.abduction(batch["features"])
        loc_s, scale_s, loc_y, scale_y = heads.action(loc_u, scale_u)
        stats = position_statistics(heads, loc_s, scale_s, loc_y, scale_y, loc_u, scale_u, batch["labels"],
                                    batch["numeric_labels"], generator)
        del loc_s, scale_s
        for b, i in enumerate(rows):
            if data.target_index[i] > 0:
                targets.append(stats[b, data.target_index[i] - 1])
        collected.append(stats.reshape(-1, len(FIELDS)))
    all_stats = torch.cat(collected)
    position_metrics = summarize(all_stats, heads)
    target_stats = torch.stack(targets)
    col = {name: target_stats[:, FIELDS.index(name)] for name in ("loc_y", "scale_y", "true_value")}
    target = regression_metrics(heads, col["loc_y"], col["scale_y"], col["true_value"], prefix="")
    target["n_targets"] = len(targets)
    return position_metrics, target, target_stats, all_stats


def target_predictions(heads: CausalQwenForCausalLM, target_stats: torch.Tensor) -> list[float]:
    return heads.to_value(target_stats[:, FIELDS.index("loc_y")]).tolist()


# ----------------------------------------------------------------------------------------------------------------
# Arms (b) and (b2): Qwen's lm_head on cached features
# ----------------------------------------------------------------------------------------------------------------


def shifted_rows(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of the positions that have a next token, and that token."""
    targets = batch["labels"][:, 1:]
    valid = targets != IGNORE_INDEX
    return batch["features"][:, :-1][valid], targets[valid]


def train_digits(head: nn.Linear, data: Encoded, profile: Profile, steps: int, seed: int, ntl=None,
                 desc: str = "train") -> list[dict]:
    """Cross-entropy (+ 0.3·NTL when `ntl` is given) on the lm_head alone: on cached features this is exactly the
    loss and gradient of the full model with a frozen backbone."""
    optimizer = torch.optim.AdamW(head.parameters(), lr=profile.head_lr, weight_decay=0.0)
    history = []
    bar = tqdm(batches_of(len(data.ids), profile.batch_size, steps, seed), total=steps, desc=desc)
    for step, rows in enumerate(bar, start=1):
        feats, targets = shifted_rows(data.batch(rows, head.weight.device))
        logits = head(feats)
        ce = nn.functional.cross_entropy(logits, targets)
        loss = ce
        entry = {"step": step, "ce": ce.item(), "positions": len(targets)}
        if ntl is not None:
            # ntloss takes [B, T, V] logits and [B, T] labels that are already aligned (no shift inside).
            number_loss = ntl(logits[None], targets[None])
            loss = ce + NTL_WEIGHT * number_loss
            entry["ntl"] = number_loss.item()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        entry["loss"] = loss.item()
        history.append(entry)
        bar.set_postfix(loss=f"{entry['loss']:.3f}")
    return history


@torch.no_grad()
def evaluate_digits(head: nn.Linear, data: Encoded, digit_ids: torch.Tensor, profile: Profile) -> dict:
    """Next-token accuracy, softmax perplexity and the F1 of predicting a digit, over all valid positions."""
    correct = nll = n = tp = predicted = actual = 0.0
    for k in range(0, len(data.ids), profile.eval_batch):
        rows = list(range(k, min(k + profile.eval_batch, len(data.ids))))
        feats, targets = shifted_rows(data.batch(rows, head.weight.device))
        logits = head(feats)
        pred = logits.argmax(-1)
        correct += (pred == targets).sum().item()
        nll += nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        n += targets.numel()
        pred_digit, true_digit = torch.isin(pred, digit_ids), torch.isin(targets, digit_ids)
        tp += (pred_digit & true_digit).sum().item()
        predicted += pred_digit.sum().item()
        actual += true_digit.sum().item()
    precision = tp / predicted if predicted else 0.0
    recall = tp / actual if actual else 0.0
    return {"eval/accuracy": correct / n, "eval/ppl_softmax": math.exp(min(nll / n, 700.0)),
            "eval/num_f1": 2 * precision * recall / (precision + recall) if precision + recall else 0.0}


@torch.no_grad()
def greedy_numbers(backbone, heads: dict[str, nn.Linear], tokenizer, examples: list[NumericExample],
                   batch_size: int, desc: str) -> tuple[dict[str, list[float | None]], dict[str, list[str]]]:
    """Greedy continuation of the text before each target, parsed as a number, for every head.

    Returns the parsed values (None where the continuation does not start with a number) and the decoded
    continuations.

    The prompt is prefilled once per batch (left padding) and its KV cache is copied for each head, so the
    heads share the prompt's cost. A row stops at its first token that cannot continue a number.
    """
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    number_piece = torch.zeros(backbone.embed_tokens.num_embeddings, dtype=torch.bool)
    for i, token in enumerate(vocab):
        number_piece[i] = token is not None and token != "" and all(ch.isdigit() or ch in ".,-" for ch in token)
    prompts = [ex.text[:ex.target_char_span[0]] for ex in examples]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: dict[str, list[float | None]] = {name: [None] * len(prompts) for name in heads}
    texts: dict[str, list[str]] = {name: [""] * len(prompts) for name in heads}
    for k in tqdm(range(0, len(order), batch_size), desc=desc, leave=False):
        rows = order[k:k + batch_size]
        enc = tokenizer([prompts[i] for i in rows], padding=True, padding_side="left", return_tensors="pt")
        mask = enc["attention_mask"]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        prefill = DynamicCache()
        out = backbone(input_ids=enc["input_ids"], attention_mask=mask, position_ids=positions,
                       past_key_values=prefill, use_cache=True)
        for name, head in heads.items():
            cache, hidden, step_mask = copy.deepcopy(prefill), out.last_hidden_state[:, -1], mask
            position = positions[:, -1:]
            generated = [[] for _ in rows]
            done = torch.zeros(len(rows), dtype=torch.bool)
            for _ in range(MAX_NEW_DIGITS):
                token = head(hidden).argmax(-1)
                done |= ~number_piece[token]
                for b in (~done).nonzero().flatten().tolist():
                    generated[b].append(int(token[b]))
                if bool(done.all()):
                    break
                step_mask = torch.cat([step_mask, torch.ones(len(rows), 1, dtype=mask.dtype)], -1)
                position = position + 1
                hidden = backbone(input_ids=token[:, None], attention_mask=step_mask, position_ids=position,
                                  past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
            for b, i in enumerate(rows):
                text = tokenizer.decode(generated[b])
                spans = find_numbers(text)
                results[name][i] = spans[0].value if spans and spans[0].start == 0 else None
                texts[name][i] = text
    return results, texts


# ----------------------------------------------------------------------------------------------------------------
# Metrics of point predictions
# ----------------------------------------------------------------------------------------------------------------


def point_metrics(predicted: list[float | None], true: list[float]) -> dict:
    """The regression metrics of `causal_qwen.metrics.regression_metrics` for point predictions.

    An unparseable prediction counts as 0 (a model that writes no number is wrong); `parse_rate` says how often.
    """
    pred = torch.tensor([p if p is not None and math.isfinite(p) else 0.0 for p in predicted], dtype=torch.float64)
    y = torch.tensor(true, dtype=torch.float64)
    err = (pred - y).abs()

    def r2(p: torch.Tensor, t: torch.Tensor) -> float:
        return (1.0 - (p - t).square().sum() / (t - t.mean()).square().sum()).item()

    def symlog10(x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x) * torch.log10(1.0 + x.abs())

    return {"reg_mae": err.mean().item(), "reg_mdae": err.median().item(), "reg_r2": r2(pred, y),
            "reg_r2_symlog": r2(symlog10(pred), symlog10(y)),
            "reg_rel_err_median": (err / y.abs().clamp(min=1e-12)).median().item(),
            "parse_rate": sum(p is not None for p in predicted) / max(len(predicted), 1), "n_targets": len(true)}


def per_template(predicted: list[float | None], examples: list[NumericExample]) -> dict[str, float]:
    """Median relative error of the target per template."""
    errors: dict[str, list[float]] = {}
    for p, ex in zip(predicted, examples, strict=True):
        p = p if p is not None and math.isfinite(p) else 0.0
        errors.setdefault(ex.template, []).append(abs(p - ex.target_value) / max(abs(ex.target_value), 1e-12))
    return {name: statistics.median(v) for name, v in sorted(errors.items())}


# ----------------------------------------------------------------------------------------------------------------
# The experiment
# ----------------------------------------------------------------------------------------------------------------


def hardware() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()[:20]
    except (OSError, subprocess.CalledProcessError):
        lines = [platform.processor()]
    return "\n".join(lines)


def sweep_configs() -> list[dict]:
    """The base configuration, then one field changed at a time."""
    configs = [dict(BASE_CONFIG)]
    for name, values in SWEEP.items():
        configs += [{**BASE_CONFIG, name: value} for value in values]
    return configs


def model_fields(config: dict) -> dict:
    """The CausalQwenConfig fields of a sweep configuration."""
    return {k: v for k, v in config.items() if k not in ("warm_start", "num_row_init")}


def new_causal(qwen, num_id: int, config: dict, numeric_embedding: nn.Module, data: dict, seed: int,
               digit_ids: list[int] | None = None):
    """Fresh heads for `config` reading the cached features (their numeric embedding is the one that made them)."""
    row_init = digit_ids if config.get("num_row_init") == "digits" else "copy"
    heads = causal_heads(qwen, num_id, seed, num_row_init=row_init, **model_fields(config)).to(qwen.device)
    heads.numeric_embedding.load_state_dict(numeric_embedding.state_dict())
    warm = warm_start_regression(heads, data["train"], data["validation"]) if config["warm_start"] else None
    return heads, warm


def describe(config: dict) -> str:
    changed = [f"{k}={v}" for k, v in config.items() if BASE_CONFIG.get(k) != v]
    return ", ".join(changed) or "base (code defaults)"


def select_defaults(rows: list[dict]) -> dict:
    """For each swept field, the value whose run ranks best on validation; ties keep the base value.

    A run's score is its mean rank over three validation metrics: the target's median relative error (numbers),
    the next-token accuracy and the OvR perplexity (text).
    """
    keys = [("target", "reg_rel_err_median", 1), ("positions", "eval/accuracy", -1), ("positions", "eval/ppl_ovr", 1)]
    score = [0.0] * len(rows)
    for part, key, sign in keys:
        ranked = sorted(range(len(rows)), key=lambda i: sign * rows[i][part][key])
        for rank, i in enumerate(ranked):
            score[i] += rank / len(keys)
    chosen = dict(BASE_CONFIG)
    for name in SWEEP:
        candidates = [i for i, r in enumerate(rows) if all(r["config"][k] == BASE_CONFIG[k] for k in BASE_CONFIG
                                                           if k != name)]
        best = min(candidates, key=lambda i: (score[i], rows[i]["config"][name] != BASE_CONFIG[name]))
        chosen[name] = rows[best]["config"][name]
    for row, s in zip(rows, score, strict=True):
        row["selection_score"] = s
    return chosen


def run(args: argparse.Namespace) -> dict:
    profile = replace(PROFILES[args.profile], **{k: v for k, v in (
        ("n_train", args.num_train), ("steps", args.steps), ("sweep_steps", args.sweep_steps),
        ("batch_size", args.batch_size), ("n_test", args.num_test), ("n_extrapolation", args.num_test),
        ("n_validation", args.num_validation)) if v is not None})
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not profile.tiny else "cpu")
    timings: dict[str, float] = {}
    started = time.perf_counter()

    def lap(name: str, since: float) -> float:
        timings[name] = round(time.perf_counter() - since, 1)
        print(f"[{time.perf_counter() - started:7.1f}s] {name}: {timings[name]}s", flush=True)
        return time.perf_counter()

    t = time.perf_counter()
    splits = make_splits(profile.n_train, profile.n_validation, profile.n_test, profile.n_extrapolation,
                         seed=args.seed)
    num_tokenizer = CausalQwenTokenizer.from_pretrained(QWEN_DIR)
    digit_tokenizer = AutoTokenizer.from_pretrained(QWEN_DIR)
    qwen = load_qwen(profile.tiny, args.seed).to(device)
    qwen.requires_grad_(False)
    backbone = qwen.model
    num_id = num_tokenizer.num_token_id
    t = lap("load", t)

    # Features. (a): numbers enter through the numeric embedding, frozen at its initial value.
    base_heads = causal_heads(qwen, num_id, args.seed, **model_fields(BASE_CONFIG)).to(device)
    numeric_embedding = base_heads.numeric_embedding

    def numeric_embed(ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        ids, values = ids.to(device), values.to(device)
        return numeric_embedding(backbone.embed_tokens(ids), ids, values)

    def digit_embed(ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return backbone.embed_tokens(ids.to(device))

    numeric_data, digit_data, throughput = {}, {}, {}
    for split, examples in splits.items():
        numeric_data[split] = encode_numeric(num_tokenizer, examples)
        digit_data[split] = encode_digits(digit_tokenizer, examples)
        throughput[f"numeric/{split}"] = cache_features(backbone, numeric_data[split], profile.feature_batch,
                                                        numeric_embed, desc=f"features (a) {split}")
        throughput[f"digits/{split}"] = cache_features(backbone, digit_data[split], profile.feature_batch,
                                                       digit_embed, desc=f"features (b) {split}")
        t = lap(f"features {split}", t)
    print("backbone tokens/s:", {k: round(v, 1) for k, v in throughput.items()}, flush=True)
    tokens = {"numeric": {s: d.tokens() for s, d in numeric_data.items()},
              "digits": {s: d.tokens() for s, d in digit_data.items()}}

    # Sweep (a) on validation: short runs, one field changed at a time.
    sweep_rows = []
    if profile.sweep_steps > 0 and not args.skip_sweep:
        for config in sweep_configs():
            t0 = time.perf_counter()
            heads, _ = new_causal(qwen, num_id, config, numeric_embedding, numeric_data, args.seed)
            history = train_causal(heads, numeric_data["train"], profile, profile.sweep_steps, args.seed,
                                   desc=f"sweep {describe(config)}", batch_size=profile.sweep_batch_size)
            positions, target, _, _ = evaluate_causal(heads, numeric_data["validation"], profile, args.seed,
                                                   desc="sweep eval")
            sweep_rows.append({"config": config, "name": describe(config), "positions": positions,
                               "target": target, "final_loss": history[-1]["loss"],
                               "seconds": round(time.perf_counter() - t0, 1)})
            print(f"sweep {describe(config)}: {target['reg_rel_err_median']:.4g} rel err, "
                  f"acc {positions['eval/accuracy']:.4f}, ppl_ovr {positions['eval/ppl_ovr']:.4g}", flush=True)
            del heads
        chosen = select_defaults(sweep_rows)
        t = lap("sweep", t)
    else:
        chosen = dict(BASE_CONFIG)
    if args.a_config == "base":
        chosen = dict(BASE_CONFIG)
    print("arm (a) configuration:", chosen, flush=True)

    results: dict = {"arms": {}, "per_template": {}}
    true = {s: [ex.target_value for ex in splits[s] if ex.target_value is not None] for s in ("test", "extrapolation")}
    with_target = {s: [ex for ex in splits[s] if ex.target_value is not None] for s in ("test", "extrapolation")}

    # (a) CausalQwen with the code's configuration, and (a+) with the two opt-in options on top of it.
    digit_rows = num_tokenizer.convert_tokens_to_ids([str(d) for d in range(10)])
    histories, results["warm_start"] = {}, {}
    arms_a = {"a": chosen, "a_plus": {**chosen, **PLUS_OPTIONS}}
    if args.skip_plus:
        del arms_a["a_plus"]
    for arm, config in arms_a.items():
        heads, results["warm_start"][arm] = new_causal(qwen, num_id, config, numeric_embedding, numeric_data,
                                                       args.seed, digit_rows)
        histories[arm] = train_causal(heads, numeric_data["train"], profile, profile.steps, args.seed,
                                      desc=f"train ({arm})")
        t = lap(f"train ({arm})", t)
        results["arms"][arm] = {}
        for split in ("test", "extrapolation"):
            positions, target, target_stats, all_stats = evaluate_causal(heads, numeric_data[split], profile,
                                                                         args.seed, desc=f"eval ({arm}) {split}")
            results["arms"][arm][split] = {"positions": positions, "target": target}
            predicted = target_predictions(heads, target_stats)
            examples = [ex for ex, i in zip(splits[split], numeric_data[split].target_index, strict=True) if i > 0]
            results["per_template"].setdefault(split, {})[arm] = per_template(predicted, examples)
            plot_predictions(heads, target_stats, out / f"{arm}_predictions_{split}.png")
            plot_u_scale(all_stats, out / f"{arm}_u_scale_{split}.png")
        if heads.action.reg_log_noise is not None:
            results["warm_start"][arm]["final_regression_noise"] = heads.action.reg_log_noise.exp().item()
        t = lap(f"eval ({arm})", t)
        del heads

    # (b) and (b2): an untied copy of the tied embedding as the lm_head, trained on the same texts and steps.
    ntl_fn = None
    try:
        from ntloss import NTLoss

        ntl_fn = NTLoss(tokenizer=digit_tokenizer, vocab_size=qwen.config.vocab_size)
    except ImportError:
        print("ntloss is not installed: arm (b2) is skipped (pip install ntloss)")
    lm_heads = {}
    for name, ntl in (("b", None), ("b2", ntl_fn)):
        if name == "b2" and ntl is None:
            continue
        head = nn.Linear(qwen.config.hidden_size, qwen.config.vocab_size, bias=False).to(device)
        head.weight.data.copy_(qwen.lm_head.weight.data)
        histories[name] = train_digits(head, digit_data["train"], profile, profile.steps, args.seed, ntl=ntl,
                                       desc=f"train ({name})")
        lm_heads[name] = head.requires_grad_(False)
        t = lap(f"train ({name})", t)
    digit_ids = torch.tensor(digit_tokenizer.convert_tokens_to_ids([str(d) for d in range(10)]), device=device)
    for split in ("test", "extrapolation"):
        decoded, continuations = greedy_numbers(backbone, lm_heads, digit_tokenizer, with_target[split],
                                                profile.decode_batch, desc=f"decode {split}")
        for name, head in lm_heads.items():
            results["arms"].setdefault(name, {})[split] = {
                "positions": evaluate_digits(head, digit_data[split], digit_ids, profile),
                "target": point_metrics(decoded[name], true[split]),
            }
            results["per_template"][split][name] = per_template(decoded[name], with_target[split])
            results.setdefault("samples", {}).setdefault(split, {})[name] = [
                {"prompt": ex.text[:ex.target_char_span[0]], "true": ex.target_value, "continuation": c, "parsed": v}
                for ex, c, v in list(zip(with_target[split], continuations[name], decoded[name], strict=True))[:12]]
        t = lap(f"eval (b) {split}", t)

    # (c) the trivial baseline.
    baselines = template_baselines(splits["train"])
    for which, k in (("c_mean", 0), ("c_median", 1)):
        for split in ("test", "extrapolation"):
            predicted = [baselines[ex.template][k] for ex in with_target[split]]
            results["arms"].setdefault(which, {})[split] = {"target": point_metrics(predicted, true[split])}
            results["per_template"][split][which] = per_template(predicted, with_target[split])

    for name, history in histories.items():
        plot_loss_curves(history, out / f"loss_{name}.png")
    timings["total"] = round(time.perf_counter() - started, 1)
    results.update({
        "command": args.command_line, "profile": asdict(profile), "seed": args.seed, "chosen_config": chosen,
        "sweep": sweep_rows, "timings_s": timings, "backbone_tokens_per_s": throughput, "tokens": tokens,
        "trained_texts_per_arm": profile.steps * profile.batch_size,
        "trained_positions": {name: sum(e["positions"] for e in h) for name, h in histories.items()},
        "hardware": hardware(), "torch": torch.__version__, "threads": torch.get_num_threads(), "device": str(device),
    })
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
    (out / "results.md").write_text(markdown(results), encoding="utf-8")
    print(markdown(results))
    return results


# ----------------------------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------------------------

ARM_NAMES = {"a": "(a) CausalQwen", "a_plus": "(a+) CausalQwen, digit-row <NUM> + value noise",
             "b": "(b) Qwen + CE", "b2": "(b2) Qwen + CE + 0.3·NTL",
             "c_mean": "(c) template mean", "c_median": "(c) template median"}


def _fmt(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) < 1e6):
        return f"{x:.0f}" if isinstance(x, int) else f"{x:.4g}"
    return f"{x:.4g}"


def markdown(results: dict) -> str:
    lines = []
    for split in ("test", "extrapolation"):
        lines += [f"### Target number, {split} split", "",
                  "| arm | reg_mdae | reg_mae | R² | R² symlog10 | median rel. err. | coverage 50% | coverage 90% "
                  "| parsed |", "|---|---|---|---|---|---|---|---|---|"]
        for arm, name in ARM_NAMES.items():
            if arm not in results["arms"]:
                continue
            m = results["arms"][arm][split]["target"]
            lines.append(f"| {name} | {_fmt(m['reg_mdae'])} | {_fmt(m['reg_mae'])} | {_fmt(m['reg_r2'])} | "
                         f"{_fmt(m['reg_r2_symlog'])} | {_fmt(m['reg_rel_err_median'])} | "
                         f"{_fmt(m.get('reg_coverage_50'))} | {_fmt(m.get('reg_coverage_90'))} | "
                         f"{_fmt(m.get('parse_rate', 1.0))} |")
        lines += ["", f"### All positions, {split} split", "",
                  "| arm | accuracy | num_f1 | ppl_softmax | ppl_ovr | ovr_prob_sum_median "
                  "| ovr_prob_sum_median (causal) |",
                  "|---|---|---|---|---|---|---|"]
        for arm in ("a", "a_plus", "b", "b2"):
            if arm not in results["arms"]:
                continue
            m = results["arms"][arm][split]["positions"]
            lines.append(f"| {ARM_NAMES[arm]} | {_fmt(m['eval/accuracy'])} | {_fmt(m['eval/num_f1'])} | "
                         f"{_fmt(m['eval/ppl_softmax'])} | {_fmt(m.get('eval/ppl_ovr'))} | "
                         f"{_fmt(m.get('dist/ovr_prob_sum_median'))} | "
                         f"{_fmt(m.get('dist/ovr_prob_sum_median_causal'))} |")
        templates = sorted({t for arm in results["per_template"][split].values() for t in arm})
        arms = [a for a in ARM_NAMES if a in results["per_template"][split]]
        lines += ["", f"### Median relative error of the target per template, {split} split", "",
                  "| template | " + " | ".join(ARM_NAMES[a] for a in arms) + " |", "|---" * (len(arms) + 1) + "|"]
        for template in templates:
            cells = [_fmt(results["per_template"][split][a].get(template)) for a in arms]
            lines.append(f"| {template} | " + " | ".join(cells) + " |")
        lines.append("")
    if results["sweep"]:
        lines += ["### Sweep of arm (a) on the validation split", "",
                  "| configuration | target median rel. err. | target mdae | coverage 90% | accuracy | num_f1 "
                  "| ppl_softmax | ppl_ovr | ovr_prob_sum_median | (causal) | final train loss | score | seconds |",
                  "|---" * 13 + "|"]
        for row in results["sweep"]:
            p, t = row["positions"], row["target"]
            lines.append(f"| {row['name']} | {_fmt(t['reg_rel_err_median'])} | {_fmt(t['reg_mdae'])} | "
                         f"{_fmt(t['reg_coverage_90'])} | {_fmt(p['eval/accuracy'])} | {_fmt(p['eval/num_f1'])} | "
                         f"{_fmt(p['eval/ppl_softmax'])} | {_fmt(p['eval/ppl_ovr'])} | "
                         f"{_fmt(p['dist/ovr_prob_sum_median'])} | {_fmt(p['dist/ovr_prob_sum_median_causal'])} | "
                         f"{_fmt(row['final_loss'])} | {_fmt(row['selection_score'])} | {_fmt(row['seconds'])} |")
        lines += ["", f"Chosen configuration: `{results['chosen_config']}`", ""]
    lines += ["### Wall time (seconds)", "", "| phase | seconds |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in results["timings_s"].items()]
    lines += ["", "Backbone throughput (tokens/s): " + ", ".join(
        f"{k} {v:.0f}" for k, v in results["backbone_tokens_per_s"].items()), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    parser.add_argument("--output", default="runs/experiment")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-train", type=int, help="override the profile's training texts")
    parser.add_argument("--num-validation", type=int)
    parser.add_argument("--num-test", type=int, help="texts in the test and in the extrapolation split")
    parser.add_argument("--steps", type=int, help="optimizer steps per arm")
    parser.add_argument("--sweep-steps", type=int, help="optimizer steps per sweep run (0: no sweep)")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--a-config", choices=["selected", "base"], default="selected",
                        help="arm (a) uses the sweep's selection (default) or the code defaults")
    parser.add_argument("--skip-plus", action="store_true", help="do not run arm (a+)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: all cores)")
    args = parser.parse_args()
    args.command_line = "python experiments/run_experiment.py " + " ".join(sys.argv[1:])
    if args.threads:
        torch.set_num_threads(args.threads)
    run(args)


if __name__ == "__main__":
    main()
