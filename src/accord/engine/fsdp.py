"""Fully sharded data parallelism with PyTorch FSDP2 (`fully_shard`).

Each decoder layer is one sharding unit, then the root: parameters, gradients and AdamW
state are split over the ranks (DTensors on a 1-D device mesh) and a layer's parameters
are gathered only while it runs. The same code runs on GPU (NCCL) and CPU (gloo).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from accord.batching import BatchPlan
from accord.dist import DistInfo
from accord.engine.precision import DTYPES
from accord.engine.torch_update import TorchUpdateEngine
from accord.engine.wrapping import broadcast_from_rank0, enable_activation_checkpointing, ensure_process_group, layer_modules
from accord.recipe import Recipe


def build(recipe: Recipe, model: nn.Module, info: DistInfo, device: torch.device, plan: BatchPlan, total_steps: int) -> FSDPEngine:
    return FSDPEngine(model, recipe, info, device, total_steps)


class FSDPEngine(TorchUpdateEngine):
    def __init__(self, model: nn.Module, recipe: Recipe, info: DistInfo, device: torch.device, total_steps: int):
        ensure_process_group(device)
        model.to(device)
        broadcast_from_rank0(model)
        if recipe.engine.activation_checkpointing:
            # transformers checkpoints each layer's forward, so FSDP's gather hooks stay outside the recompute.
            enable_activation_checkpointing(model)
        mesh = init_device_mesh(device.type, (info.world_size,))
        precision = recipe.engine.precision
        if precision == "no":
            policy = MixedPrecisionPolicy()
        else:
            # Compute in bf16/fp16, keep the sharded master weights in fp32 and reduce gradients in fp32.
            policy = MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)
        for layer in layer_modules(model, recipe.engine.fsdp_layer_class):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        # The sharded model is both: its forward gathers the parameters (see lockstep), and
        # the optimizer's state is sharded like them.
        super().__init__(model, model, recipe, info, device, total_steps)

    @property
    def lockstep(self) -> bool:
        return True

    def sync_context(self, last_micro_step: bool) -> contextlib.AbstractContextManager:
        # Without sync FSDP2 keeps accumulating unsharded gradients locally and
        # reduce-scatters their sum on the last micro-step: the same result as one big batch.
        self._wrapped.set_requires_gradient_sync(last_micro_step)
        return contextlib.nullcontext()

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        # Collective: every rank contributes its shards; rank 0 receives the full fp32 tensors.
        state = get_model_state_dict(self._wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if state else None
