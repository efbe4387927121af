"""zero1: DeepSpeed ZeRO-1, or torch's ZeroRedundancyOptimizer over DDP
(engine.zero1_implementation; `auto` takes DeepSpeed when it is installed)."""

from __future__ import annotations

import torch
from torch import nn

from accord.distributed import group as dist
from accord.distributed.batch_plan import BatchPlan
from accord.distributed.group import DistInfo
from accord.engine import runs_deepspeed
from accord.engine.base import Engine
from accord.engine.ddp import DDPEngine
from accord.engine.deepspeed import engine as deepspeed_engine
from accord.engine.spec import EngineSpec
from accord.engine.zero_torch import TorchZeroEngine


def build(
    spec: EngineSpec, model: nn.Module, info: DistInfo, device: torch.device, plan: BatchPlan, total_steps: int
) -> Engine:
    if runs_deepspeed(spec.engine.strategy, spec.engine):
        return deepspeed_engine.build(spec, model, info, device, plan, total_steps)
    why = (
        "as asked (engine.zero1_implementation=torch)"
        if spec.engine.zero1_implementation == "torch"
        else "because DeepSpeed is not installed"
    )
    dist.print0(f"accord: zero1 uses torch's ZeroRedundancyOptimizer over DDP {why}")
    if info.world_size == 1:
        return DDPEngine(model, spec, info, device, total_steps)  # one process: nothing to shard
    return TorchZeroEngine(model, spec, info, device, total_steps)
