"""What a run is made of, as the training loop reads it: built once by accord.run.assemble
(build_run), then only read (the Trainer, evaluation, checkpoints). The loop depends on this
module, not on how the run was put together."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accord.data.order import GlobalOrder
from accord.data.packing import Rows
from accord.distributed import group as dist
from accord.distributed.batch_plan import BatchPlan
from accord.engine import Engine
from accord.recipe.schema import Recipe
from accord.tasks.base import Task
from accord.tasks.sequence_shards import SequenceShards


@dataclass(frozen=True)
class ModelFacts:
    name: str
    num_params: int  # the whole model, counted before adapters and sharding
    trainable: int
    flops_per_token: float  # for MFU
    peak_tflops: float | None  # one device's peak; None where unknown (no MFU then)


@dataclass(frozen=True, kw_only=True)
class RunSetup:
    """Everything a run is made of; every rank holds the same global plan (rows, order, plan).
    Built from named parts only (build_run), so a part added here cannot shift the others."""

    recipe: Recipe
    info: dist.DistInfo
    tokenizer: Any
    task: Task
    train_data: Any  # datasets.Dataset of encoded examples (memory-mapped)
    eval_data: Any | None
    data_report: dict[str, int]
    rows: Rows  # which examples form each row of the global order
    order: GlobalOrder
    plan: BatchPlan
    total_steps: int
    engine: Engine
    model: ModelFacts
    sequence: SequenceShards  # this rank's slice of each row (engine.sequence_parallel)

    @property
    def out_dir(self) -> Path:
        return Path(self.recipe.output.dir)
