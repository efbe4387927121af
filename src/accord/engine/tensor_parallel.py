"""Tensor parallelism (engine.tensor_parallel: N), with torch's own `torch.distributed.tensor.parallel`.

The ranks form a device mesh ("dp", "tp") whose inner dimension is TP: ranks r*N … r*N+N-1
are one TP group (consecutive ranks, so a group stays inside a node when N divides the
processes per node) and train on the same rows; the data-parallel strategy (ddp, fsdp) runs
over the "dp" dimension. Each decoder layer's attention projections and MLP are split as
the model's own `base_model_tp_plan` says (transformers ships one for Llama, Qwen2 and
Mistral; accord's `LLAMA_STYLE_PLAN` where a config has none; Qwen3's per-head norms need a
gradient sum accord does not map yet, so it is refused): q/k/v and gate/up
column-wise, o and down row-wise, so a layer's attention runs on N-th of the heads and its
MLP on N-th of the intermediate features, with one all-reduce after each. Embeddings, norms
and the output layer stay whole (replicated), so every TP rank computes the same loss.

The parallelised parameters are DTensors; the model is parallelised on the meta device and
each rank then fills only its shards (accord.models.weights), so no rank holds the whole
model. Checkpoints (DCP) and the export read DTensors per tensor as under FSDP2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accord.compat.transformers import text_config
from accord.errors import UserInputError

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

# The module names the plan splits, relative to the base model (transformers' layout for
# Llama-style decoders), used where a config ships no base_model_tp_plan of its own.
LLAMA_STYLE_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
# transformers' plan words accord maps onto torch's ParallelStyles.
STYLES = ("colwise", "rowwise")


def plan_words(config: Any) -> dict[str, str] | None:
    """The base model's plan (module pattern -> transformers' style word): the config's own
    base_model_tp_plan, else accord's Llama-style plan for a config shaped like one."""
    text = text_config(config)
    plan = getattr(text, "base_model_tp_plan", None)
    if plan:
        return dict(plan)
    if getattr(text, "num_attention_heads", None) and getattr(text, "intermediate_size", None):
        return dict(LLAMA_STYLE_PLAN)
    return None


def check_tensor_parallel(n: int, config, world: int | None = None) -> list[str]:
    """What rules out engine.tensor_parallel=`n` for this model config (None: not known yet) on
    `world` processes (None: not known yet), each a one-line message; what the recipe alone
    rules out (strategy, task, LoRA, sequence parallelism) its schema refuses."""
    if n == 1:
        return []
    key = f"engine.tensor_parallel={n}"
    if world is not None and world % n:
        return [
            f"{key} does not divide the {world} processes; use a TP size that divides them "
            f"(or run on a multiple of {n} processes)"
        ]
    if config is None:
        return []
    words = plan_words(config)
    if words is None:
        return [f"{key}: {type(config).__name__} has no tensor-parallel plan (base_model_tp_plan); set it to 1"]
    unknown = sorted({w for w in words.values() if w not in STYLES})
    if unknown:
        return [
            f"{key}: the model's tensor-parallel plan uses {', '.join(unknown)}, which accord does not map onto "
            f"torch's styles yet (colwise and rowwise only); set engine.tensor_parallel=1"
        ]
    text = text_config(config)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    intermediate = getattr(text, "intermediate_size", None)
    for what, count in (("attention heads", heads), ("key/value heads", kv_heads), ("intermediate size", intermediate)):
        if isinstance(count, int) and count % n:
            valid = [d for d in range(2, n * 2 + 1) if all(_divides(d, c) for c in (heads, kv_heads, intermediate))]
            return [
                f"{key} must divide the model's {what} ({count}); "
                f"use {', '.join(map(str, valid)) or 'no value above 1'} or 1"
            ]
    return []


def _divides(d: int, count: Any) -> bool:
    return not isinstance(count, int) or count % d == 0


def data_parallel_mesh(device: torch.device, world: int, tp: int, names: tuple[str, ...] = ("dp", "tp")) -> DeviceMesh:
    """The device mesh of `world` ranks, TP innermost: ("dp", "tp") by default; under ddp
    ("dp", "dp_shard", "tp") with a dp_shard of 1, so FSDP2's hybrid mode replicates over "dp"."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (world // tp, tp) if len(names) == 2 else (world // tp, 1, tp)
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def parallel_styles(config: Any) -> dict[str, Any]:
    """The base model's plan as torch ParallelStyles (module pattern -> style)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {pattern: styles[word]() for pattern, word in (plan_words(config) or {}).items() if word in styles}


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split the model's decoder layers over `tp_mesh` as its plan says (before any data-parallel
    wrapping, on the meta device or on real storage)."""
    from torch.distributed.tensor.parallel import parallelize_module

    config = model.config
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "base_model", model)
    # base_model_tp_plan's patterns are relative to the decoder stack (`layers.*...`).
    parallelize_module(base, tp_mesh, parallel_styles(config))


def refuse(n: int, config, world: int | None = None) -> None:
    problems = check_tensor_parallel(n, config, world)
    if problems:
        raise UserInputError(problems[0])


def parallelize(model: nn.Module, tp: int, world: int, device: torch.device, names: tuple[str, ...]) -> DeviceMesh:
    """Collective: check the model against engine.tensor_parallel=`tp`, build the mesh (`names`,
    TP innermost) and split the model over its "tp" dimension. Returns the mesh."""
    refuse(tp, model.config, world)
    mesh = data_parallel_mesh(device, world, tp, names)
    apply_tensor_parallel(model, mesh["tp"])
    return mesh
