"""What DeepSpeed ZeRO holds per rank, for `accord plan` (accord.engine.memory): the memory
models of zero1, zero2 and zero3.

Parameters in fp32 (bf16 is autocast, as under DDP/FSDP) or fp16 (DeepSpeed's loss-scaled
fp16 mode); AdamW state and an fp32 master partition of each flat parameter group (weights
decayed / not decayed). ZeRO-1/2 copy it from the parameters whatever their dtype; ZeRO-3
over fp32 parameters steps the parameters' own partition (accord makes DeepSpeed's reuse test
work: accord.engine.deepspeed.engine), so only fp16 parameters have a master copy there.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from accord.engine.memory import Footprint


class ZeroMemory:
    def __init__(self, stage: int):
        self.stage = stage

    def state(self, model: nn.Module, world: int, precision: str, offload: str) -> dict[str, float]:
        params = list(model.parameters())
        trainable = [p for p in params if p.requires_grad]
        total = sum(p.numel() for p in params)
        trained = sum(p.numel() for p in trainable)
        compute = 2 if precision == "fp16" else 4
        groups = [sum(p.numel() for p in trainable if p.ndim >= 2), sum(p.numel() for p in trainable if p.ndim < 2)]
        partition = sum(math.ceil(n / world) for n in groups if n)
        # One AdamW step count per flat group; ZeRO-3 splits each group into layer-sized sub-groups.
        steps = sum(1 for n in groups if n)
        if self.stage == 3:
            from accord.engine.deepspeed.config import zero3_sub_groups

            steps = zero3_sub_groups(
                model, [[p for p in trainable if p.ndim >= 2], [p for p in trainable if p.ndim < 2]], world
            )
        state = {
            "params": compute * (math.ceil(total / world) if self.stage == 3 else total),
            "grads": compute * (partition if self.stage >= 2 else trained),
            "optimizer": 2 * 4 * partition + 4 * steps,
            "master": 0.0 if self.stage == 3 and compute == 4 else 4 * partition,
        }
        if offload != "none":
            state["optimizer"] = state["master"] = 0.0
        if offload == "optimizer+params":
            state["params"] = 0.0
        return state

    def phases(self, footprint: Footprint) -> dict[str, float]:
        """ZeRO-1/2 build flat fp32 groups beside the module's parameters and their master
        partition; the optimizer state is created at resume by a zero step (with gradients)
        and the checkpoint read into it one tensor at a time. ZeRO-3: see _zero3_phases."""
        f = footprint
        if self.stage == 3:
            return self._zero3_phases(f)
        build = f.params + f.master + (f.params if f.compute == 4 else 0.0)
        train = f.params + f.grads + f.optimizer + f.master + max(f.activations, f.update)
        resume = build + f.optimizer + f.grads + f.largest
        return f.peaks(build, train, resume, staged=_staged(f))

    def _zero3_phases(self, f: Footprint) -> dict[str, float]:
        """Built: the partitions (with fp16, also their fp32 master copy) and the flat gradient
        partitions (at initialisation), DeepSpeed's gradient bucket, and transiently one module
        (materialised whole on rank 0) or one unpartitioned sub-group's fp32 gradient buffer
        (initialize_optimizer_states). AdamW's moments come at the first step; the gradient
        partitions and bucket stay allocated between steps. Trained: what it gathers, and on the
        CPU the step's temporaries: one sub-group's flattened gradient and AdamW's (foreach)
        intermediates, about three partitions of one layer. Resumed: built, AdamW's state
        created to load into, and the read, in host memory: a batch of the rows around this
        rank's partitions (at most READ_BUFFER_BYTES, or its whole share of the moments), one
        stored tensor while DCP reads it and the rows of the one that overflows the batch. On a
        GPU only one partition at a time is copied to it."""
        from accord.engine.state import READ_BUFFER_BYTES  # here: it imports torch.distributed.checkpoint

        held = f.params + f.master + f.grads + 4 * _reduce_bucket(f.model)
        at_rest = held + f.optimizer
        build = held + max(f.module_buffer, 4 * f.layer_unit)
        step = 3 * 4 * f.layer_unit / f.world if f.cpu else 0.0
        train = at_rest + max(f.activations + f.gathered, step)
        read = min(READ_BUFFER_BYTES, 2 * f.whole / f.world) + 2 * f.largest if f.cpu else f.largest
        resume = max(build, at_rest + read)
        return f.peaks(build, train, resume, at_rest=at_rest, staged=_staged(f))


def _staged(f: Footprint) -> float:
    """What a checkpoint holds in host memory beside the state: DeepSpeed gathers each tensor
    whole and its owner keeps it until written, a part of at most WRITE_BUFFER_BYTES (or one
    entry) per rank at a time, or under checkpoint.async its whole share (12 bytes per
    parameter / world), which DCP's background write copies once more where torch's
    async_save cannot be told not to."""
    from accord.engine.state import ASYNC_WRITES_OWNED, WRITE_BUFFER_BYTES  # imports torch.distributed.checkpoint

    share = 3 * f.whole / f.world  # fp32 weights and both moments, each tensor kept by one rank
    asynchronous = f.recipe.checkpoint.async_
    kept = share if asynchronous else min(share, max(WRITE_BUFFER_BYTES, 2 * f.largest))
    copies = 2 if asynchronous and not ASYNC_WRITES_OWNED else 1  # DCP's staging copy
    return copies * kept if f.cpu else 0.0


def _reduce_bucket(model: nn.Module) -> int:
    """Elements of DeepSpeed's gradient bucket as accord sizes it (deepspeed_config), or
    DeepSpeed's default where the model names no hidden size."""
    from accord.engine.wrapping import hidden_size

    width = hidden_size(model)
    return width * width if width else 500_000_000


class Zero1Memory(ZeroMemory):
    """ZeRO-1's state in the plan whichever runs it; torch's ZeroRedundancyOptimizer over DDP
    (accord.engine.runs_deepspeed decides) builds, trains and checkpoints as DDP does."""

    def __init__(self):
        super().__init__(1)

    def phases(self, footprint: Footprint) -> dict[str, float]:
        from accord.engine import runs_deepspeed
        from accord.engine.memory import DDP

        if runs_deepspeed(footprint.strategy, footprint.recipe.engine):
            return super().phases(footprint)
        return DDP.phases(footprint)


ZERO1 = Zero1Memory()
ZERO2 = ZeroMemory(2)
ZERO3 = ZeroMemory(3)
