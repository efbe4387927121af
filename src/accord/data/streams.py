"""Streaming sources: rows that are never materialised, walked once into token shards.

A source is streamed when it says `streaming: true` (its local files read by `datasets`
as an IterableDataset) or names a `function: pkg.module:function` that returns an
IterableDataset (a Dataset, or any iterable of row dicts, is accepted too). Preparation
walks the stream once, in order, in batches (data/chunks.py), so memory is one batch;
counts and random access come from the shards written. Rows get the same `__source` /
`__row` columns as file sources, and their checks run row by row as the stream is read,
so a bad row still stops preparation with one line naming it.

Only sft, pretrain and dpo take streams: the others read their whole table before
tokenising (classify its label set, reward its row format, grpo its raw rows).
`eval_fraction` needs random access; a streamed `data.eval` is read into Arrow for sft
(its generation metrics read raw rows).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from accord.data.chat import _flatten_parts, _from_sharegpt
from accord.data.rows import ROW, SOURCE, DataError
from accord.data.sources import load_source, locate_files
from accord.errors import UserInputError
from accord.recipe.schema import DataConfig, SourceConfig
from accord.registry import load_object

_STREAM_FORMATS = {
    "jsonl": ("json", {}),
    "json": ("json", {}),
    "csv": ("csv", {}),
    "tsv": ("csv", {"delimiter": "\t"}),
    "parquet": ("parquet", {}),
    "text": ("text", {"sample_by": "document"}),
}
BATCH = 256  # rows per checked batch as the stream is read


def is_stream(ds: Any) -> bool:
    import datasets

    return isinstance(ds, datasets.IterableDataset)


def has_streams(cfg: DataConfig) -> bool:
    return any(s.streamed for s in (cfg.train or []) + (cfg.eval or []))


def check_task(cfg: DataConfig, task) -> None:
    """Refuse streams for a task whose preparation needs the whole table, before any reading."""
    if has_streams(cfg) and not task.takes_streams:
        raise DataError(
            f"task {task.name}: a streamed data source (streaming: true or function:) is read once, in order, "
            "which only sft, pretrain and dpo take (this task reads its whole table first); "
            "read this source without streaming"
        )


def load_stream_split(cfg: DataConfig, seed: int, required: tuple[str, ...]):
    """(train, eval or None) as IterableDatasets, for a data section with a streamed source."""
    if cfg.eval is None and cfg.eval_fraction:
        raise DataError(
            f"data.eval_fraction={cfg.eval_fraction:g}: a streamed source has no random access to hold rows out of; "
            f"give data.eval instead (it may stream too)"
        )
    assert cfg.train is not None
    train = _mix([stream_source(s, required, "data.train") for s in cfg.train], [s.weight for s in cfg.train], seed)
    if cfg.eval is None:
        return train, None
    return train, _mix([stream_source(s, required, "data.eval") for s in cfg.eval], [s.weight for s in cfg.eval], seed)


def stream_source(source: SourceConfig, required: tuple[str, ...], role: str):
    """One source as an IterableDataset with checked `required` columns, `__source` and `__row`."""
    label = "" if role == "data.train" else f"{role}: "
    if not source.streamed:  # a file source mixed with streamed ones: read as usual, then streamed
        return load_source(source, required, role).to_iterable_dataset()
    if source.function is not None:
        ds, where = _from_function(source.function, role), f"{label}{source.function}"
    else:
        ds, where = _from_files(source), f"{label}{source.path}"
    names = columns(ds, where)
    missing = [column for column in source.fields.values() if column not in names]
    if missing:
        raise DataError(f"{where}: fields maps to column(s) {missing} that the data does not have (columns: {names})")
    ds = ds.rename_columns({column: name for name, column in source.fields.items() if column != name})
    names = [next((name for name, column in source.fields.items() if column == c), c) for c in names]
    ds = ds.map(_numbered(where), batched=True, batch_size=BATCH, with_indices=True)
    if "conversations" in names and "messages" not in names:
        ds = ds.map(_from_sharegpt, batched=True, batch_size=BATCH, remove_columns=["conversations"])
    elif "messages" in names:
        ds = ds.map(_flatten_parts, batched=True, batch_size=BATCH)
    return checked(ds, required, where)


def _from_function(target: str, role: str):
    import datasets

    fn = load_object(target, f"{role}.function")
    if not callable(fn):
        raise DataError(f"{role}.function: {target} is not callable; name a function that returns an IterableDataset")
    result = _call(fn, target)
    if isinstance(result, datasets.IterableDataset):
        return result
    if isinstance(result, datasets.Dataset):
        return result.to_iterable_dataset()
    if not hasattr(result, "__iter__") or isinstance(result, (str, bytes, dict)):
        raise DataError(
            f"{role}.function: {target} returned {type(result).__name__}; "
            "return a datasets IterableDataset or an iterable of row dicts"
        )
    # A plain iterable may be one-shot (a generator): each walk calls the function again.
    return datasets.IterableDataset.from_generator(_rows_of, gen_kwargs={"target": target})


def _call(fn: Callable, target: str) -> Any:
    try:
        return fn()
    except UserInputError:
        raise
    except Exception as e:
        raise DataError(
            f"{target}: the data function raised {type(e).__name__}: {' '.join(str(e).split())[:200]}"
        ) from None


def _rows_of(target: str) -> Iterator[dict]:
    for number, row in enumerate(_call(load_object(target, "data function"), target), start=1):
        if not isinstance(row, dict):
            raise DataError(f"{target}: row {number}: expected a dict of columns, got {type(row).__name__}")
        yield row


def _from_files(source: SourceConfig):
    import datasets

    path, fmt, files = locate_files(source)
    if fmt not in _STREAM_FORMATS:
        raise DataError(
            f"{path}: streaming: true reads {', '.join(_STREAM_FORMATS)} files; this source is {fmt} (drop streaming)"
        )
    if source.document != "file":
        raise DataError(
            f"{path}: document: splits text files that are read whole; drop streaming (or document) on this source"
        )
    builder, kwargs = _STREAM_FORMATS[fmt]
    if fmt in ("csv", "tsv", "text"):
        kwargs = kwargs | {"encoding": source.encoding}
    datasets.disable_progress_bars()
    return datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **kwargs)


def _numbered(where: str) -> Callable:
    def number(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        return {SOURCE: [where] * len(indices), ROW: [i + 1 for i in indices]}

    return number


class BatchRows:
    """A batch of columns read like a Dataset by the row checks (`rows["col"]`, `rows[i]`)."""

    def __init__(self, batch: dict[str, list]):
        self.batch = batch
        self.column_names = list(batch)

    def __len__(self) -> int:
        return len(self.batch[SOURCE])

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.batch[key]
        return {name: values[key] for name, values in self.batch.items()}


def checked(ds, fields: tuple[str, ...], where: str, check: Callable[[BatchRows], None] | None = None):
    """`ds` whose `fields` are checked (and numbers made text) row by row as it is read,
    plus `check` on every batch; the first bad row stops the walk with one line."""

    def check_batch(batch: dict[str, list]) -> dict[str, list]:
        out = {}
        for field in fields:
            if field not in batch:
                present = [c for c in batch if not c.startswith("__")]
                raise DataError(
                    f"{where}: missing field {field!r} (fields present: {', '.join(present)}); "
                    f"rename with fields: {{{field}: <column>}}"
                )
            values = [str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in batch[field]]
            for i, value in enumerate(values):
                if not isinstance(value, str):
                    problem = (
                        "is missing or null"
                        if value is None
                        else f"must be a string (got {type(value).__name__} {value!r:.40})"
                    )
                    raise DataError(f"{batch[SOURCE][i]}: row {batch[ROW][i]}: field {field!r} {problem}")
            out[field] = values
        if check is not None:
            check(BatchRows(batch))
        return out

    return ds.map(check_batch, batched=True, batch_size=BATCH)


def columns(ds, where: str = "data") -> list[str]:
    """A stream's column names: from its features, else its first row (read for it)."""
    if ds.column_names is not None:
        return list(ds.column_names)
    first = next(iter(ds), None)
    if first is None:
        raise DataError(f"{where}: no rows")
    return list(first)


def row_at(ds, index: int) -> dict:
    """Row `index` of a stream (walked to it: for error messages only)."""
    return next(islice(iter(ds), index, None))


def read_into_arrow(ds, folder: Path):
    """A streamed split as an Arrow Dataset under `folder` (written as it is read)."""
    import datasets

    return datasets.Dataset.from_generator(_walk, gen_kwargs={"ds": ds}, cache_dir=str(folder), keep_in_memory=False)


def _walk(ds) -> Iterator[dict]:
    yield from ds


def _mix(parts: list, weights: list[float], seed: int):
    """Streams mixed like sources.mix: concatenated for equal weights, else interleaved."""
    import datasets

    if len(parts) == 1:
        return parts[0]
    common = set.intersection(*(set(columns(p)) for p in parts))
    parts = [p.select_columns(sorted(common)) for p in parts]
    if len(set(weights)) == 1:
        return datasets.concatenate_datasets(parts)
    total = sum(weights)
    return datasets.interleave_datasets(
        parts, probabilities=[w / total for w in weights], seed=seed, stopping_strategy="all_exhausted"
    )


def function_identity(target: str) -> str:
    """What the cache fingerprint knows of a data function: its name and its module file."""
    module = target.partition(":")[0]
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    origin = Path(spec.origin) if spec is not None and spec.origin and Path(spec.origin).exists() else None
    if origin is None:
        return target
    stat = origin.stat()
    return f"{target}:{origin}:{stat.st_size}:{stat.st_mtime_ns}"
