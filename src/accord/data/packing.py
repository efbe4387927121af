"""Rows of the global order: single examples, or whole examples packed into max_length rows.

Packing is best-fit decreasing over the whole training set (never per rank), so the rows
— and therefore every global batch — are the same for any number of processes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Rows:
    """Which examples make each row, with per-row target and token counts."""

    members: list[list[int]]
    targets: np.ndarray
    lengths: np.ndarray

    @classmethod
    def build(cls, lengths: np.ndarray, targets: np.ndarray, capacity: int | None) -> Rows:
        members = best_fit_decreasing(lengths, capacity) if capacity else [[i] for i in range(len(lengths))]
        return cls(
            members,
            np.array([targets[m].sum() for m in members], dtype=np.int64),
            np.array([lengths[m].sum() for m in members], dtype=np.int64),
        )

    def __len__(self) -> int:
        return len(self.members)


def training_rows(train, capacity: int | None) -> Rows:
    """The rows of the global order for an encoded training set: examples packed into
    `capacity`-token rows, or one example per row when `capacity` is None."""
    lengths = np.asarray(train["length"], dtype=np.int64)
    return Rows.build(lengths, np.asarray(train["num_targets"], dtype=np.int64), capacity)


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Longest examples first, each into the open row with the least room that fits it."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, row index), sorted
    for i in order:
        need = int(lengths[i])
        at = bisect.bisect_left(room, (need, -1))
        if at < len(room):
            free, row = room.pop(at)
            rows[row].append(i)
            if free - need > 0:
                bisect.insort(room, (free - need, row))
        else:
            rows.append([i])
            if capacity - need > 0:
                bisect.insort(room, (capacity - need, len(rows) - 1))
    return rows
