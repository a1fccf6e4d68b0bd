"""One training step (forward + backward), CausalQwen against Qwen2ForCausalLM, time and peak memory.

Baseline: Qwen2ForCausalLM with the backbone frozen and a trainable untied lm_head, using transformers' own
loss. CausalQwen: built from that very model with `from_qwen` (backbone frozen), in training mode, so its loss
takes the fused chunked path. Both get the same batch of random ids (random weights: no checkpoint is downloaded
here) of shape Qwen2.5-0.5B (hidden 896, 24 layers, vocabulary 151,936), or fewer layers with `--layers`.

Two batches: text only, and one in which every 16th token is a number (`<NUM>` with a value). With numbers the
numeric embedding trains, and its gradient has to pass back through the whole frozen backbone: that backward is
work the baseline never does (its frozen backbone sees no trainable input), so the second row is reported as
what it costs, not as a like-for-like ratio.

Both models live in one process; steps alternate between them, time is the median over `--steps` steps, and peak
memory is the resident high-water mark of one step above the resident size before it (see memory.py); on a GPU
(`--device cuda`) it is torch's peak of allocated memory above what was allocated before the step.

    python benchmarks/bench_training_step.py              # 24 layers, B=2, S=256
    python benchmarks/bench_training_step.py --layers 4   # quick
    python benchmarks/bench_training_step.py --device cuda --dtype bfloat16 --batch 8 --seq 1024
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from memory import peak_kb, reset_peak, resident_kb
from transformers import Qwen2Config, Qwen2ForCausalLM

from causal_qwen import CausalQwenForCausalLM


def qwen25_config(layers: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )


def build_models(layers: int, device: str = "cpu", dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    baseline = Qwen2ForCausalLM(qwen25_config(layers))
    with torch.no_grad():
        baseline.lm_head.weight.copy_(baseline.model.embed_tokens.weight)  # untied copy, as from_qwen makes
    baseline.model.requires_grad_(False)
    causal = CausalQwenForCausalLM.from_qwen(baseline, num_token_id=151_665)
    return baseline.to(device, dtype).train(), causal.to(device, dtype).train()


def make_batch(batch: int, seq: int, with_numbers: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 151_000, (batch, seq), generator=g)
    values = torch.zeros(batch, seq, dtype=torch.float64)
    if with_numbers:
        ids[:, 8::16] = 151_665
        values[:, 8::16] = torch.rand(batch, len(range(8, seq, 16)), generator=g, dtype=torch.float64) * 1000
    return {"input_ids": ids, "numeric_values": values}


def step(model, batch: dict[str, torch.Tensor], causal: bool) -> tuple[float, float]:
    """One forward + backward; returns (seconds, peak MB above the memory in use before it)."""
    model.zero_grad(set_to_none=True)
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        use_hwm = reset_peak()
        before = 1024 * (resident_kb() if use_hwm else peak_kb(False))
    start = time.perf_counter()
    if causal:
        loss = model(batch["input_ids"], numeric_values=batch["numeric_values"], labels=batch["input_ids"]).loss
    else:
        loss = model(batch["input_ids"], labels=batch["input_ids"]).loss
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else 1024 * peak_kb(use_hwm)
    return seconds, (peak - before) / 2**20


def measure(baseline, causal, batch, steps: int) -> dict[str, float]:
    step(baseline, batch, False)  # warm-up: first-call allocations and kernel selection
    step(causal, batch, True)
    times = {"baseline": [], "causal": []}
    peaks = {"baseline": [], "causal": []}
    for _ in range(steps):
        for name, model in (("baseline", baseline), ("causal", causal)):
            seconds, peak = step(model, batch, name == "causal")
            times[name].append(seconds)
            peaks[name].append(peak)
    return {f"{k}_s": statistics.median(v) for k, v in times.items()} | {f"{k}_mb": max(v) for k, v in peaks.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--tf32", action="store_true", help="let CUDA run fp32 products as TF32 (both models)")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = args.tf32

    baseline, causal = build_models(args.layers, args.device, getattr(torch, args.dtype))
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else \
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
    print(f"training step, {args.layers} layers, B={args.batch}, S={args.seq}, {args.dtype}, "
          f"torch {torch.__version__}, {where}{', TF32 on' if args.tf32 else ''}")
    header = f"{'batch':<14}{'Qwen2 s':>9}{'Causal s':>10}{'time ratio':>12}{'Qwen2 MB':>10}{'Causal MB':>11}" \
             f"{'memory ratio':>14}"
    print(header)
    print("-" * len(header))
    for label, with_numbers in (("text only", False), ("with numbers", True)):
        batch = {k: v.to(args.device) for k, v in make_batch(args.batch, args.seq, with_numbers).items()}
        r = measure(baseline, causal, batch, args.steps)
        print(f"{label:<14}{r['baseline_s']:>9.2f}{r['causal_s']:>10.2f}{r['causal_s'] / r['baseline_s']:>11.2f}x"
              f"{r['baseline_mb']:>10.0f}{r['causal_mb']:>11.0f}{r['causal_mb'] / r['baseline_mb']:>13.2f}x")
    print("goal: time ratio <= 1.3x, memory ratio <= 1.0x (text only: the like-for-like comparison)")


if __name__ == "__main__":
    main()
