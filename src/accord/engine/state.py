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


def save_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, writer: bool) -> None:
    """Collective: every rank takes part in gathering; only `writer` writes."""
    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if writer:
        save_file(_unshared(model_state), folder / MODEL_FILE)
        torch.save(optim_state, folder / OPTIMIZER_FILE)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every rank reads the whole state (checkpoints live on storage all ranks share) and
    keeps its part: all of it under DDP, its shard under a sharded strategy."""
    model_state = load_file(folder / MODEL_FILE)
    optim_state = torch.load(folder / OPTIMIZER_FILE, weights_only=True, map_location="cpu")
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
