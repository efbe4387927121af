"""Expert parallelism (engine.expert_parallel: N), with transformers' own expert-parallel layer.

Ranks r*N … r*N+N-1 form an expert-parallel (EP) group: each MoE layer's fused expert
parameters are split on the expert dimension over the group (rank i of the group holds experts
i*E/N … (i+1)*E/N-1), and every routed token is sent to its expert's rank and back with
all-to-all (transformers' `apply_expert_parallelism`, reached through accord.compat). Unlike
tensor parallelism, the N ranks of a group train on *different* rows: the data-parallel size
stays the world, and the rest of the model (attention, router, embeddings, norms) is
data-parallel over all the ranks as the strategy makes it (ddp: replicated, fsdp: sharded).

Gradients: a dense parameter's gradient is averaged over the world, as without EP. An expert
shard's gradient already holds the tokens of its whole EP group (the all-to-all's backward
brings them), so it is summed over the ranks that hold the same experts (the "dp" dimension:
ranks i, i+N, i+2N …) and divided by the world, not by that dimension's size: with the
trainer's loss scaled by the world (engine.torch_update), both end as the sum over the global
batch's targets divided by their count. FSDP2 does the reduction of both (set_gradient_divide_factor).

The experts are split on the meta device and each rank then fills only its rows
(accord.models.weights); checkpoints (DCP) and the export read the DTensors per tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accord.compat.torch import quiet_dtensor_redistribution
from accord.compat.transformers import EXPERT_STYLES, apply_expert_parallel, expert_plan
from accord.errors import UserInputError
from accord.models.moe import config_experts

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh


def check_expert_parallel(n: int, config, world: int | None = None) -> list[str]:
    """What rules out engine.expert_parallel=`n` for this model config (None: not known yet) on
    `world` processes (None: not known yet), each a one-line message; what the recipe alone
    rules out (strategy, task, LoRA, the other layouts) its schema refuses."""
    if n == 1:
        return []
    key = f"engine.expert_parallel={n}"
    if world is not None and world % n:
        return [
            f"{key} does not divide the {world} processes; use an EP size that divides them "
            f"(or run on a multiple of {n} processes)"
        ]
    if config is None:
        return []
    experts = config_experts(config)
    if experts == 0:
        return [f"{key}: {type(config).__name__} is a dense model (no routed experts to split); set it to 1"]
    if experts % n:
        valid = [str(d) for d in range(2, experts + 1) if experts % d == 0 and (world is None or world % d == 0)]
        fix = f"use {', '.join(valid)} or 1" if valid else "set it to 1"
        return [f"{key} must divide the model's {experts} experts per layer; {fix}"]
    styles = set(expert_plan(config).values())
    if "ep_dispatch_experts" not in styles or styles - set(EXPERT_STYLES):
        return [
            f"{key}: {type(config).__name__} has no expert-parallel plan accord can run (base_model_ep_plan with "
            "fused experts dispatched by all-to-all); set it to 1"
        ]
    return []


def refuse(n: int, config, world: int | None = None) -> None:
    problems = check_expert_parallel(n, config, world)
    if problems:
        raise UserInputError(problems[0])


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that hold a layer's experts (their parameters split over the EP group)."""
    from torch.distributed.tensor import DTensor

    return [
        m
        for m in model.modules()
        if any(isinstance(p, DTensor) for p in m.parameters(recurse=False)) and getattr(m, "_is_expert_parallel", False)
    ]


def shard_experts(
    model: nn.Module, n: int, world: int, device: torch.device, replicate: bool, mp_policy: Any = None
) -> DeviceMesh:
    """Collective: check the model against engine.expert_parallel=`n`, split its experts over the
    EP groups of `n` ranks and wrap each experts module with FSDP2 over the ranks that hold the
    same experts (`replicate`: whole on each, as DDP; else sharded, as FSDP). Returns the expert
    mesh ("dp", "dp_shard", "ep")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    refuse(n, model.config, world)
    quiet_dtensor_redistribution()
    groups = world // n
    shape = (groups, 1, n) if replicate else (1, groups, n)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp", "dp_shard", "ep"))
    # The ranks sharing one batch: none (a dimension of size 1), as every rank has its own rows.
    apply_expert_parallel(model, mesh["ep"], mesh["dp_shard" if replicate else "dp"])
    holders = mesh["dp", "dp_shard"] if replicate else mesh["dp_shard"]
    for module in expert_modules(model):
        fully_shard(module, mesh=holders, mp_policy=mp_policy or MixedPrecisionPolicy())
        # Summed over the holders and divided by the world (see the module's docstring).
        module.set_gradient_divide_factor(float(world))
        if not replicate and groups > 1:
            # A divide factor other than the group's size is a PREMUL_SUM, which gloo lacks: sum in
            # the collective, divide after. Not with one shard (or a replicated one): FSDP2 then
            # divides before its all-reduce, and a forced sum would divide twice.
            module.set_force_sum_reduction_for_comms(True)
    return mesh


def expert_shards(config: Any, expert_parallel: int) -> int:
    """Experts per MoE layer each rank holds under engine.expert_parallel."""
    return config_experts(config) // max(expert_parallel, 1)
