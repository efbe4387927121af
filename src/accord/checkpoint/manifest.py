"""Checkpoints that verify: the size and checksum of every file, recorded when a checkpoint is
sealed, and checked before a run resumes from it.

`MANIFEST.json` is written into the checkpoint before its COMPLETE marker:

    {"format": 1, "hash": "sha256",
     "files": {"state/__1_0.distcp": {"bytes": 5678, "sha256": "9f2c...", "rank": 1}, ...}}

Each rank hashes the files it wrote, in parallel (an asynchronous checkpoint in its writer
thread), and rank 0 gathers the entries and adds its own small files. Each entry names the
rank that wrote the file: on resume, rank r checks the files written by ranks r, r + world,
... — on an unchanged layout the files its own node wrote, so with node-local output folders
a file missing on a node is named as such. A checkpoint written before manifests existed is
checked as before: every shard present and as long as DCP's index says.
"""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from accord.engine.state import state_problems

MANIFEST = "MANIFEST.json"
# sha256: crc32 would cost a fraction as much, but each rank hashes only its own 1/world of the state,
# in parallel; an async checkpoint hashes off the training path; a user can check any file by
# hand with the standard `sha256sum`; and 32 bits is a thin check for multi-GB shards copied
# between file systems. The manifest names its algorithm, so a later change breaks no old one.
HASH = "sha256"
FORMAT = 1
CHUNK_BYTES = 2**20


def hash_file(path: Path, algorithm: str = HASH) -> str:
    digest = hashlib.new(algorithm)
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while size := f.readinto(buffer):
            digest.update(view[:size])  # releases the GIL: a writer thread does not hold up training
    return digest.hexdigest()


def file_entries(folder: Path, names: Iterable[str], rank: int) -> dict[str, dict[str, Any]]:
    """The manifest's entries for files in `folder` that `rank` wrote (paths relative to it)."""
    return {
        name: {"bytes": (folder / name).stat().st_size, HASH: hash_file(folder / name), "rank": rank} for name in names
    }


def unlisted_entries(folder: Path, listed: dict[str, Any], rank: int = 0) -> dict[str, dict[str, Any]]:
    """The sealing rank's entries for the files in `folder` that no rank listed: the small ones
    it wrote itself (the DCP index, the schedule, the run's state and recipe, the layout)."""
    names = sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file())
    return file_entries(folder, [name for name in names if name not in listed and name != MANIFEST], rank=rank)


def write_manifest(folder: Path, entries: dict[str, dict[str, Any]]) -> None:
    """Rank 0, before the checkpoint is marked COMPLETE (its caller flushes it to disk)."""
    manifest = {"format": FORMAT, "hash": HASH, "files": dict(sorted(entries.items()))}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def verify(folder: Path, rank: int = 0, world: int = 1, checksums: bool = True) -> list[str]:
    """Why this rank's share of `folder`'s files differs from what was recorded at seal time:
    one reason per file, naming it (empty when they match). `checksums=False` checks presence
    and sizes only (stat calls, for a quick look before workers start)."""
    if not (folder / MANIFEST).is_file():
        return state_problems(folder) if rank == 0 else []  # written before manifests existed
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        algorithm, files = manifest["hash"], manifest["files"]
        mine = {name: entry for name, entry in files.items() if int(entry["rank"]) % world == rank}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{MANIFEST} cannot be read ({type(e).__name__})"] if rank == 0 else []
    problems = []
    for name, entry in sorted(mine.items()):
        try:
            problem = _file_problem(folder, name, entry, algorithm, checksums)
        except OSError as e:
            problem = f"{name} cannot be read ({e.strerror or type(e).__name__})"
        if problem:
            problems.append(problem)
    return problems


def _file_problem(folder: Path, name: str, entry: dict[str, Any], algorithm: str, checksum: bool) -> str | None:
    path = folder / name
    if not path.is_file():
        return f"{name} (written by rank {entry['rank']}) is missing on this node ({socket.gethostname()})"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"{name} is {size:,} bytes, expected {entry['bytes']:,}"
    if checksum and hash_file(path, algorithm) != entry[algorithm]:
        return f"{name} does not match its {algorithm} checksum (its bytes changed after it was written)"
    return None
