"""Fully sharded data parallelism with PyTorch FSDP2 (`fully_shard`).

Each decoder layer is one sharding unit, then the root: parameters, gradients and AdamW
state are split over the ranks (DTensors on a 1-D device mesh) and a layer's parameters
are gathered only while it runs. The same code runs on GPU (NCCL) and CPU (gloo).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from accord.distributed.batch_plan import BatchPlan
from accord.distributed.group import DistInfo
from accord.engine.long_rows import apply_memory_levers
from accord.engine.precision import DTYPES
from accord.engine.spec import EngineSpec
from accord.engine.torch_update import TorchUpdateEngine
from accord.engine.wrapping import ensure_process_group, layer_modules
from accord.models.weights import is_meta, materialize


def build(
    spec: EngineSpec, model: nn.Module, info: DistInfo, device: torch.device, plan: BatchPlan, total_steps: int
) -> TorchUpdateEngine:
    if spec.engine.pipeline_parallel > 1:  # each stage sharded over the pipelines (engine/pipeline/)
        from accord.engine.pipeline.engine import build as pipelined

        return pipelined(spec, model, info, device, total_steps)
    return FSDPEngine(model, spec, info, device, total_steps)


class FSDPEngine(TorchUpdateEngine):
    def __init__(self, model: nn.Module, spec: EngineSpec, info: DistInfo, device: torch.device, total_steps: int):
        ensure_process_group(device)
        # transformers checkpoints each layer's forward, so FSDP's gather hooks stay outside the recompute.
        apply_memory_levers(model, spec.engine, spec.max_length, device)
        self._world = info.world_size
        self.tensor_parallel = spec.engine.tensor_parallel
        self.expert_parallel = spec.engine.expert_parallel
        # Under engine.tensor_parallel the mesh is ("dp", "tp") and FSDP2 shards over "dp" (2-D).
        self._mesh = init_device_mesh(device.type, (info.world_size,)) if self.tensor_parallel == 1 else None
        self._layer_class = spec.engine.fsdp_layer_class
        precision = spec.engine.precision
        if precision == "no":
            self._policy = MixedPrecisionPolicy()
        else:
            # Compute in bf16/fp16, keep the sharded master weights in fp32 and reduce gradients in fp32.
            # Gathering in bf16 (not fp32 under autocast, as the other strategies compute) halves the
            # all-gathers and holds no bf16 copy of every weight until backward; the forward then runs
            # wholly in bf16, a small measured loss gap to ddp (docs/strategies-and-multinode.md).
            self._policy = MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)
        self._shard(model, device)
        # The sharded model is both: its forward gathers the parameters (see lockstep), and
        # the optimizer's state is sharded like them.
        super().__init__(model, model, spec, info, device, total_steps)

    def _shard(self, model: nn.Module, device: torch.device) -> None:
        """Shard each layer, then the root. A meta-device model (accord's own build) is
        sharded before it has storage: each rank then allocates and fills only its shards
        (accord.models.weights), so no process ever holds the whole model."""
        if not is_meta(model):
            model.to(device)  # every rank built the same values (seeded per name)
        mesh = self._mesh
        if self.tensor_parallel > 1:
            from accord.engine.tensor_parallel import parallelize

            mesh = parallelize(model, self.tensor_parallel, self._world, device, ("dp", "tp"))["dp"]
        if self.expert_parallel > 1:
            from accord.engine.expert_parallel import shard_experts

            # The experts are sharded over the ranks that hold the same ones; each layer's
            # other parameters, wrapped next, over every rank.
            shard_experts(model, self.expert_parallel, self._world, device, replicate=False, mp_policy=self._policy)
        for layer in layer_modules(model, self._layer_class):
            fully_shard(layer, mesh=mesh, mp_policy=self._policy)
        fully_shard(model, mesh=mesh, mp_policy=self._policy)
        materialize(model, device)

    def prepare_frozen(self, model: nn.Module) -> nn.Module:
        """A frozen model (DPO's reference) sharded like the policy: its forward is collective too."""
        model.requires_grad_(False)
        self._shard(model, self.device)
        return model.eval()

    @property
    def lockstep(self) -> bool:
        return True

    def sync_context(self, last_micro_step: bool) -> contextlib.AbstractContextManager:
        # Every micro-step reduce-scatters its gradients and adds them to the sharded ones:
        # the same sum as one big batch. Skipping the sync until the last micro-step would
        # save communication, but FSDP2 then keeps the whole model's unsharded gradients on
        # every rank in between (+4 bytes per parameter: more than the rank's shard of the
        # weights and moments at world 2).
        return contextlib.nullcontext()
