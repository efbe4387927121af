"""Read raw rows from local files with `datasets`, with errors that name the file and row.

Every source becomes a `datasets.Dataset` whose columns carry the names the task reads
(after `fields` renames), plus `__source` / `__row` columns so that a later problem with
a row (a label outside the set, an over-long example) can still name where it came from.
A hub name (ORG/NAME, no local file of that name) is read from the snapshot that
recipe/hub.py pinned, with datasets.load_dataset.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from accord.data.chat import normalise_chat
from accord.data.documents import split_documents
from accord.data.pieces import PIECE, document_starts, file_documents, has_pieces
from accord.data.rows import ROW, SOURCE, DataError, row_origin  # noqa: F401 (read from here too)
from accord.recipe.hub import HubError, is_hub_name, local_path
from accord.recipe.paths import PathError, resolve_path
from accord.recipe.schema import SourceConfig

_SUFFIXES = {
    ".jsonl": "jsonl",
    ".json": "json",
    ".csv": "csv",
    ".tsv": "tsv",
    ".parquet": "parquet",
    ".txt": "text",
    ".yml": "chatterbot",
    ".yaml": "chatterbot",
}


def load_source(source: SourceConfig, required: tuple[str, ...], role: str = "data.train"):
    """One source as a Dataset with the `required` columns (as strings unless the task says otherwise).
    `role`: the recipe key it comes from; an eval source's errors say so (its rows too)."""
    try:
        return _load_source(source, required, "" if role == "data.train" else f"{role}: ")
    except DataError as e:
        if role == "data.train" or str(e).startswith(f"{role}: "):
            raise
        raise DataError(f"{role}: {e}") from None


def _load_source(source: SourceConfig, required: tuple[str, ...], label: str):
    import datasets

    if source.path is not None and is_hub_name(source.path):
        return _finish(_load_hub(source), source, source.path, "hub", required, label)
    path, fmt, files = locate_files(source)
    if source.document != "file" and fmt != "text":
        raise DataError(
            f"{path}: document: {source.document if isinstance(source.document, str) else 'separator'} splits "
            f"text files; this source is {fmt} (set format: text for plain text)"
        )
    _check_text_encoding(files, fmt, source.encoding)
    datasets.disable_progress_bars()
    if fmt == "arrow":
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    elif fmt == "chatterbot":
        ds = datasets.Dataset.from_list(_chatterbot_rows(files))
    elif fmt == "text" and source.document != "file":
        ds = split_documents(files, source.document, source.encoding)
    elif fmt == "text":
        ds = file_documents(files, source.encoding)
    else:
        ds = _load_files(files, fmt, source)
    return _finish(ds, source, path, fmt, required, label)


def _finish(ds, source: SourceConfig, path, fmt: str, required: tuple[str, ...], label: str):
    """The source's rows renamed, with their origin, chat turns normalised and the task's columns checked."""
    ds = _rename(ds, source, path)
    if fmt == "contrastive":
        ds = _split_common_prefix(ds, path)
    ds = ds.add_column(SOURCE, [f"{label}{path}"] * len(ds)).add_column(ROW, list(range(1, len(ds) + 1)))
    ds = normalise_chat(ds)
    ds = check_columns(ds, required, str(path))
    if len(ds) == 0:
        raise DataError(f"{path}: no rows")
    return ds


def _load_hub(source: SourceConfig):
    """A hub dataset's split, read by datasets from the snapshot folder huggingface_hub keeps:
    offline, datasets' own hub lookup asks the hub for the repository's files and falls back
    only to its prepared Arrow cache, never to huggingface_hub's cache of the repository."""
    import datasets

    try:
        folder = local_path(source.path, source.revision, "dataset", source.path)
    except HubError as e:
        raise DataError(str(e)) from None
    try:
        builder = datasets.load_dataset_builder(str(folder), source.config)
    except ValueError as e:  # an unknown config: datasets names the ones there are
        raise DataError(f"{source.path}: {' '.join(str(e).split())[:300]}") from None
    splits = list(builder.config.data_files or {})
    if splits and source.split not in splits:
        raise DataError(
            f"{source.path}{'/' + source.config if source.config else ''}: no split {source.split!r} "
            f"(splits: {', '.join(splits)}); set split: to one of them"
        )
    return datasets.load_dataset(str(folder), source.config, split=source.split)


def locate_files(source: SourceConfig) -> tuple[Path, str, list[str]]:
    """(path, format, files) of a file source, or the one line saying what is wrong."""
    try:
        path = resolve_path(source.path)
    except PathError as e:
        raise DataError(str(e)) from None
    if not path.exists():
        raise DataError(_not_found(source))
    candidates = _candidates(path, source.glob)
    fmt = detect_format(path, source.format, candidates, source.glob is not None)
    return path, fmt, _files(path, fmt, candidates, source.glob is not None)


def _not_found(source: SourceConfig) -> str:
    """Where a missing source was looked for; the hub is named only for what looks like a hub name."""
    folders = source._looked_in or (str(Path.cwd()),)
    where = f"looked in {' and '.join(folders)}" + (
        "; a relative path is read from the current folder, else from the recipe file's folder"
        if len(folders) > 1
        else ""
    )
    return f"data source {source.path!r} not found ({where})"


def _candidates(path: Path, glob: str | None) -> list[Path]:
    """The files of a folder source: those its glob matches, or every file in it (and below)."""
    if path.is_file():
        if glob is not None:
            raise DataError(
                f"{path}: glob: {glob!r} selects files in a folder, and this source is a file; "
                "drop glob or give the folder"
            )
        return [path]
    files = sorted(p for p in path.glob(glob or "**/*") if p.is_file())
    if glob is not None and not files:
        raise DataError(
            f"{path}: glob: {glob!r} matches no files in this folder; "
            'check the pattern (e.g. "**/*.md" for every .md file below it)'
        )
    return files


def detect_format(path: Path, declared: str, candidates: list[Path] | None = None, globbed: bool = False) -> str:
    if declared != "auto":
        return declared
    if path.is_dir():
        if (
            (path / "dataset_info.json").exists()
            or (path / "dataset_dict.json").exists()
            or (path / "state.json").exists()
        ):
            return "arrow"
        files = candidates if candidates is not None else _candidates(path, None)
        # Files a glob chose on purpose are plain text when their suffix says nothing (.md, .rst).
        formats = {_SUFFIXES.get(p.suffix, "text" if globbed else None) for p in files} - {None}
        if len(formats) == 1:
            return formats.pop()
        found = sorted({p.suffix for p in files if p.suffix in _SUFFIXES or globbed})
        raise DataError(
            f"{path}: cannot tell the format of this folder (found {found or 'no data files'}); set format: ..."
        )
    fmt = _SUFFIXES.get(path.suffix)
    if fmt is None:
        raise DataError(
            f"{path}: unknown file type {path.suffix!r}; set format: jsonl | json | csv | tsv | parquet | text"
        )
    return fmt


def _files(path: Path, fmt: str, candidates: list[Path], globbed: bool) -> list[str]:
    if fmt == "arrow" or path.is_file():
        return [str(path)]
    if globbed:
        return [str(p) for p in candidates]
    suffixes = [s for s, f in _SUFFIXES.items() if f == fmt] or [".json", ".jsonl"]
    files = [str(p) for p in candidates if p.suffix in suffixes]
    if not files:
        raise DataError(f"{path}: no {fmt} files in this folder")
    return files


# Formats read as text, and whether source.encoding applies to them (JSON is UTF-8 by definition).
_TEXT_FORMATS = {
    "jsonl": False,
    "json": False,
    "contrastive": False,
    "chatterbot": False,
    "csv": True,
    "tsv": True,
    "text": True,
}


def _check_text_encoding(files: list[str], fmt: str, encoding: str) -> None:
    """Name the file and line of the first byte that is not UTF-8: datasets and pyarrow
    would otherwise fail later with a UnicodeDecodeError that names neither."""
    import codecs

    if fmt not in _TEXT_FORMATS or (_TEXT_FORMATS[fmt] and codecs.lookup(encoding).name != "utf-8"):
        return
    for file in files:
        decoder, lines, offset = codecs.getincrementaldecoder("utf-8")(), 1, 0
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as e:
                    bad = e.object[e.start]
                    line = lines + chunk[: e.start].count(b"\n")
                    fix = "save it as UTF-8" + (
                        ", or set encoding: (e.g. latin-1) on this source" if _TEXT_FORMATS[fmt] else ""
                    )
                    raise DataError(
                        f"{file}:{line}: not UTF-8 text (byte 0x{bad:02x} at offset {offset + e.start}); {fix}"
                    ) from None
                lines += chunk.count(b"\n")
                offset += len(chunk)
            try:
                decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                raise DataError(
                    f"{file}:{lines}: not UTF-8 text (the file ends inside a character); save it as UTF-8"
                ) from None


def _load_files(files: list[str], fmt: str, source: SourceConfig):
    import datasets

    builder, kwargs = {
        "jsonl": ("json", {}),
        "json": ("json", {}),
        "contrastive": ("json", {}),
        "csv": ("csv", {"encoding": source.encoding}),
        "tsv": ("csv", {"encoding": source.encoding, "delimiter": "\t"}),
        "parquet": ("parquet", {}),
    }[fmt]
    try:
        return datasets.load_dataset(builder, data_files=files, split="train", **kwargs)
    except Exception as e:  # datasets wraps parser errors; find the line ourselves for JSON
        for file in files:
            _raise_on_no_rows(Path(file))
        if builder == "json":
            for file in files:
                _raise_on_bad_json(Path(file))
        cause = e.__cause__ or e
        raise DataError(f"{', '.join(files)}: cannot be read as {fmt}: {' '.join(str(cause).split())[:300]}") from None


def _raise_on_no_rows(path: Path) -> None:
    """An empty (or blank) file makes the parsers fail with an empty message: say so."""
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return
    what = "empty" if path.stat().st_size == 0 else "blank (only white space)"
    raise DataError(f"{path}: the file is {what}: it has no rows; fill it or leave it out of the recipe's data")


def _raise_on_bad_json(path: Path) -> None:
    if path.suffix == ".json":
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.lstrip().startswith("["):  # one JSON document: it is parsed whole anyway
            try:
                json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
            return
    with path.open(encoding="utf-8", errors="replace") as lines:  # JSON lines: one line at a time
        _raise_on_bad_line(path, lines)


def _raise_on_bad_line(path: Path, lines) -> None:
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")


def _rename(ds, source: SourceConfig, path: Path):
    missing = [column for column in source.fields.values() if column not in ds.column_names]
    if missing:
        raise DataError(
            f"{path}: fields maps to column(s) {missing} that the data does not have (columns: {ds.column_names})"
        )
    return ds.rename_columns({column: name for name, column in source.fields.items() if column != name})


def check_columns(ds, required: tuple[str, ...], where: str):
    """Every required column exists and holds text (numbers from CSV become text); returns
    the dataset with those columns as strings, or names the first bad row."""
    import datasets

    missing = [field for field in required if field not in ds.column_names]
    if missing:
        if SOURCE in ds.column_names and len(ds):
            files = ", ".join(sorted(set(ds.unique(SOURCE))))  # the files (and, for eval, the role) to fix
            where = files if where in files else f"{files}: {where}"
        present = [c for c in ds.column_names if not c.startswith("__")]
        raise DataError(
            f"{where}: missing field {', '.join(map(repr, missing))} (fields present: {', '.join(present)}); "
            f"rename with fields: {{{missing[0]}: <column>}}"
        )
    for field in required:
        dtype = getattr(ds.features[field], "dtype", None)
        if (
            dtype is not None
            and dtype not in ("string", "large_string")
            and dtype != "null"
            and ("int" in dtype or "float" in dtype or dtype == "bool")
        ):
            ds = ds.cast_column(field, datasets.Value("string"))
            dtype = "string"
        if dtype in ("string", "large_string"):
            # Arrow counts the nulls without reading the text; the rows are read (in batches)
            # only to name the first null one.
            if ds.data.column(field).null_count:
                first = next((i for i, v in _values(ds, field) if v is None), None)
                if first is not None:
                    raise DataError(f"{_where(ds, first, where)}: field {field!r} is missing or null")
            continue
        for i, value in _values(ds, field):
            if not isinstance(value, str):
                raise DataError(
                    f"{_where(ds, i, where)}: field {field!r} must be a string "
                    f"(got {type(value).__name__} {value!r:.40})"
                )
    return ds


def _values(ds, field: str):
    """(row, value) of one column, read a batch at a time: a column of a large corpus is never
    held whole as Python objects."""
    at = 0
    for batch in ds.select_columns([field]).iter(batch_size=1000):
        for value in batch[field]:
            yield at, value
            at += 1


def _where(ds, index: int, default: str) -> str:
    if SOURCE in ds.column_names:
        return f"{ds[index][SOURCE]}: row {ds[index][ROW]}"
    return f"{default}: row {index + 1}"


def _chatterbot_rows(files: list[str]) -> list[dict[str, Any]]:
    """chatterbot-corpus YAML: each conversation is a list of alternating user / assistant turns."""
    import yaml

    rows = []
    for file in files:
        data = yaml.safe_load(Path(file).read_text(encoding="utf-8")) or {}
        for conversation in data.get("conversations") or []:
            turns = [str(t) for t in conversation if t is not None]
            if len(turns) >= 2:
                roles = ["user", "assistant"] * len(turns)
                rows.append({"messages": [{"role": r, "content": t} for r, t in zip(roles, turns)]})
    if not rows:
        raise DataError(f"{', '.join(files)}: no conversations found")
    return rows


def _split_common_prefix(ds, path: Path):
    """Rows of two texts (positive / negative) that share a prompt: the shared part up to
    the last line break or space becomes `prompt`, the rest `chosen` and `rejected`."""
    for field in ("positive", "negative"):
        if field not in ds.column_names:
            raise DataError(
                f"{path}: format contrastive needs fields positive and negative (columns: {ds.column_names})"
            )

    def split(row: dict[str, str]) -> dict[str, str]:
        good, bad = row["positive"], row["negative"]
        shared = len(_common_prefix(good, bad))
        cut = max(good.rfind("\n", 0, shared), good.rfind(" ", 0, shared)) + 1
        return {"prompt": good[:cut], "chosen": good[cut:], "rejected": bad[cut:]}

    return ds.map(split, remove_columns=["positive", "negative"])


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


def take_share(ds, source: SourceConfig, seed: int):
    """The rows a source's `fraction` or `count` asks for: datasets' seeded shuffle, cut to
    size (a count beyond the source's rows repeats the whole shuffled source first)."""
    if source.fraction is None and source.count is None:
        return ds
    if has_pieces(ds):
        raise DataError(
            f"{source.path}: fraction / count draw rows, and this text source is read in pieces of documents; "
            "use weight, or document: line / paragraph"
        )
    wanted = source.count if source.count is not None else max(1, round(source.fraction * len(ds)))
    shuffled = ds.shuffle(seed=seed)
    rows = [i % len(ds) for i in range(wanted)]
    return shuffled.select(rows)


def mix(parts: list, weights: list[float], seed: int):
    """One dataset from several: concatenated when the weights are equal, otherwise sampled
    in the given proportions (smaller sources repeat) until every source was seen once."""
    import datasets

    if len(parts) == 1:
        return parts[0]
    if any(has_pieces(p) for p in parts):  # documents read in pieces stay whole
        parts = [p if has_pieces(p) else p.add_column(PIECE, [0] * len(p)) for p in parts]
    columns = set.intersection(*(set(p.column_names) for p in parts))
    parts = [p.select_columns(sorted(columns)) for p in parts]
    parts = [p.cast(parts[0].features) for p in parts]
    if len(set(weights)) == 1:
        return datasets.concatenate_datasets(parts)
    total = sum(weights)
    probabilities = [w / total for w in weights]
    if not any(has_pieces(p) for p in parts):
        return datasets.interleave_datasets(
            parts, probabilities=probabilities, seed=seed, stopping_strategy="all_exhausted"
        )
    return _interleave_documents(parts, probabilities, seed)


def _interleave_documents(parts: list, probabilities: list[float], seed: int):
    """interleave_datasets over whole documents: datasets' own sampling picks which source's
    next document comes (the same picks as over rows when every document is one row), and
    each pick brings all of that document's rows."""
    import datasets
    import numpy as np

    whole = datasets.concatenate_datasets(parts)
    offsets = np.cumsum([0] + [len(p) for p in parts])
    bounds = []  # per part: its documents' (first row, end row) in `whole`
    for p, offset in zip(parts, offsets):
        starts = document_starts(p) + offset
        bounds.append(np.stack([starts, np.append(starts[1:], offset + len(p))], axis=1))
    picks = datasets.interleave_datasets(
        [datasets.Dataset.from_dict({"doc": b.tolist()}) for b in bounds],
        probabilities=probabilities,
        seed=seed,
        stopping_strategy="all_exhausted",
    )
    first, end = np.asarray(picks["doc"], dtype=np.int64).reshape(-1, 2).T
    sizes = end - first
    rows = np.repeat(first - np.cumsum(sizes) + sizes, sizes) + np.arange(int(sizes.sum()))
    return whole.select(rows)
