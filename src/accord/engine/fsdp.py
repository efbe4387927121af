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
from accord.engine.optim import build_optimizer, build_scheduler
from accord.engine.precision import _DTYPES, build_grad_scaler
from accord.engine.torch_update import TorchUpdateEngine
from accord.engine.wrapping import broadcast_from_rank0, enable_activation_checkpointing, ensure_process_group, layer_modules
from accord.recipe import Recipe


class FSDPEngine(TorchUpdateEngine):
    def __init__(self, model: nn.Module, recipe: Recipe, info: DistInfo, device: torch.device, plan: BatchPlan, total_steps: int):
        ensure_process_group(device)
        self.device = device
        self.world_size = info.world_size
        self.precision = recipe.engine.precision
        self.max_grad_norm = recipe.optim.max_grad_norm
        model.to(device)
        broadcast_from_rank0(model)
        if recipe.engine.activation_checkpointing:
            # transformers checkpoints each layer's forward, so FSDP's gather hooks stay outside the recompute.
            enable_activation_checkpointing(model)
        mesh = init_device_mesh(device.type, (info.world_size,))
        if self.precision == "no":
            policy = MixedPrecisionPolicy()
        else:
            # Compute in bf16/fp16, keep the sharded master weights in fp32 and reduce gradients in fp32.
            policy = MixedPrecisionPolicy(param_dtype=_DTYPES[self.precision], reduce_dtype=torch.float32)
        self.layers = layer_modules(model, recipe.engine.fsdp_layer_class)
        for layer in self.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.model = self._module = model
        self.optimizer = build_optimizer(model, recipe.optim, device)  # its state is sharded like the parameters
        self.scheduler = build_scheduler(self.optimizer, recipe.optim, total_steps)
        self.scaler = build_grad_scaler(self.precision, device)  # handles DTensor gradients (found_inf reduced over ranks)
        self._params = [p for p in model.parameters() if p.requires_grad]

    @property
    def module(self) -> nn.Module:
        # The sharded model itself: its forward gathers the parameters (see lockstep).
        return self._module

    @property
    def lockstep(self) -> bool:
        return True

    def sync_context(self, last_micro_step: bool) -> contextlib.AbstractContextManager:
        # Without sync FSDP2 keeps accumulating unsharded gradients locally and
        # reduce-scatters their sum on the last micro-step: the same result as one big batch.
        self.model.set_requires_gradient_sync(last_micro_step)
        return contextlib.nullcontext()

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        # Collective: every rank contributes its shards; rank 0 receives the full fp32 tensors.
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if state else None
