"""Letting go of a memory-mapped Arrow split's pages once they are read.

`datasets` keeps a split (a JSONL corpus converted to Arrow, say) in Arrow files that it
memory-maps. Reading the split through, as preparation does, leaves every page read
resident in the reading process and counted in its RSS, many times what the preparation
itself holds for a large corpus. Those pages are clean copies of the file, so
dropping them from this process's mapping (madvise MADV_DONTNEED) is safe: a page touched
again is read back from the page cache. Linux only; elsewhere nothing is done.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import TypeVar

from accord.compat.libc import madvise_dontneed

RELEASE_EVERY = 32  # work units between two releases (16 MB of text, 32,000 rows)

T = TypeVar("T")


def arrow_files(ds) -> frozenset[str]:
    """The Arrow files a `datasets.Dataset` reads (none for a stream or an in-memory table)."""
    try:
        return frozenset(os.path.realpath(f["filename"]) for f in ds.cache_files)
    except (AttributeError, KeyError, TypeError):
        return frozenset()


def release(paths: frozenset[str]) -> int:
    """Drop this process's resident pages of its read-only mappings of `paths`; returns how
    many mappings were released."""
    madvise = madvise_dontneed() if paths else None
    if madvise is None:
        return 0
    released = 0
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            # Only read-only mappings: a writable one could hold changes the file does not.
            if len(fields) < 6 or "w" in fields[1] or fields[5].rstrip("\n") not in paths:
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if madvise(start, end - start):
                released += 1
    return released


def released_as_read(items: Iterable[T], ds, every: int = RELEASE_EVERY) -> Iterator[T]:
    """`items` (work units read from `ds` in order), releasing `ds`'s mapped pages every
    `every` of them and at the end."""
    paths = arrow_files(ds)
    if not paths:
        yield from items
        return
    for count, item in enumerate(items, 1):
        yield item
        if count % every == 0:
            release(paths)
    release(paths)
