"""`accord plan`: what each strategy holds per GPU, and which fits.

Model state comes from the parameter shapes of the recipe's model, built on the meta
device (no memory, no download): parameters, gradients, AdamW's two moments and step
counters, and DeepSpeed's fp32 master partition, split over the ranks as each strategy
splits them (FSDP2 shards dim 0 of each tensor with torch.chunk; ZeRO partitions flat
groups). Activations are an estimate per layer from the config, micro batch and length.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from accord.batching import BatchPlan, divisors
from accord.recipe import Recipe
from accord.tasks.chunked_loss import chunking_blocker

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
GIB = 2**30


@dataclass
class StrategyPlan:
    strategy: str
    params: float  # bytes per GPU (the largest share, rank 0)
    grads: float
    optimizer: float
    master: float
    activations: float
    micro_batch_size: int
    grad_accum: int

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.master + self.activations

    def as_dict(self) -> dict:
        return asdict(self) | {"total_gib": self.total / GIB}


def meta_model(recipe: Recipe):
    """The recipe's model with meta tensors: shapes and dtypes only, nothing loaded."""
    from transformers import AutoConfig

    from accord.models import apply_lora, auto_class, build_model, build_tokenizer, model_folder
    from accord.tasks import build_task

    tokenizer = build_tokenizer(recipe.model)
    task = build_task(recipe, tokenizer)
    kwargs = task.model_kwargs()  # before the data is read: what the recipe alone fixes (e.g. classify.labels)
    with torch.device("meta"):
        folder = model_folder(recipe.model)
        if folder is not None:
            config = AutoConfig.from_pretrained(folder, trust_remote_code=recipe.model.trust_remote_code, **kwargs)
            model = auto_class(task.model_kind).from_config(config, trust_remote_code=recipe.model.trust_remote_code)
        else:
            model = build_model(recipe.model, tokenizer, recipe.seed, task.model_kind, kwargs, meta=True)
        if recipe.lora is not None:
            model = apply_lora(model, recipe.lora, task.model_kind, recipe.seed)
    return model


def model_state(model, strategy: str, world: int, precision: str, offload: str) -> dict[str, float]:
    """Bytes of model state on rank 0 (which holds the largest share) under `strategy`."""
    params = [p for p in model.parameters()]
    trainable = [p for p in params if p.requires_grad]
    weight = 4  # accord trains fp32 weights (autocast computes in bf16/fp16)
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in trainable)
    adam = lambda n: 2 * 4 * n + 4 * len(trainable) * (n > 0)  # noqa: E731  exp_avg, exp_avg_sq, step
    if strategy == "ddp":
        return {"params": weight * total, "grads": weight * trained, "optimizer": adam(trained), "master": 0.0}
    if strategy == "fsdp":
        local = lambda ps: sum(_chunk0(p, world) for p in ps)  # noqa: E731
        shard = local(trainable)
        return {"params": weight * local(params), "grads": weight * shard, "optimizer": adam(shard), "master": 0.0}
    # DeepSpeed ZeRO: parameters in fp32 (bf16 is autocast, as under DDP/FSDP) or fp16
    # (DeepSpeed's loss-scaled fp16 mode); AdamW state (and an fp32 master copy unless ZeRO-3
    # already partitions fp32 parameters) of this rank's partition of each flat parameter
    # group (weights decayed / not decayed).
    stage = int(strategy[-1])
    compute = 2 if precision == "fp16" else 4
    groups = [sum(p.numel() for p in trainable if p.ndim >= 2), sum(p.numel() for p in trainable if p.ndim < 2)]
    partition = sum(math.ceil(n / world) for n in groups if n)
    keeps_master = stage < 3 or compute != 4
    state = {
        "params": compute * (math.ceil(total / world) if stage == 3 else total),
        "grads": compute * (partition if stage >= 2 else trained),
        "optimizer": 2 * 4 * partition + 4 * sum(1 for n in groups if n),
        "master": 4 * partition if keeps_master else 0.0,
    }
    if offload != "none":
        state["optimizer"] = state["master"] = 0.0
    if offload == "optimizer+params":
        state["params"] = 0.0
    return state


def _chunk0(p: torch.Tensor, world: int) -> int:
    """Elements of rank 0's FSDP2 shard: torch.chunk along dim 0."""
    if p.dim() == 0:
        return p.numel()
    rows = math.ceil(p.shape[0] / world)
    return min(rows, p.shape[0]) * (p.numel() // max(p.shape[0], 1))


def activations(model, micro: int, length: int, precision: str, checkpointing: bool, loss_chunk: int = 0) -> float:
    """Bytes kept for backward: per layer and token about 8h + 4f values in the compute
    dtype (norm inputs and outputs, q/k/v, attention output, the MLP's four f-wide
    tensors; flash/sdpa attention keeps no score matrix), plus the loss's logits: fp32
    logits and their log-softmax for every token, or with the chunked loss (`loss_chunk`
    tokens at a time) about four fp32 chunk × vocabulary tensors (the recomputed logits,
    their softmax and gradients) whatever the length."""
    config = model.config
    h = getattr(config, "hidden_size", 0)
    f = getattr(config, "intermediate_size", 4 * h)
    layers = getattr(config, "num_hidden_layers", 1)
    vocab = getattr(config, "vocab_size", 0)
    element = 2 if precision in ("bf16", "fp16") else 4
    tokens = micro * length
    per_layer = (8 * h + 4 * f) * element * tokens
    kept = layers * h * element * tokens + per_layer if checkpointing else layers * per_layer
    logits = 4 * 4 * min(loss_chunk, tokens) * vocab if loss_chunk else 2 * 4 * tokens * vocab
    return kept + logits


def plan(recipe: Recipe, gpus: int, nodes: int = 1) -> tuple[list[StrategyPlan], int]:
    world = gpus * nodes
    batch = BatchPlan.derive(recipe.batch.global_batch_size, recipe.batch.micro_batch_size, world)
    model = meta_model(recipe)
    # The built-in causal-LM tasks chunk their loss (train.loss_chunk_size); others hold whole logits.
    loss_chunk = recipe.train.loss_chunk_size if recipe.task in ("sft", "pretrain", "dpo") and chunking_blocker(model, recipe) is None else 0
    rows = []
    for strategy in STRATEGIES:
        offload = recipe.engine.offload if strategy.startswith("zero") else "none"
        if offload == "optimizer+params" and strategy != "zero3":
            offload = "optimizer"
        state = model_state(model, strategy, world, recipe.engine.precision, offload)
        act = activations(model, batch.micro_batch_size, recipe.data.max_length, recipe.engine.precision, recipe.engine.activation_checkpointing, loss_chunk)
        rows.append(StrategyPlan(strategy, **state, activations=act, micro_batch_size=batch.micro_batch_size, grad_accum=batch.grad_accum))
    return rows, world


def recommend(rows: list[StrategyPlan], recipe: Recipe, world: int, memory_gib: float, device: str = "GPU") -> str:
    """The cheapest strategy that fits (least communication first), and the largest micro
    batch it can take with the resulting accumulation."""
    budget = memory_gib * GIB
    fitting = [r for r in rows if r.total <= budget]
    if not fitting:
        best = min(rows, key=lambda r: r.total)
        return (
            f"nothing fits in {memory_gib:g} GiB per {device}: the smallest is {best.strategy} at {best.total / GIB:.1f} GiB; "
            f"use more {device}s, engine.activation_checkpointing=true, a smaller batch.micro_batch_size or data.max_length, "
            f"or engine.offload"
        )
    choice = fitting[0]
    per_rank = recipe.batch.global_batch_size // world
    base = choice.total - choice.activations
    per_sequence = choice.activations / choice.micro_batch_size
    fits = [m for m in divisors(per_rank) if base + per_sequence * m <= budget]
    micro = max(fits) if fits else choice.micro_batch_size
    return (
        f"recommended: engine.strategy={choice.strategy} with batch.micro_batch_size={micro} "
        f"({world} × {micro} × {per_rank // micro} accumulation = {recipe.batch.global_batch_size}), "
        f"~{(base + per_sequence * micro) / GIB:.1f} of {memory_gib:.1f} GiB per {device}"
    )


def format_table(rows: list[StrategyPlan], memory_gib: float | None) -> str:
    header = f"{'strategy':9} {'params':>9} {'grads':>9} {'optimizer':>10} {'master':>9} {'activations':>12} {'total GiB':>10}" + ("  fits" if memory_gib else "")
    lines = [header, "-" * len(header)]
    for r in rows:
        cells = [r.params, r.grads, r.optimizer, r.master]
        line = f"{r.strategy:9} " + " ".join(f"{c / GIB:>9.3f}" for c in cells[:3]) + f" {cells[3] / GIB:>9.3f} {r.activations / GIB:>12.3f} {r.total / GIB:>10.3f}"
        if memory_gib:
            line += "  yes" if r.total <= memory_gib * GIB else "  no"
        lines.append(line)
    return "\n".join(lines)
