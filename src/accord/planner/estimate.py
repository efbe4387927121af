"""`accord plan`: what each strategy holds per GPU, and which fits.

Model state comes from the parameter shapes of the recipe's model, built on the meta
device (no memory, no download): parameters, gradients, AdamW's two moments and step
counters, and DeepSpeed's fp32 master partition, split over the ranks as each strategy
splits them. Every registered strategy with a memory model is planned, in the registry's
order; the model lives beside its engine (accord.engine.memory). Activations are an
estimate per layer from the config, micro batch and length. A task's frozen second model (dpo's
and kto's reference, grpo's KL anchor, distill's teacher: Task.frozen_model) adds its weights,
sharded as the strategy shards the trained model's, and what its forward holds while it runs.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

import torch

from accord import registry
from accord.compat.transformers import attn_implementation
from accord.distributed.batch_plan import BatchPlan, divisors
from accord.engine.expert_parallel import expert_shards
from accord.engine.long_rows import mlp_tiles
from accord.engine.memory import Footprint, MemoryModel, expert_parallel_local
from accord.errors import UserInputError
from accord.recipe.schema import Recipe
from accord.registry import load_object
from accord.tasks import task_config
from accord.tasks.base import FrozenModel
from accord.tasks.chunked_loss import chunk_tokens, chunking_blocker

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
    # The frozen model's (Task.frozen_model) weights per rank, and what its forward holds.
    frozen: float = 0.0
    frozen_activations: float = 0.0
    # engine.expert_parallel: the experts of each MoE layer this rank holds (0: not split).
    expert_shards: int = 0

    @property
    def total(self) -> float:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.master
            + self.activations
            + self.frozen
            + self.frozen_activations
        )

    def as_dict(self) -> dict:
        return asdict(self) | {
            "total_gib": self.total / GIB,
            "phases_gib": {k: v / GIB for k, v in self.phases.items()},
        }


def meta_model(recipe: Recipe):
    """The recipe's model with meta tensors: shapes and dtypes only, nothing loaded."""
    from transformers import AutoConfig

    from accord.models.build import apply_lora, auto_class, build_model, model_folder
    from accord.run.inputs import tokenizer_and_task

    tokenizer, task = tokenizer_and_task(task_config(recipe))
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


def activations(
    model,
    micro: int,
    length: int,
    precision: str,
    checkpointing: bool | str,
    loss_chunk: int = 0,
    sequence_parallel: int = 1,
    mlp_tiles: int = 1,
    tensor_parallel: int = 1,
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
    `mlp_tiles` divides the MLP's f-wide tensors (one tile's exist at a time); under
    `tensor_parallel` N a rank keeps 1/N of the heads' tensors (q, k, v, attention output) and
    of the MLP's, the norms' h-wide ones whole."""
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
    per_layer = (4 * h + 4 * h / tensor_parallel + 4 * f / (mlp_tiles * tensor_parallel)) * element * tokens
    inputs = 0 if checkpointing == "offload" else layers * h * element * tokens
    kept = inputs + per_layer if checkpointing else layers * per_layer
    whole = 2 * 4 * tokens * vocab
    # Rows whose targets fit one chunk are computed whole (nothing to gain from recomputing).
    logits = min(whole, 4 * 4 * loss_chunk * vocab) if loss_chunk else whole
    return kept + logits + mask


def frozen_meta_model(recipe: Recipe, frozen: FrozenModel, trained):
    """The frozen model on the meta device: a folder's (or hub name's) config, or the trained
    model itself when it is a copy of the starting model (whose LoRA parameters it lacks)."""
    if frozen.folder is None:
        return trained
    from transformers import AutoConfig, AutoModelForCausalLM

    from accord.recipe.hub import local_path

    folder = local_path(frozen.folder, frozen.revision, where=frozen.key)
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=recipe.model.trust_remote_code)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())[:300]
        raise UserInputError(f"{frozen.key}: {folder} cannot be read as a model folder: {reason}") from None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=recipe.model.trust_remote_code)


def frozen_weights(model) -> float:
    """Bytes of a frozen model's fp32 weights (adapters, which a frozen copy lacks, left out)."""
    return float(sum(p.numel() * 4 for name, p in model.named_parameters() if "lora_" not in name))


def frozen_activations(model, micro: int, length: int, precision: str, keeps_logits: bool, loss_chunk: int) -> float:
    """Bytes a frozen model's forward holds (no gradients, so nothing is kept for a backward):
    one layer's tensors at a time (about 8h + 4f values per token in the compute dtype), and
    its fp32 logits: whole when they are kept for the loss (distill's teacher), else as the
    answer log-probabilities take them (chunk-sized with the chunked loss)."""
    config = model.config
    h = getattr(config, "hidden_size", 0)
    f = getattr(config, "intermediate_size", 4 * h)
    vocab = getattr(config, "vocab_size", 0)
    element = 2 if precision in ("bf16", "fp16") else 4
    tokens = micro * length
    whole = 4 * tokens * vocab
    logits = whole if keeps_logits or not loss_chunk else min(whole, 2 * 4 * loss_chunk * vocab)
    return (8 * h + 4 * f) * element * tokens + logits


def phase_peaks(
    model, strategy: str, world: int, state: dict[str, float], activations: float, recipe: Recipe, cpu: bool
) -> dict[str, float]:
    """Bytes rank 0 holds at the peak of each phase, above an empty process's, under
    `strategy`: live tensors on the rank's device (host memory when `cpu`, else the GPU's).

    Every phase keeps the model state it starts from; on top of it (each strategy's memory
    model, accord.engine.memory, says what its engine adds):
    - build: what the strategy allocates while it builds or wraps the model;
    - train: gradients, AdamW's moments (created at step 1), the micro-batch's activations
      and what a sharded strategy gathers;
    - checkpoint: the state at rest (gradients are freed after each step) and one tensor
      being serialised; checkpoint.async first copies this rank's state to host memory;
    - export: the state at rest and the tensor being gathered;
    - resume: the build, then the optimizer state and the checkpoint read into it.
    Host memory on the CPU is counted as live bytes: glibc's heap can keep more unless
    engine.release_host_memory is on (see docs/memory-and-plan.md).
    """
    footprint = Footprint(strategy, model, world, state, activations, recipe, cpu)
    return memory_model(strategy).phases(footprint)


def memory_model(strategy: str) -> MemoryModel:
    """The registered strategy's memory model (accord.registry.Strategy.memory)."""
    return load_object(registry.strategy(strategy).memory, f"engine.strategy {strategy}: memory model")


def model_state(model, strategy: str, world: int, precision: str, offload: str) -> dict[str, float]:
    """Bytes of model state on rank 0 (which holds the largest share) under `strategy`."""
    return memory_model(strategy).state(model, world, precision, offload)


def plan(recipe: Recipe, gpus: int, nodes: int = 1, cpu: bool = False) -> tuple[list[StrategyPlan], int]:
    """Each strategy's bytes per rank on nodes × gpus ranks (`cpu`: CPU processes, whose
    phases also count what the checkpoint and export hold in host memory)."""
    world = gpus * nodes
    if recipe.engine.pipeline_parallel > 1:  # one row per pipeline rank, under the recipe's strategy
        return _pipeline_rows(recipe, world, cpu), world
    batch = BatchPlan.of(recipe.batch, recipe.engine, world)
    model = meta_model(recipe)
    tp = recipe.engine.tensor_parallel
    if tp > 1:
        from accord.engine.memory import tensor_parallel_local

        # One TP rank's part of each split layer; the strategies then shard or replicate it over
        # the data-parallel groups (world / TP).
        tensor_parallel_local(model, tp)
    # Tasks that chunk their loss (train.loss_chunk_size) hold chunk-sized logits; others whole ones.
    loss_chunk = 0
    config = task_config(recipe)
    cls = config.task_class
    if cls.chunked_loss and chunking_blocker(model, config) is None:
        positions = batch.micro_batch_size * recipe.data.max_length
        loss_chunk = chunk_tokens(recipe.train.loss_chunk_size, positions, getattr(model.config, "vocab_size", 0))
    # On a CPU run host memory is the device's: offloading keeps the layer inputs where they were.
    checkpointing = (
        True if cpu and recipe.engine.activation_checkpointing == "offload" else recipe.engine.activation_checkpointing
    )
    tiles = mlp_tiles(recipe.engine.tiled_mlp, recipe.data.max_length, model) if recipe.engine.tiled_mlp else 1
    if tp > 1:
        act = activations(
            model,
            batch.micro_batch_size,
            recipe.data.max_length,
            recipe.engine.precision,
            checkpointing,
            loss_chunk,
            tensor_parallel=tp,
        )
        per_degree = {1: act}
    else:
        per_degree = _sequence_parallel_activations(model, recipe, world, loss_chunk, checkpointing, tiles)
        act = per_degree[recipe.engine.sequence_parallel]
    frozen = cls.frozen_model(config)
    frozen_model = frozen_meta_model(recipe, frozen, model) if frozen is not None else None
    frozen_act = 0.0
    if frozen is not None:
        frozen_act = frozen_activations(
            frozen_model,
            batch.micro_batch_size,
            recipe.data.max_length,
            recipe.engine.precision,
            frozen.keeps_logits,
            loss_chunk,
        )
    ep = recipe.engine.expert_parallel
    shards = expert_shards(model.config, ep) if ep > 1 else 0
    rows = []
    for strategy, spec in registry.STRATEGIES.items():  # in their order: least communication first
        if spec.memory is None:
            continue  # a user's strategy registered without one
        if (tp > 1 and "tensor_parallel" not in spec.combines_with) or (
            ep > 1 and "expert_parallel" not in spec.combines_with
        ):
            continue
        offload = spec.offload_for(recipe.engine.offload)
        # Under EP a rank holds E/N experts, whole where the strategy replicates; sharded over the
        # world/N ranks holding the same ones, that is E/world rows of each: the unsplit model's
        # share under a strategy that shards over the world.
        subject = expert_parallel_local(copy.deepcopy(model), ep) if ep > 1 and not spec.shards_params else model
        state = model_state(subject, strategy, world // tp, recipe.engine.precision, offload)
        phases = phase_peaks(subject, strategy, world // tp, state, act, recipe, cpu)
        held = 0.0
        if frozen_model is not None:
            # Sharded like the trained model where the strategy shards its parameters (Engine.prepare_frozen).
            held = frozen_weights(frozen_model) / (world // tp if spec.shards_params else 1)
            phases = {name: peak + held + (frozen_act if name == "train" else 0.0) for name, peak in phases.items()}
        rows.append(
            StrategyPlan(
                strategy,
                **state,
                activations=act,
                micro_batch_size=batch.micro_batch_size,
                grad_accum=batch.grad_accum,
                phases=phases,
                sequence_parallel=per_degree,
                frozen=held,
                frozen_activations=frozen_act if frozen_model is not None else 0.0,
                expert_shards=shards,
            )
        )
    return rows, world


def _pipeline_rows(recipe: Recipe, world: int, cpu: bool) -> list[StrategyPlan]:
    """engine.pipeline_parallel: one row per pipeline rank, named strategy:rank (planner/stages.py)."""
    from accord.planner.stages import in_flight, rank_model

    engine = recipe.engine
    dp = world // engine.pipeline_parallel
    batch = BatchPlan.of(recipe.batch, recipe.engine, world)
    micro, length = batch.micro_batch_size, recipe.data.max_length
    whole = meta_model(recipe)
    logits = 2 * 4 * micro * length * getattr(whole.config.get_text_config(), "vocab_size", 0)
    checkpointing = True if cpu and engine.activation_checkpointing == "offload" else engine.activation_checkpointing
    decoder = activations(whole, micro, length, engine.precision, checkpointing) - logits
    rows = []
    for rank in range(engine.pipeline_parallel):
        model, share, last = rank_model(meta_model(recipe), recipe, rank)
        flying = in_flight(recipe, rank, batch.grad_accum)
        act = flying * decoder * share + (flying * logits / engine.stages_per_rank if last else 0)
        state = model_state(model, engine.strategy, dp, engine.precision, "none")
        phases = phase_peaks(model, engine.strategy, dp, state, act, recipe, cpu)
        rows.append(
            StrategyPlan(
                f"{engine.strategy}:{rank}",
                **state,
                activations=act,
                micro_batch_size=micro,
                grad_accum=batch.grad_accum,
                phases=phases,
            )
        )
    return rows


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
    if recipe.engine.pipeline_parallel > 1:
        from accord.planner.stages import stage_advice

        return stage_advice(rows, memory_gib, device)
    budget = memory_gib * GIB
    fitting = [r for r in rows if r.total <= budget]
    if not fitting:
        return _split_rows(rows, recipe, budget, memory_gib, device) or _nothing_fits(rows, memory_gib, device)
    choice = fitting[0]
    # data-parallel: a sequence- or tensor-parallel group shares its rows
    groups = world // (recipe.engine.sequence_parallel * recipe.engine.tensor_parallel)
    per_rank = recipe.batch.global_batch_size // groups
    # Both models' activations grow with the micro batch (a frozen model's forward too).
    scaling = choice.activations + choice.frozen_activations
    base = choice.total - scaling
    per_sequence = scaling / choice.micro_batch_size
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
                    f"recommended: engine.sequence_parallel={n} with engine.strategy={r.strategy}: each row's "
                    f"{recipe.data.max_length} "
                    f"tokens split over {n} {device}s (activations {r.activations / GIB:.1f} -> {act / GIB:.1f} GiB), "
                    f"~{total / GIB:.1f} of {memory_gib:.1f} GiB per {device}"
                )
    return None


def _nothing_fits(rows: list[StrategyPlan], memory_gib: float, device: str) -> str:
    best = min(rows, key=lambda r: r.total)
    return (
        f"nothing fits in {memory_gib:g} GiB per {device}: the smallest is {best.strategy} at {best.total / GIB:.1f} "
        "GiB; "
        f"use more {device}s, engine.activation_checkpointing=true, engine.sequence_parallel, a smaller "
        "batch.micro_batch_size "
        f"or data.max_length, or engine.offload"
    )


def format_table(rows: list[StrategyPlan], memory_gib: float | None) -> str:
    """One row per strategy; a `frozen` column (the frozen model's weights and forward) when the task holds one."""
    frozen = any(r.frozen for r in rows)
    header = (
        f"{'strategy':9} {'params':>9} {'grads':>9} {'optimizer':>10} {'master':>9} {'activations':>12} "
        + (f"{'frozen':>9} " if frozen else "")
        + f"{'total GiB':>10}"
        + ("  fits" if memory_gib else "")
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        cells = [r.params, r.grads, r.optimizer, r.master]
        line = (
            f"{r.strategy:9} "
            + " ".join(f"{c / GIB:>9.3f}" for c in cells[:3])
            + f" {cells[3] / GIB:>9.3f} {r.activations / GIB:>12.3f}"
            + (f" {(r.frozen + r.frozen_activations) / GIB:>9.3f}" if frozen else "")
            + f" {r.total / GIB:>10.3f}"
        )
        if memory_gib:
            line += "  yes" if r.total <= memory_gib * GIB else "  no"
        lines.append(line)
    return "\n".join(lines)


def expert_line(rows: list[StrategyPlan]) -> str:
    """engine.expert_parallel: how many of each MoE layer's experts a rank holds, and how."""
    shards = rows[0].expert_shards
    sharded = "sharded with the ranks holding the same experts"
    how = ", ".join(
        f"{r.strategy}: {sharded if registry.strategy(r.strategy).shards_params else 'whole'}" for r in rows
    )
    return f"accord: expert parallel: each rank holds {shards} experts of each MoE layer ({how})"


def format_phases(rows: list[StrategyPlan]) -> str:
    """Each phase's peak per rank (GiB above an empty process's), one row per strategy."""
    header = f"{'strategy':9} " + " ".join(f"{p:>10}" for p in PHASES)
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r.strategy:9} " + " ".join(f"{r.phases.get(p, 0.0) / GIB:>10.3f}" for p in PHASES))
    return "\n".join(lines)
