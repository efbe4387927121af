"""Whether the output disk holds the checkpoints a run will write: a warning at start-up, a
refusal before a save that would fill it (an OSError the trainer reports like a full disk)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path


def raise_if_no_space(root: Path, needed: int) -> None:
    free = shutil.disk_usage(root).free
    if free < needed:
        raise OSError(
            errno.ENOSPC,
            f"No space left on device: {root} has {_size(free)} free, a checkpoint needs ~{_size(needed)}",
        )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return ""


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def checkpoint_bytes(params: int, trained: int) -> int:
    """A checkpoint's size, roughly: fp32 weights, and AdamW's two moments of the trained ones."""
    return 4 * params + 8 * trained


def state_bytes(engine) -> int:
    # ZeRO-3 leaves each parameter empty on the rank and keeps its size in ds_numel.
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in engine.module.parameters()]
    return checkpoint_bytes(sum(n for n, _ in sizes), sum(n for n, trained in sizes if trained))


def disk_space_warning(out_dir: Path, params: int, trained: int, keep_last: int) -> str | None:
    """A warning when the output disk cannot hold keep_last + 1 checkpoints."""
    estimate = checkpoint_bytes(params, trained)
    needed = (keep_last + 1) * estimate
    free = shutil.disk_usage(out_dir).free
    if free >= needed:
        return None
    return (
        f"only {free / 2**30:.1f} GiB free under {out_dir}, but {keep_last + 1} checkpoints of "
        f"~{estimate / 2**30:.2f} GiB each may be on disk at once; a write that runs out of space stops the run"
    )
