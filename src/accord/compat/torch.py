"""torch internals accord uses.

- nn.Module's own tables of parameters and buffers (models.weights fills a meta-device model
  in place, one module at a time, keeping tied parameters tied);
- a module's `forward` replaced by an instance attribute (nn.Module.__call__ calls
  `self.forward`, so hooks and every wrapper still run around it): the memory levers of
  engine.long_rows and the chunked loss's output layer;
- where a DTensor's local shard sits in the whole tensor (models.weights);
- an LRScheduler's last learning rates, set after its multipliers are replaced
  (checkpoint.lr_on_resume), and which entries of its state are per parameter group
  (engine.state fits a checkpoint's schedule to another strategy's groups);
- the logger of DTensor's redistribution module, whose performance note engine.expert_parallel
  quiets.

Public API is used wherever it does the same: `DTensor.to_local()` for the local shard,
`get_last_lr()` to read the learning rates.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accord.compat import incompatible

if TYPE_CHECKING:
    import torch
    from torch import nn

WRITTEN_FOR = "2.13"

# The entries of an LRScheduler's state_dict (LambdaLR's) that hold one value per parameter group.
SCHEDULER_GROUP_KEYS = ("base_lrs", "_last_lr", "lr_lambdas")


def _missing(what: str, needed_by: str) -> Exception:
    import torch

    return incompatible("torch", torch.__version__, what, needed_by, WRITTEN_FOR)


def _table(module: nn.Module, name: str) -> Any:
    try:
        return module.__dict__[name]
    except KeyError:
        raise _missing(f"nn.Module has no {name!r} table", "accord's weight initialisation") from None


def parameter_table(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The module's own parameters by name: the live table, so that assigning an entry
    replaces the parameter the module uses (as to_empty does), without register_parameter's
    checks."""
    return _table(module, "_parameters")


def buffer_table(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The module's own buffers by name (the live table, as parameter_table)."""
    return _table(module, "_buffers")


def is_persistent_buffer(module: nn.Module, name: str) -> bool:
    """Whether the module's own buffer `name` is in its state dict (register_buffer's `persistent`)."""
    return name not in _table(module, "_non_persistent_buffers_set")


def replace_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    """`module(...)` calls `forward` from now on, inside the module's hooks and any wrapper
    around it: an instance attribute, which nn.Module.__call__ finds before the class's method."""
    module.forward = forward


def local_offset(tensor: Any) -> tuple[int, ...]:
    """Where a DTensor's local shard (`tensor.to_local()`) starts in the whole tensor."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        raise _missing(
            "torch.distributed.tensor._utils.compute_local_shape_and_global_offset", "accord's sharded initialisation"
        ) from None
    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(offset)


def set_last_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, lrs: list[float]) -> None:
    """What `scheduler.get_last_lr()` returns from now on (it steps only forward; a resumed run
    that replaced its multipliers sets the current learning rates itself)."""
    if "_last_lr" not in scheduler.__dict__:
        raise _missing(f"{type(scheduler).__name__} has no '_last_lr'", "resuming with another train.max_steps")
    scheduler._last_lr = list(lrs)


def extension_build_lock(name: str) -> Path:
    """The file torch's JIT build of C++ extension `name` holds while it compiles (in
    TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions); a later build waits while it exists."""
    from torch.utils import cpp_extension

    if not hasattr(cpp_extension, "_get_build_directory"):
        raise _missing("torch.utils.cpp_extension has no '_get_build_directory'", "the DeepSpeed op build check")
    return Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"


def quiet_dtensor_redistribution() -> None:
    """DTensor warns on every gradient norm and export gather of a 2-D shard (one collective per
    mesh dimension instead of one over a flattened pair): a cost it names, not a fault. Its
    logger is named for a private module."""
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
