"""The engine: process group, device, strategy wrapping, precision and gradient-sync control.

The only layer that knows which strategy wraps the model; the trainer calls the same few
methods (sync_context, autocast, backward, step) whatever the strategy.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import nn

from accord import dist
from accord.batching import BatchPlan
from accord.dist import DistInfo
from accord.engine.base import Engine
from accord.recipe import Recipe

INSTALL_DEEPSPEED = "pip install deepspeed (or pip install 'accord[deepspeed]')"


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def build_engine(recipe: Recipe, model: nn.Module, info: DistInfo, device: torch.device, plan: BatchPlan, total_steps: int) -> Engine:
    engine = _build(recipe, model, info, device, plan, total_steps)
    if recipe.engine.compile:
        engine.compile()
    return engine


def _build(recipe: Recipe, model: nn.Module, info: DistInfo, device: torch.device, plan: BatchPlan, total_steps: int) -> Engine:
    if device.type == "cpu":
        # transformers imports DeepSpeed (when installed) to ask whether ZeRO-3 is active;
        # naming the accelerator spares every run DeepSpeed's "no GPU found" warning.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    strategy = recipe.engine.strategy
    if strategy == "ddp":
        from accord.engine.ddp import DDPEngine

        return DDPEngine(model, recipe, info, device, plan, total_steps)
    if strategy == "fsdp":
        from accord.engine.fsdp import FSDPEngine

        return FSDPEngine(model, recipe, info, device, plan, total_steps)
    if strategy == "zero1" and recipe.engine.offload == "none" and (
        recipe.engine.zero1_implementation == "torch" or (recipe.engine.zero1_implementation == "auto" and not deepspeed_available())
    ):
        from accord.engine.zero_torch import TorchZeroEngine

        why = "as asked (engine.zero1_implementation=torch)" if recipe.engine.zero1_implementation == "torch" else "because DeepSpeed is not installed"
        dist.print0(f"accord: zero1 uses torch's ZeroRedundancyOptimizer over DDP {why}")
        return TorchZeroEngine(model, recipe, info, device, plan, total_steps)
    if strategy in ("zero1", "zero2", "zero3"):
        if not deepspeed_available():
            raise RuntimeError(f"engine.strategy={strategy} needs DeepSpeed, which is not installed: {INSTALL_DEEPSPEED}")
        from accord.engine.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(model, recipe, info, device, plan, total_steps)
    raise ValueError(f"unknown strategy {strategy!r}")


__all__ = ["Engine", "build_engine", "deepspeed_available"]
