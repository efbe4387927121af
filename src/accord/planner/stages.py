"""`accord plan` under engine.pipeline_parallel: what each pipeline rank holds, one row per
rank (its stages' parameters, gradients and AdamW state under ddp or fsdp over the pipelines,
and its micro-batches in flight).

A rank's activations are its stages' share of the decoder's (by layer count) for each
micro-batch the schedule keeps in flight on it: all m under gpipe; under 1f1b rank r runs
p - r forwards before its first backward (the first rank the most); the interleaved
schedules keep about v·(p - r) stage-micro-batches. The last stage adds the whole logits of
each (the chunked loss is not used on it). An estimate, like the rest of the plan."""

from __future__ import annotations

from accord.distributed.batch_plan import BatchPlan
from accord.recipe.schema import Recipe


def stage_rows(recipe: Recipe, world: int, cpu: bool) -> list:
    """One StrategyPlan per pipeline rank (named strategy:rank), under the recipe's strategy."""
    from accord.engine.pipeline.schedule import rank_stages
    from accord.engine.pipeline.stages import keep_stages
    from accord.planner.estimate import StrategyPlan, activations, meta_model, model_state, phase_peaks

    engine = recipe.engine
    pp, per_rank = engine.pipeline_parallel, engine.stages_per_rank
    stages, dp = pp * per_rank, world // pp
    batch = BatchPlan.for_recipe(recipe, world)
    micro, m = batch.micro_batch_size, batch.grad_accum
    whole = meta_model(recipe)
    config = whole.config.get_text_config()
    vocab = getattr(config, "vocab_size", 0)
    logits = 2 * 4 * micro * recipe.data.max_length * vocab
    checkpointing = True if cpu and engine.activation_checkpointing == "offload" else engine.activation_checkpointing
    decoder = activations(whole, micro, recipe.data.max_length, engine.precision, checkpointing) - logits
    rows = []
    for rank in range(pp):
        held = rank_stages(engine.pipeline_schedule, rank, pp, per_rank)
        model = meta_model(recipe)
        keep_stages(model, held, stages)
        in_flight = m if engine.pipeline_schedule == "gpipe" else min(m * per_rank, per_rank * (pp - rank))
        act = in_flight * decoder * len(held) / stages + (in_flight * logits / per_rank if stages - 1 in held else 0)
        state = model_state(model, engine.strategy, dp, engine.precision, "none")
        rows.append(
            StrategyPlan(
                f"{engine.strategy}:{rank}",
                **state,
                activations=act,
                micro_batch_size=micro,
                grad_accum=m,
                phases=phase_peaks(model, engine.strategy, dp, state, act, recipe, cpu),
            )
        )
    return rows


def stage_advice(rows: list, memory_gib: float, device: str) -> str:
    """The answer under pipeline parallelism: whether the busiest pipeline rank fits."""
    from accord.planner.estimate import GIB

    largest = max(rows, key=lambda r: r.total)
    rank = largest.strategy.rsplit(":", 1)[1]
    verdict = "fits" if largest.total <= memory_gib * GIB else "does not fit"
    fix = (
        ""
        if largest.total <= memory_gib * GIB
        else (
            "; use more pipeline stages (engine.pipeline_parallel), engine.strategy=fsdp over the pipelines, "
            "engine.activation_checkpointing=true or a smaller batch.micro_batch_size"
        )
    )
    return (
        f"pipeline rank {rank} holds the most ({largest.total / GIB:.3f} GiB per {device}): it {verdict} in "
        f"{memory_gib:.1f} GiB{fix}"
    )
