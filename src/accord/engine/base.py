"""What every strategy provides to the training loop."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch import nn


class Engine(ABC):
    """Each strategy sets, in its constructor:

    - `device`;
    - `module`: the plain model, for evaluation, generation and saving;
    - `_wrapped`: what holds the strategy's state and hooks (DDP, FSDP2's sharded root,
      DeepSpeed's engine), and runs the training forward;
    - `state_optimizer`: the optimizer whose `state` holds this rank's AdamW tensors (the
      inner one where a wrapper steps it), for model_state_bytes.
    """

    device: torch.device
    module: nn.Module
    _wrapped: nn.Module
    state_optimizer: torch.optim.Optimizer
    _compiled: nn.Module | None = None

    @property
    def train_model(self) -> nn.Module:
        """What the training forward runs: the wrapped model, compiled when asked."""
        return self._compiled if self._compiled is not None else self._wrapped

    def compile(self) -> None:
        """torch.compile the training forward (engine.compile); state and hooks stay on
        the uncompiled wrapper, so checkpoints and gradient sync are unchanged."""
        self._compiled = torch.compile(self._wrapped)

    @abstractmethod
    def sync_context(self, last_micro_step: bool) -> AbstractContextManager:
        """Gradients are synchronised across ranks only on the last micro-step of a step."""

    @abstractmethod
    def autocast(self) -> AbstractContextManager:
        """Mixed precision for the forward pass and the loss."""

    @abstractmethod
    def backward(self, loss_sum: torch.Tensor, global_targets: int) -> None:
        """Back-propagate loss_sum / global_targets, where global_targets counts the targets
        of the whole global batch (all ranks, all micro-steps)."""

    @abstractmethod
    def step(self, skip_nonfinite: bool = False) -> tuple[torch.Tensor, bool]:
        """Clip, update, advance the schedule, zero the gradients. Returns the gradient norm
        before clipping (a device tensor: reading it is the caller's choice of sync point)
        and whether the update was applied.

        The update is not applied only when a non-finite gradient dropped it: with
        `skip_nonfinite` (this reads the norm: one host sync), or where the strategy always
        drops such updates itself (DeepSpeed). An fp16 overflow that loss scaling handles
        counts as applied. Every rank returns the same answer."""

    @property
    def lockstep(self) -> bool:
        """True when every rank must run the same forward passes (sharded parameters are
        gathered collectively in forward): evaluation and generation then keep ranks in step."""
        return False

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        """Collective: the whole model's weights on rank 0 (CPU), for export. None means the
        plain module already holds all of them (nothing to gather)."""
        return None

    @property
    def handles_overflow(self) -> bool:
        """True when inf gradients are expected and handled (fp16 loss scaling skips them)."""
        return False

    @property
    @abstractmethod
    def lr(self) -> float: ...

    @abstractmethod
    def save_state(self, folder: Path, writer: bool) -> None:
        """Collective: model, optimizer, schedule and loss-scaler state into `folder`
        (which exists on every rank); files are written where `writer` is true."""

    @abstractmethod
    def load_state(self, folder: Path) -> None:
        """Collective: restore what save_state wrote, whatever the world size then was."""

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds, from the real tensors: parameters (local
        shards), optimizer state, and master weights when the optimizer updates copies
        (DeepSpeed's fp32 partitions). What `accord plan` predicts."""
        module_params = {id(p) for p in self.module.parameters()}
        optimizer = self.state_optimizer
        states = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        masters = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in module_params]
        return {
            "params": sum(_local_bytes(p) for p in self.module.parameters()),
            "optimizer": sum(_local_bytes(t) for t in states),
            "master": sum(_local_bytes(p) for p in masters),
        }

    def close(self) -> None:
        """Release what the strategy holds (hooks, buffers); called on every rank."""


def _local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for a tensor: a DTensor's local shard, a ZeRO-3 parameter's partition."""
    local = getattr(tensor, "_local_tensor", None)
    if local is None:
        local = getattr(tensor, "ds_tensor", None)
    if local is None:
        local = tensor
    return local.numel() * local.element_size()
