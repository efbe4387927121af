"""Batch arithmetic: world × micro × accumulation = global, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass

from accord.errors import UserInputError


class BatchPlanError(UserInputError):
    """The requested batch sizes cannot be split over this many processes."""


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int
    micro_batch_size: int
    world_size: int

    @classmethod
    def derive(cls, global_batch_size: int, micro_batch_size: int | None, world_size: int) -> BatchPlan:
        """The plan for a world size; `micro_batch_size=None` means no accumulation."""
        if world_size < 1:
            raise BatchPlanError(f"world size must be at least 1, got {world_size}")
        if global_batch_size % world_size:
            worlds = [w for w in divisors(global_batch_size) if w <= 64]
            raise BatchPlanError(
                f"batch.global_batch_size={global_batch_size} cannot be split over {world_size} processes; "
                f"use a global batch that is a multiple of {world_size} "
                f"(or run on {_or_list(worlds)} processes)"
            )
        per_rank = global_batch_size // world_size
        micro = per_rank if micro_batch_size is None else micro_batch_size
        if per_rank % micro:
            raise BatchPlanError(
                f"batch.micro_batch_size={micro} does not divide the {per_rank} sequences per process "
                f"(global {global_batch_size} / {world_size} processes); "
                f"valid micro_batch_size values for {world_size} processes: {', '.join(map(str, divisors(per_rank)))}"
            )
        return cls(global_batch_size, micro, world_size)

    @property
    def per_rank(self) -> int:
        return self.global_batch_size // self.world_size

    @property
    def grad_accum(self) -> int:
        return self.per_rank // self.micro_batch_size

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
        return (
            f"{self.world_size} process{'es' if self.world_size != 1 else ''} × {self.micro_batch_size} sequences "
            f"× {self.grad_accum} accumulation step{'s' if self.grad_accum != 1 else ''} "
            f"= {self.global_batch_size} sequences per optimizer step"
        )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _or_list(items: list[int]) -> str:
    text = [str(i) for i in items]
    return text[0] if len(text) == 1 else ", ".join(text[:-1]) + " or " + text[-1]
