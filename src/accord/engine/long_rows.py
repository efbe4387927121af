"""Memory levers for long rows, applied to the model before a strategy wraps it:
activation checkpointing (engine.activation_checkpointing: true, or "offload" to keep the
checkpointed layer inputs in host memory) and the tiled MLP (engine.tiled_mlp).

Both change where and when activations live, never what is computed: losses and gradients
equal the plain model's (tested to 1e-6 in fp32).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from accord.compat.torch import replace_forward
from accord.engine.wrapping import enable_activation_checkpointing, layer_modules


def apply_memory_levers(model: nn.Module, engine_cfg, max_length: int, device: torch.device) -> None:
    """engine.activation_checkpointing and engine.tiled_mlp on `model` (the unwrapped model)."""
    if engine_cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    if engine_cfg.activation_checkpointing == "offload":
        offload_saved_activations(model, pin_memory=device.type == "cuda")
    if engine_cfg.tiled_mlp:
        tile_mlps(model, mlp_tiles(engine_cfg.tiled_mlp, max_length, model))


class HostSavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Tensors autograd saves for backward are copied to host memory (pinned on a GPU, so
    the copies back overlap compute) and brought back when backward needs them.

    Like torch.autograd.graph.save_on_cpu, except that parameters stay where they are: a
    layer's weight saved for its input gradient is already held by the model (and under
    FSDP2 / ZeRO-3 is re-gathered for backward anyway), so copying it out and back each step
    would only cost transfer and host memory. Tensors already on the CPU are kept as they
    are, so on a CPU run this changes nothing but the code path.
    """

    def __init__(self, pin_memory: bool):
        def pack(tensor: torch.Tensor):
            if tensor.device.type == "cpu" or isinstance(tensor, nn.Parameter):
                return tensor
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin_memory)
            host.copy_(tensor)  # as torch's save_on_cpu: the copy out is synchronous, the copy back is not
            return (tensor.device, host)

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=pin_memory)

        super().__init__(pack, unpack)


def offload_saved_activations(model: nn.Module, pin_memory: bool) -> None:
    """Every forward of `model` saves its tensors for backward through HostSavedTensors. With
    activation checkpointing those are mostly each layer's input (what checkpointing keeps),
    so the device holds about one layer's activations at a time whatever the depth."""
    plain = model.forward

    def forward(*args, **kwargs):
        with HostSavedTensors(pin_memory):
            return plain(*args, **kwargs)

    replace_forward(model, forward)  # every wrapper (DDP, FSDP2, DeepSpeed) calls it


def mlp_tiles(setting: bool | int, max_length: int, model: nn.Module) -> int:
    """How many sequence tiles each MLP call is split into. `true`: tiles of about
    hidden_size tokens (DeepSpeed's TiledMLP rule: a tile's intermediate activations are
    then about the size of one MLP weight), counted from data.max_length so that every rank
    makes the same number of calls (ZeRO-3 gathers parameters per call)."""
    if setting is True:
        hidden = getattr(model.config, "hidden_size", None) or max_length
        return max(1, math.ceil(max_length / hidden))
    return int(setting)


def tile_mlps(model: nn.Module, tiles: int) -> None:
    """Each decoder layer's `mlp` runs `tiles` slices of the sequence one after another, each
    under torch.utils.checkpoint: its intermediate activations (gate, up, their product:
    rows × intermediate_size each) exist for one tile at a time, in forward and in backward,
    at the price of a second MLP forward in backward (a third with activation checkpointing).

    Why not DeepSpeed's TiledMLP (ulysses_sp): its backward runs torch.autograd.backward once
    per tile, so each weight's gradient is accumulated once per tile; DeepSpeed's ZeRO is told
    to wait for the last one, but DDP's and FSDP2's gradient hooks would fire per tile (its
    own comment: "DDP, FSDP will need something similar"). Here the tiles are ordinary
    branches of one graph: autograd sums a weight's tile gradients before accumulating once.
    A dense MLP is position-wise, so the values are the untiled ones (up to how the matrix
    products block their sums); a mixture-of-experts block is not tiled (its routing and
    auxiliary outputs are not a position-wise tensor).
    """
    if tiles < 2:
        return
    config = getattr(model, "config", None)
    if any(getattr(config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ValueError(
            f"engine.tiled_mlp: {type(model).__name__} has mixture-of-experts MLPs, which accord does not tile; "
            "set engine.tiled_mlp=false"
        )
    layers = layer_modules(model)
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    if not layers or any(not isinstance(m, nn.Module) for m in mlps):
        raise ValueError(
            f"engine.tiled_mlp: {type(model).__name__}'s decoder layers have no `mlp` module to tile; "
            "set engine.tiled_mlp=false"
        )
    for mlp in mlps:
        _tile(mlp, tiles)


def _tile(mlp: nn.Module, tiles: int) -> None:
    if "_accord_plain_forward" in mlp.__dict__:
        return
    plain = mlp.forward
    mlp._accord_plain_forward = plain

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        # tensor_split gives exactly `tiles` pieces (some empty on a short row): the same
        # number of module calls on every rank.
        pieces = torch.tensor_split(hidden, tiles, dim=-2)
        if not torch.is_grad_enabled():
            return torch.cat([plain(piece) for piece in pieces], dim=-2)
        # Non-reentrant checkpoint per tile; nothing random inside an MLP to replay.
        return torch.cat(
            [checkpoint(plain, piece, use_reentrant=False, preserve_rng_state=False) for piece in pieces], dim=-2
        )

    replace_forward(mlp, forward)
