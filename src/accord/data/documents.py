"""Text files cut into documents: one per line, per paragraph, or between separators.

A text source is one document per file by default (datasets' `sample_by="document"`).
Lines come from datasets' own text reader; paragraphs (text between blank lines, a blank
line being one with only spaces) and separators are read here, in bounded chunks, so a
file larger than memory is never held whole.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from accord.data.rows import DataError

_CHUNK = 1 << 20  # characters read at a time


def split_documents(files: list[str], document, encoding: str):
    """A Dataset with one `text` row per non-blank document of `files` (in file order);
    `document` is "line", "paragraph" or a DocumentSeparator."""
    import datasets

    if document == "line":
        ds = datasets.load_dataset("text", data_files=files, split="train", encoding=encoding, sample_by="line")
        return ds.filter(lambda batch: [bool(t.strip()) for t in batch["text"]], batched=True)
    separator = None if document == "paragraph" else document.separator
    if separator is not None:
        for file in files:
            if not _occurs(file, separator, encoding):
                raise DataError(
                    f"{file}: the document separator {separator!r} never occurs in this file; "
                    f"fix document.separator, or use document: file | line | paragraph"
                )
    # Sizes and times are part of datasets' cache key, so an edited file is read again.
    stamps = [(os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    return datasets.Dataset.from_generator(
        _rows, gen_kwargs={"files": files, "separator": separator, "encoding": encoding, "stamps": stamps}
    )


def _rows(files: list[str], separator: str | None, encoding: str, stamps: list) -> Iterator[dict[str, str]]:
    for file in files:
        for text in documents(file, separator, encoding):
            yield {"text": text}


def documents(file: str, separator: str | None, encoding: str) -> Iterator[str]:
    """The documents of one file between `separator`s (None: between blank lines), without
    the line breaks around each; blank documents are left out. Linear in the file's size."""
    with open(file, encoding=encoding) as f:
        pieces = _paragraphs(f) if separator is None else _between(f, separator)
        for piece in pieces:
            text = piece.strip("\r\n")
            if text.strip():
                yield text


def _paragraphs(f) -> Iterator[str]:
    lines: list[str] = []
    for line in f:
        if line.strip():
            lines.append(line)
        elif lines:
            yield "".join(lines)
            lines = []
    yield "".join(lines)


def _between(f, separator: str) -> Iterator[str]:
    # The current document's text so far, and the last len(separator) - 1 characters read,
    # which may be the start of a separator that ends in the next chunk.
    pieces: list[str] = []
    carry, keep = "", len(separator) - 1
    while chunk := f.read(_CHUNK):
        *ended, last = (carry + chunk).split(separator)
        for i, part in enumerate(ended):
            yield "".join(pieces) + part if i == 0 else part
            pieces = []
        cut = max(0, len(last) - keep)
        pieces.append(last[:cut])
        carry = last[cut:]
    yield "".join(pieces) + carry


def _occurs(file: str, separator: str, encoding: str) -> bool:
    tail = ""
    with open(file, encoding=encoding) as f:
        while chunk := f.read(_CHUNK):
            if separator in tail + chunk:
                return True
            tail = (tail + chunk)[-len(separator) :]
    return False
