"""Data parallelism with torch's DistributedDataParallel (a plain model for one process)."""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accord.batching import BatchPlan
from accord.dist import DistInfo
from accord.engine.base import Engine
from accord.engine.optim import build_optimizer, build_scheduler
from accord.engine.precision import autocast, build_grad_scaler
from accord.engine.state import load_full_state, load_schedule, save_full_state, save_schedule
from accord.engine.wrapping import enable_activation_checkpointing
from accord.recipe import Recipe


class DDPEngine(Engine):
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

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.precision, self.device)

    def backward(self, loss_sum: torch.Tensor, global_targets: int) -> None:
        # DDP averages gradients over ranks; multiplying by the world size turns that
        # average into the sum, so the result is sum(all token losses) / global_targets.
        loss = loss_sum * (self.world_size / global_targets)
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def step(self, skip_nonfinite: bool = False) -> tuple[torch.Tensor, bool]:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self._params, max_norm)
        stepped = True
        if skip_nonfinite and self.scaler is None and not torch.isfinite(grad_norm).item():
            stepped = False  # identical decision on every rank: the norm is of synced gradients
        elif self.scaler is not None:
            # Skips the update itself when the fp16 gradients overflowed, then adapts the scale.
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, stepped

    @property
    def handles_overflow(self) -> bool:
        return self.scaler is not None

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def save_state(self, folder: Path, writer: bool) -> None:
        save_full_state(self.model, self.optimizer, folder, writer)
        if writer:
            save_schedule(folder, self.scheduler, self.scaler)

    def load_state(self, folder: Path) -> None:
        load_full_state(self.model, self.optimizer, folder)
        load_schedule(folder, self.scheduler, self.scaler)


def _no_buffer_sync_per_forward() -> dict[str, bool]:
    """Transformer models keep no running statistics, so syncing buffers before every
    forward only costs time. The flag was renamed in recent torch."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}
