"""Optimizer and learning-rate schedule, the same for every strategy."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from transformers import get_scheduler

from accord.recipe.schema import OptimConfig

_SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """The trainable parameters in AdamW groups: biases and norm weights (1-D tensors) are
    not decayed, as is customary. Every strategy builds its optimizer from these groups."""
    params = [p for p in model.parameters() if p.requires_grad]
    # A ZeRO-3 parameter built partitioned holds an empty stub: its shape is ds_shape.
    ndim = lambda p: len(getattr(p, "ds_shape", p.shape))  # noqa: E731
    groups = [
        {"params": [p for p in params if ndim(p) >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if ndim(p) < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device: torch.device, shard: bool = False
) -> torch.optim.Optimizer:
    """AdamW over param_groups(model). With `shard`, torch's ZeroRedundancyOptimizer wraps
    it: each rank keeps and updates the AdamW state of its share of the parameters (ZeRO-1)."""
    groups = param_groups(model, cfg)
    # The fused kernel is one launch per step instead of several per tensor on GPU.
    settings = {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "fused": device.type == "cuda" or None}
    if shard:
        # Imported here: torch.distributed.optim compiles its functional optimizers with
        # TorchScript at import (CPU time in every process), for zero1 only.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **settings)
    return torch.optim.AdamW(groups, **settings)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """transformers' LambdaLR for optim.schedule over `total_steps` steps (warm-up first)."""
    return _scheduler(optimizer, cfg.schedule, cfg.warmup_steps, total_steps)


@functools.cache
def schedule_multiplier(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The multiplier of the peak learning rate at each step that build_scheduler's LambdaLR
    applies (transformers' own function, taken from a scheduler over a throwaway optimizer):
    checkpoint.lr_on_resume computes a resumed run's schedule through it."""
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    (multiplier,) = _scheduler(probe, schedule, warmup_steps, total_steps).lr_lambdas
    return multiplier


def _scheduler(
    optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return get_scheduler(_SCHEDULES[schedule], optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)
