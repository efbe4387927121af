"""Reading examples out of the prepared (memory-mapped) datasets and onto the device."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def fetch(ds, indices: Iterable[int]) -> list[dict]:
    """Examples `indices` of an Arrow dataset as dicts, in one read."""
    indices = [int(i) for i in indices]
    columns = ds[indices]
    return [{name: values[k] for name, values in columns.items()} for k in range(len(indices))]


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    if device.type != "cuda":
        return batch
    # Pinned host memory lets the copy overlap the previous micro-step's compute.
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


def lockstep_batches(count: int, rank: int, world_size: int, size: int) -> Iterator[tuple[list[int], float]]:
    """This rank's contiguous share of `count` examples in micro-batches, as (indices, weight).

    Every rank yields the same number of batches: a rank with fewer examples repeats one
    with weight 0, because under sharded strategies each forward pass is a collective.
    """
    per_rank = -(-count // world_size)
    start = rank * per_rank
    share = list(range(start, min(start + per_rank, count)))
    for at in range(0, per_rank, size):
        chunk = share[at : at + size]
        yield (chunk, 1.0) if chunk else ([0], 0.0)
