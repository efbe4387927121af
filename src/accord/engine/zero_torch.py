"""ZeRO-1 without DeepSpeed: torch's ZeroRedundancyOptimizer over DDP.

Gradients are all-reduced as under DDP; each rank keeps and updates the AdamW state of its
share of the parameters and broadcasts the updated values. Checkpoints have the DDP
format (the optimizer state is consolidated on rank 0 and keyed by parameter name).
"""

from __future__ import annotations

from itertools import chain
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer

from accord.engine.ddp import DDPEngine
from accord.engine.optim import param_groups
from accord.engine.state import load_schedule, read_state_files, save_schedule, write_state_files
from accord.recipe import Recipe


class TorchZeroEngine(DDPEngine):
    def _build_optimizer(self, recipe: Recipe, device: torch.device) -> torch.optim.Optimizer:
        if self.world_size == 1:
            return super()._build_optimizer(recipe, device)  # nothing to shard
        cfg = recipe.optim
        return ZeroRedundancyOptimizer(
            param_groups(self._module, cfg),
            optimizer_class=torch.optim.AdamW,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            fused=device.type == "cuda" or None,
        )

    def _names(self) -> dict[torch.Tensor, str]:
        return {p: name for name, p in self._module.named_parameters()}

    def save_state(self, folder: Path, writer: bool) -> None:
        if not isinstance(self.optimizer, ZeroRedundancyOptimizer):
            return super().save_state(folder, writer)
        model_state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        self.optimizer.consolidate_state_dict(to=0)  # collective; `writer` is rank 0
        if not writer:
            return
        full = self.optimizer.state_dict()
        # Global indices follow the parameter groups' order: translate them into names.
        names = self._names()
        index_names = [names[p] for p in chain.from_iterable(g["params"] for g in self.optimizer.param_groups)]
        state = {index_names[i]: _to_cpu(s) for i, s in full["state"].items() if s is not None}
        groups = [g | {"params": [index_names[i] for i in g["params"]]} for g in full["param_groups"]]
        write_state_files(model_state, {"state": state, "param_groups": groups}, folder)
        save_schedule(folder, self.scheduler, self.scaler)

    def load_state(self, folder: Path) -> None:
        if not isinstance(self.optimizer, ZeroRedundancyOptimizer):
            return super().load_state(folder)
        model_state, optim_state = read_state_files(folder)
        set_model_state_dict(self.model, model_state, options=StateDictOptions(full_state_dict=True))
        names = self._names()
        ordered = [names[p] for p in chain.from_iterable(g["params"] for g in self.optimizer.param_groups)]
        index = {name: i for i, name in enumerate(ordered)}
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
