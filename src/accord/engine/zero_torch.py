"""ZeRO-1 without DeepSpeed: torch's ZeroRedundancyOptimizer over DDP.

Gradients are all-reduced as under DDP; each rank keeps and updates the AdamW state of its
share of the parameters and broadcasts the updated values. Checkpoints have the DDP
format (the optimizer state is consolidated on rank 0 and keyed by parameter name).
"""

from __future__ import annotations

from itertools import chain
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from accord.dist import DistInfo
from accord.engine.ddp import DDPEngine
from accord.engine.state import load_schedule, read_state_files, save_schedule, write_state_files
from accord.recipe import Recipe


class TorchZeroEngine(DDPEngine):
    """For several processes (with one there is nothing to shard: zero1.build takes DDP)."""

    shard_optimizer = True

    def __init__(self, model: nn.Module, recipe: Recipe, info: DistInfo, device: torch.device, total_steps: int):
        super().__init__(model, recipe, info, device, total_steps)
        self.state_optimizer = self.optimizer.optim  # the local AdamW over this rank's share

    def _names(self) -> dict[torch.Tensor, str]:
        return {p: name for name, p in self.module.named_parameters()}

    def _names_by_index(self) -> list[str]:
        """Parameter names in the order of the optimizer's global state indices (its groups' order)."""
        names = self._names()
        return [names[p] for p in chain.from_iterable(g["params"] for g in self.optimizer.param_groups)]

    def save_state(self, folder: Path, writer: bool) -> None:
        model_state = get_model_state_dict(self._wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        self.optimizer.consolidate_state_dict(to=0)  # collective; `writer` is rank 0
        if not writer:
            return
        full = self.optimizer.state_dict()
        index_names = self._names_by_index()
        state = {index_names[i]: _to_cpu(s) for i, s in full["state"].items() if s is not None}
        groups = [g | {"params": [index_names[i] for i in g["params"]]} for g in full["param_groups"]]
        write_state_files(model_state, {"state": state, "param_groups": groups}, folder)
        save_schedule(folder, self.scheduler, self.scaler)

    def load_state(self, folder: Path) -> None:
        model_state, optim_state = read_state_files(folder)
        set_model_state_dict(self._wrapped, model_state, options=StateDictOptions(full_state_dict=True))
        names = self._names()
        index = {name: i for i, name in enumerate(self._names_by_index())}
        saved_groups = {g["params"][0]: g for g in optim_state["param_groups"] if g["params"]}
        groups = []
        for group in self.optimizer.param_groups:
            mine = [names[p] for p in group["params"]]
            settings = {k: v for k, v in saved_groups.get(mine[0], group).items() if k != "params"}
            groups.append(settings | {"params": [index[n] for n in mine]})
        state = {index[name]: value for name, value in optim_state["state"].items() if name in index}
        # A full (consolidated) state dict: each rank keeps the state of its own share.
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        load_schedule(folder, self.scheduler, self.scaler)


def _to_cpu(state: dict) -> dict:
    return {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in state.items()}
