"""Model and optimizer state of torch-native strategies, as whole (unsharded) tensors.

A checkpoint holds the full model (safetensors) and the full optimizer state keyed by
parameter name, so it can be loaded by any number of processes under any torch strategy:
resuming on a different world size needs no resharding step.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULE_FILE = "schedule.pt"

# The files' layout, whatever the strategy that wrote them:
#   model.safetensors  every entry of model.state_dict(), full fp32 tensors
#   optimizer.pt       {"state": {param name: {"step", "exp_avg", "exp_avg_sq"}},
#                       "param_groups": [{hyper-parameters..., "params": [param names]}]}
#   schedule.pt        {"scheduler": LR scheduler state, "scaler": GradScaler state or None, ...}


def save_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, writer: bool) -> None:
    """Collective: every rank takes part in gathering; only `writer` writes."""
    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if writer:
        write_state_files(model_state, optim_state, folder)


def write_state_files(model_state: dict[str, torch.Tensor], optim_state: dict, folder: Path) -> None:
    save_file(_unshared(model_state), folder / MODEL_FILE)
    torch.save(optim_state, folder / OPTIMIZER_FILE)


def read_state_files(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    model_state = load_file(folder / MODEL_FILE)
    optim_state = torch.load(folder / OPTIMIZER_FILE, weights_only=True, map_location="cpu")
    return model_state, optim_state


def save_schedule(folder: Path, scheduler, scaler: torch.amp.GradScaler | None = None, **extra) -> None:
    torch.save({"scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler else None, **extra}, folder / SCHEDULE_FILE)


def load_schedule(folder: Path, scheduler, scaler: torch.amp.GradScaler | None = None) -> dict:
    """Restores the scheduler (and the GradScaler when both sides have one); returns the whole record."""
    extra = torch.load(folder / SCHEDULE_FILE, weights_only=True)
    scheduler.load_state_dict(extra["scheduler"])
    if scaler is not None and extra.get("scaler") is not None:
        scaler.load_state_dict(extra["scaler"])
    return extra


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every rank reads the whole state (checkpoints live on storage all ranks share) and
    keeps its part: all of it under DDP, its shard under a sharded strategy."""
    model_state, optim_state = read_state_files(folder)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=StateDictOptions(full_state_dict=True),
    )


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): copy the repeats."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if ptr in seen else tensor.contiguous()
        seen.add(ptr)
    return out
