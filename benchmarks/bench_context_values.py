"""One training step (forward + backward) with the context-value path (docs/design.md §1b) on and off.

Two CausalQwen models of Qwen2.5-0.5B's shape (hidden 896, 24 layers, vocabulary 151,936; random weights, so no
checkpoint is read), built by `from_qwen` from one Qwen2 model, so that they differ only in the path. What trains
is what `CausalQwenTrainer` trains at its defaults (docs/training.md): the backbone frozen, the value side (the
read-out, the path, the numeric embedding and the abduction network) held out of the optimizer, so that the
backward stops at the heads; `--train-value-features` trains the numeric embedding and the abduction network too
(the backward then runs through the backbone), and `--train-path` the path. Two batches of `--batch` × `--seq`
random ids: one in which `--numbers` tokens are `<NUM>` with values, and one of text only (where the path has nothing
to read). As in `Trainer`, whose `TrainingArguments.use_cache` is False by default, the steps build no generation
cache (`--use-cache` builds it, as a bare forward does).

Both models live in one process and steps alternate between them, in turn off first and on first (so that neither
model always runs second); the time is the median over `--steps` steps, and the ratio is the path's step time over
the step without it. The quartiles of the ratio within each pair of steps say how much of that ratio is noise. On a
GPU (`--device cuda`) each step is timed between two synchronisations.

    python benchmarks/bench_context_values.py                  # 24 layers, B=1, S=1024, 64 numbers
    python benchmarks/bench_context_values.py --layers 4       # quick (the path's share is then 6x larger)
    python benchmarks/bench_context_values.py --device cuda --dtype bfloat16 --steps 20 --batches 1 8 --kernels

`--kernels` also counts what one step of each model launches: on a GPU the kernels and their summed device time
(torch's profiler), which tell a launch-bound step (the device idle between small kernels) from a computing one; on
a CPU the operators that compute, forward and backward (views excepted, which launch nothing on a GPU).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from causal_qwen import CausalQwenForCausalLM
from causal_qwen.training import value_side_parameters

NUM = 151_665


def build_models(layers: int, train_path: bool, train_features: bool, device: torch.device, dtype: torch.dtype,
                 use_cache: bool = False) -> tuple[CausalQwenForCausalLM, CausalQwenForCausalLM]:
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    ))
    off = CausalQwenForCausalLM.from_qwen(qwen, num_token_id=NUM, context_values=False).train()
    on = CausalQwenForCausalLM.from_qwen(qwen, num_token_id=NUM, context_values=True).train()
    with torch.no_grad():  # a path that reads: random queries, keys and choices rather than the linear-only start
        g = torch.Generator().manual_seed(1)
        for param in on.abduction.context_values.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.05)
    for model in (off, on):  # as `CausalQwenTrainer` holds them
        # As `Trainer` sets it (`TrainingArguments.use_cache`, False by default): a training step keeps no cache.
        model.config.use_cache = use_cache
        for param in value_side_parameters(model, features=not train_features):
            param.requires_grad_(False)
    on.abduction.context_values.requires_grad_(train_path)
    return off.to(device, dtype), on.to(device, dtype)


def make_batch(batch: int, seq: int, numbers: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 151_000, (batch, seq), generator=g)
    values = torch.zeros(batch, seq, dtype=torch.float64)
    if numbers:
        where = torch.linspace(8, seq - 2, numbers).long()
        ids[:, where] = NUM
        values[:, where] = torch.rand(batch, numbers, generator=g, dtype=torch.float64) * 1000
    return {"input_ids": ids.to(device), "numeric_values": values.to(device), "labels": ids.to(device)}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step(model: CausalQwenForCausalLM, batch: dict[str, torch.Tensor]) -> float:
    model.zero_grad(set_to_none=True)
    synchronize(batch["input_ids"].device)
    start = time.perf_counter()
    model(**batch).loss.backward()
    synchronize(batch["input_ids"].device)
    return time.perf_counter() - start


def measure(off, on, batch, steps: int) -> tuple[float, float, tuple[float, float]]:
    """The median step time of each model, and the quartiles of the ratio of the two steps of each pair: how far
    the ratio moves from one pair of steps to the next (a noise the median of a short run does not show)."""
    step(off, batch), step(on, batch)  # warm-up
    times = {"off": [], "on": []}
    for i in range(steps):
        order = (("off", off), ("on", on)) if i % 2 == 0 else (("on", on), ("off", off))
        for name, model in order:
            times[name].append(step(model, batch))
    ratios = [t_on / t_off for t_on, t_off in zip(times["on"], times["off"], strict=True)]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return statistics.median(times["off"]), statistics.median(times["on"]), (quartiles[0], quartiles[-1])


class _ComputingOperators(TorchDispatchMode):
    """Counts the operators that reach the kernels, views excepted (on a GPU a view launches nothing)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def launches(model: CausalQwenForCausalLM, batch: dict[str, torch.Tensor]) -> tuple[int, float]:
    """What one step launches: (kernels, their summed device ms) on a GPU, from torch's profiler; (operators that
    compute, 0) on a CPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    if batch["input_ids"].device.type != "cuda":
        with _ComputingOperators() as counted:
            model(**batch).loss.backward()
        return counted.count, 0.0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(**batch).loss.backward()
        synchronize(batch["input_ids"].device)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return len(kernels), sum(e.time_range.elapsed_us() for e in kernels) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batches", type=int, nargs="+", default=[1], help="batch sizes, each measured in turn")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--numbers", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kernels", action="store_true", help="also count what one step of each model launches")
    parser.add_argument("--train-path", action="store_true", help="let the path's weights train too")
    parser.add_argument("--use-cache", action="store_true",
                        help="build the generation cache in each step, as a model's forward does by default outside "
                             "`Trainer`")
    parser.add_argument("--train-value-features", action="store_true",
                        help="train the numeric embedding and the abduction network (backward through the backbone)")
    args = parser.parse_args()
    if min(args.batches) < 1:
        raise ValueError(f"--batches must be at least 1 each, got {args.batches}")
    if args.numbers < 1 or args.numbers > args.seq - 10:
        raise ValueError(f"--numbers must be in [1, seq - 10], got {args.numbers}")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    off, on = build_models(args.layers, args.train_path, args.train_value_features, device, dtype,
                           args.use_cache)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    print(f"{where}, {args.dtype}, torch {torch.__version__}; {args.layers} layers, S={args.seq},"
          f" path {'trained' if args.train_path else 'held'},"
          f" value features {'trained' if args.train_value_features else 'held'},"
          f" cache {'built' if args.use_cache else 'off (as in Trainer)'}")
    unit = "kernels" if device.type == "cuda" else "computing operators"
    extra = f" {unit} off / on | device ms off / on |" if args.kernels else ""
    print(f"| B | batch | step without the path (s) | with it (s) | ratio | pairs' ratio, quartiles |{extra}")
    print("|---|---|---|---|---|---|" + ("---|---|" if args.kernels else ""))
    for size in args.batches:
        for name, numbers in ((f"{args.numbers} numbers", args.numbers), ("text only", 0)):
            batch = make_batch(size, args.seq, numbers, device)
            t_off, t_on, (low, high) = measure(off, on, batch, args.steps)
            row = f"| {size} | {name} | {t_off:.3f} | {t_on:.3f} | {t_on / t_off:.3f} | {low:.3f} to {high:.3f} |"
            if args.kernels:
                (n_off, ms_off), (n_on, ms_on) = launches(off, batch), launches(on, batch)
                row += f" {n_off} / {n_on} | {ms_off:.1f} / {ms_on:.1f} |"
            print(row, flush=True)

if __name__ == "__main__":
    main()
