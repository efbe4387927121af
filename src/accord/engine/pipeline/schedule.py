"""engine.pipeline_schedule: torch's schedule classes, which stages each rank holds under them,
and the idle share ("bubble") each leaves in theory."""

from __future__ import annotations

# The recipe's names -> torch.distributed.pipelining's classes.
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
SINGLE = ("gpipe", "1f1b")


def schedule_class(name: str) -> type:
    from torch.distributed import pipelining
    from torch.distributed.pipelining import schedules

    cls = SCHEDULES[name]
    return getattr(pipelining, cls, None) or getattr(schedules, cls)


def rank_stages(schedule: str, pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The stage indices pipeline rank `pp_rank` holds: looped (rank k holds k, k+pp, ...) for
    the interleaved schedules, a V (k and 2pp-1-k) for zbv, so the last stage sits on rank 0."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + j * pp for j in range(per_rank)]


def theoretical_bubble(pp: int, micro_batches: int, per_rank: int = 1) -> float:
    """The idle share of a step under 1F1B / GPipe with equal stage times: (p - 1) / (m + p - 1);
    interleaving v stages per rank shrinks the ramp to (p - 1) / (v·m + p - 1)."""
    return (pp - 1) / (per_rank * micro_batches + pp - 1)
