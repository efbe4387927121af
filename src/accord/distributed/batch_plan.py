"""Batch arithmetic: world × micro × accumulation = global, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from accord.errors import UserInputError

if TYPE_CHECKING:
    from accord.recipe.schema import BatchConfig, EngineConfig


class BatchPlanError(UserInputError):
    """The requested batch sizes cannot be split over this many processes."""


@dataclass(frozen=True)
class BatchPlan:
    """`world_size` counts the data-parallel groups: processes / (sequence_parallel ×
    tensor_parallel). The ranks of one sequence-parallel group train on the same rows, each a
    slice of their tokens; the ranks of one tensor-parallel group on the same rows and tokens,
    each a slice of every layer (so only one of them counts a row's loss in sums over ranks).
    Under engine.pipeline_parallel a group's ranks are one pipeline: each holds stages of the
    model, and every micro-batch of the group's rows passes through all of them."""

    global_batch_size: int
    micro_batch_size: int
    world_size: int
    sequence_parallel: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    @classmethod
    def of(cls, batch: BatchConfig, engine: EngineConfig, processes: int) -> BatchPlan:
        """The plan of a recipe's batch section on `processes` processes, with its engine
        section's sequence-, tensor- and pipeline-parallel degrees. Derived once per process
        where a run starts and handed on from there (the launcher's checks, the workers'
        RunSetup); raises BatchPlanError naming a split that does not work."""
        return cls.derive(
            batch.global_batch_size,
            batch.micro_batch_size,
            processes,
            engine.sequence_parallel,
            engine.tensor_parallel,
            engine.pipeline_parallel,
        )

    @classmethod
    def derive(
        cls,
        global_batch_size: int,
        micro_batch_size: int | None,
        world_size: int,
        sequence_parallel: int = 1,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
    ) -> BatchPlan:
        """The plan for `world_size` processes, `sequence_parallel` × `tensor_parallel` of them
        to a row (engine.sequence_parallel, engine.tensor_parallel); `micro_batch_size=None`
        means no accumulation."""
        if world_size < 1:
            raise BatchPlanError(f"world size must be at least 1, got {world_size}")
        levers = (
            ("sequence_parallel", sequence_parallel),
            ("tensor_parallel", tensor_parallel),
            ("pipeline_parallel", pipeline_parallel),
        )
        for key, n in levers:
            if world_size % n:
                raise BatchPlanError(
                    f"engine.{key}={n} does not divide the {world_size} processes; "
                    f"use one of {', '.join(map(str, divisors(world_size)))} "
                    f"(or run on a multiple of {n} processes)"
                )
        per_row = sequence_parallel * tensor_parallel * pipeline_parallel
        named = [f"engine.{k}={n}" for k, n in levers if n > 1]
        if world_size % per_row:
            raise BatchPlanError(
                f"{' × '.join(named)} = {per_row} does not divide the {world_size} processes; lower one of them"
            )
        unit = "processes" if per_row == 1 else f"data-parallel groups (processes / {' × '.join(named)})"
        plan = cls._derive(global_batch_size, micro_batch_size, world_size // per_row, unit)
        return cls(
            plan.global_batch_size,
            plan.micro_batch_size,
            plan.world_size,
            sequence_parallel,
            tensor_parallel,
            pipeline_parallel,
        )

    @classmethod
    def _derive(cls, global_batch_size: int, micro_batch_size: int | None, world_size: int, unit: str) -> BatchPlan:
        if global_batch_size % world_size:
            worlds = [w for w in divisors(global_batch_size) if w <= 64]
            raise BatchPlanError(
                f"batch.global_batch_size={global_batch_size} cannot be split over {world_size} {unit}; "
                f"use a global batch that is a multiple of {world_size} "
                f"(or run on {_or_list(worlds)} {unit})"
            )
        per_rank = global_batch_size // world_size
        micro = per_rank if micro_batch_size is None else micro_batch_size
        if per_rank % micro:
            raise BatchPlanError(
                f"batch.micro_batch_size={micro} does not divide the {per_rank} sequences per process "
                f"(global {global_batch_size} / {world_size} {unit}); "
                f"valid micro_batch_size values for {world_size} {unit}: {', '.join(map(str, divisors(per_rank)))}"
            )
        return cls(global_batch_size, micro, world_size)

    @property
    def processes(self) -> int:
        """Every process of the run: the data-parallel groups × their sequence- and tensor-parallel ranks."""
        return self.world_size * self.ranks_per_group

    @property
    def ranks_per_group(self) -> int:
        """The ranks that train on the same rows (one data-parallel group)."""
        return self.sequence_parallel * self.tensor_parallel * self.pipeline_parallel

    @property
    def per_rank(self) -> int:
        return self.global_batch_size // self.world_size

    @property
    def grad_accum(self) -> int:
        return self.per_rank // self.micro_batch_size

    def data_rank(self, rank: int) -> int:
        """The data-parallel group of global rank `rank` (groups are runs of consecutive ranks)."""
        return rank // self.ranks_per_group

    def counts(self, rank: int) -> bool:
        """Whether `rank`'s loss and metrics count in a sum over ranks: a tensor-parallel group's
        ranks compute the same ones, so only its first counts (sequence-parallel ranks each
        hold their own tokens)."""
        return rank % self.tensor_parallel == 0

    def micro_slice(self, rank: int, micro_step: int) -> slice:
        """Positions within a global batch that `rank` trains on at `micro_step`.

        Rank r owns the contiguous block [r*per_rank, (r+1)*per_rank) and walks it in
        micro-batches, so the union over ranks and micro-steps is the whole global batch
        exactly once, whatever the decomposition.
        """
        if not (0 <= rank < self.world_size and 0 <= micro_step < self.grad_accum):
            raise IndexError(f"rank {rank} / micro-step {micro_step} outside {self}")
        start = rank * self.per_rank + micro_step * self.micro_batch_size
        return slice(start, start + self.micro_batch_size)

    def describe(self) -> str:
        kinds = " and ".join(
            kind
            for kind, n in (
                ("sequence", self.sequence_parallel),
                ("tensor", self.tensor_parallel),
                ("pipeline", self.pipeline_parallel),
            )
            if n > 1
        )
        groups = (
            f"{self.world_size} data-parallel group{'s' if self.world_size != 1 else ''} of {self.ranks_per_group} "
            f"processes ({kinds} parallel)"
            if self.ranks_per_group > 1
            else f"{self.world_size} process{'es' if self.world_size != 1 else ''}"
        )
        return (
            f"{groups} × {self.micro_batch_size} sequences "
            f"× {self.grad_accum} accumulation step{'s' if self.grad_accum != 1 else ''} "
            f"= {self.global_batch_size} sequences per optimizer step"
        )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _or_list(items: list[int]) -> str:
    text = [str(i) for i in items]
    return text[0] if len(text) == 1 else ", ".join(text[:-1]) + " or " + text[-1]
