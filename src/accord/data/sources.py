"""Read rows from local files, with errors that name the file and line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from accord.data.generated import Rows, generate
from accord.recipe import DataConfig


class DataError(ValueError):
    """Unusable input data; the message names the file and line."""


def read_jsonl(path: str | Path, required: tuple[str, ...]) -> Rows:
    """Rows of a JSON-lines file; each must be an object with string `required` fields."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    rows: Rows = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{number}: expected a JSON object with {', '.join(required)}")
            for field in required:
                if not isinstance(row.get(field), str):
                    found = "missing" if field not in row else f"a {type(row[field]).__name__}"
                    raise DataError(f"{path}:{number}: field {field!r} must be a string ({found})")
            rows.append({field: row[field] for field in required})
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def load_rows(cfg: DataConfig, seed: int, required: tuple[str, ...]) -> tuple[Rows, Rows]:
    """(train, eval) rows from the recipe's data section."""
    if cfg.generate is not None:
        return generate(cfg.generate, seed)
    assert cfg.train is not None
    train = read_jsonl(cfg.train, required)
    if cfg.eval is not None:
        return train, read_jsonl(cfg.eval, required)
    if cfg.eval_fraction:
        held_out = max(1, round(len(train) * cfg.eval_fraction))
        order = np.random.default_rng([seed, 0x5EED]).permutation(len(train))
        keep = sorted(order[held_out:])
        return [train[i] for i in keep], [train[i] for i in sorted(order[:held_out])]
    return train, []
