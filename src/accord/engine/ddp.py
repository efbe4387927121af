"""Data parallelism with torch's DistributedDataParallel (a plain model for one process)."""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accord.distributed.batch_plan import BatchPlan
from accord.distributed.group import DistInfo
from accord.engine.long_rows import apply_memory_levers
from accord.engine.spec import EngineSpec
from accord.engine.torch_update import TorchUpdateEngine
from accord.models.vision import leaves_parameters_unused
from accord.models.weights import materialize


def build(
    spec: EngineSpec, model: nn.Module, info: DistInfo, device: torch.device, plan: BatchPlan, total_steps: int
) -> TorchUpdateEngine:
    if spec.engine.pipeline_parallel > 1:  # replicated over the pipelines (engine/pipeline/)
        from accord.engine.pipeline.engine import build as pipelined

        return pipelined(spec, model, info, device, total_steps)
    return DDPEngine(model, spec, info, device, total_steps)


class DDPEngine(TorchUpdateEngine):
    def __init__(self, model: nn.Module, spec: EngineSpec, info: DistInfo, device: torch.device, total_steps: int):
        self.tensor_parallel = spec.engine.tensor_parallel
        self.expert_parallel = spec.engine.expert_parallel
        if self.tensor_parallel > 1 or self.expert_parallel > 1:
            split = self._tensor_parallel if self.tensor_parallel > 1 else self._expert_parallel
            super().__init__(model, split(model, spec, info, device), spec, info, device, total_steps)
            return
        materialize(model, device)  # a meta-device model gets its (per-name seeded or loaded) values
        model.to(device)
        apply_memory_levers(model, spec.engine, spec.max_length, device)
        wrapped = model
        if info.world_size > 1:
            wrapped = DistributedDataParallel(
                model,
                device_ids=[device.index] if device.type == "cuda" else None,
                gradient_as_bucket_view=True,
                find_unused_parameters=leaves_parameters_unused(model),
                **_no_buffer_sync_per_forward(),
            )
        super().__init__(model, wrapped, spec, info, device, total_steps)

    def _tensor_parallel(self, model: nn.Module, spec: EngineSpec, info: DistInfo, device: torch.device) -> nn.Module:
        """engine.tensor_parallel: split the layers over each TP group, then replicate over the
        data-parallel groups. DDP cannot hold DTensor parameters, so the replication is FSDP2's
        hybrid mode with shards of one rank (an all-reduce of the gradients over "dp", as DDP
        does; nothing is sharded)."""
        from torch.distributed.fsdp import fully_shard

        from accord.engine.tensor_parallel import parallelize
        from accord.engine.wrapping import ensure_process_group

        ensure_process_group(device)
        apply_memory_levers(model, spec.engine, spec.max_length, device)
        mesh = parallelize(model, self.tensor_parallel, info.world_size, device, ("dp", "dp_shard", "tp"))
        if info.world_size > self.tensor_parallel:
            fully_shard(model, mesh=mesh["dp", "dp_shard"])
        materialize(model, device)
        return model.to(device)

    def _expert_parallel(self, model: nn.Module, spec: EngineSpec, info: DistInfo, device: torch.device) -> nn.Module:
        """engine.expert_parallel: split the experts over each EP group, then replicate the rest
        over every rank, with FSDP2's hybrid mode with shards of one rank as under TP (DDP cannot
        hold the experts' DTensors)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from accord.engine.expert_parallel import shard_experts
        from accord.engine.wrapping import ensure_process_group

        ensure_process_group(device)
        apply_memory_levers(model, spec.engine, spec.max_length, device)
        shard_experts(model, self.expert_parallel, info.world_size, device, replicate=True)
        dense = init_device_mesh(device.type, (info.world_size, 1), mesh_dim_names=("dp", "dp_shard"))
        fully_shard(model, mesh=dense)
        materialize(model, device)
        return model.to(device)

    @property
    def lockstep(self) -> bool:
        # A TP group's forward is collective, and so is an EP group's (the all-to-all).
        return self.tensor_parallel > 1 or self.expert_parallel > 1

    def sync_context(self, last_micro_step: bool) -> contextlib.AbstractContextManager:
        if last_micro_step or not isinstance(self._wrapped, DistributedDataParallel):
            return contextlib.nullcontext()
        return self._wrapped.no_sync()


def _no_buffer_sync_per_forward() -> dict[str, bool]:
    """Transformer models keep no running statistics, so syncing buffers before every
    forward only costs time. The flag was renamed in recent torch."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}
