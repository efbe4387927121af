"""The engine: process group, device, strategy wrapping, precision and gradient-sync control.

The only layer that knows which strategy wraps the model; the trainer calls the same few
methods (sync_context, autocast, backward, step) whatever the strategy. Strategies are
found by name in accord.registry.STRATEGIES.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accord.registry import STRATEGIES, load_object

if TYPE_CHECKING:
    import torch
    from torch import nn

    from accord.distributed.batch_plan import BatchPlan
    from accord.distributed.group import DistInfo
    from accord.engine.base import Engine
    from accord.recipe.schema import Recipe

    EngineFactory = Callable[[Recipe, nn.Module, DistInfo, torch.device, BatchPlan, int], Engine]

INSTALL_DEEPSPEED = "pip install deepspeed (or pip install 'accord[deepspeed]')"


def __getattr__(name: str) -> Any:
    # Engine on first use: its module imports torch.distributed.checkpoint (seconds on a
    # busy machine), which the launcher asking accord.engine.device for the device never needs.
    if name == "Engine":
        from accord.engine.base import Engine

        return Engine
    raise AttributeError(f"module 'accord.engine' has no attribute {name!r}")


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def build_engine(
    recipe: Recipe, model: nn.Module, info: DistInfo, device: torch.device, plan: BatchPlan, total_steps: int
) -> Engine:
    """The recipe's strategy around `model` (with Ulysses attention under
    engine.sequence_parallel), compiled when engine.compile asks."""
    if device.type == "cpu":
        # transformers imports DeepSpeed (when installed) to ask whether ZeRO-3 is active;
        # naming the accelerator spares every run DeepSpeed's "no GPU found" warning.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if recipe.engine.sequence_parallel > 1:
        from accord.engine.sequence_parallel.ulysses import install_ulysses

        install_ulysses(recipe, model, info, plan.micro_batch_size)
    factory: EngineFactory = load_object(
        STRATEGIES[recipe.engine.strategy], f"engine.strategy={recipe.engine.strategy}"
    )
    engine = factory(recipe, model, info, device, plan, total_steps)
    if recipe.engine.compile:
        engine.compile()
    return engine


__all__ = ["Engine", "build_engine", "deepspeed_available"]
