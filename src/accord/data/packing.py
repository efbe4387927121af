"""Rows of the global order: single examples, or whole examples packed into max_length rows.

Packing is best-fit decreasing inside fixed windows of PACK_WINDOW consecutive examples of
the prepared data (never per rank), so the rows — and therefore every global batch — are
the same for any number of processes, and packing a corpus of any size holds one window's
lists at a time. The rows are kept as flat arrays (CSR: row r is
member_ids[starts[r]:starts[r+1]]), not a Python list per row. The preparation writes them
next to the token shards (write_rows), window by window, and every rank memory-maps them: a
rank's memory for the rows does not grow with the corpus (they were ~8 bytes per example
and 24 per row in every rank).
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from accord.data.shards import map_file, read_meta, write_meta

PACK_WINDOW = 4096  # examples packed together; best fit inside a window is within ~1% of global


class Members(Sequence):
    """`members[r]`: the example ids of row r, as a list; the identity when unpacked."""

    def __init__(self, starts: np.ndarray | None, ids: np.ndarray | None, count: int):
        self._starts, self._ids, self._count = starts, ids, count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, r):  # type: ignore[override]
        r = int(r)
        if not -self._count <= r < self._count:
            raise IndexError(r)
        r %= self._count
        if self._ids is None:
            return [r]
        assert self._starts is not None
        return self._ids[self._starts[r] : self._starts[r + 1]].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return (self[r] for r in range(self._count))


@dataclass(frozen=True)
class Rows:
    """Which examples make each row, with per-row target and token counts."""

    members: Members
    targets: np.ndarray
    lengths: np.ndarray

    @classmethod
    def build(cls, lengths: np.ndarray, targets: np.ndarray, capacity: int | None) -> Rows:
        lengths, targets = np.asarray(lengths), np.asarray(targets)
        if not capacity:
            return cls(Members(None, None, len(lengths)), targets, lengths)
        ids, sizes = windowed_best_fit(lengths, capacity)
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        row_of = np.repeat(np.arange(len(sizes)), sizes)
        return cls(
            Members(starts, ids, len(sizes)),
            np.bincount(row_of, weights=targets[ids], minlength=len(sizes)).astype(np.int64),
            np.bincount(row_of, weights=lengths[ids], minlength=len(sizes)).astype(np.int64),
        )

    def __len__(self) -> int:
        return len(self.members)

    @classmethod
    def load(cls, folder: Path) -> Rows:
        """Rows written by write_rows, memory-mapped."""
        meta = read_meta(folder / _ROWS_META, None)
        starts, ids = (
            map_file(folder / "starts.bin", np.dtype(np.int64)),
            map_file(folder / "members.bin", np.dtype(np.int64)),
        )
        targets, lengths = (
            map_file(folder / "targets.bin", np.dtype(np.int64)),
            map_file(folder / "lengths.bin", np.dtype(np.int64)),
        )
        return cls(Members(starts, ids, meta["rows"]), targets, lengths)


_ROWS_META = "rows.json"


def rows_folder(split: Path, capacity: int) -> Path:
    return split / f"rows-{capacity}"


def write_rows(train, capacity: int, folder: Path) -> None:
    """The packed rows of a prepared split (its `length` and `num_targets` columns) as files
    Rows.load maps, written a window at a time."""
    lengths, targets = train["length"], train["num_targets"]
    folder.mkdir(parents=True)
    names = ("members.bin", "starts.bin", "targets.bin", "lengths.bin")
    files = {name: open(folder / name, "wb") for name in names}
    files["starts.bin"].write(np.zeros(1, dtype=np.int64).tobytes())
    rows, members = 0, 0
    with contextlib.ExitStack() as stack:
        for f in files.values():
            stack.enter_context(f)
        for _start, ids, sizes in _windows(lengths, capacity, PACK_WINDOW):
            row_of = np.repeat(np.arange(len(sizes)), sizes)
            files["members.bin"].write(ids.tobytes())
            files["starts.bin"].write((members + np.cumsum(sizes)).astype(np.int64).tobytes())
            window_targets, window_lengths = np.asarray(targets[ids]), np.asarray(lengths[ids])
            files["targets.bin"].write(
                np.bincount(row_of, weights=window_targets, minlength=len(sizes)).astype(np.int64).tobytes()
            )
            files["lengths.bin"].write(
                np.bincount(row_of, weights=window_lengths, minlength=len(sizes)).astype(np.int64).tobytes()
            )
            rows, members = rows + len(sizes), members + len(ids)
    write_meta(folder / _ROWS_META, {"rows": rows, "capacity": capacity}, "", list(names))


def training_rows(train, capacity: int | None) -> Rows:
    """The rows of the global order for an encoded training set: examples packed into
    `capacity`-token rows (memory-mapped where the preparation wrote them), or one example
    per row when `capacity` is None (then the columns are used as they come: token shards
    give memory-mapped ones)."""
    folder = getattr(train, "folder", None)
    if capacity and folder is not None and (rows_folder(folder, capacity) / _ROWS_META).exists():
        return Rows.load(rows_folder(folder, capacity))
    lengths, targets = train["length"], train["num_targets"]
    if not capacity and hasattr(lengths, "sum") and hasattr(targets, "sum"):
        return Rows(Members(None, None, len(lengths)), targets, lengths)
    return Rows.build(np.asarray(lengths), np.asarray(targets), capacity)


def windowed_best_fit(lengths: np.ndarray, capacity: int, window: int = PACK_WINDOW) -> tuple[np.ndarray, np.ndarray]:
    """(member ids of all rows back to back, members per row): best fit decreasing over each
    window of consecutive examples in turn."""
    parts = list(_windows(lengths, capacity, window))
    if not parts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate([ids for _, ids, _ in parts]), np.concatenate([sizes for _, _, sizes in parts])


def _windows(lengths, capacity: int, window: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(first example, member ids of its rows back to back, members per row) per window."""
    for start in range(0, len(lengths), window):
        rows = best_fit_decreasing(np.asarray(lengths[start : start + window]), capacity)
        ids = np.fromiter((start + i for row in rows for i in row), dtype=np.int64)
        yield start, ids, np.fromiter((len(row) for row in rows), dtype=np.int64)


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
