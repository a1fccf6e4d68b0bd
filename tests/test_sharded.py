"""FSDP2 and DeepSpeed ZeRO-2/3 on 2 CPU processes (gloo) against one process on the same global batch.

Each run is `tests/sharded_worker.py` (3 steps of CausalQwenTrainer, per-module rates, a tiny Qwen2 with a 512-word
vocabulary): one process with batch 4, or 2 processes under torchrun with batch 2 each, reading the same examples in
the same order. After 3 steps the loss of every step and every trainable parameter agree to fp32 tolerance; the
model each sharded run saves (a full state dict) loads with `from_pretrained` and gives the single process's
outputs; a sharded run resumed from its step-2 checkpoint ends where the uninterrupted run ends. The DeepSpeed tests
need the `deepspeed` package (the `deepspeed` extra) and are skipped without it. Each run writes the bytes of
parameters and optimizer state it holds per rank; docs/training.md quotes them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from causal_qwen import CausalQwenForCausalLM
from causal_qwen.data.collator import CausalQwenDataCollator

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("sharded_worker.py")
sys.path.insert(0, str(WORKER.parent))
from sharded_worker import dataset  # noqa: E402

pytestmark = pytest.mark.distributed

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="needs deepspeed (pip install causal_qwen[deepspeed])")


def _run(out: Path, engine: str, processes: int, *flags: str) -> Path:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH")]))}
    batch = str(4 // processes)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    command = (launcher if processes > 1 else [sys.executable]) + [str(WORKER), str(out), engine, batch, *flags]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}")
    return out


class Runs:
    """Each configuration is run once per session; tests share the results."""

    def __init__(self, root: Path):
        self.root, self.done = root, {}

    def get(self, engine: str, *flags: str, processes: int = 2) -> Path:
        key = (engine, processes, flags)
        if key not in self.done:
            name = "-".join([engine, str(processes), *(f.strip("-").replace("/", "_") for f in flags)])
            self.done[key] = _run(self.root / name, engine, processes, *flags)
        return self.done[key]

    def single(self, *flags: str) -> Path:
        return self.get("single", *flags, processes=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("sharded"))


def assert_same_training(got: Path, want: Path, rtol: float = 1e-5, atol: float = 1e-6) -> float:
    """Same loss at each step and the same trainable parameters; returns the largest absolute difference."""
    losses, expected = (json.loads((d / "losses.json").read_text()) for d in (got, want))
    assert losses.keys() == expected.keys() == {"1", "2", "3"}
    for step in expected:
        assert losses[step] == pytest.approx(expected[step], rel=rtol), step
    a, b = torch.load(got / "params.pt"), torch.load(want / "params.pt")
    assert a.keys() == b.keys() and {"action.cls_head.weight", "numeric_embedding.w_num", "action.reg_log_noise",
                                     "abduction.loc_net.weight"} <= a.keys()
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=name)
    return max((a[n] - b[n]).abs().max().item() for n in b)


def assert_wrapped(run: Path, prefix: str) -> None:
    for rank in (0, 1):
        memory = json.loads((run / f"memory-{rank}.json").read_text())
        assert memory["world_size"] == 2 and memory["wrapped"].startswith(prefix), memory


def assert_saved_model_gives_single_process_outputs(run: Path, single: Path) -> None:
    batch = CausalQwenDataCollator(0)(dataset(4))
    batch = {k: batch[k] for k in ("input_ids", "numeric_values")}
    outputs = []
    for folder in (run / "model", single / "model"):
        model = CausalQwenForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            outputs.append(model(**batch))
    got, want = outputs
    for name in ("loc_S", "scale_S", "loc_Y", "scale_Y"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5, msg=name)


def assert_resume_ends_where_the_run_ends(runs: Runs, engine: str) -> None:
    full = runs.get(engine, "--save-steps", "2")
    checkpoint = full / "run" / "checkpoint-2"
    assert checkpoint.is_dir()
    resumed = runs.get(engine, "--resume", str(checkpoint))
    a, b = torch.load(resumed / "params.pt"), torch.load(full / "params.pt")
    for name in b:
        assert torch.equal(a[name], b[name]), name
    # The log of steps 1 and 2 comes back with the checkpoint's trainer state; step 3 is computed again.
    assert json.loads((resumed / "losses.json").read_text()) == json.loads((full / "losses.json").read_text())


# FSDP2: FULL_SHARD through accelerate's FSDP2 preparation (Trainer's fsdp_config).


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_fsdp2_full_shard_equals_one_process(runs, checkpointing):
    run = runs.get("fsdp2", "--checkpointing") if checkpointing else runs.get("fsdp2", "--save-steps", "2")
    assert_wrapped(run, "fsdp2 root+layers=True")
    assert_same_training(run, runs.single())


def test_fsdp2_with_a_rank_without_numbers_equals_one_process(runs):
    # Rank 1's batches have no number. The numeric embedding and the value head still run on that rank under a
    # sharding engine, so both ranks gather and reduce the same parameters in the same order (docs/training.md),
    # and CausalQwenTrainer divides the regression sum by the step's count of numbers over both ranks.
    run = runs.get("fsdp2", "--uneven", "--checkpointing")
    assert_wrapped(run, "fsdp2")
    assert_same_training(run, runs.single("--uneven", "--checkpointing"))


@pytest.mark.parametrize("engine", ["ddp", "fsdp2", pytest.param("zero3", marks=needs_deepspeed)])
def test_the_context_path_with_a_rank_without_numbers_equals_one_process(runs, engine):
    # The context-value path of docs/design.md §1b: on the rank without numbers it reads nothing, and its parameters
    # stay in the graph (0·params), so every engine gathers and reduces them as on the other rank.
    flags = ("--uneven", "--context-values")
    run = runs.get(engine, *flags)
    single = runs.single(*flags)
    assert {k for k in torch.load(single / "params.pt") if k.startswith("abduction.context_values.")} == {
        f"abduction.context_values.{name}" for name in (
            "query.weight", "query.bias", "key.weight", "key.bias", "key_before.weight", "choice.weight", "choice.bias",
            "mean_score.weight", "mean_score.bias", "guard.weight", "guard.bias", "width.weight", "width.bias",
            "width_by_choice", "mean_width")}
    assert_same_training(run, single)


def test_ddp_with_a_rank_without_numbers_equals_one_process(runs):
    assert_same_training(runs.get("ddp", "--uneven"), runs.single("--uneven"))


def test_ddp_logs_the_loss_parts_of_one_process(runs):
    # Each process holds its share of the step's loss parts; the log averages them over the processes as Trainer
    # averages `loss`, so the parts are the one-process ones and add up to `loss` (rank 1 has no number).
    got, want = (json.loads((run / "loss_parts.json").read_text())
                 for run in (runs.get("ddp", "--uneven"), runs.single("--uneven")))
    assert got.keys() == want.keys() == {"1", "2", "3"}
    for step, parts in want.items():
        assert parts["reg_loss_effective"] > 0 and parts["total_loss"] == pytest.approx(parts["loss"], rel=1e-6)
        assert got[step]["total_loss"] == pytest.approx(got[step]["loss"], rel=1e-6)
        for key, value in parts.items():
            assert got[step][key] == pytest.approx(value, rel=1e-5), (step, key)


def test_fsdp2_saved_model_reloads_and_resume_continues(runs):
    assert_saved_model_gives_single_process_outputs(runs.get("fsdp2", "--save-steps", "2"), runs.single())
    assert_resume_ends_where_the_run_ends(runs, "fsdp2")


# DeepSpeed through Trainer's deepspeed= argument.


@needs_deepspeed
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_equals_one_process(runs, stage):
    run = runs.get(stage, "--save-steps", "2")
    assert_wrapped(run, f"deepspeed {stage} partitioned={stage == 'zero3'}")
    assert_same_training(run, runs.single())


@needs_deepspeed
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_with_a_rank_without_numbers_equals_one_process(runs, stage):
    # ZeRO-2 reduces gradients in buckets filled in the order they come: the same graph on every rank (the value
    # head included, on an empty selection) keeps that order the same.
    assert_same_training(runs.get(stage, "--uneven"), runs.single("--uneven"))


@needs_deepspeed
def test_zero3_saved_model_reloads_and_resume_continues(runs):
    assert_saved_model_gives_single_process_outputs(runs.get("zero3", "--save-steps", "2"), runs.single())
    assert_resume_ends_where_the_run_ends(runs, "zero3")


def test_sharded_ranks_hold_half_the_parameters(runs):
    single = json.loads((runs.single() / "memory-0.json").read_text())
    engines = ["fsdp2"] + (["zero3"] if importlib.util.find_spec("deepspeed") else [])
    for engine in engines:
        run = runs.get(engine, "--save-steps", "2")
        for rank in (0, 1):
            memory = json.loads((run / f"memory-{rank}.json").read_text())
            assert memory["parameters"] < 0.6 * single["parameters"], (engine, rank, memory, single)


@pytest.mark.parametrize("engine", ["fsdp2", pytest.param("zero2", marks=needs_deepspeed)])
def test_value_head_start_reaches_the_sharded_parameters(runs, engine):
    # The engine splits (FSDP) or copies (DeepSpeed's optimizer) the parameters when training starts, so
    # CausalQwenTrainer fits the value head before: the fitted head is the one that trains, and the first loss is
    # lower than without the fit.
    run = runs.get(engine, "--value-head-start")
    fit = json.loads((run / "value_head_fit.json").read_text())
    assert fit["positions"] == 16  # rank 0's half of the 16 examples' 32 numbers; its fit is broadcast
    plain = runs.get(engine, "--save-steps", "2")
    first = [json.loads((r / "losses.json").read_text())["1"] for r in (run, plain)]
    assert first[0] < first[1]


def test_ddp_refits_the_value_readout_on_rank_0_and_broadcasts_it(runs):
    # Each rank reads its own shard of the training set; rank 0's refit is the one every replica holds. (The
    # features train here: by default nothing the value reads trains and nothing is refitted.)
    run = runs.get("ddp", "--value-head-start", "--train-value-features")
    readouts = [torch.load(run / f"readout-{rank}.pt") for rank in (0, 1)]
    assert readouts[0]["refits"] == readouts[1]["refits"] == [3]
    for key in ("weight", "bias", "log_noise"):
        torch.testing.assert_close(readouts[1][key], readouts[0][key], rtol=0, atol=0, msg=key)
    start = json.loads((run / "value_head_fit.json").read_text())
    assert start["positions"] == 16  # rank 0's half of the 16 examples' 32 numbers
