"""TRL's `datasets:` mixture and the alignment-handbook's `dataset_mixture` as data.train
sources, and their `test_split_size` as data.eval_fraction.

The two name their per-dataset shares differently: TRL's `fraction` is a dataset's share of
the mixture, which TRL makes as large as it can without repeating a row (so the rows kept
depend on every dataset's size); the handbook's `weight` is the share of that dataset's own
rows kept (a seeded draw), which is accord's `fraction`. `test_split_size` is datasets'
train_test_split(test_size=...) on the mixed rows: a float is the held-out share, an int a count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accord.interop.mapping import Refused


def trl_mixture(value, job) -> dict[str, Any]:
    """TRL's `datasets: [{path, name, split, columns, fraction}]` (trl.DatasetMixtureConfig)."""
    items = list(value or [])
    sources = [_source(item) for item in items]
    out: dict[str, Any] = {}
    if any(item.get("fraction") is not None for item in items):
        counts = _trl_counts(items)
        for source, count, rows in zip(sources, counts, [_rows(item) for item in items], strict=True):
            if count < rows:
                source["count"] = count
        sources = [s for s, count in zip(sources, counts, strict=True) if count > 0]
        out["_note"] = "fraction as the rows TRL keeps (count: a seeded draw where TRL takes the first rows)"
    if sources:
        out["data.train"] = sources
    return out


def handbook_mixture(value, job) -> dict[str, Any]:
    """The handbook's `dataset_mixture: {datasets: [{id, config, split, columns, weight}], test_split_size}`."""
    value = dict(value or {})
    items = list(value.get("datasets") or [])
    sources = []
    for item in items:
        source = _source(item)
        weight = item.get("weight")
        if weight is not None and not 0 < float(weight) <= 1:
            raise Refused(
                f"dataset_mixture weight {weight!r}: the handbook keeps int(weight × rows) of a dataset, at most all",
                "a weight in (0, 1]",
            )
        if weight is not None and float(weight) < 1:
            source["fraction"] = float(weight)
        sources.append(source)
    out: dict[str, Any] = {"data.train": sources} if sources else {}
    return out | held_out(value.get("test_split_size"), items)


def test_split(value, job) -> dict[str, Any]:
    """TRL's top-level test_split_size (a field of trl.DatasetMixtureConfig)."""
    return held_out(value, list(job.value("datasets") or []))


def held_out(value, items: list) -> dict[str, Any]:
    """A float in (0, 1) is data.eval_fraction; a whole number counts rows, which becomes a
    fraction only with the mixture's row count (the nearest value given when it is known)."""
    if value is None or value == 0:
        return {}
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and 0 < value < 1:
        return {"data.eval_fraction": float(value)}
    if number and value >= 1 and float(value).is_integer():
        whole = all(item.get("fraction") is None and item.get("weight") is None for item in items)
        rows = [_rows(item) for item in items] if whole else [None]
        nearest = "test_split_size as a fraction of the mixed rows, e.g. 0.05"
        if items and None not in rows and value < sum(rows):
            nearest = f"test_split_size: {int(value) / sum(rows):.4g} ({int(value)} of the mixture's {sum(rows)} rows)"
        raise Refused(
            f"test_split_size {value!r} is a count of rows; accord holds out a fraction of them (data.eval_fraction)",
            nearest,
        )
    raise Refused(f"test_split_size {value!r} is neither a fraction in (0, 1) nor a row count", "e.g. 0.05")


# datasets' packaged builders, named as a dataset's path with the file(s) in data_files.
_BUILDERS = ("json", "csv", "parquet", "text", "arrow")


def _source(item: dict) -> dict[str, Any]:
    source = {"path": item.get("path") or item.get("id")}
    files = item.get("data_files")
    if files is not None or item.get("data_dir") is not None:
        if not (isinstance(files, str) and source["path"] in _BUILDERS and item.get("data_dir") is None):
            raise Refused(
                f"dataset {source['path']!r} with data_files={files!r}, data_dir={item.get('data_dir')!r}",
                "path: the file itself (one file or folder per dataset)",
            )
        # load_dataset("text", ...) makes each line a row; the other builders' files are read by their suffix.
        source = {"path": files} | ({"format": "text", "document": "line"} if source["path"] == "text" else {})
    for key, new in (("name", "config"), ("config", "config"), ("split", "split"), ("revision", "revision")):
        if item.get(key) not in (None, "train"):
            source[new] = item[key]
    return source


def _trl_counts(items: list) -> list[int]:
    """The rows trl.get_dataset keeps of each dataset: shares normalised, the mixture size the
    largest at which no dataset repeats, round(share × size) of each."""
    if any(item.get("fraction") is None for item in items):
        raise Refused("TRL needs fraction on every dataset of a mixture or on none", "a fraction on each")
    rows = [_rows(item) for item in items]
    if None in rows:
        raise Refused(
            "TRL's fraction is a dataset's share of the mixture, sized by every dataset's rows; accord counts "
            "them only for local JSONL files",
            "count on each source (the rows to keep), or weight (shares, with the smaller sources repeated)",
        )
    shares = [float(item["fraction"]) / sum(float(item["fraction"]) for item in items) for item in items]
    size = min(n / share for n, share in zip(rows, shares, strict=True) if share > 0)
    return [round(share * size) for share in shares]


def _rows(item: dict) -> int | None:
    """The rows of a whole local JSONL file (None for anything else)."""
    path = Path(str(_source(item)["path"]))
    if path.suffix != ".jsonl" or not path.is_file() or item.get("split") not in (None, "train"):
        return None
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
