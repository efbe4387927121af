"""Which device this worker computes on."""

from __future__ import annotations

import torch

from accord.errors import UserInputError
from accord.recipe.schema import EngineConfig


def wants_cuda(cfg: EngineConfig) -> bool:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserInputError("engine.device=cuda but no CUDA device is visible (use engine.device=auto or cpu)")
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def select_device(cfg: EngineConfig, local_rank: int) -> torch.device:
    """cuda:<local rank> (the launcher restricts visibility to engine.devices), else the CPU."""
    if wants_cuda(cfg):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")
