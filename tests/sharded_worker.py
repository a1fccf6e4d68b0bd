"""Train a tiny CausalQwen with CausalQwenTrainer for 3 steps: one process, DDP, FSDP2 or DeepSpeed ZeRO-2/3.

Usage (the single process runs the global batch, 2 processes half of it each, under torchrun):

    python tests/sharded_worker.py OUT_DIR ENGINE PER_DEVICE_BATCH [--uneven] [--checkpointing] [--save-steps N]
                                   [--resume CHECKPOINT] [--context-values]

ENGINE is `single`, `ddp`, `fsdp2`, `zero2` or `zero3`; the FSDP2 and DeepSpeed settings are those of
`FSDP2_CONFIG` and `DEEPSPEED_CONFIGS` below (docs/training.md quotes them). The main process writes to OUT_DIR:
`params.pt` (every trainable parameter, whole, gathered from the shards), `losses.json` (the loss of each step),
`loss_parts.json` (the loss parts logged beside it),
`model/` (`trainer.save_model`, a full state dict) and, from every rank, `memory-RANK.json`. With `--uneven`, every
other pair of examples has no number, so that one of 2 ranks gets batches without any.

On a machine without a GPU, accelerate 1.15 runs neither FSDP nor DeepSpeed: it enables FSDP only for accelerator
devices (`AcceleratorState`, whose FSDP branch lists MULTI_GPU, MULTI_XPU, ... but not MULTI_CPU), and for DeepSpeed
it finds no backend without `use_cpu` (so each rank counts itself as process 0 of 1) while `use_cpu` turns
DeepSpeed off. `run_sharding_engines_on_cpu` makes the two choices that accelerate makes on a GPU (gloo for the
backend, FSDP for the distributed type); torch's `fully_shard` and DeepSpeed's CPU accelerator (gloo without
oneCCL) do the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
from pathlib import Path

import torch
from ddp_worker import NUM, dataset
from transformers import Qwen2Config, Qwen2ForCausalLM, TrainingArguments
from worker_exit import exit_worker

from causal_qwen import CausalQwenForCausalLM
from causal_qwen.data.collator import CausalQwenDataCollator
from causal_qwen.training import CausalQwenTrainer

STEPS = 3

FSDP2_CONFIG = {
    "version": 2,
    "reshard_after_forward": True,  # FULL_SHARD
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"],
    "state_dict_type": "FULL_STATE_DICT",
    "cpu_ram_efficient_loading": False,
}

_DEEPSPEED_COMMON = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
    "bf16": {"enabled": False},
    "fp16": {"enabled": False},
}
DEEPSPEED_CONFIGS = {
    "zero2": {**_DEEPSPEED_COMMON, "zero_optimization": {
        "stage": 2, "overlap_comm": False, "contiguous_gradients": True, "reduce_bucket_size": 5e8,
    }},
    "zero3": {**_DEEPSPEED_COMMON, "zero_optimization": {
        "stage": 3, "overlap_comm": False, "contiguous_gradients": True, "reduce_bucket_size": 5e8,
        # 0: every parameter is partitioned, the tiny ones too (by default those under 1e5 elements are not).
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 0,
        "stage3_gather_16bit_weights_on_model_save": True,
    }},
}


def build_model(regression_noise: float = 1.0, context_values: bool = False) -> CausalQwenForCausalLM:
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    return CausalQwenForCausalLM.from_qwen(qwen, num_token_id=NUM, ovr_threshold=1.0, abduction_scale_init=0.1,
                                           regression_noise=regression_noise, context_values=context_values,
                                           context_values_rank=4)


def run_sharding_engines_on_cpu() -> None:
    """Let accelerate run FSDP and DeepSpeed on CPU processes (gloo), as it does on GPUs (see the module's doc)."""
    from accelerate.state import AcceleratorState, DistributedType, PartialState

    if torch.cuda.is_available():
        return
    prepare_backend = PartialState._prepare_backend

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        found = prepare_backend(self, cpu, sagemaker_dp, backend)
        if found[1] == DistributedType.NO and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.MULTI_CPU
        return found

    init = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    PartialState._prepare_backend = _prepare_backend
    AcceleratorState.__init__ = __init__


def full_trainable_parameters(trainer) -> dict[str, torch.Tensor]:
    """Every trainable parameter, whole, on every rank (a collective under FSDP2 and ZeRO-3)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    named = [(n.replace("._checkpoint_wrapped_module", ""), p) for n, p in model.named_parameters() if p.requires_grad]
    if trainer.is_deepspeed_enabled and hasattr(named[0][1], "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {n: p.detach().clone() for n, p in named}
    out = {}
    for n, p in named:
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n] = p.detach().clone()
    return out


def resident_bytes(trainer) -> dict[str, int]:
    """Bytes of the parameters, gradients and optimizer states this rank holds (shards where it holds shards)."""
    seen, totals = set(), {"parameters": 0, "optimizer": 0}

    def add(kind, t):
        if isinstance(t, torch.Tensor) and t.numel():
            if hasattr(t, "to_local"):
                t = t.to_local()
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
            if key not in seen:
                seen.add(key)
                totals[kind] += t.numel() * t.element_size()

    model = trainer.accelerator.unwrap_model(trainer.model)
    for p in model.parameters():
        add("parameters", getattr(p, "ds_tensor", None) if hasattr(p, "ds_tensor") else p)
    optimizer = trainer.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)
    inner = getattr(inner, "optimizer", inner)  # accelerate's wrapper, then DeepSpeed's ZeRO optimizer
    for state in inner.state.values():
        for t in state.values():
            add("optimizer", t)
    for group in inner.param_groups:  # DeepSpeed's fp32 partitions (the inner optimizer's parameters)
        for t in group["params"]:
            add("optimizer", t)
    totals["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return totals


def wrapped(trainer) -> str:
    """What the engine made of the model, so that a test sees the run was sharded as asked."""
    from torch.distributed.fsdp import FSDPModule

    model = trainer.accelerator.unwrap_model(trainer.model)
    if isinstance(model, FSDPModule):
        layer = model.model.layers[0]
        return f"fsdp2 root+layers={isinstance(layer, FSDPModule)}"
    if trainer.is_deepspeed_enabled:
        stage = trainer.accelerator.state.deepspeed_plugin.zero_stage
        return f"deepspeed zero{stage} partitioned={hasattr(model.action.cls_head.weight, 'ds_id')}"
    return type(trainer.model).__name__


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("engine", choices=["single", "ddp", "fsdp2", "zero2", "zero3"])
    parser.add_argument("per_device_batch", type=int)
    parser.add_argument("--uneven", action="store_true")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume")
    parser.add_argument("--regression-noise", type=float, default=1.0)
    parser.add_argument("--value-head-start", action="store_true")
    parser.add_argument("--train-value-features", action="store_true")
    parser.add_argument("--context-values", action="store_true")
    a = parser.parse_args()
    out = Path(a.out_dir)
    run_sharding_engines_on_cpu()

    kwargs = {}
    if a.engine == "fsdp2":
        kwargs.update(use_cpu=True, ddp_backend="gloo", fsdp=True,
                      fsdp_config={**FSDP2_CONFIG, "activation_checkpointing": a.checkpointing})
    elif a.engine in DEEPSPEED_CONFIGS:
        kwargs.update(deepspeed=DEEPSPEED_CONFIGS[a.engine], activation_checkpointing=a.checkpointing)
    else:
        kwargs.update(use_cpu=True, ddp_backend="gloo" if a.engine == "ddp" else None,
                      activation_checkpointing=a.checkpointing)
    # The arguments first: with ZeRO-3 in them, the model is built partitioned (deepspeed.zero.Init).
    args = TrainingArguments(
        output_dir=str(out / "run"), per_device_train_batch_size=a.per_device_batch, max_steps=STEPS,
        learning_rate=1e-2, train_sampling_strategy="sequential", report_to=[], logging_steps=1, seed=0,
        disable_tqdm=True, save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500,
        save_only_model=False, **kwargs,
    )
    if a.engine in DEEPSPEED_CONFIGS:
        # As a user loads a checkpoint: from_pretrained after the arguments, so that under ZeRO-3 the model is built
        # partitioned (deepspeed.zero.Init). Rank 0 writes the start checkpoint, the others wait for it.
        start = out / "start"
        if args.process_index == 0:
            build_model(a.regression_noise, a.context_values).save_pretrained(start)
        torch.distributed.barrier()
        model = CausalQwenForCausalLM.from_pretrained(start)
    else:
        model = build_model(a.regression_noise, a.context_values)
    trainer = CausalQwenTrainer(model=model, args=args, train_dataset=dataset(uneven=a.uneven),
                                data_collator=CausalQwenDataCollator(0), value_head_start=a.value_head_start,
                                train_value_features=a.train_value_features)
    trainer.train(resume_from_checkpoint=a.resume)
    params = full_trainable_parameters(trainer)
    memory = resident_bytes(trainer)
    trainer.save_model(str(out / "model"))
    if trainer.is_world_process_zero():
        (out / "value_head_fit.json").write_text(json.dumps(model.config.value_head_fit))
    rank = trainer.args.process_index
    out.mkdir(parents=True, exist_ok=True)
    if a.engine in ("single", "ddp") and trainer.value_head_start is not None:
        # Each rank's value read-out after its refits (rank 0 fits, the others receive it).
        action = model.action
        torch.save({"weight": action.reg_head.weight.detach().clone(), "bias": action.reg_head.bias.detach().clone(),
                    "log_noise": action.reg_log_noise.detach().clone(),
                    "refits": [step for step, _ in trainer.value_head_start.refits]}, out / f"readout-{rank}.pt")
    (out / f"memory-{rank}.json").write_text(json.dumps({**memory, "engine": a.engine, "wrapped": wrapped(trainer),
                                                         "world_size": trainer.args.world_size}))
    if trainer.is_world_process_zero():
        torch.save(params, out / "params.pt")
        losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
        (out / "losses.json").write_text(json.dumps(losses))
        parts = {e["step"]: {k: e[k] for k in ("loss", "total_loss", "cls_loss_mean", "reg_loss_effective")}
                 for e in trainer.state.log_history if "total_loss" in e}
        (out / "loss_parts.json").write_text(json.dumps(parts))


if __name__ == "__main__":
    main()
    exit_worker()
