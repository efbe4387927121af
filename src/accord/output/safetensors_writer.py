"""transformers' sharded safetensors written one tensor at a time.

safetensors has no streaming writer: a file's header, which holds every tensor's offsets,
comes before the data, so `save_file` takes the whole shard (and serialises it into one more
buffer). Here each tensor's bytes go to the shard's data file as they arrive, and the writer
keeps only names, dtypes, shapes and offsets; a full shard gets its header, followed by the
data copied inside the kernel (copy_file_range: no buffer in this process). The files are
plain safetensors (read back with safetensors / from_pretrained); the cost is writing each
byte twice on the local disk.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch

SHARD_INDEX = "model.safetensors.index.json"  # the shards' index, named as transformers names it
SINGLE_FILE = "model.safetensors"  # a model of one shard, as save_pretrained names it

# The format's dtype names (safetensors' Dtype enum).
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class ShardedSafetensorsWriter:
    """`model-0000k-of-0000n.safetensors` files of at most `shard_bytes` of tensor data each
    (or one tensor) and their index, in `folder`; or one `model.safetensors` when all fit in one."""

    def __init__(self, folder: Path, shard_bytes: int):
        self.folder, self.shard_bytes = folder, shard_bytes
        self.entries: dict[str, dict] = {}  # the open shard's header
        self.size = 0
        self.data = None  # the open shard's data file
        self.parts: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"{name}: safetensors has no dtype {tensor.dtype}")
        nbytes = tensor.nbytes
        if self.entries and self.size + nbytes > self.shard_bytes:
            self._flush()
        if self.data is None:
            self.data = open(self._data_path(), "wb")  # noqa: SIM115  closed by _flush
        # Little-endian bytes as they are in memory (a copy only if not contiguous).
        self.data.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        self.entries[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self.size, self.size + nbytes],
        }
        self.size += nbytes
        self.total += nbytes

    def close(self) -> None:
        """Writes the last shard and the index (an empty model: one empty shard). One shard is
        `model.safetensors` without an index, as save_pretrained writes it: tools open that name."""
        if self.entries or not self.parts:
            self._flush()
        count = len(self.parts)
        if count == 1:
            self.parts[0][0].rename(self.folder / SINGLE_FILE)
            return
        weight_map = {}
        for k, (path, names) in enumerate(self.parts, start=1):
            name = f"model-{k:05d}-of-{count:05d}.safetensors"
            path.rename(self.folder / name)
            weight_map |= dict.fromkeys(names, name)
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / SHARD_INDEX).write_text(json.dumps(index, indent=2) + "\n")

    def _data_path(self) -> Path:
        return self.folder / f".data-{len(self.parts):05d}"

    def _flush(self) -> None:
        if self.data is None:
            self.data = open(self._data_path(), "wb")  # noqa: SIM115
        self.data.close()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.entries}, separators=(",", ":")).encode()
        header += b" " * (-(8 + len(header)) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        path = self.folder / f".part-{len(self.parts):05d}.safetensors"
        source = self._data_path()
        with open(path, "wb") as out, open(source, "rb") as data:
            out.write(struct.pack("<Q", len(header)) + header)
            out.flush()
            _copy(data, out, self.size)
        source.unlink()
        self.parts.append((path, list(self.entries)))
        self.entries, self.size, self.data = {}, 0, None


def _copy(source, target, count: int) -> None:
    """`count` bytes from `source`'s position to `target`'s, in the kernel where it can."""
    try:
        while count > 0:
            copied = os.copy_file_range(source.fileno(), target.fileno(), count)
            if copied == 0:
                raise OSError("copy_file_range copied nothing")
            count -= copied
    except (AttributeError, OSError):  # not Linux, or a file system without it: through a buffer
        shutil.copyfileobj(source, target, 16 << 20)
