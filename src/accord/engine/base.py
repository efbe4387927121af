"""What every strategy provides to the training loop."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch import nn

from accord.engine.state import PendingWrite


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
    # engine.tensor_parallel: runs of this many consecutive ranks hold one model between them,
    # see the same rows and compute the same loss.
    tensor_parallel: int = 1
    # engine.expert_parallel: runs of this many consecutive ranks split each MoE layer's experts
    # between them, on different rows.
    expert_parallel: int = 1
    # engine.pipeline_parallel: a step's micro-batches run through the stages in one call
    # (engine.pipeline's train_batch) instead of a forward and backward each.
    pipelined: bool = False

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

    def full_tensors(self, writer: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Collective: each entry of the model's state dict as a whole fp32 CPU tensor, one at
        a time (a sharded one is gathered, handed out and freed before the next), for export.
        Only `writer` receives the tensors (None elsewhere); a tied weight comes once, under
        its first name."""
        for name, tensor in unique_entries(self.module):
            yield name, (tensor.detach().cpu() if writer else None)

    def prepare_frozen(self, model: nn.Module) -> nn.Module:
        """A second, frozen model (DPO's reference) ready for forward passes on this engine's
        device: materialised from its meta-device build, and sharded like the trained model
        where the strategy shards (its forward is then collective, like the policy's)."""
        from accord.models.weights import materialize

        model.requires_grad_(False)
        return materialize(model, self.device).to(self.device).eval()

    @property
    def handles_overflow(self) -> bool:
        """True when inf gradients are expected and handled (fp16 loss scaling skips them)."""
        return False

    @property
    @abstractmethod
    def lr(self) -> float: ...

    @abstractmethod
    def save_state(self, folder: Path, writer: bool, asynchronous: bool = False) -> PendingWrite | None:
        """Collective: model, optimizer, schedule and loss-scaler state into `folder` (which
        exists on every rank): each rank writes its part of the sharded state (engine.state's
        layout), `writer` the small files. With `asynchronous` the tensors are copied to host
        memory and written in the background: the caller waits on what is returned."""

    @abstractmethod
    def load_state(self, folder: Path) -> None:
        """Collective: restore what save_state wrote, whatever the world size and strategy then were."""

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
        """Release what the strategy holds (hooks, buffers); called on every rank. A concrete
        no-op here, not abstract: strategies that hold nothing need not override it."""
        return None


def _local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for a tensor: a DTensor's local shard, a ZeRO-3 parameter's partition."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        with torch.no_grad():
            local = tensor.to_local()
    else:
        local = getattr(tensor, "ds_tensor", None)
    if local is None:
        local = tensor
    return local.numel() * local.element_size()


def unique_entries(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's state-dict entries (parameters as they are: DTensors, ZeRO-3 stubs), each
    tensor once: a tied weight's later names are left out, as save_pretrained leaves them."""
    seen: set[int] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor
