"""Checkpoints that survive crashes: writing, sealing, pruning, finding and reading them (the
rules for resuming from them are accord.checkpoint.resume).

A checkpoint is written into `checkpoints/.tmp-step-NNNNNN/` (every rank its shards of the
model and optimizer state, see accord.engine.state; rank 0 the small files), flushed to
disk, marked COMPLETE and only then renamed to `checkpoints/step-NNNNNN/`; `latest` is
replaced atomically after that and older checkpoints are pruned last. A crash at any moment
therefore leaves the previous complete checkpoint untouched, and a folder without its
marker is never used. With checkpoint.async the shards are written in the background and
the sealing (COMPLETE, rename, latest, prune) happens once they are all on disk.

Before COMPLETE, rank 0 writes MANIFEST.json: every file's size and checksum, each hashed
by the rank that wrote it (accord.checkpoint.manifest). A resume takes the newest checkpoint
whose files still match it, naming the ones it skipped, which it leaves in place.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.distributed.checkpoint.api import CheckpointException

from accord import __version__, faults
from accord.atomic import fsync_folder, write_atomic
from accord.checkpoint import node_folders as nodefolders
from accord.checkpoint.disk_space import folder_bytes, raise_if_no_space, state_bytes
from accord.checkpoint.manifest import file_entries, unlisted_entries, write_manifest
from accord.distributed import group as dist
from accord.errors import CheckpointError
from accord.recipe.schema import Recipe, recipe_to_yaml

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
LATEST = "latest"
STATE_FILE = "state.json"
RECIPE_FILE = "recipe.yaml"

# What a resumed run must share with the run that wrote the checkpoint: anything else
# (logging, evaluation, max_steps, micro batch, processes, checkpointing) may change.
IDENTITY = ("seed", "task", "model", "data", "batch.global_batch_size")
# Where and how the data is prepared, not what it is: a resume on another machine (another
# cache folder, another number of preparing processes) trains on the same rows.
NOT_IDENTITY = ("data.cache_dir", "data.prepare_workers", "data.prepare_timeout_s")


@dataclass(frozen=True)
class TrainingState:
    step: int  # optimizer steps completed
    epoch: int  # position of the next global batch in the global data order
    index: int
    world_size: int
    micro_batch_size: int
    data_order: str = ""  # accord.data.order.order_version; "" in checkpoints from before it was recorded
    accord_version: str = __version__
    saved_at: float = 0.0
    # A checkpoint brought in from another trainer's folder (checkpoint.trainer_folder): its
    # path. Its data position is not that trainer's: the resume takes accord's at `step`.
    started_from: str = ""


# ------------------------------------------------------------------ writing


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def save_checkpoint(
    engine, recipe: Recipe, state: TrainingState, out_dir: Path, info: dist.DistInfo, asynchronous: bool = False
) -> PendingCheckpoint:
    """Collective: every rank writes its share into a temporary folder, rank 0 seals it once
    every rank's files are written. Synchronous: sealed when this returns. Asynchronous: the
    tensors are copied to host memory here and written in the background while training
    goes on; the result's wait() (collective) must come before the next checkpoint."""
    root = out_dir / CHECKPOINTS
    final = root / step_name(state.step)
    tmp = root / f".tmp-{final.name}"
    error = None
    if nodefolders.writes_folder(info):  # rank 0, and with a folder per node each node's leader
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash while writing this step before
            previous = complete_checkpoints(root)
            if previous:  # the last one's size is what this one needs: stop before half-writing it
                raise_if_no_space(root, folder_bytes(previous[-1]))
            (tmp / "rng").mkdir(parents=True)
        except OSError as e:
            error = e
    _agree_or_raise(error, state.step, tmp, info)
    write = None
    try:
        write = engine.save_state(tmp, writer=info.is_main, asynchronous=asynchronous)
        _save_rng(tmp, info)
    except (Exception, CheckpointException) as e:  # an OSError, or DCP's report of one on some rank (a BaseException)
        error = e
    needed = state_bytes(engine)
    _agree_or_raise(error, state.step, tmp, info, needed)
    pending = PendingCheckpoint(state, recipe, root, final, tmp, info, write, asynchronous, needed)
    if not asynchronous:
        pending.wait()
    return pending


class PendingCheckpoint:
    """A checkpoint whose files are being written; sealed (on rank 0) as soon as they are,
    in a background thread when the write is asynchronous. Until then it is a .tmp- folder
    that resuming ignores: a crash leaves the previous checkpoint whole."""

    def __init__(
        self,
        state: TrainingState,
        recipe: Recipe,
        root: Path,
        final: Path,
        tmp: Path,
        info: dist.DistInfo,
        write,
        asynchronous: bool,
        needed: int | None = None,
    ):
        self.state, self.recipe, self.root, self.final, self.tmp, self.info = state, recipe, root, final, tmp, info
        self.needed = needed  # bytes the checkpoint takes, roughly
        self._write = write
        self._error: BaseException | None = None
        self._thread = None
        if asynchronous:
            self._thread = threading.Thread(target=self._finish, name=f"accord-checkpoint-{state.step}", daemon=True)
            self._thread.start()

    def _finish(self) -> None:
        entries: dict[str, Any] | str = {}
        try:
            if self._write is not None:
                self._write.result()  # this rank's files; on rank 0 also the index, written after every rank's
            entries = self._hash_own_files()
        except (Exception, CheckpointException) as e:
            self._error, entries = e, f"rank {self.info.rank}: {_reason(e)}"
        # Every rank's entries to rank 0, on every rank alike (a failed one sends its error):
        # over the background write's own group when asynchronous, never training's.
        gathered = dist.all_gather_objects(entries, group=getattr(self._write, "group", None) if self._thread else None)
        try:
            failed = [e for e in gathered if isinstance(e, str)]
            if failed and self._error is None:
                raise OSError(failed[0])
            faults.pause_before_sealing_checkpoint(self.state.step)
            if nodefolders.writes_folder(self.info):  # every rank's files are written by now (DCP's last collective)
                # Each folder's manifest lists the files its own ranks wrote into it (one folder: every rank's).
                manifest = {
                    name: entry
                    for rank_entries in gathered
                    for name, entry in rank_entries.items()
                    if nodefolders.writes_into_my_folder(int(entry["rank"]), self.info)
                }
                _seal(self.state, self.recipe, self.root, self.final, self.tmp, manifest, self.info.rank)
        except (Exception, CheckpointException) as e:
            self._error = self._error or e

    def _hash_own_files(self) -> dict[str, Any]:
        """The manifest's entries for the files this rank wrote: its shards and its RNG state
        (rank 0's small files are hashed when it seals)."""
        names = [*(self._write.files() if self._write is not None else []), f"rng/{_rng_name(self.info.rank)}"]
        return file_entries(self.tmp, names, self.info.rank)

    def wait(self) -> Path:
        """Collective: the write finished and the checkpoint is sealed on every rank's word."""
        if self._thread is None:
            self._finish()
        else:
            self._thread.join()
        _agree_or_raise(self._error, self.state.step, self.tmp, self.info, self.needed)
        return self.final


def _seal(
    state: TrainingState, recipe: Recipe, root: Path, final: Path, tmp: Path, manifest: dict[str, Any], leader: int = 0
) -> None:
    """The folder's leader (rank 0 where one folder is shared), once every rank's files are in
    `tmp` and `manifest` holds their entries: record them, mark it COMPLETE, rename it into place,
    point `latest` at it, and only then prune older checkpoints."""
    (tmp / STATE_FILE).write_text(json.dumps(asdict(state) | {"saved_at": time.time()}, indent=1))
    (tmp / RECIPE_FILE).write_text(recipe_to_yaml(recipe))
    nodefolders.record(tmp)  # layout.json first: the manifest covers it
    write_manifest(tmp, manifest | unlisted_entries(tmp, manifest, rank=leader))
    _fsync_tree(tmp)
    write_atomic(tmp / COMPLETE, "", durable=True)
    if final.exists():
        # The same step written again by a run resumed from an earlier one, perhaps because
        # this one failed verification: kept aside for the user, never deleted.
        os.rename(final, root / f"replaced-{final.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.rename(tmp, final)
    fsync_folder(root)
    write_atomic(root / LATEST, final.name + "\n", durable=True)
    prune(root, recipe.checkpoint.keep_last, sealed=final)


def _agree_or_raise(
    error: BaseException | None, step: int, tmp: Path, info: dist.DistInfo, needed: int | None = None
) -> None:
    """All ranks learn whether any rank failed, so none waits forever in the next collective.
    `needed`: the bytes a checkpoint takes, to tell a full disk from other failures."""
    (failed,) = dist.any_rank(error is not None)
    if not failed:
        return
    if nodefolders.writes_folder(info):
        shutil.rmtree(tmp, ignore_errors=True)
    reason = _reason(error) if error is not None else "it failed on another rank"
    if nodefolders.writes_folder(info) and needed is not None and not reason.startswith("No space left"):
        # torch.save's zip writer reports a full disk as "unexpected pos ..." (the OSError is lost
        # in C++): with the partial checkpoint gone, a disk still short of one names the cause.
        try:
            raise_if_no_space(tmp.parent, needed)
        except OSError as e:
            reason = e.strerror
    raise CheckpointError(
        f"could not write the checkpoint of step {step}: {reason}; earlier checkpoints are intact — "
        f"free disk space or fix the output folder, then resume with --resume"
    )


def _reason(error: BaseException) -> str:
    """The OSError behind a failure (DCP wraps each rank's in its own exception), in one line."""
    seen: list[BaseException] = [error]
    while seen:
        e = seen.pop(0)
        if not isinstance(e, BaseException):
            continue
        if isinstance(e, OSError):
            return f"{e.strerror or e} ({e.filename})" if e.filename else f"{e.strerror or e}"
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            # each rank's (exception, traceback summary)
            seen += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        seen += [c for c in (e.__cause__, e.__context__) if c is not None]
    # No OSError: the first rank's own exception, not DCP's wrapper ("CheckpointException ranks:...").
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = min(failures.items(), key=lambda item: item[0])
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {type(inner).__name__}: {' '.join(str(inner).split())[:300]}"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def prune(root: Path, keep_last: int, sealed: Path | None = None) -> None:
    """Remove the oldest complete checkpoints beyond `keep_last` (called after `sealed`, a new
    one, is complete). Only those up to `sealed`'s step count: later ones are from before a
    resume from an earlier step (one skipped because it failed verification, kept for the
    user), so the one just written, which verifies, is never removed in their favour."""
    found = [p for p in complete_checkpoints(root) if sealed is None or p.name <= sealed.name]
    for old in found[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def _rng_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _save_rng(tmp: Path, info: dist.DistInfo) -> None:
    """This rank's RNG state, into its own node's folder (which it creates if need be)."""
    path = tmp / "rng" / _rng_name(info.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), path)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    for path in [folder, *[p for p in folder.rglob("*") if p.is_dir()]]:
        fsync_folder(path)


# ------------------------------------------------------------------ finding and reading


def complete_checkpoints(root: Path) -> list[Path]:
    """Sealed checkpoints, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if p.is_dir() and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: p.name)


def incomplete_checkpoints(root: Path) -> list[Path]:
    """Folders a crash left behind: never used, reported on resume."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not (p / COMPLETE).is_file())


def latest_checkpoint(out_dir: Path) -> Path | None:
    found = complete_checkpoints(out_dir / CHECKPOINTS)
    return found[-1] if found else None


def read_state(folder: Path) -> TrainingState:
    data = json.loads((folder / STATE_FILE).read_text())
    return TrainingState(**{k: v for k, v in data.items() if k in TrainingState.__dataclass_fields__})


def read_checkpoint_recipe(folder: Path) -> dict[str, Any]:
    return yaml.safe_load((folder / RECIPE_FILE).read_text())


def restore_rng(folder: Path, state: TrainingState, info: dist.DistInfo, seed: int) -> bool:
    """This rank's RNG as it was, when the world size is unchanged (else a seeded fresh one)."""
    path = folder / "rng" / _rng_name(info.rank)
    if state.world_size == info.world_size and path.is_file():
        saved = torch.load(path, weights_only=True)
        torch.set_rng_state(saved["torch"])
        if "cuda" in saved and torch.cuda.is_available():
            torch.cuda.set_rng_state(saved["cuda"])
        return True
    torch.manual_seed(seed_for(seed, state.step, info.rank))
    return False


def seed_for(seed: int, step: int, rank: int) -> int:
    """A distinct, reproducible torch seed per (run seed, step, rank)."""
    return (seed * 1_000_003 + step) * 4099 + rank
