"""`accord plan` under engine.pipeline_parallel: what each pipeline rank holds (estimate.py
makes one row per rank from these: its stages' parameters, gradients and AdamW state under
ddp or fsdp over the pipelines, and its micro-batches in flight).

A rank's activations are its stages' share of the decoder's (by layer count) for each
micro-batch the schedule keeps in flight on it: all m under gpipe; under 1f1b rank r runs
p - r forwards before its first backward (the first rank the most); the interleaved
schedules keep about v·(p - r) stage-micro-batches. The last stage adds the whole logits of
each (the chunked loss is not used on it). An estimate, like the rest of the plan."""

from __future__ import annotations

from torch import nn

GIB = 2**30


def rank_model(model: nn.Module, recipe, rank: int) -> tuple[nn.Module, float, bool]:
    """`model` (on the meta device) pruned to pipeline rank `rank`'s stages, the share of the
    decoder layers it holds, and whether it holds the last stage."""
    from accord.engine.pipeline.schedule import rank_stages
    from accord.engine.pipeline.stages import keep_stages

    engine = recipe.engine
    stages = engine.pipeline_parallel * engine.stages_per_rank
    held = rank_stages(engine.pipeline_schedule, rank, engine.pipeline_parallel, engine.stages_per_rank)
    keep_stages(model, held, stages)
    return model, len(held) / stages, stages - 1 in held


def in_flight(recipe, rank: int, micro_batches: int) -> int:
    """Stage-micro-batches whose activations rank `rank` holds at once (see the module's text)."""
    engine = recipe.engine
    if engine.pipeline_schedule == "gpipe":
        return micro_batches
    v = engine.stages_per_rank
    return min(micro_batches * v, v * (engine.pipeline_parallel - rank))


def stage_advice(rows: list, memory_gib: float, device: str) -> str:
    """The answer under pipeline parallelism: whether the busiest pipeline rank fits."""
    largest = max(rows, key=lambda r: r.total)
    rank = largest.strategy.rsplit(":", 1)[1]
    fits = largest.total <= memory_gib * GIB
    fix = (
        ""
        if fits
        else "; use more pipeline stages (engine.pipeline_parallel), engine.strategy=fsdp over the pipelines, "
        "engine.activation_checkpointing=true or a smaller batch.micro_batch_size"
    )
    return (
        f"pipeline rank {rank} holds the most ({largest.total / GIB:.3f} GiB per {device}): it "
        f"{'fits' if fits else 'does not fit'} in {memory_gib:.1f} GiB{fix}"
    )
