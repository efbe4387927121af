"""What the strategies need to know about the model: its layers, activation checkpointing,
and a process group even for a single process."""

from __future__ import annotations

import torch
import torch.distributed as torch_dist
from torch import nn

from accord.compat.transformers import no_split_modules


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each layer's activations in backward (transformers' own per-layer
    checkpointing, non-reentrant: it works under DDP, FSDP2 and DeepSpeed alike, and with
    frozen parameters such as LoRA's base weights)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"engine.activation_checkpointing: {type(model).__name__} does not support activation checkpointing; "
            f"set engine.activation_checkpointing=false"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def layer_modules(model: nn.Module, class_name: str | None = None) -> list[nn.Module]:
    """The modules to shard as one unit each (decoder layers), innermost first.

    `class_name` (engine.fsdp_layer_class) names the class; by default the classes the model
    declares in `_no_split_modules`, else the blocks of its largest uniform ModuleList.
    """
    modules = list(model.modules())
    if class_name:
        found = [m for m in modules if type(m).__name__ == class_name]
        if not found:
            raise ValueError(
                f"engine.fsdp_layer_class={class_name}: {type(model).__name__} has no module of that class "
                f"(its repeated blocks: {', '.join(sorted(_block_classes(model))) or 'none found'})"
            )
    else:
        names = set(no_split_modules(model))
        found = [m for m in modules if type(m).__name__ in names and m is not model]
        if not found:
            found = _largest_block_list(model)
    # modules() is pre-order: reversed, every module comes after the modules inside it,
    # which is the order nested sharding needs.
    return list(reversed(found))


def _uniform_lists(model: nn.Module) -> list[nn.ModuleList]:
    return [
        m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(c) for c in m}) == 1
    ]


def _largest_block_list(model: nn.Module) -> list[nn.Module]:
    lists = _uniform_lists(model)
    if not lists:
        return []
    best = max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
    return list(best)


def _block_classes(model: nn.Module) -> set[str]:
    return {type(ml[0]).__name__ for ml in _uniform_lists(model)}


def ensure_process_group(device: torch.device) -> None:
    """Sharded strategies need a process group even for one process (accord's dist.init
    creates none then): a one-rank group on an in-memory store. dist.shutdown destroys it."""
    if torch_dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch_dist.init_process_group(backend, store=torch_dist.HashStore(), rank=0, world_size=1)


def hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    value = getattr(config, "hidden_size", None) if config is not None else None
    return int(value) if isinstance(value, int) else None
