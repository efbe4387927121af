"""Prepared token shards: one flat token file plus a memory-mapped index, read by reference.

Layout of a prepared split (a folder):
- `tokens.bin`   every example's ids back to back, uint16 when the vocabulary fits, else uint32;
- `targets.bin`  one bit per token (numpy packbits order): 1 where the token is a loss target,
                 so labels are derived at batch time instead of stored as a second int64 copy;
- `offsets.bin`  int64, examples + 1 entries: example i is tokens[offsets[i]:offsets[i+1]];
- `num_targets.bin` int32 per example (targets after the first token, as the loss counts them);
- `shards.json`  dtype, counts, the tokenizer's identity and the byte size of every file.

Why a flat file and not Arrow: the reader needs token *ranges* (a pre-training block crosses
documents) and bit-packed masks; both are a slice of a memmap here, and the writer appends
without holding anything but the piece being written. Every rank maps the same files, so a
process's memory does not grow with the corpus (the page cache is shared).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from accord.data.rows import IGNORE, DataError

META = "shards.json"
_TOKENS, _TARGETS, _OFFSETS, _NUM_TARGETS = "tokens.bin", "targets.bin", "offsets.bin", "num_targets.bin"


def id_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class ShardWriter:
    """Appends examples (or, with `block_length`, a token stream cut into blocks) to the
    files above; memory is one appended piece plus fewer than 8 carried mask bits."""

    def __init__(self, folder: Path, dtype: np.dtype, block_length: int | None = None):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.dtype, self.block_length = folder, dtype, block_length
        self._files = {name: open(folder / name, "wb") for name in (_TOKENS, _OFFSETS, _NUM_TARGETS)}
        self._bits = BitFile(folder / _TARGETS)
        self.tokens = 0
        self.examples = 0
        self._blocks_end = 0  # where the last written block ends (stream mode)
        self._files[_OFFSETS].write(np.zeros(1, dtype=np.int64).tobytes())

    def add_examples(self, tokens: np.ndarray, mask: np.ndarray, lengths: np.ndarray, num_targets: np.ndarray) -> None:
        assert self.block_length is None
        self._append(tokens, mask)
        ends = self.tokens - int(lengths.sum()) + np.cumsum(lengths, dtype=np.int64)
        self._files[_OFFSETS].write(ends.astype(np.int64).tobytes())
        self._files[_NUM_TARGETS].write(num_targets.astype(np.int32).tobytes())
        self.examples += len(lengths)

    def add_chunk(self, chunk: dict[str, np.ndarray], keep: np.ndarray) -> None:
        """The kept examples of a tokenised chunk (data/chunks.py)."""
        lengths = chunk["lengths"]
        token_keep = np.repeat(keep, lengths)
        self.add_examples(
            chunk["tokens"][token_keep], chunk["mask"][token_keep], lengths[keep], chunk["num_targets"][keep]
        )

    def add_stream(self, tokens: np.ndarray) -> None:
        """Tokens that continue the stream; a block ends at every multiple of block_length
        (every token but a block's first is a target)."""
        assert self.block_length is not None
        start = self.tokens
        self._append(tokens, np.ones(len(tokens), dtype=bool))
        L = self.block_length
        ends = np.arange((start // L + 1) * L, self.tokens + 1, L, dtype=np.int64)
        self._write_blocks(ends)

    def _write_blocks(self, ends: np.ndarray) -> None:
        if len(ends) == 0:
            return
        starts = np.concatenate([np.array([self._blocks_end], dtype=np.int64), ends[:-1]])
        self._files[_OFFSETS].write(ends.tobytes())
        self._files[_NUM_TARGETS].write((ends - starts - 1).astype(np.int32).tobytes())
        self._blocks_end = int(ends[-1])
        self.examples += len(ends)

    def _append(self, tokens: np.ndarray, mask: np.ndarray) -> None:
        self._files[_TOKENS].write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._bits.write(mask)
        self.tokens += len(tokens)

    def close(self, tokenizer_id: str, extra: dict | None = None) -> dict:
        if self.block_length is not None and self.tokens - self._blocks_end > 1:
            self._write_blocks(np.array([self.tokens], dtype=np.int64))  # the last, shorter block
        self._bits.close()
        for f in self._files.values():
            f.close()
        meta = {"dtype": self.dtype.name, "examples": self.examples, "tokens": self.tokens}
        return write_meta(self.folder / META, meta | (extra or {}), tokenizer_id, [*self._files, _TARGETS])


class BitFile:
    """A file of bits appended in pieces of any length (numpy packbits order); memory is the
    piece plus fewer than 8 carried bits."""

    def __init__(self, path: Path):
        self._file = open(path, "wb")
        self._carry = np.zeros(0, dtype=bool)  # bits not yet a whole byte

    def write(self, bits: np.ndarray) -> None:
        bits = np.concatenate([self._carry, bits.astype(bool)])
        whole = len(bits) - len(bits) % 8
        self._file.write(np.packbits(bits[:whole]).tobytes())
        self._carry = bits[whole:]

    def close(self) -> None:
        self._file.write(np.packbits(self._carry).tobytes())
        self._file.close()


def read_bits(bits: np.ndarray, a: int, b: int) -> np.ndarray:
    """Bits [a, b) of a memory-mapped BitFile, as booleans."""
    first = a // 8
    return np.unpackbits(bits[first : (b + 7) // 8])[a - 8 * first : b - 8 * first].astype(bool)


def write_meta(path: Path, meta: dict, tokenizer_id: str, files: list[str]) -> dict:
    """The meta file, written last: the tokenizer's identity and every file's size, which
    read_meta checks."""
    meta = meta | {"tokenizer": tokenizer_id, "bytes": {name: (path.parent / name).stat().st_size for name in files}}
    path.write_text(json.dumps(meta))
    return meta


def read_meta(path: Path, tokenizer_id: str | None) -> dict:
    """A prepared split's meta file, once its files are checked whole and from this tokenizer."""
    folder = path.parent
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        raise DataError(f"{path}: missing or unreadable; delete {folder.parent} to prepare the data again") from None
    if tokenizer_id is not None and meta.get("tokenizer") != tokenizer_id:
        raise DataError(
            f"{folder}: these token shards were prepared with another tokenizer; "
            f"delete {folder.parent} to prepare the data again"
        )
    for name, size in meta["bytes"].items():
        actual = (folder / name).stat().st_size if (folder / name).exists() else -1
        if actual != size:
            raise DataError(
                f"{folder / name}: truncated or damaged ({max(actual, 0)} bytes, expected {size}); "
                f"delete {folder.parent} to prepare the data again"
            )
    return meta


class TokenShards:
    """A prepared split, memory-mapped; indexes like a datasets.Dataset where the trainer
    reads it (`ds[list_of_ids]` gives columns `input_ids` and `labels`; `ds["length"]`,
    `ds["num_targets"]` give the index columns as arrays)."""

    column_names = ["input_ids", "labels", "length", "num_targets"]

    def __init__(self, folder: Path, tokenizer_id: str | None = None):
        self.folder = folder
        self.meta = meta = read_meta(folder / META, tokenizer_id)
        self.tokens = map_file(folder / _TOKENS, np.dtype(meta["dtype"]))
        self.bits = map_file(folder / _TARGETS, np.dtype(np.uint8))
        self.offsets = map_file(folder / _OFFSETS, np.dtype(np.int64))
        self.num_targets = map_file(folder / _NUM_TARGETS, np.dtype(np.int32))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def select(self, indices) -> TokenShards:
        """The first n examples (what `train.eval_limit` keeps), as the same kind of view."""
        n = len(indices)
        if list(indices) != list(range(n)):
            raise ValueError("token shards select a leading range of examples only")
        view = object.__new__(TokenShards)
        view.__dict__.update(self.__dict__)
        view.offsets, view.num_targets = self.offsets[: n + 1], self.num_targets[:n]
        return view

    def lengths(self) -> Lengths:
        return Lengths(self.offsets)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, labels) of example i as int64 arrays."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        ids = self.tokens[a:b].astype(np.int64)
        return ids, np.where(read_bits(self.bits, a, b), ids, IGNORE)

    def __getitem__(self, key):
        if isinstance(key, str):
            if key == "length":
                return self.lengths()
            if key == "num_targets":
                return np.asarray(self.num_targets)
            if key in ("input_ids", "labels"):
                return self[list(range(len(self)))][key]
            raise KeyError(key)
        if isinstance(key, (int, np.integer)):
            ids, labels = self.example(int(key))
            return {"input_ids": ids.tolist(), "labels": labels.tolist()}
        pairs = [self.example(int(i)) for i in key]
        return {"input_ids": [p[0].tolist() for p in pairs], "labels": [p[1].tolist() for p in pairs]}

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


class Lengths:
    """Example lengths read from the memory-mapped offsets when asked for: an array of them
    would be 4-8 bytes per example in every rank's memory (its batches, sum and mean are
    all a run needs)."""

    def __init__(self, offsets: np.ndarray):
        self._offsets = offsets

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            index = np.arange(len(self))[index]
        index = np.asarray(index, dtype=np.int64)
        if index.size and (index.min() < -len(self) or index.max() >= len(self)):
            raise IndexError(f"example {index.max()} of {len(self)}")
        index = index % max(len(self), 1)
        out = np.asarray(self._offsets[index + 1] - self._offsets[index])
        return int(out) if out.ndim == 0 else out

    def __array__(self, dtype=None, copy=None):
        return np.diff(self._offsets).astype(dtype or np.int64)

    def sum(self) -> int:
        return int(self._offsets[-1] - self._offsets[0]) if len(self) else 0

    def mean(self) -> float:
        return self.sum() / len(self) if len(self) else float("nan")

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()


def map_file(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")
