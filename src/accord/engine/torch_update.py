"""What the strategies built on a plain torch optimizer share (DDP, torch ZeRO-1, FSDP2):
the optimizer, schedule and loss scaler, the token-normalised backward, the update with
clipping, skipping and loss scaling, and the sharded checkpoint. A subclass only
wraps the model."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from accord.distributed.group import DistInfo
from accord.engine.base import Engine, unique_entries
from accord.engine.optim import build_optimizer, build_scheduler
from accord.engine.precision import autocast, build_grad_scaler
from accord.engine.spec import EngineSpec
from accord.engine.state import PendingWrite, load_schedule, load_torch_state, save_schedule, save_torch_state


def _by_layout(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters grouped so that each group's norm is one computation: plain tensors, and
    DTensors per device mesh (under engine.tensor_parallel the split layers live on the TP
    mesh or the 2-D one, the rest are plain tensors or on the data-parallel mesh)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        key = p.device_mesh if isinstance(p, DTensor) else None
        groups.setdefault(key, []).append(p)
    return list(groups.values())


class TorchUpdateEngine(Engine):
    # torch's ZeroRedundancyOptimizer instead of AdamW itself (ZeRO-1 over DDP).
    shard_optimizer = False

    def __init__(
        self,
        module: nn.Module,
        wrapped: nn.Module,
        spec: EngineSpec,
        info: DistInfo,
        device: torch.device,
        total_steps: int,
    ):
        """`module` is the model on `device`, `wrapped` the strategy's wrapper around it
        (its parameters are the ones to optimize: FSDP2 has made them sharded DTensors)."""
        self.device = device
        self.module = module
        self._wrapped = wrapped
        # The data-parallel groups the gradients are averaged over (a TP group's ranks share rows).
        self.world_size = info.world_size // spec.engine.tensor_parallel
        self.precision = spec.engine.precision
        self.max_grad_norm = spec.optim.max_grad_norm
        self.optimizer = build_optimizer(module, spec.optim, device, shard=self.shard_optimizer)
        self.state_optimizer = self.optimizer
        self.scheduler = build_scheduler(self.optimizer, spec.optim, total_steps)
        # fp16 only; it handles FSDP2's DTensor gradients too (found_inf reduced over ranks).
        self.scaler = build_grad_scaler(self.precision, device)
        self._params = [p for p in module.parameters() if p.requires_grad]

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
        groups = _by_layout([p for p in self._params if p.grad is not None])
        norms = []
        for params in groups:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], error_if_nonfinite=False)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        grad_norm = norms[0] if len(norms) == 1 else torch.nn.utils.get_total_norm(norms, error_if_nonfinite=False)
        if not norms:
            grad_norm = torch.zeros((), device=self.device)
        grad_norm = self._whole_norm(grad_norm)
        if self.max_grad_norm is not None:
            for params in groups:
                torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, grad_norm)
        return grad_norm

    def _whole_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The norm of the whole gradient from this rank's: the same here, where every rank
        holds (a shard of) every parameter; pipeline stages combine theirs."""
        return norm

    def step(self, skip_nonfinite: bool = False) -> tuple[torch.Tensor, bool]:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = self.clip_gradients()
        applied = True
        if skip_nonfinite and self.scaler is None and not torch.isfinite(grad_norm).item():
            applied = False  # the same decision on every rank: the norm is of the whole, synced gradient
        elif self.scaler is not None:
            # Skips the update itself when the fp16 gradients overflowed, then adapts the scale.
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, applied

    @property
    def handles_overflow(self) -> bool:
        return self.scaler is not None

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def save_state(self, folder: Path, writer: bool, asynchronous: bool = False) -> PendingWrite | None:
        # Each rank writes its part, keyed by name: any strategy on any world size resumes.
        pending = save_torch_state(self._wrapped, self.optimizer, folder, asynchronous)
        if writer:
            save_schedule(folder, self.scheduler, self.scaler)
        return pending

    def load_state(self, folder: Path) -> None:
        load_torch_state(self._wrapped, self.optimizer, folder)
        load_schedule(folder, self.scheduler, self.scaler)

    def full_tensors(self, writer: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
        # FSDP2's DTensors are gathered one at a time (every rank takes part); plain tensors are whole already.
        for name, tensor in unique_entries(self.module):
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            yield name, (tensor.detach().cpu() if writer else None)
