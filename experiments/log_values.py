"""Which log the context-value path's log-space combination sums: symlog(v) or ln|v| (`context_values_log`).

Two measurements, in one process, that need no real model (minutes on a CPU):

1. What each form can write at best: on products and ratios drawn like the corpus' and a price per carat, the
   least-squares weights of the stated values' logs in the head's symlog space, and the median relative error of
   the value they give (ln|v| with weights (1, 1) or (1, −1) is exact; symlog is not where a factor is small).
2. What the start from data fits: a tiny random Qwen2 converted with each form, `fit_value_head` on texts that state
   a (e^0 to e^8) and b (0.22 to 3.0) and then a/b, and the held-out median relative error of a/b, with the path's
   held-out NLL against the linear read-out's and the step its fit kept.

    python experiments/log_values.py
    python experiments/log_values.py --fit-learning-rate 3e-3 --fit-patience 400   # the fit slower and longer
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from causal_qwen import CausalQwenForCausalLM
from causal_qwen.starts import fit_value_head, path_rows

NUM = 120


def symlog(v: np.ndarray) -> np.ndarray:
    return np.sign(v) * np.log1p(np.abs(v))


def best_weights(stated: list[np.ndarray], target: np.ndarray, log, inverse) -> tuple[np.ndarray, float]:
    """Least-squares weights of `log` of the stated values for `log` of the target; the median relative error of
    the value they give, `inverse` of the weighted sum."""
    x = np.column_stack([log(v) for v in stated])
    weights, *_ = np.linalg.lstsq(x, log(target), rcond=None)
    predicted = inverse(x @ weights)
    return weights, float(np.median(np.abs(predicted - target) / np.abs(target)))


def expressible(n: int = 5000, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    price = np.round(np.exp(rng.uniform(0.0, np.log(1000.0), n)), 2)
    quantity = rng.integers(2, 10, n).astype(float)
    speed, hours = rng.uniform(5.0, 120.0, n), rng.uniform(0.5, 8.0, n)
    carat = np.exp(rng.uniform(np.log(0.2), np.log(3.0), n))
    total = np.exp(rng.uniform(np.log(300.0), np.log(19000.0), n))
    tasks = {"price x quantity (2-9)": ([price, quantity], price * quantity),
             "speed x hours (0.5-8)": ([speed, hours], speed * hours),
             "price / carat (0.2-3)": ([total, carat], total / carat)}
    print("| task | symlog: best weights | median rel. error | ln|v|: best weights | median rel. error |")
    print("|---|---|---|---|---|")
    for name, (stated, target) in tasks.items():
        ws, es = best_weights(stated, target, symlog, lambda y: np.sign(y) * np.expm1(np.abs(y)))
        wl, el = best_weights(stated, target, lambda v: np.log(np.abs(v)), np.exp)
        print(f"| {name} | {np.round(ws, 3).tolist()} | {es:.3f} | {np.round(wl, 3).tolist()} | {el:.1e} |")


def ratio_batches(n_batches: int, seed: int) -> list[dict]:
    """Texts `w <NUM:a> x <NUM:b> ... y <NUM:a/b>` of ten tokens, 16 to a batch."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n_batches):
        ids = torch.randint(1, 100, (16, 10), generator=g)
        values = torch.zeros(16, 10, dtype=torch.float64)
        a = torch.exp(torch.rand(16, generator=g, dtype=torch.float64) * 8.0)
        b = torch.exp(torch.rand(16, generator=g, dtype=torch.float64) * 2.6 - 1.5)
        ids[:, 0], ids[:, 3], ids[:, 7] = 5, 6, 7  # the same words before each number
        ids[:, 1], ids[:, 4], ids[:, 8] = NUM, NUM, NUM
        values[:, 1], values[:, 4], values[:, 8] = a, b, a / b
        batches.append(dict(input_ids=ids, numeric_values=values, labels=ids.clone(),
                            attention_mask=torch.ones_like(ids)))
    return batches


def ratio_error(model, batches: list[dict]) -> float:
    errors = []
    with torch.no_grad():
        for batch in batches:
            out = model(batch["input_ids"], numeric_values=batch["numeric_values"])
            median = model.value_interval(out.loc_Y[:, 7], out.scale_Y[:, 7])[0]
            truth = batch["numeric_values"][:, 8]
            errors.append((median - truth).abs() / truth)
    return float(torch.cat(errors).median())


def fitted(seeds: list[int], n_batches: int) -> None:
    print("\n| backbone seed | form | a/b median rel. error | held-out NLL: path / read-out alone | step kept |")
    print("|---|---|---|---|---|")
    for seed in seeds:
        for form in ("symlog", "log"):
            torch.manual_seed(seed)
            qwen = Qwen2ForCausalLM(Qwen2Config(
                vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)).eval()
            model = CausalQwenForCausalLM.from_qwen(qwen, num_token_id=NUM, context_values=True,
                                                    context_values_rank=4, context_values_log=form).eval()
            fit = fit_value_head(model, ratio_batches(n_batches, 1), num_row=False)
            print(f"| {seed} | {form} | {ratio_error(model, ratio_batches(4, 2)):.3f} | "
                  f"{fit.context_nll:.3f} / {fit.context_nll_linear:.3f} | {fit.context_step} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the tiny backbone")
    parser.add_argument("--batches", type=int, default=20, help="training batches of 16 texts")
    parser.add_argument("--fit-learning-rate", type=float, help="the path fit's Adam rate (the library's: 1e-2)")
    parser.add_argument("--fit-patience", type=int, help="steps without a better held-out error (the library's: 200)")
    args = parser.parse_args()
    if args.fit_learning_rate is not None:
        path_rows._LEARNING_RATE = args.fit_learning_rate
    if args.fit_patience is not None:
        path_rows._PATIENCE = args.fit_patience
    expressible()
    fitted([int(s) for s in args.seeds.split(",")], args.batches)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
