"""Peak memory and time of the classification head + OvR loss, forward and backward: chunked against straightforward.

Both paths are the model's own: *straightforward* is `CausalQwenAction` (loc_S, scale_S as `[1, N, V]` tensors)
followed by `loss.causal_qwen_loss` of its scores; *chunked* is the fused `loss.FusedHead`: the heads-and-loss step
`CausalQwenAction.forward` with `output_distributions` on and off, as the model's forward calls it.
The text-only configuration (no regression head) isolates the classification head, which is where the
`[N, V]` tensors are.
Inputs are loc_U and scale_U of shape `[1, N + 1, C]` (N positions with a label after the shift) and the module's
parameters W_cls `[V, C]`, b_cls, b_noise and a learnable threshold, all fp32 and all requiring gradients.

How memory is measured: CPU tensors in torch have no allocator statistics, so each measurement runs in a fresh
process, which builds its inputs, warms the kernels up on a tiny vocabulary, then resets the kernel's high-water
mark of its resident set (writing 5 to /proc/self/clear_refs) and runs one forward + backward. The reported peak
is VmHWM minus the resident size just before the run: everything the head and loss allocate, gradients included
(W_cls.grad alone is V·C·4 bytes, 545 MB at Qwen2.5-0.5B size), and nothing of the inputs. Where clear_refs cannot
be written, ru_maxrss is used instead (then setup transients could only raise the baseline, never the peak).
Time is the wall time of that same first forward + backward (`--repeats` > 1 adds warm runs and keeps the best).

The straightforward path needs about a dozen `[N, V]` fp32 tensors at once (2.5 GB each at N = 4096), so it is
run only where its estimate fits in the memory available; beyond, its peak is extrapolated linearly from the
measured points and marked as such.

Usage:
    python benchmarks/bench_ovr_head_loss.py [--sizes 4096 16384] [--quick] [--vocab 151936] [--hidden 896]
                                             [--memory-budget-mb 256] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time

import torch
from memory import peak_kb, reset_peak, resident_kb

from causal_qwen import CausalQwenConfig
from causal_qwen.loss import LossTargets, Tiling
from causal_qwen.modeling import CausalQwenAction

QWEN25_VOCAB, QWEN25_HIDDEN = 151_936, 896
MB = 2**20


def build_action(vocab: int, hidden: int, seed: int = 0) -> CausalQwenAction:
    """The action module of a text-only model, with parameters drawn in place (no transient copies)."""
    config = CausalQwenConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, use_numeric=False, num_token_id=None,
        learnable_threshold=True, ovr_threshold=1.0,
    )
    action = CausalQwenAction(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        action.cls_head.weight.normal_(0.0, 0.02, generator=generator)
        action.cls_head.bias.zero_()
        action.b_noise.fill_(0.1)
    return action


def build_inputs(positions: int, hidden: int, vocab: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    loc_u = torch.randn(1, positions + 1, hidden, generator=generator).requires_grad_()
    scale_u = torch.rand(1, positions + 1, hidden, generator=generator).add_(0.05).requires_grad_()
    labels = torch.randint(0, vocab, (1, positions + 1), generator=generator)
    return loc_u, scale_u, labels


def head_and_loss(path: str, action: CausalQwenAction, loc_u, scale_u, labels, budget: int | None) -> torch.Tensor:
    """One forward + backward of the head and its classification loss; returns the loss."""
    targets = LossTargets.from_labels(labels)
    if path == "straightforward":
        loss = action(loc_u, scale_u, targets, output_distributions=True).loss
    else:
        loss = action(loc_u, scale_u, targets, output_distributions=False, tiling=Tiling(memory_budget=budget)).loss
    loss.backward()
    return loss.detach()


def measure(path: str, positions: int, vocab: int, hidden: int, budget: int | None, repeats: int) -> dict:
    """Runs inside the child process: one cold forward + backward measured for memory and time."""
    small = build_action(512, hidden)
    head_and_loss(path, small, *build_inputs(8, hidden, 512), budget)  # loads kernels and thread pools
    del small
    action = build_action(vocab, hidden)
    loc_u, scale_u, labels = build_inputs(positions, hidden, vocab)

    use_hwm = reset_peak()
    baseline = resident_kb()
    start = time.perf_counter()
    loss = head_and_loss(path, action, loc_u, scale_u, labels, budget)
    seconds = time.perf_counter() - start
    peak = peak_kb(use_hwm) - baseline
    for _ in range(repeats - 1):
        for tensor in (loc_u, scale_u, *action.parameters()):
            tensor.grad = None
        start = time.perf_counter()
        head_and_loss(path, action, loc_u, scale_u, labels, budget)
        seconds = min(seconds, time.perf_counter() - start)
    return {"peak_mb": peak / 1024, "seconds": seconds, "loss": loss.item(), "hwm": use_hwm}


def run_child(path: str, positions: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", path, str(positions), "--vocab", str(args.vocab), "--hidden",
               str(args.hidden), "--repeats", str(args.repeats)]
    if args.memory_budget_mb is not None:
        command += ["--memory-budget-mb", str(args.memory_budget_mb)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def available_mb() -> float:
    with open("/proc/meminfo") as meminfo:
        return int(re.search(r"MemAvailable:\s+(\d+)", meminfo.read()).group(1)) / 1024


def straightforward_estimate_mb(positions: int, vocab: int, measured: dict[int, dict]) -> float:
    """Linear in N through the measured points (or 12 fp32 [N, V] tensors before any measurement)."""
    points = sorted((n, r["peak_mb"]) for n, r in measured.items() if "peak_mb" in r)
    if len(points) >= 2:
        (n0, m0), (n1, m1) = points[0], points[-1]
        slope = (m1 - m0) / (n1 - n0)
        return m1 + slope * (positions - n1)
    if len(points) == 1:
        n0, m0 = points[0]
        return m0 * positions / n0
    return 12 * positions * vocab * 4 / MB


def table_row(positions: int, fused: dict, plain: dict[int, dict], vocab: int) -> list[str]:
    if "error" in fused:
        return [str(positions), "failed", fused["error"][:40], "", "", "", ""]
    naive = plain.get(positions)
    if naive is None or "error" in naive:
        naive_mb = straightforward_estimate_mb(positions, vocab, plain)
        reason = "not run" if naive is None else "failed"
        return [str(positions), f"{fused['peak_mb']:.0f}", f"{fused['seconds']:.1f}", f"~{naive_mb:.0f} (extrap.)",
                reason, f"~{naive_mb / fused['peak_mb']:.1f}x", "-"]
    time_ratio = f"{naive['seconds'] / fused['seconds']:.2f}x"
    if abs(naive["loss"] - fused["loss"]) > 1e-4 * abs(naive["loss"]):
        time_ratio += " (LOSS MISMATCH)"
    return [str(positions), f"{fused['peak_mb']:.0f}", f"{fused['seconds']:.1f}", f"{naive['peak_mb']:.0f}",
            f"{naive['seconds']:.1f}", f"{naive['peak_mb'] / fused['peak_mb']:.1f}x", time_ratio]


def format_row(cells: list[str], widths: list[int]) -> str:
    return " | ".join(cell.rjust(width) for cell, width in zip(cells, widths, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", help="values of B·S (positions with a label)")
    parser.add_argument("--quick", action="store_true", help="sizes 256 512 1024 (a few minutes on 2 cores)")
    parser.add_argument("--vocab", type=int, default=QWEN25_VOCAB)
    parser.add_argument("--hidden", type=int, default=QWEN25_HIDDEN)
    parser.add_argument("--memory-budget-mb", type=int, default=None, help="scratch budget of the chunked path")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-straightforward-mb", type=float, default=None,
                        help="skip the straightforward path above this estimate (default: 70%% of MemAvailable)")
    parser.add_argument("--child", nargs=2, metavar=("PATH", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    budget = None if args.memory_budget_mb is None else args.memory_budget_mb * MB
    if args.child:
        path, positions = args.child
        print(json.dumps(measure(path, int(positions), args.vocab, args.hidden, budget, args.repeats)))
        return

    sizes = args.sizes or ([256, 512, 1024] if args.quick else [4096, 16384])
    limit = args.max_straightforward_mb or 0.7 * available_mb()
    print(f"V={args.vocab} C={args.hidden} fp32, threads={torch.get_num_threads()}, forward+backward of head+loss; "
          f"straightforward run only below {limit:.0f} MB (est.)")
    chunked, plain = {}, {}
    for positions in sorted(sizes):
        chunked[positions] = run_child("chunked", positions, args)
        estimate = straightforward_estimate_mb(positions, args.vocab, plain)
        if estimate <= limit:
            plain[positions] = run_child("straightforward", positions, args)
        print(f"  measured N={positions}: chunked {chunked[positions]}, straightforward "
              f"{plain.get(positions, f'skipped (estimate {estimate:.0f} MB)')}", flush=True)

    headers = ["B·S", "chunked MB", "chunked s", "straightfwd MB", "straightfwd s", "mem ratio", "time ratio"]
    rows = [headers] + [table_row(n, chunked[n], plain, args.vocab) for n in sorted(sizes)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(headers))]
    print()
    print(format_row(rows[0], widths))
    print("-+-".join("-" * w for w in widths))
    for row in rows[1:]:
        print(format_row(row, widths))
    print("\nratios are straightforward / chunked; peak MB is the resident high-water mark above the inputs, "
          "gradients included.")


if __name__ == "__main__":
    main()
