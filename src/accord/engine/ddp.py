"""Data parallelism with torch's DistributedDataParallel (a plain model for one process)."""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accord.batching import BatchPlan
from accord.dist import DistInfo
from accord.engine.optim import build_optimizer, build_scheduler
from accord.engine.precision import build_grad_scaler
from accord.engine.torch_update import TorchUpdateEngine
from accord.engine.wrapping import enable_activation_checkpointing
from accord.recipe import Recipe


class DDPEngine(TorchUpdateEngine):
    def __init__(self, model: nn.Module, recipe: Recipe, info: DistInfo, device: torch.device, plan: BatchPlan, total_steps: int):
        self.device = device
        self.world_size = info.world_size
        self.precision = recipe.engine.precision
        self.max_grad_norm = recipe.optim.max_grad_norm
        self._module = model.to(device)
        if recipe.engine.activation_checkpointing:
            enable_activation_checkpointing(self._module)
        if info.world_size > 1:
            self.model = DistributedDataParallel(
                self._module,
                device_ids=[device.index] if device.type == "cuda" else None,
                gradient_as_bucket_view=True,
                **_no_buffer_sync_per_forward(),
            )
        else:
            self.model = self._module
        self.optimizer = self._build_optimizer(recipe, device)
        self.scheduler = build_scheduler(self.optimizer, recipe.optim, total_steps)
        self.scaler = build_grad_scaler(self.precision, device)
        self._params = [p for p in self._module.parameters() if p.requires_grad]

    def _build_optimizer(self, recipe: Recipe, device: torch.device) -> torch.optim.Optimizer:
        return build_optimizer(self._module, recipe.optim, device)

    @property
    def module(self) -> nn.Module:
        return self._module

    def sync_context(self, last_micro_step: bool) -> contextlib.AbstractContextManager:
        if last_micro_step or not isinstance(self.model, DistributedDataParallel):
            return contextlib.nullcontext()
        return self.model.no_sync()

def _no_buffer_sync_per_forward() -> dict[str, bool]:
    """Transformer models keep no running statistics, so syncing buffers before every
    forward only costs time. The flag was renamed in recent torch."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}
