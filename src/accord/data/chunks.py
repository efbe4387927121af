"""Tokenise a split into token shards with every local core, resumably.

The split is cut into work units in a fixed order: about UNIT_CHARS of text for
pre-training (a document longer than that is cut into pieces at whitespace, so no process
ever tokenises a whole huge document), UNIT_ROWS rows otherwise. Each unit is tokenised by a
worker process into its own chunk file, written under a temporary name and renamed when
complete: a killed preparation keeps its finished chunks and the next one tokenises only
the rest. A single process then joins the chunks, in unit order, into the shard files
(shards.py), applying the truncation policy; the result does not depend on the number of
workers. No process group exists here: nothing can time out while the data is prepared.
"""

from __future__ import annotations

import os
import re
import sys
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from accord.atomic import replacing
from accord.compat.datasets import is_selection
from accord.data.columns import ColumnWriter, encode_columns
from accord.data.mapped_pages import released_as_read
from accord.data.nodeshare import NodeShare
from accord.data.pieces import documents
from accord.data.rows import IGNORE, DataError, row_origin
from accord.data.shards import ShardWriter, id_dtype
from accord.data.streams import is_stream, row_at
from accord.data.token_ids import token_ids
from accord.observe.progress import byte_bar
from accord.recipe.schema import DataConfig

UNIT_CHARS = 1 << 19  # text per pre-training unit: a worker's transient memory follows it
UNIT_ROWS = 1000  # rows per unit for the other tasks
_SPACE = re.compile(r"\s")


@dataclass(frozen=True)
class Unit:
    index: int
    load: Callable[[], Any]  # text units: [(text, starts_doc, ends_doc)]; row units: a column dict
    chars: int  # text characters, for the progress bar's MB/s (0: counted once loaded)


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def write_shards(
    ds, task, data: DataConfig, split: str, out: Path, work: Path, tokenizer_id: str, workers: int, quiet: bool = False
) -> dict[str, int]:
    """Tokenise `ds` into token shards in `out` (chunks kept in `work` until then), applying
    the data section's truncation policy; returns counts."""
    work.mkdir(parents=True, exist_ok=True)
    streams = getattr(task, "streams_text", False)
    units = released_as_read(_text_units(ds) if streams else _row_units(ds), ds)
    total = _text_bytes(ds)
    _tokenise_missing(
        units, task, work, _workers(ds, streams, total, workers), total=total, desc=f"tokenize {split}", quiet=quiet
    )
    writer = _writer(task, out, streams)
    counts = (
        _join_documents(work, writer, task, split) if streams else _join_examples(work, writer, task, data, ds, split)
    )
    if writer.examples == 0:
        raise DataError(
            f"no {split} examples left after data.truncation={data.truncation} (data.max_length={data.max_length})"
        )
    writer.close(tokenizer_id, {"split": split})
    return {f"{split}_examples": writer.examples, f"{split}_tokens": writer.tokens} | counts


def _writer(task, out: Path, streams: bool) -> ShardWriter | ColumnWriter:
    dtype = id_dtype(len(task.tokenizer))
    schema = task.shard_schema()
    if schema is not None:
        return ColumnWriter(out, schema, dtype)
    return ShardWriter(out, dtype, block_length=task.max_length if streams and task.join else None)


def tokenise_share(
    ds, task, split: str, work: Path, workers: int, share: NodeShare, sealed: Callable[[], bool], rest: bool = True
) -> None:
    """Several nodes (nodeshare.py): this node's units first, then (`rest`) every unit still
    missing, until `sealed()` says another node finished the cache (its work folder may then
    vanish)."""
    if sealed():
        return
    work.mkdir(parents=True, exist_ok=True)
    streams = getattr(task, "streams_text", False)
    total = _text_bytes(ds)
    workers = _workers(ds, streams, total, workers)
    try:
        for owned in (True, False) if rest else (True,):
            units = released_as_read(_text_units(ds) if streams else _row_units(ds), ds)
            mine = (unit for unit in units if not sealed() and (share.owns(unit.index) or not owned))
            _tokenise_missing(
                mine,
                task,
                work,
                workers,
                total=None,
                desc=f"tokenize {split} (node {share.node} of {share.nodes})",
                quiet=True,
            )
    except OSError:
        if not sealed():
            raise


def _workers(ds, streams: bool, total: int | None, workers: int) -> int:
    if (not is_stream(ds) and len(ds) <= UNIT_ROWS) if not streams else (total is not None and total <= 2 * UNIT_CHARS):
        return 1  # a unit or two: starting a pool costs more than it saves
    return workers


# ---------------------------------------------------------------- units (main process, in order)


def _text_units(ds) -> Iterator[Unit]:
    """Documents grouped (or cut) into pieces of about UNIT_CHARS, in file order."""
    pieces: list[tuple[str, bool, bool]] = []
    chars, index = 0, 0
    for document in documents(ds):
        for piece in _cuts(document):
            if chars and chars + len(piece[0]) > UNIT_CHARS:
                yield _text_unit(index, pieces, chars)
                pieces, chars, index = [], 0, index + 1
            pieces.append(piece)
            chars += len(piece[0])
    if pieces:
        yield _text_unit(index, pieces, chars)


def _text_unit(index: int, pieces: list, chars: int) -> Unit:
    return Unit(index, lambda: pieces, chars)


def _cuts(parts: Iterator[str]) -> Iterator[tuple[str, bool, bool]]:
    """(text, starts the document, ends it) pieces of at most ~UNIT_CHARS of one document
    given as consecutive parts, each cut just before a whitespace character, where
    byte-level BPE pre-tokenisers split anyway: tokenising the pieces gives the tokens of
    the whole (tokenizers that add a prefix space to every text may differ at a cut). The
    cuts depend only on the document's text, not on how it was read in parts: a cut is
    decided once 2 * UNIT_CHARS characters past the previous one are read (or the end)."""
    text, at, first, ended = "", 0, True, False
    while True:
        if not ended and len(text) - at <= 2 * UNIT_CHARS:
            part = next(parts, None)
            ended = part is None
            text = text[at:] + (part or "")
            at = 0
            continue
        if len(text) - at <= UNIT_CHARS:
            yield text[at:], first, True
            return
        found = _SPACE.search(text, at + UNIT_CHARS, at + 2 * UNIT_CHARS)
        end = found.start() if found else at + UNIT_CHARS
        yield text[at:end], first, False
        at, first = end, False


def _row_units(ds) -> Iterator[Unit]:
    if is_stream(ds):  # read once, in order, a unit at a time
        for index, batch in enumerate(ds.iter(batch_size=UNIT_ROWS)):
            yield Unit(index, partial(dict, batch), 0)
        return
    for index, start in enumerate(range(0, len(ds), UNIT_ROWS)):
        yield Unit(index, partial(_rows, ds, start), 0)


def _rows(ds, start: int) -> dict[str, list]:
    return ds[start : start + UNIT_ROWS]


def _text_bytes(ds) -> int | None:
    """Bytes of text in the split, for the bar's ETA (None where the rows are a selection)."""
    if is_stream(ds) or is_selection(ds):
        return None
    return int(ds.data.nbytes)


# ---------------------------------------------------------------- tokenising (workers)

_TASK = None  # the task, inherited by forked workers


def _chunk_path(work: Path, index: int) -> Path:
    return work / f"chunk-{index:07d}.npz"


def _tokenise_missing(
    units: Iterator[Unit], task, work: Path, workers: int, total: int | None, desc: str, quiet: bool = False
) -> None:
    """Every unit without a chunk file gets one, `workers` at a time, at most 2 per worker
    in flight (units are read as they are needed, never all at once)."""
    global _TASK
    _TASK = task
    kept = 0
    with byte_bar(total, desc) as bar:
        pending: deque = deque()
        pool = _pool(workers) if workers > 1 else None
        try:
            for unit in units:
                path = _chunk_path(work, unit.index)
                if path.exists():
                    kept += 1
                    bar.update(unit.chars)
                    continue
                payload = unit.load()
                size = unit.chars or _chars(payload)
                if pool is None:
                    _encode_unit(payload, path)
                    bar.update(size)
                    continue
                pending.append((pool.submit(_encode_unit, payload, path), size))
                while len(pending) >= 2 * workers:
                    _finish(pending.popleft(), bar)
            while pending:
                _finish(pending.popleft(), bar)
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
    if kept and not quiet:
        print(
            f"accord: {desc}: {kept} chunk(s) kept from an interrupted preparation in {work}",
            file=sys.stderr,
            flush=True,
        )


def _pool(workers: int):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # Forked workers inherit the task (and its tokenizer) instead of unpickling it; the
    # tokenizer's own thread pool is off in them, the processes are the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))


def _finish(item, bar) -> None:
    future, size = item
    future.result()  # a worker's DataError surfaces here, for the earliest failing unit
    bar.update(size)


def _chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_chars(v) for v in value)
    return 0


def _encode_unit(payload: Any, path: Path) -> None:
    task = _TASK
    assert task is not None
    arrays = _encode_text(task, payload) if getattr(task, "streams_text", False) else _encode_rows(task, payload)
    with replacing(path) as f:  # complete or absent: a kill never leaves half a chunk
        np.savez(f, **arrays)


def _encode_text(task, pieces: list[tuple[str, bool, bool]]) -> dict[str, np.ndarray]:
    dtype = id_dtype(len(task.tokenizer))  # the shards' dtype: a chunk is a quarter of int64's bytes
    prefix, eos = np.asarray(task.prefix, dtype=dtype), np.asarray([task.eos_id], dtype=dtype)
    parts, lengths = [], []
    for ids, (_, starts, ends) in zip(token_ids(task.tokenizer, [text for text, _, _ in pieces]), pieces):
        ids = np.asarray(ids, dtype=dtype)  # one conversion per piece, not per token
        parts += [prefix] * starts + [ids] + [eos] * ends
        lengths.append(len(prefix) * starts + len(ids) + ends)
    flags = np.array([[s, e] for _, s, e in pieces], dtype=bool).reshape(-1, 2)
    return {
        "tokens": np.concatenate(parts) if parts else np.zeros(0, dtype=dtype),
        "lengths": np.asarray(lengths, dtype=np.int64),
        "flags": flags,
    }


def _encode_rows(task, batch: dict[str, list]) -> dict[str, np.ndarray]:
    out = task.encode_batch(batch)
    dtype = id_dtype(len(task.tokenizer))
    schema = task.shard_schema()
    if schema is not None:
        return encode_columns(schema, out, dtype)
    ids = [np.asarray(x, dtype=dtype) for x in out["input_ids"]]
    labels = [np.asarray(x, dtype=np.int64) for x in out["labels"]]
    return {
        "tokens": np.concatenate(ids) if ids else np.zeros(0, dtype=dtype),
        "mask": np.concatenate(labels) != IGNORE if labels else np.zeros(0, dtype=bool),
        "lengths": np.asarray(out["length"], dtype=np.int64),
        "num_targets": np.asarray(out["num_targets"], dtype=np.int64),
        "over": np.asarray(out["over_length"], dtype=bool),
    }


# ---------------------------------------------------------------- joining (main process, in order)


def _chunks(work: Path) -> Iterator[dict[str, np.ndarray]]:
    index = 0
    while (path := _chunk_path(work, index)).exists():
        with np.load(path) as chunk:
            yield {name: chunk[name] for name in chunk.files}
        index += 1


def _join_documents(work: Path, writer: ShardWriter, task, split: str) -> dict[str, int]:
    """Pre-training: the documents' stream cut into blocks, or (no joining) each document
    its own example truncated to max_length."""
    if writer.block_length is not None:
        for chunk in _chunks(work):
            writer.add_stream(chunk["tokens"])
        return {}
    over = 0
    doc: list[np.ndarray] = []
    kept = 0  # tokens of the current document kept so far (max_length + 1 at most)
    for chunk in _chunks(work):
        at = 0
        for length, (starts, ends) in zip(chunk["lengths"], chunk["flags"]):
            piece = chunk["tokens"][at : at + length]
            at += length
            if starts:
                doc, kept = [], 0
            if kept <= task.max_length:
                doc.append(piece[: task.max_length + 1 - kept])
                kept += len(doc[-1])
            if ends:
                ids = np.concatenate(doc)
                over += len(ids) > task.max_length
                ids = ids[: task.max_length]
                if len(ids) > 1:
                    writer.add_examples(
                        ids, np.ones(len(ids), dtype=bool), np.array([len(ids)]), np.array([len(ids) - 1])
                    )
    return {f"{split}_over_length": over, f"{split}_dropped": 0} if over else {}


def _join_examples(
    work: Path, writer: ShardWriter | ColumnWriter, task, data: DataConfig, ds, split: str
) -> dict[str, int]:
    """Examples in row order, with data.truncation applied: over-long ones dropped under
    `drop`, refused under `error`; an example with no target left is dropped when truncation
    took them, refused otherwise."""
    policy = data.truncation
    over_count, dropped, first_over = 0, 0, None
    row = 0
    for chunk in _chunks(work):
        lengths, over, targets = chunk["lengths"], chunk["over"], chunk["num_targets"]
        keep = np.ones(len(lengths), dtype=bool)
        for k in np.flatnonzero(targets == 0):
            if not over[k]:
                raise DataError(
                    f"{row_origin(_row(ds, row + int(k)))}: this example has no target tokens (nothing to train on); "
                    "fix or remove it"
                )
            keep[k] = False
        if over.any() and first_over is None:
            first_over = row + int(np.flatnonzero(over)[0])
        over_count += int(over.sum())
        if policy == "drop":
            keep &= ~over
        dropped += int((~keep).sum())
        writer.add_chunk(chunk, keep)
        row += len(lengths)
    if over_count and policy == "error":
        raise DataError(
            f"{row_origin(_row(ds, first_over))}: {over_count} {split} example(s) are longer than data.max_length="
            f"{data.max_length} tokens (this one first); raise max_length or set data.truncation=truncate|drop"
        )
    return {f"{split}_over_length": over_count, f"{split}_dropped": dropped}


def _row(ds, index: int) -> dict:
    return row_at(ds, index) if is_stream(ds) else ds[index]
