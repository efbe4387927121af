"""Text files read one document per file, in bounded pieces.

datasets' text reader (`sample_by="document"`) reads a whole file into one row, so a file
larger than memory cannot be prepared. Here a file is read PIECE_CHARS characters at a
time into consecutive rows; the `__piece` column numbers a document's rows (0 starts a
document), so the readers downstream — the held-out split, mixing by weight, the
tokenising units (chunks.py) — keep a document's rows together and in order. A document
of at most PIECE_CHARS characters is one row, exactly as before.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import numpy as np

PIECE = "__piece"
PIECE_CHARS = 1 << 22  # characters per row of a long document (~4-16 MB of memory while read)


def file_documents(files: list[str], encoding: str):
    """A Dataset with one document per file: columns `text` and `__piece`."""
    import datasets

    # Sizes and times are part of datasets' cache key, so an edited file is read again.
    stamps = [(os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    features = datasets.Features({"text": datasets.Value("string"), PIECE: datasets.Value("int32")})
    return datasets.Dataset.from_generator(
        _rows,
        features=features,
        writer_batch_size=4,  # rows are written 4 pieces at a time
        gen_kwargs={"files": files, "encoding": encoding, "stamps": stamps, "size": PIECE_CHARS},
    )


def _rows(files: list[str], encoding: str, stamps: list, size: int) -> Iterator[dict]:
    for file in files:
        # Text mode translates universal newlines as datasets' reader does, across reads too.
        with open(file, encoding=encoding) as f:
            text = f.read(size)
            yield {"text": text, PIECE: 0}
            for k in itertools.count(1):
                if not (text := f.read(size)):
                    break
                yield {"text": text, PIECE: k}


def has_pieces(ds) -> bool:
    return PIECE in (ds.column_names or [])  # a stream of unknown features names no columns


def document_starts(ds) -> np.ndarray:
    """The first row of every document, in row order (every row when rows are documents)."""
    if not has_pieces(ds):
        return np.arange(len(ds))
    pieces = ds.with_format("arrow")[PIECE].to_numpy(zero_copy_only=False)
    return np.flatnonzero(pieces == 0)


def documents(ds) -> Iterator[Iterator[str]]:
    """Each document's text as an iterator of its rows' texts (consume each before the next)."""
    columns = ["text", PIECE] if has_pieces(ds) else ["text"]
    number = itertools.count()

    def rows() -> Iterator[tuple[int, str]]:
        doc = -1
        for batch in ds.select_columns(columns).iter(batch_size=16):
            for k, text in enumerate(batch["text"]):
                if PIECE not in batch or batch[PIECE][k] == 0:
                    doc = next(number)
                yield doc, text

    for _, group in itertools.groupby(rows(), key=lambda row: row[0]):
        yield (text for _, text in group)
