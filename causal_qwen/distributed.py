"""What the model does for data-parallel and sharding engines (DDP, FSDP, DeepSpeed), and nothing else.

The rules (docs/training.md, FSDP and DeepSpeed):

- DDP waits for a gradient of every trainable parameter (unless told to look for unused ones, which it is not under
  activation checkpointing): a loss keeps the parameters a batch leaves unused in its graph with 0 · their sum
  (`keep_in_graph`), which gives them a gradient of exactly 0 and adds no backward pass through the backbone.
- A sharding engine (FSDP, DeepSpeed) all-gathers parameters in the backward pass of the modules it goes through
  and reduces gradients in the order they come, so every rank must build the same graph (`sharded_training`); and a
  parameter read outside its module's forward may be a shard or an empty placeholder, so `keep_in_graph` is called
  only where its parameters are gathered (or not sharded).
- DeepSpeed ZeRO-3 gathers a module's own parameters when the module is called; the action network reads its
  heads' weights without calling the heads, so they are registered as its external parameters
  (`register_zero3_heads`).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["check_zero3_heads", "deepspeed_zero3_enabled", "keep_in_graph", "register_zero3_heads",
           "sharded_training"]


def keep_in_graph(*sources: nn.Module | torch.Tensor | None) -> torch.Tensor | float:
    """0 · Σ of the trainable parameters of `sources` (modules or parameters; None skipped), or 0.0 if none.

    Added to a training loss, it puts those parameters in the graph with a gradient of exactly 0.
    """
    params = [p for source in sources if source is not None
              for p in (source.parameters() if isinstance(source, nn.Module) else (source,)) if p.requires_grad]
    if not params:
        return 0.0
    return 0.0 * torch.stack([p.sum() for p in params]).sum()


def sharded_training() -> bool:
    """Whether this forward runs in a process group and not inside DistributedDataParallel.

    That is: under a sharding engine (FSDP, DeepSpeed), which all-gathers parameters in the backward pass of the
    modules it goes through and reduces gradients in the order they come (DeepSpeed's buckets), so every rank must
    build the same graph; and whose parameters, outside their module's forward, are shards or empty placeholders
    (ZeRO-3 partitions them even in a single process). DDP needs only a gradient of every parameter; a single
    process without a process group needs nothing, and gets `False` from the first, cheap call.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    return nn.parallel.DistributedDataParallel._get_active_ddp_module() is None


def deepspeed_zero3_enabled() -> bool:
    """transformers' flag for a model built under ZeRO-3 (TrainingArguments or HfDeepSpeedConfig made first)."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


def register_zero3_heads(action: nn.Module) -> None:
    """Tell DeepSpeed ZeRO-3 to gather the heads' parameters around `action`'s forward and backward.

    ZeRO-3 partitions every parameter and gathers a module's own parameters when the module is called; the action
    network's forward reads those of `cls_head` and `reg_head` without calling them, which DeepSpeed's
    `register_external_parameter` is for. Idempotent; call it again after replacing a head.
    """
    try:  # in a try block, so that the remote-code copy of this file does not require deepspeed
        from deepspeed import zero
    except ImportError as error:
        raise ImportError("register_zero3_heads is for DeepSpeed ZeRO-3 and needs deepspeed") from error
    for head in (action.cls_head, action.reg_head):
        if head is not None:
            for param in head.parameters():
                zero.register_external_parameter(action, param)


def check_zero3_heads(action: nn.Module) -> None:
    """Raise if ZeRO-3 partitioned the heads and `register_zero3_heads(action)` was not called."""
    weight = action.cls_head.weight
    if hasattr(weight, "ds_id") and id(weight) not in getattr(action, "_external_params", {}):
        raise RuntimeError(
            "DeepSpeed ZeRO-3 partitions the heads, and the action network reads them in its forward: call "
            "model.action.register_zero3_heads() before deepspeed.initialize (CausalQwenTrainer does, and so does "
            "building the model after TrainingArguments with a ZeRO-3 config)"
        )
