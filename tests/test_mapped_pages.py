"""Preparation reads a memory-mapped Arrow split through; the pages it has read are let go as
it goes, so its RSS does not grow with the corpus (4 GB of JSONL: 3.6 GB of them before)."""

from __future__ import annotations

import os
import sys

import pytest
from datasets import Dataset, load_from_disk

from accord.data.mapped_pages import arrow_files, release, released_as_read

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")


def _resident_kib(paths: frozenset[str]) -> int:
    """This process's resident KiB of its mappings of `paths` (from /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="utf-8") as smaps:
        for line in smaps:
            first = line.split(maxsplit=5)
            if "-" in first[0] and len(first) >= 5 and ":" in first[3]:  # a mapping's header line
                inside = len(first) == 6 and first[5].strip() in paths
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.fixture(scope="module")
def mapped(tmp_path_factory):
    folder = tmp_path_factory.mktemp("arrow")
    rows = [f"row {i} " + "the of and to in a that was " * 40 for i in range(8000)]  # ~9 MB of text
    Dataset.from_dict({"text": rows}).save_to_disk(str(folder))
    ds = load_from_disk(str(folder))
    return ds, rows


def test_pages_read_from_a_mapped_split_are_released_and_read_back_unchanged(mapped):
    ds, rows = mapped
    paths = arrow_files(ds)
    assert paths and all(os.path.isfile(p) for p in paths)
    read = [t for batch in ds.iter(batch_size=500) for t in batch["text"]]
    assert _resident_kib(paths) > 4 * 1024  # what reading it through leaves in this process
    assert release(paths) >= 1
    assert _resident_kib(paths) < 512
    assert [t for batch in ds.iter(batch_size=500) for t in batch["text"]] == read == rows  # still readable


def test_units_read_in_order_leave_no_mapped_pages_behind(mapped):
    ds, rows = mapped
    release(arrow_files(ds))
    units = (ds[start : start + 100]["text"] for start in range(0, len(ds), 100))
    seen = [t for unit in released_as_read(units, ds, every=10) for t in unit]
    assert seen == rows
    assert _resident_kib(arrow_files(ds)) < 512


def test_a_split_without_arrow_files_passes_its_units_through():
    ds = Dataset.from_dict({"text": ["a", "b"]})  # in memory: nothing mapped
    assert arrow_files(ds) == frozenset()
    assert list(released_as_read(iter([1, 2, 3]), ds)) == [1, 2, 3]
