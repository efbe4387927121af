"""Files and folders that are complete or absent: written under a temporary name beside the
target, then renamed over it, so a kill or a concurrent reader never sees half of one.

Standard library only, at the bottom of the layers: the data cache, the metrics, the launcher's
gate, the checkpoints and the output folder all write through it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def write_atomic(path: str | os.PathLike, data: bytes | str, *, durable: bool = False) -> None:
    """Replace `path` with `data` (text is UTF-8) in one step; `durable` as in `replacing`."""
    with replacing(path, "wb" if isinstance(data, bytes) else "w", durable=durable) as f:
        f.write(data)


@contextlib.contextmanager
def replacing(path: str | os.PathLike, mode: str = "wb", *, durable: bool = False) -> Iterator[IO[Any]]:
    """An open file (`mode` "wb" or "w") that becomes `path` when the block ends without error;
    on error it is removed and `path` is left as it was. `durable` fsyncs the file before the
    rename and the folder after it, so the new file survives a power loss, not only a kill.

    The temporary name holds the pid: processes (nodes sharing a folder) writing the same file
    do not write into each other's, and the last rename wins."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_folder(path.parent)


@contextlib.contextmanager
def replacing_folder(final: Path) -> Iterator[Path]:
    """A new empty sibling folder of `final` to write into, renamed into place (replacing what
    was there) when the block ends without error, removed when it does not."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def fsync_folder(folder: Path) -> None:
    """Make the folder's entries (renames, new files) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
