"""`accord plan`: what each strategy holds per GPU, and which fits.

Model state comes from the parameter shapes of the recipe's model, built on the meta
device (no memory, no download): parameters, gradients, AdamW's two moments and step
counters, and DeepSpeed's fp32 master partition, split over the ranks as each strategy
splits them (FSDP2 shards dim 0 of each tensor with torch.chunk; ZeRO partitions flat
groups). Activations are an estimate per layer from the config, micro batch and length.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from accord.compat.transformers import attn_implementation
from accord.distributed.batch_plan import BatchPlan, divisors
from accord.engine.long_rows import mlp_tiles
from accord.errors import UserInputError
from accord.recipe.schema import Recipe
from accord.tasks.chunked_loss import chunk_tokens, chunking_blocker

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
PHASES = ("build", "train", "checkpoint", "export", "resume")
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
    # Each phase's own peak per rank, bytes above an empty process's (see phase_peaks).
    phases: dict[str, float] = field(default_factory=dict)
    # Activations per rank under each engine.sequence_parallel the world and model allow.
    sequence_parallel: dict[int, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.master + self.activations

    def as_dict(self) -> dict:
        return asdict(self) | {
            "total_gib": self.total / GIB,
            "phases_gib": {k: v / GIB for k, v in self.phases.items()},
        }


def meta_model(recipe: Recipe):
    """The recipe's model with meta tensors: shapes and dtypes only, nothing loaded."""
    from transformers import AutoConfig

    from accord.models.build import apply_lora, auto_class, build_model, build_tokenizer, model_folder
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
            model = apply_lora(model, recipe.lora, task.model_kind, recipe.seed, recipe.model.path)
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
    # (DeepSpeed's loss-scaled fp16 mode); AdamW state and an fp32 master partition of each
    # flat parameter group (weights decayed / not decayed). ZeRO-1/2 copy it from the
    # parameters whatever their dtype; ZeRO-3 over fp32 parameters steps the parameters' own
    # partition (accord makes DeepSpeed's reuse test work: deepspeed_engine), so only fp16
    # parameters have a master copy there.
    stage = int(strategy[-1])
    compute = 2 if precision == "fp16" else 4
    groups = [sum(p.numel() for p in trainable if p.ndim >= 2), sum(p.numel() for p in trainable if p.ndim < 2)]
    partition = sum(math.ceil(n / world) for n in groups if n)
    # One AdamW step count per flat group; ZeRO-3 splits each group into layer-sized sub-groups.
    steps = sum(1 for n in groups if n)
    if stage == 3:
        from accord.engine.deepspeed.config import zero3_sub_groups

        steps = zero3_sub_groups(
            model, [[p for p in trainable if p.ndim >= 2], [p for p in trainable if p.ndim < 2]], world
        )
    state = {
        "params": compute * (math.ceil(total / world) if stage == 3 else total),
        "grads": compute * (partition if stage >= 2 else trained),
        "optimizer": 2 * 4 * partition + 4 * steps,
        "master": 0.0 if stage == 3 and compute == 4 else 4 * partition,
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


def activations(
    model,
    micro: int,
    length: int,
    precision: str,
    checkpointing: bool | str,
    loss_chunk: int = 0,
    sequence_parallel: int = 1,
    mlp_tiles: int = 1,
) -> float:
    """Bytes kept for backward: per layer and token about 8h + 4f values in the compute
    dtype (norm inputs and outputs, q/k/v, attention output, the MLP's four f-wide
    tensors; flash/sdpa attention keeps no score matrix), plus the loss's logits: fp32
    logits and their log-softmax for every token, or with the chunked loss (`loss_chunk`
    tokens at a time, once the targets exceed one chunk) about four fp32 chunk × vocabulary
    tensors (the recomputed logits, their softmax and gradients) whatever the length.
    Under `sequence_parallel` N a rank holds the tokens of 1/N of each row, and (sdpa and
    eager) the whole row's document mask, one byte per pair of tokens. `checkpointing`
    "offload" keeps the layer inputs in host memory (not counted: off the device);
    `mlp_tiles` divides the MLP's f-wide tensors (one tile's exist at a time)."""
    config = model.config
    h = getattr(config, "hidden_size", 0)
    f = getattr(config, "intermediate_size", 4 * h)
    layers = getattr(config, "num_hidden_layers", 1)
    vocab = getattr(config, "vocab_size", 0)
    element = 2 if precision in ("bf16", "fp16") else 4
    tokens = micro * -(-length // sequence_parallel)
    mask = (
        micro * length * length if sequence_parallel > 1 and "flash" not in (attn_implementation(config) or "") else 0
    )
    per_layer = (8 * h + 4 * f / mlp_tiles) * element * tokens
    inputs = 0 if checkpointing == "offload" else layers * h * element * tokens
    kept = inputs + per_layer if checkpointing else layers * per_layer
    whole = 2 * 4 * tokens * vocab
    # Rows whose targets fit one chunk are computed whole (nothing to gain from recomputing).
    logits = min(whole, 4 * 4 * loss_chunk * vocab) if loss_chunk else whole
    return kept + logits + mask


def phase_peaks(
    model, strategy: str, world: int, state: dict[str, float], activations: float, recipe: Recipe, cpu: bool
) -> dict[str, float]:
    """Bytes rank 0 holds at the peak of each phase, above an empty process's, under
    `strategy`: live tensors on the rank's device (host memory when `cpu`, else the GPU's).

    Every phase keeps the model state it starts from; on top of it:
    - build: a sharded strategy (fsdp, zero3) builds on the meta device and initialises or
      loads one module at a time, whole (accord.models.weights); DDP allocates its gradient
      buckets (gradients are views into them) when it wraps the model; DeepSpeed ZeRO-1/2
      copies the parameters into flat fp32 groups and its master partition. ZeRO-3 allocates
      its flat gradient partitions, its gradient bucket (and under fp16 an fp32 master copy
      of the partitions) at initialisation (they stay; AdamW's moments come at step 1).
    - train: gradients, AdamW's moments (created at step 1), the micro-batch's activations
      and what a sharded strategy gathers: the root's parameters (kept from forward to
      backward) and two layers' (the one running and the one prefetched), plus the running
      layer's whole gradient before its reduce-scatter. AdamW on the CPU updates one tensor
      at a time (one tensor's temporary); on a GPU its fused kernel needs none.
    - checkpoint: the state at rest (gradients are freed after each step) and one tensor
      being serialised; checkpoint.async first copies this rank's state to host memory.
      DeepSpeed gathers each tensor whole and its owner keeps it in host memory until written:
      a part of at most WRITE_BUFFER_BYTES (or one entry) per rank at a time, or under
      checkpoint.async its whole share (12 bytes per parameter / world), which DCP's background
      write copies once more where torch's async_save cannot be told not to.
    - export: the state at rest and the tensor being gathered; the writing rank writes each
      whole tensor to its safetensors shard as it arrives (one at a time, in host memory).
    - resume: the build, then the optimizer state, created by a zero step (with gradients,
      but for DDP's already in its buckets), and the checkpoint read into it one tensor at a
      time (ZeRO-3: a batch of the rows around its partitions, READ_BUFFER_BYTES at most).
    Host memory on the CPU is counted as live bytes: glibc's heap can keep more unless
    engine.release_host_memory is on (see docs/memory-and-plan.md).
    """
    compute = 2 if recipe.engine.precision in ("bf16", "fp16") else 4
    params = list(model.parameters())
    whole = 4 * sum(p.numel() for p in params)
    largest = 4 * max((p.numel() for p in params), default=0)
    module_buffer = 4 * max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    P, G, O, M = state["params"], state["grads"], state["optimizer"], state["master"]  # noqa: N806
    at_rest = P + O + M
    sharded = strategy in ("fsdp", "zero3")
    gathered = 0.0
    if sharded:
        from accord.engine.wrapping import layer_modules

        layers = layer_modules(model, recipe.engine.fsdp_layer_class)
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        unit = max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0)
        root = sum(p.numel() for p in params if id(p) not in in_layers)
        gathered = compute * (root + 2 * unit) + 4 * unit
    update = largest if cpu else 0.0
    if strategy == "ddp" or (strategy == "zero1" and _torch_zero1(recipe)):
        buckets = G if world > 1 else 0.0  # DDP's: the gradients live in them from then on (one process: no DDP)
        build = P + buckets
        train = P + G + O + max(activations, update)
        resume = build + O + (G - buckets) + largest  # measured: the zero step adds nothing beside DDP's buckets
    elif strategy == "fsdp":
        build = P + module_buffer
        train = P + G + O + M + max(activations + gathered, update)
        resume = build + O + M + G + largest
    elif sharded:  # zero3
        from accord.engine.state import READ_BUFFER_BYTES  # here: it imports torch.distributed.checkpoint

        # Built: the partitions (with fp16, also their fp32 master copy) and the flat gradient
        # partitions (at initialisation), DeepSpeed's gradient bucket, and transiently one module
        # (materialised whole on rank 0) or one unpartitioned sub-group's fp32 gradient buffer
        # (initialize_optimizer_states). AdamW's moments come at the first step.
        held = P + M + G + 4 * _reduce_bucket(model)
        at_rest = held + O  # the gradient partitions and bucket stay allocated between steps
        build = held + max(module_buffer, 4 * unit)
        # The step's temporaries on the CPU: one sub-group's flattened gradient and AdamW's
        # (foreach) intermediates, about three partitions of one layer.
        step = 3 * 4 * unit / world if cpu else 0.0
        train = at_rest + max(activations + gathered, step)
        # Built, AdamW's state created to load into, and the read, in host memory: a batch of
        # the rows around this rank's partitions (at most READ_BUFFER_BYTES, or its whole share
        # of the moments), one stored tensor while DCP reads it and the rows of the one that
        # overflows the batch. On a GPU only one partition at a time is copied to it.
        read = min(READ_BUFFER_BYTES, 2 * whole / world) + 2 * largest if cpu else largest
        resume = max(build, at_rest + read)
    else:  # DeepSpeed ZeRO-1/2: flat fp32 groups beside the module's parameters
        build = P + M + (P if compute == 4 else 0.0)
        train = P + G + O + M + max(activations, update)
        resume = build + O + G + largest
    staged = at_rest if recipe.checkpoint.async_ and cpu else 0.0
    if strategy in ("zero2", "zero3") or (strategy == "zero1" and not _torch_zero1(recipe)):  # DeepSpeed
        from accord.engine.state import (  # here: it imports torch.distributed.checkpoint
            ASYNC_WRITES_OWNED,
            WRITE_BUFFER_BYTES,
        )

        share = 3 * whole / world  # fp32 weights and both moments, each tensor kept by one rank
        kept = share if recipe.checkpoint.async_ else min(share, max(WRITE_BUFFER_BYTES, 2 * largest))
        copies = 2 if recipe.checkpoint.async_ and not ASYNC_WRITES_OWNED else 1  # DCP's staging copy
        staged = copies * kept if cpu else 0.0
    checkpoint = max(train, at_rest + largest + staged)
    # The tensor being gathered and, in host memory, the whole copy being written (one at a time).
    export = at_rest + largest + (largest if cpu else 0.0)
    return {"build": build, "train": train, "checkpoint": checkpoint, "export": export, "resume": resume}


def _reduce_bucket(model) -> int:
    """Elements of DeepSpeed's gradient bucket as accord sizes it (deepspeed_config), or
    DeepSpeed's default where the model names no hidden size."""
    from accord.engine.wrapping import hidden_size

    width = hidden_size(model)
    return width * width if width else 500_000_000


def _torch_zero1(recipe: Recipe) -> bool:
    """zero1 runs as torch's ZeroRedundancyOptimizer over DDP (accord.engine.zero1)."""
    from accord.engine import deepspeed_available

    return recipe.engine.offload == "none" and (
        recipe.engine.zero1_implementation == "torch"
        or (recipe.engine.zero1_implementation == "auto" and not deepspeed_available())
    )


def plan(recipe: Recipe, gpus: int, nodes: int = 1, cpu: bool = False) -> tuple[list[StrategyPlan], int]:
    """Each strategy's bytes per rank on nodes × gpus ranks (`cpu`: CPU processes, whose
    phases also count what the checkpoint and export hold in host memory)."""
    world = gpus * nodes
    batch = BatchPlan.derive(
        recipe.batch.global_batch_size, recipe.batch.micro_batch_size, world, recipe.engine.sequence_parallel
    )
    model = meta_model(recipe)
    # The built-in causal-LM tasks chunk their loss (train.loss_chunk_size); others hold whole logits.
    loss_chunk = 0
    if recipe.task in ("sft", "pretrain", "dpo") and chunking_blocker(model, recipe) is None:
        positions = batch.micro_batch_size * recipe.data.max_length
        loss_chunk = chunk_tokens(recipe.train.loss_chunk_size, positions, getattr(model.config, "vocab_size", 0))
    # On a CPU run host memory is the device's: offloading keeps the layer inputs where they were.
    checkpointing = (
        True if cpu and recipe.engine.activation_checkpointing == "offload" else recipe.engine.activation_checkpointing
    )
    tiles = mlp_tiles(recipe.engine.tiled_mlp, recipe.data.max_length, model) if recipe.engine.tiled_mlp else 1
    per_degree = _sequence_parallel_activations(model, recipe, world, loss_chunk, checkpointing, tiles)
    act = per_degree[recipe.engine.sequence_parallel]
    rows = []
    for strategy in STRATEGIES:
        offload = recipe.engine.offload if strategy.startswith("zero") else "none"
        if offload == "optimizer+params" and strategy != "zero3":
            offload = "optimizer"
        state = model_state(model, strategy, world, recipe.engine.precision, offload)
        phases = phase_peaks(model, strategy, world, state, act, recipe, cpu)
        rows.append(
            StrategyPlan(
                strategy,
                **state,
                activations=act,
                micro_batch_size=batch.micro_batch_size,
                grad_accum=batch.grad_accum,
                phases=phases,
                sequence_parallel=per_degree,
            )
        )
    return rows, world


def _sequence_parallel_activations(
    model, recipe: Recipe, world: int, loss_chunk: int, checkpointing: bool | str, tiles: int
) -> dict[int, float]:
    """Activations per rank for the recipe's engine.sequence_parallel and each other degree
    the world, the batch, the task and the model's heads allow."""
    from accord.engine.sequence_parallel.ulysses import check_sequence_parallel

    out = {}
    for n in divisors(world):
        if n != recipe.engine.sequence_parallel and check_sequence_parallel(
            recipe.model_copy(update={"engine": recipe.engine.model_copy(update={"sequence_parallel": n})}),
            model.config,
        ):
            continue
        try:
            batch = BatchPlan.derive(recipe.batch.global_batch_size, recipe.batch.micro_batch_size, world, n)
        except UserInputError:
            continue
        out[n] = activations(
            model,
            batch.micro_batch_size,
            recipe.data.max_length,
            recipe.engine.precision,
            checkpointing,
            loss_chunk,
            n,
            tiles,
        )
    return out


def recommend(rows: list[StrategyPlan], recipe: Recipe, world: int, memory_gib: float, device: str = "GPU") -> str:
    """The cheapest strategy that fits (least communication first), and the largest micro
    batch it can take with the resulting accumulation."""
    budget = memory_gib * GIB
    fitting = [r for r in rows if r.total <= budget]
    if not fitting:
        return _split_rows(rows, recipe, budget, memory_gib, device) or _nothing_fits(rows, memory_gib, device)
    choice = fitting[0]
    groups = world // recipe.engine.sequence_parallel  # data-parallel: a sequence-parallel group shares its rows
    per_rank = recipe.batch.global_batch_size // groups
    base = choice.total - choice.activations
    per_sequence = choice.activations / choice.micro_batch_size
    fits = [m for m in divisors(per_rank) if base + per_sequence * m <= budget]
    micro = max(fits) if fits else choice.micro_batch_size
    return (
        f"recommended: engine.strategy={choice.strategy} with batch.micro_batch_size={micro} "
        f"({groups} × {micro} × {per_rank // micro} accumulation = {recipe.batch.global_batch_size}), "
        f"~{(base + per_sequence * micro) / GIB:.1f} of {memory_gib:.1f} GiB per {device}"
    )


def _split_rows(rows: list[StrategyPlan], recipe: Recipe, budget: float, memory_gib: float, device: str) -> str | None:
    """The smallest engine.sequence_parallel above the recipe's that makes a strategy fit
    (the cheapest such strategy), or None."""
    current = recipe.engine.sequence_parallel
    for n, act in sorted(rows[0].sequence_parallel.items()):
        if n <= current:
            continue
        for r in rows:
            total = r.total - r.activations + act
            if total <= budget:
                return (
                    f"recommended: engine.sequence_parallel={n} with engine.strategy={r.strategy}: each row's {recipe.data.max_length} "
                    f"tokens split over {n} {device}s (activations {r.activations / GIB:.1f} -> {act / GIB:.1f} GiB), "
                    f"~{total / GIB:.1f} of {memory_gib:.1f} GiB per {device}"
                )
    return None


def _nothing_fits(rows: list[StrategyPlan], memory_gib: float, device: str) -> str:
    best = min(rows, key=lambda r: r.total)
    return (
        f"nothing fits in {memory_gib:g} GiB per {device}: the smallest is {best.strategy} at {best.total / GIB:.1f} GiB; "
        f"use more {device}s, engine.activation_checkpointing=true, engine.sequence_parallel, a smaller batch.micro_batch_size "
        f"or data.max_length, or engine.offload"
    )


def format_table(rows: list[StrategyPlan], memory_gib: float | None) -> str:
    header = (
        f"{'strategy':9} {'params':>9} {'grads':>9} {'optimizer':>10} {'master':>9} {'activations':>12} {'total GiB':>10}"
        + ("  fits" if memory_gib else "")
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        cells = [r.params, r.grads, r.optimizer, r.master]
        line = (
            f"{r.strategy:9} "
            + " ".join(f"{c / GIB:>9.3f}" for c in cells[:3])
            + f" {cells[3] / GIB:>9.3f} {r.activations / GIB:>12.3f} {r.total / GIB:>10.3f}"
        )
        if memory_gib:
            line += "  yes" if r.total <= memory_gib * GIB else "  no"
        lines.append(line)
    return "\n".join(lines)


def format_phases(rows: list[StrategyPlan]) -> str:
    """Each phase's peak per rank (GiB above an empty process's), one row per strategy."""
    header = f"{'strategy':9} " + " ".join(f"{p:>10}" for p in PHASES)
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r.strategy:9} " + " ".join(f"{r.phases.get(p, 0.0) / GIB:>10.3f}" for p in PHASES))
    return "\n".join(lines)
