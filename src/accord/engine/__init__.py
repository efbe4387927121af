"""The engine: process group, device, strategy wrapping, precision and gradient-sync control.

The only layer that knows which strategy wraps the model; the trainer calls the same few
methods (sync_context, autocast, backward, step) whatever the strategy.
"""

from __future__ import annotations

import torch
from torch import nn

from accord.batching import BatchPlan
from accord.dist import DistInfo
from accord.engine.base import Engine
from accord.recipe import Recipe


def build_engine(recipe: Recipe, model: nn.Module, info: DistInfo, device: torch.device, plan: BatchPlan, total_steps: int) -> Engine:
    if recipe.engine.strategy == "ddp":
        from accord.engine.ddp import DDPEngine

        return DDPEngine(model, recipe, info, device, plan, total_steps)
    raise ValueError(f"unknown strategy {recipe.engine.strategy!r}")


__all__ = ["Engine", "build_engine"]
