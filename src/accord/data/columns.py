"""Prepared examples of several token columns (a preference pair's two sides, a text and
its token types) and per-example numbers (a class id): token shards for classify, dpo and
reward, written and read like the causal tasks' (shards.py), by reference.

Layout of a prepared split (a folder), for a Schema:
- per sequence column `c`: `c.ids.bin` (every example's ids back to back, the vocabulary's
  id dtype) and `c.offsets.bin` (int64, examples + 1 entries);
- per label column `m` over sequence `c`: `m.bits.bin`, one bit per token of `c` (1 where
  the token is a target: labels are `c`'s ids there and IGNORE elsewhere, derived at batch
  time instead of stored as an int64 copy);
- per value column `v`: `v.bin`, one fixed-shape number (or row of numbers) per example;
- `length.bin`, `num_targets.bin`: int32 per example, the index the global order reads;
- `columns.json`: the schema, counts, the tokenizer's identity and every file's size.

Nothing grows with the corpus in a reader but what a batch asks for: every rank maps the
same files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from accord.data.rows import IGNORE
from accord.data.shards import BitFile, map_file, read_bits, read_meta, write_meta

COLUMNS_META = "columns.json"
_INDEX = {"length": "int32", "num_targets": "int32"}  # value columns every split has


@dataclass(frozen=True)
class Schema:
    """What a task's encoded example holds (the columns of its encode_batch that are kept)."""

    sequences: tuple[str, ...]  # lists of ids per example, e.g. chosen_input_ids
    labels: dict[str, str] = field(default_factory=dict)  # a labels column -> the sequence it marks
    values: dict[str, str] = field(default_factory=dict)  # one number per example -> numpy dtype

    def as_json(self) -> dict:
        return {"sequences": list(self.sequences), "labels": self.labels, "values": self.values}


def encode_columns(schema: Schema, out: dict[str, list], dtype: np.dtype) -> dict[str, np.ndarray]:
    """A chunk (data/chunks.py) of encode_batch's output: each sequence flat with its
    lengths, each labels column as a mask over its sequence's tokens, the values, and the
    index columns (`lengths`: the example's length, `num_targets`, `over`)."""
    arrays: dict[str, np.ndarray] = {}
    for name in schema.sequences:
        arrays[name] = _flat(out[name], dtype)
        arrays[f"{name}.lengths"] = np.asarray([len(x) for x in out[name]], dtype=np.int64)
    for name, sequence in schema.labels.items():
        labels = _flat(out[name], np.dtype(np.int64))
        mask = labels != IGNORE
        if len(labels) != len(arrays[sequence]) or not np.array_equal(labels[mask], arrays[sequence][mask]):
            raise ValueError(
                f"column {name} must be {sequence}'s ids where it is not {IGNORE} (token shards store it as a mask)"
            )
        arrays[name] = mask
    for name, kind in schema.values.items():
        arrays[name] = np.asarray(out[name], dtype=kind)
    return arrays | {
        "lengths": np.asarray(out["length"], dtype=np.int64),
        "num_targets": np.asarray(out["num_targets"], dtype=np.int64),
        "over": np.asarray(out["over_length"], dtype=bool),
    }


def _flat(rows: list[list[int]], dtype: np.dtype) -> np.ndarray:
    return np.concatenate([np.asarray(x, dtype=dtype) for x in rows]) if rows else np.zeros(0, dtype=dtype)


class ColumnWriter:
    """Appends the kept examples of chunks to the files above; memory is one chunk."""

    def __init__(self, folder: Path, schema: Schema, dtype: np.dtype):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.schema, self.dtype = folder, schema, dtype
        self._files = {name: open(folder / name, "wb") for name in self._plain_files()}
        self._bits = {name: BitFile(folder / f"{name}.bits.bin") for name in schema.labels}
        self._ends = dict.fromkeys(schema.sequences, 0)  # tokens so far per sequence
        for name in schema.sequences:
            self._files[f"{name}.offsets.bin"].write(np.zeros(1, dtype=np.int64).tobytes())
        self.examples = 0
        self.tokens = 0

    def _plain_files(self) -> list[str]:
        return [f"{n}.{part}.bin" for n in self.schema.sequences for part in ("ids", "offsets")] + [
            f"{n}.bin" for n in {**self.schema.values, **_INDEX}
        ]

    def add_chunk(self, chunk: dict[str, np.ndarray], keep: np.ndarray) -> None:
        for name in self.schema.sequences:
            lengths = chunk[f"{name}.lengths"]
            token_keep = np.repeat(keep, lengths)
            self._files[f"{name}.ids.bin"].write(
                np.ascontiguousarray(chunk[name][token_keep], dtype=self.dtype).tobytes()
            )
            for label in (m for m, seq in self.schema.labels.items() if seq == name):
                self._bits[label].write(chunk[label][token_keep])
            ends = self._ends[name] + np.cumsum(lengths[keep], dtype=np.int64)
            self._files[f"{name}.offsets.bin"].write(ends.tobytes())
            self._ends[name] = int(ends[-1]) if len(ends) else self._ends[name]
            if name.endswith("input_ids"):  # tokens the model reads (an encoder's token types are not more tokens)
                self.tokens += int(lengths[keep].sum())
        index = {"length": chunk["lengths"], "num_targets": chunk["num_targets"]}
        for name, kind in {**self.schema.values, **_INDEX}.items():
            values = index[name] if name in index else chunk[name]
            self._files[f"{name}.bin"].write(np.ascontiguousarray(values[keep], dtype=kind).tobytes())
        self.examples += int(keep.sum())

    def close(self, tokenizer_id: str, extra: dict | None = None) -> dict:
        for f in [*self._files.values(), *self._bits.values()]:
            f.close()
        meta = {
            "dtype": self.dtype.name,
            "examples": self.examples,
            "tokens": self.tokens,
            "schema": self.schema.as_json(),
        } | (extra or {})
        return write_meta(
            self.folder / COLUMNS_META, meta, tokenizer_id, [*self._files, *(f"{n}.bits.bin" for n in self._bits)]
        )


class ColumnShards:
    """A prepared split, memory-mapped; indexes like the datasets.Dataset it replaces where
    the trainer reads it: `ds[list_of_ids]` gives every column as lists (labels as ids or
    IGNORE), `ds["length"]` and `ds["num_targets"]` the index columns as arrays."""

    def __init__(self, folder: Path, tokenizer_id: str | None = None):
        self.folder = folder
        self.meta = meta = read_meta(folder / COLUMNS_META, tokenizer_id)
        schema = meta["schema"]
        dtype = np.dtype(meta["dtype"])
        self.sequences = {
            n: (map_file(folder / f"{n}.ids.bin", dtype), map_file(folder / f"{n}.offsets.bin", np.dtype(np.int64)))
            for n in schema["sequences"]
        }
        self.labels = {
            m: (seq, map_file(folder / f"{m}.bits.bin", np.dtype(np.uint8))) for m, seq in schema["labels"].items()
        }
        kinds = {**schema["values"], **_INDEX}
        self.values = {n: map_file(folder / f"{n}.bin", np.dtype(kind)) for n, kind in kinds.items()}
        self._count = meta["examples"]
        for name, values in self.values.items():  # a row of numbers per example (dpo's two log-probs)
            self.values[name] = values.reshape(self._count, -1) if values.size != self._count else values

    @property
    def column_names(self) -> list[str]:
        return [*self.sequences, *self.labels, *self.values]

    def __len__(self) -> int:
        return self._count

    def select(self, indices) -> ColumnShards:
        """The first n examples (what `train.eval_limit` keeps), as the same kind of view."""
        n = len(indices)
        if list(indices) != list(range(n)):
            raise ValueError("token shards select a leading range of examples only")
        view = self._view()
        view._count = n
        view.values = {name: values[:n] for name, values in self.values.items()}
        return view

    def add_column(self, name: str, values) -> ColumnShards:
        """A view with one more value column, held in memory (dpo's precomputed reference
        log-probabilities: 8 bytes a pair)."""
        values = np.asarray(values)
        assert len(values) == self._count, (name, len(values), self._count)
        view = self._view()
        view.values = {**self.values, name: values}
        return view

    def _view(self) -> ColumnShards:
        view = object.__new__(ColumnShards)
        view.__dict__.update(self.__dict__)
        return view

    def example(self, i: int) -> dict:
        out = {}
        for name, (ids, offsets) in self.sequences.items():
            out[name] = ids[int(offsets[i]) : int(offsets[i + 1])].astype(np.int64)
        for name, (sequence, bits) in self.labels.items():
            offsets = self.sequences[sequence][1]
            out[name] = np.where(read_bits(bits, int(offsets[i]), int(offsets[i + 1])), out[sequence], IGNORE)
        return {name: value.tolist() for name, value in out.items()} | {
            name: values[i].tolist() for name, values in self.values.items()
        }

    def __getitem__(self, key):
        if isinstance(key, str):
            if key in self.values:
                return self.values[key]
            if key in self.sequences or key in self.labels:
                return [self.example(i)[key] for i in range(len(self))]
            raise KeyError(key)
        if isinstance(key, (int, np.integer)):
            if not -len(self) <= key < len(self):
                raise IndexError(key)
            return self.example(int(key) % len(self))
        examples = [self.example(int(i)) for i in key]
        return {name: [e[name] for e in examples] for name in self.column_names}

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]
