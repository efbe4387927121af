"""The engine: process group, device, strategy wrapping, precision and gradient-sync control.

The only layer that knows which strategy wraps the model; the trainer calls the same few
methods (sync_context, autocast, backward, step) whatever the strategy. Strategies are
found by name in accord.registry.STRATEGIES, which also says what each one is.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accord import registry
from accord.registry import load_object

if TYPE_CHECKING:
    import torch
    from torch import nn

    from accord.distributed.batch_plan import BatchPlan
    from accord.distributed.group import DistInfo
    from accord.engine.base import Engine
    from accord.engine.spec import EngineSpec
    from accord.recipe.engine import EngineConfig

    # What a strategy's factory is called with (a custom strategy's too: accord.register_strategy).
    EngineFactory = Callable[[EngineSpec, nn.Module, DistInfo, torch.device, BatchPlan, int], Engine]

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


def runs_deepspeed(strategy: str, cfg: EngineConfig, installed: bool | None = None) -> bool:
    """Whether `strategy` runs on DeepSpeed under the recipe's engine section: a DeepSpeed
    strategy does, but one with a torch fallback (zero1) runs torch's ZeroRedundancyOptimizer
    over DDP when engine.zero1_implementation says torch, or says auto and DeepSpeed is not
    installed; offloading always needs DeepSpeed (the recipe refuses it with torch).
    `installed`: whether DeepSpeed is installed (default: look here)."""
    spec = registry.strategy(strategy)
    if not spec.deepspeed:
        return False
    if not spec.torch_fallback or cfg.offload != "none" or cfg.zero1_implementation == "deepspeed":
        return True
    if cfg.zero1_implementation == "torch":
        return False
    return deepspeed_available() if installed is None else installed


def build_engine(
    spec: EngineSpec, model: nn.Module, info: DistInfo, device: torch.device, plan: BatchPlan, total_steps: int
) -> Engine:
    """engine.strategy around `model` (with Ulysses attention under engine.sequence_parallel),
    compiled when engine.compile asks."""
    if device.type == "cpu":
        # transformers imports DeepSpeed (when installed) to ask whether ZeRO-3 is active;
        # naming the accelerator spares every run DeepSpeed's "no GPU found" warning.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    cfg = spec.engine
    if cfg.sequence_parallel > 1:
        from accord.engine.sequence_parallel.ulysses import install_ulysses

        install_ulysses(cfg.sequence_parallel, model, info, plan.micro_batch_size)
    factory: EngineFactory = load_object(registry.strategy(cfg.strategy).factory, f"engine.strategy={cfg.strategy}")
    engine = factory(spec, model, info, device, plan, total_steps)
    if cfg.compile:
        engine.compile()
    return engine


__all__ = ["Engine", "build_engine", "deepspeed_available", "runs_deepspeed"]
