"""Each rank's progress, for the launcher's hang watchdog (accord.launch.watchdog).

The loop marks every phase it enters with `phase(op, step)` ("forward", "backward/all-reduce",
"optimizer step", "eval", "checkpoint save", ...) and long phases call `tick()` as they go.
Under accord's launcher each call writes a few bytes into a small memory-mapped file per rank
in the watchdog's local folder: no system call, thread or network on the training path, and
the launcher reads exactly where a rank was even after it was stopped (SIGSTOP), which a
thread publishing to a store cannot. Each node's watchdog reads only its own ranks' files.

Every rank also dumps its Python stacks on DUMP_SIGNAL (faulthandler, from the signal handler
itself, so also while the main thread is stuck in C++): into the watchdog's folder under
accord's launcher, else on stderr (`kill -USR2 PID` under torchrun & co.).
"""

from __future__ import annotations

import faulthandler
import json
import mmap
import os
import signal
import socket
import struct
import sys
from functools import cache
from pathlib import Path
from typing import IO

DUMP_DIR_ENV = "ACCORD_WATCHDOG_DIR"  # set by the launcher's watchdog for its workers
# SIGUSR1 and SIGTERM ask for a checkpoint and a stop (SLURM's warning, preemption): USR2 is free.
DUMP_SIGNAL = signal.SIGUSR2
DONE = "done"  # the training loop ended: what follows (export, shutdown) is not watched

# A progress file: seq, ticks, step, the phase's name; the rank's identity (JSON) at IDENTITY_AT.
_PROGRESS = struct.Struct("<qqq48s")
_TICKS_AT = 8
IDENTITY_AT, FILE_SIZE = 128, 512


def progress_file(folder: str | Path, restart: int, rank: int) -> Path:
    return Path(folder) / f"progress-{restart}-rank-{rank:05d}"


def progress_files(folder: str | Path, restart: int) -> list[Path]:
    """The progress files of worker group `restart` (TORCHELASTIC_RESTART_COUNT) in `folder`."""
    return sorted(Path(folder).glob(f"progress-{restart}-rank-*"))


def stacks_file(folder: str | Path, restart: int, rank: int) -> Path:
    return Path(folder) / f"stacks-{restart}-rank-{rank:05d}.txt"


class _Beat:
    seq = 0  # phases entered: the same sequence on every rank, so it tells who is behind
    ticks = 0  # progress inside the current phase (eval batches, ...)
    mapped: mmap.mmap | None = None


_beat = _Beat()
_dump_file: IO | None = None  # kept open: faulthandler writes to its descriptor from a signal handler


def phase(op: str, step: int) -> None:
    """This rank enters `op` while at training step `step`."""
    _beat.seq += 1
    if _beat.mapped is not None:
        _PROGRESS.pack_into(_beat.mapped, 0, _beat.seq, _beat.ticks, step, _encoded(op))


def tick() -> None:
    """Progress inside a long phase."""
    _beat.ticks += 1
    if _beat.mapped is not None:
        struct.pack_into("<q", _beat.mapped, _TICKS_AT, _beat.ticks)


@cache
def _encoded(op: str) -> bytes:
    return op.encode()[: _PROGRESS.size - 24]


def start(hang_timeout_s: float | None, rank: int, local_rank: int, world_size: int, restart: int) -> None:
    """Dump stacks on DUMP_SIGNAL (a rank of several: a single process has no peer to hang
    on, and may be someone's application); under accord's watchdog, report progress."""
    global _dump_file
    folder = os.environ.get(DUMP_DIR_ENV)
    if folder is None and world_size == 1:
        return
    _dump_file = stacks_file(folder, restart, rank).open("w") if folder else None
    faulthandler.register(DUMP_SIGNAL, file=_dump_file or sys.stderr, all_threads=True)
    if folder is None or hang_timeout_s is None:
        return
    identity = json.dumps(
        {"rank": rank, "local_rank": local_rank, "host": socket.gethostname(), "pid": os.getpid()}
    ).encode()
    with progress_file(folder, restart, rank).open("w+b") as f:
        f.truncate(FILE_SIZE)  # all zeros: seq 0 means "not in the loop yet"
        f.seek(IDENTITY_AT)
        f.write(identity[: FILE_SIZE - IDENTITY_AT])
        f.flush()
        _beat.seq = _beat.ticks = 0  # this file's record starts here (not from an earlier in-process run)
        _beat.mapped = mmap.mmap(f.fileno(), FILE_SIZE)


def read_progress(path: Path) -> dict | None:
    """A rank's progress record as the watchdog sees it (seq 0: not in the loop yet), or None
    while the rank is still creating its file."""
    data = b""
    for _ in range(10):  # a read racing the rank's write could mix two records: read until stable
        again = path.read_bytes()
        if again == data:
            break
        data = again
    if len(data) < FILE_SIZE:
        return None
    seq, ticks, step, op = _PROGRESS.unpack_from(data)
    try:
        identity = json.loads(data[IDENTITY_AT:].rstrip(b"\0"))
    except ValueError:  # not written yet
        return None
    op = op.rstrip(b"\0").decode(errors="replace") if seq else "start-up (before the training loop)"
    return {**identity, "seq": seq, "ticks": ticks, "step": step, "op": op}


def enable_flight_recorder(folder: str | Path, pipe: bool) -> None:
    """NCCL: keep the last collectives of each rank (torch's flight recorder) and dump them into
    `folder` on a timeout, and with `pipe` also when the watchdog writes to the rank's pipe
    there (made when the process group is created: `folder` must exist by then). Set before
    the process group is created; values already set (by the watchdog or the user) are kept."""
    stem = str(Path(folder) / "nccl-trace-rank-")
    settings = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": stem,
        "TORCH_FR_DUMP_TEMP_FILE": stem,
    }
    if pipe:
        settings["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] = str(Path(folder) / "nccl-pipe-rank-")
    for name, value in settings.items():
        os.environ.setdefault(name, value)
