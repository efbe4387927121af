"""What the strategies built on a plain torch optimizer share (DDP, torch ZeRO-1, FSDP2):
the token-normalised backward, the update with clipping, skipping and loss scaling, and
the checkpoint of the full state."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from accord.engine.base import Engine
from accord.engine.precision import autocast
from accord.engine.state import load_full_state, load_schedule, save_full_state, save_schedule


class TorchUpdateEngine(Engine):
    """Subclasses set world_size, precision, max_grad_norm, model, optimizer, scheduler,
    scaler (None without fp16) and _params (the trainable parameters)."""

    world_size: int
    precision: str
    max_grad_norm: float | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    _params: list[torch.nn.Parameter]

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.precision, self.device)

    def backward(self, loss_sum: torch.Tensor, global_targets: int) -> None:
        # DDP and FSDP2 average gradients over ranks; multiplying by the world size turns
        # that average into the sum, so the gradient is sum(all token losses) / global_targets.
        loss = loss_sum * (self.world_size / global_targets)
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def clip_gradients(self) -> torch.Tensor:
        """Clip to max_grad_norm (when set); the norm of the whole gradient before clipping,
        the same on every rank (FSDP2's sharded gradients combine their shard norms)."""
        grads = [p.grad for p in self._params if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads, error_if_nonfinite=False)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(self._params, self.max_grad_norm, grad_norm)
        return grad_norm

    def step(self, skip_nonfinite: bool = False) -> tuple[torch.Tensor, bool]:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = self.clip_gradients()
        stepped = True
        if skip_nonfinite and self.scaler is None and not torch.isfinite(grad_norm).item():
            stepped = False  # the same decision on every rank: the norm is of the whole, synced gradient
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
        # Full tensors keyed by name, whatever the sharding: any strategy on any world size resumes.
        save_full_state(self.model, self.optimizer, folder, writer)
        if writer:
            save_schedule(folder, self.scheduler, self.scaler)

    def load_state(self, folder: Path) -> None:
        load_full_state(self.model, self.optimizer, folder)
        load_schedule(folder, self.scheduler, self.scaler)
