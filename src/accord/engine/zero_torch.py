"""ZeRO-1 without DeepSpeed: torch's ZeroRedundancyOptimizer over DDP.

Gradients are all-reduced as under DDP; each rank keeps and updates the AdamW state of its
share of the parameters and broadcasts the updated values. Checkpoints have the layout of
every strategy (engine.state): each rank writes the AdamW state of the parameters it owns,
keyed by name, so the optimizer is never consolidated on one rank.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from accord.distributed.group import DistInfo
from accord.engine.ddp import DDPEngine
from accord.engine.spec import EngineSpec
from accord.engine.state import (
    ADAM_KEYS,
    MODEL,
    OPTIM,
    PendingWrite,
    load_schedule,
    read_into,
    save_schedule,
    write_sharded,
)


class TorchZeroEngine(DDPEngine):
    """For several processes (with one there is nothing to shard: zero1.build takes DDP)."""

    shard_optimizer = True

    def __init__(self, model: nn.Module, spec: EngineSpec, info: DistInfo, device: torch.device, total_steps: int):
        super().__init__(model, spec, info, device, total_steps)
        self.state_optimizer = self.optimizer.optim  # the local AdamW over this rank's share

    def _owned(self) -> dict[str, torch.Tensor]:
        """The parameters whose AdamW state this rank keeps (ZeroRedundancyOptimizer gives each
        parameter whole to one rank), by name."""
        mine = {id(p) for group in self.state_optimizer.param_groups for p in group["params"]}
        return {name: p for name, p in self.module.named_parameters() if id(p) in mine}

    def _state(self, create: bool) -> dict:
        """This rank's part of the checkpoint: the (replicated) model, and the AdamW state of the
        parameters it owns, by name (each rank different names, so nothing is consolidated)."""
        model_state = get_model_state_dict(self._wrapped, options=StateDictOptions())
        local = self.state_optimizer.state
        optim = {}
        for name, p in self._owned().items():
            if create and not local.get(p):  # before the first update: created as AdamW would
                local[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
            if p in local and local[p]:
                optim[name] = {key: local[p][key] for key in ADAM_KEYS}
        return {MODEL: model_state, OPTIM: optim}

    def save_state(self, folder: Path, writer: bool, asynchronous: bool = False) -> PendingWrite | None:
        pending = write_sharded(self._state(create=False), folder, asynchronous)
        if writer:
            save_schedule(folder, self.scheduler, self.scaler)
        return pending

    def load_state(self, folder: Path) -> None:
        state = self._state(create=True)
        read_into(state, folder)  # in place: the local AdamW state too
        set_model_state_dict(self._wrapped, state[MODEL], options=StateDictOptions())
        load_schedule(folder, self.scheduler, self.scaler)
