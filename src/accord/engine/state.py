"""Model and optimizer state as a sharded checkpoint (torch.distributed.checkpoint, DCP),
keyed by parameter name, whatever the strategy that wrote it.

Every rank writes its own part in parallel (a DTensor's shard under FSDP2, the names it owns
under torch ZeRO-1 and DeepSpeed, a share of the replicated tensors under DDP: DCP writes
each replicated tensor once) and no rank gathers the whole model or optimizer. DCP records
each tensor's global shape and where its pieces lie, so any strategy on any number of
processes reads back what it needs: resuming on a different world size needs no
resharding step.

The layout of `state/` (DCP: `.metadata` plus one `__R_0.distcp` file per rank, and one
`__R_pK_0.distcp` per further part K where a rank wrote in parts), flattened keys:
  model.<state-dict name>                 every entry of model.state_dict(), fp32
  optim.<parameter name>.exp_avg          AdamW's moments (whole tensors, in pieces)
  optim.<parameter name>.exp_avg_sq
  optim.<parameter name>.step             a 0-d float32 tensor
and next to it `schedule.pt` (written by rank 0): {"scheduler", "scaler", ...}. The learning
rate of each group is the scheduler's last one, restored from it.
"""

from __future__ import annotations

import inspect
import math
import os
import shutil
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    FileSystemReader,
    FileSystemWriter,
    LoadPlan,
    Metadata,
    SavePlan,
)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from accord.compat.torch import SCHEDULER_GROUP_KEYS

STATE_DIR = "state"
SCHEDULE_FILE = "schedule.pt"
MODEL, OPTIM = "model", "optim"
ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")
# The single-file format of earlier accord versions (converted on resume: convert_legacy).
LEGACY_FILES = ("model.safetensors", "optimizer.pt")
# How many bytes a rank reads at once where it reads tensors itself (DeepSpeed's load): whole
# tensors under ZeRO-1/2, the rows around its partition of each under ZeRO-3.
READ_BUFFER_BYTES = 64 * 2**20
# How many bytes of gathered whole tensors a rank keeps before writing them (DeepSpeed's save,
# write_in_parts): small enough that a zero3 checkpoint stays within the training peak
# (docs/benchmarks.md).
WRITE_BUFFER_BYTES = 64 * 2**20
# Whether dcp.async_save can be given a stager (torch 2.8 or so): without one it copies the
# tensors, which a write of tensors made for it alone (write_sharded's `owned`) does not need.
ASYNC_WRITES_OWNED = "async_stager" in inspect.signature(dcp.async_save).parameters
# DCP warns on every call without a process group, even when told so (no_dist), and in its
# background writer too: a single process is meant.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


# ------------------------------------------------------------------ writing


def write_sharded(state: dict, folder: Path, asynchronous: bool = False, owned: bool = False) -> PendingWrite:
    """Collective: this rank's part of `state` ({"model": ..., "optim": ...}) into folder/state.
    With `asynchronous` the tensors are copied to host memory here and written by a
    background thread (its collectives on a gloo group of their own); wait on the result.
    `owned`: they are host tensors made for this write alone (DeepSpeed's gathered share),
    written without that copy where this torch's async_save takes a stager (ASYNC_WRITES_OWNED).
    Synchronous: written when this returns (the result is already done)."""
    writer = RecordingWriter(folder / STATE_DIR)
    if not asynchronous:
        dcp.save(state, storage_writer=writer, no_dist=not tdist.is_initialized())
        done: Future = Future()
        done.set_result(None)
        return PendingWrite(done, writer)
    group = _checkpoint_group()
    stager = {"async_stager": _AsIs()} if owned and ASYNC_WRITES_OWNED else {}
    started = dcp.async_save(
        state, storage_writer=writer, process_group=group, no_dist=not tdist.is_initialized(), **stager
    )
    return PendingWrite(started, writer, group)


class _AsIs(AsyncStager):
    """DCP's staging step for tensors nothing else will change: hands them on as they are."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict) -> dict:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class SaveEntry:
    """One thing a rank gathers whole to write (where the strategy holds no per-name shards)."""

    kind: str  # MODEL (a state-dict entry) or OPTIM (a parameter's AdamW moments)
    name: str
    nbytes: int  # what its owner keeps once gathered


def save_parts(entries: list[SaveEntry], world: int, budget: int | None) -> list[list[tuple[int, SaveEntry]]]:
    """The entries with their owner (round-robin by position), cut into consecutive parts in
    which no rank keeps more than `budget` bytes, or one entry (None: one part). The same on
    every rank: each part is one collective write."""
    parts: list[list[tuple[int, SaveEntry]]] = [[]]
    held = [0] * world
    for index, entry in enumerate(entries):
        owner = index % world
        if budget is not None and held[owner] and held[owner] + entry.nbytes > budget:
            parts.append([])
            held = [0] * world
        parts[-1].append((owner, entry))
        held[owner] += entry.nbytes
    return parts


def write_in_parts(parts: Iterable[dict], folder: Path) -> PendingWrite:
    """Collective: this rank's state (as write_sharded takes it) a part at a time, each written
    by its own DCP call before the next is made, so a rank holds one part at a time. Every
    rank yields the same number of parts (each call is collective). The result is the layout
    write_sharded writes, readable by the same readers: one index covering every part,
    written last, and each part's files named apart (`__<rank>_p<part>_0.distcp`)."""
    writer = PartsWriter(folder / STATE_DIR)
    for part in parts:
        dcp.save(part, storage_writer=writer, no_dist=not tdist.is_initialized())
        writer.part += 1
        del part  # before the next part is made: one part held at a time, not two
    writer.write_index()
    done: Future = Future()
    done.set_result(None)
    return PendingWrite(done, writer)


class PendingWrite:
    """A DCP write, maybe running in the background (this rank's files; rank 0 also writes the
    index once every rank finished), and the files this rank wrote once it is done. `group`:
    the process group of a background write's collectives (None: the default one)."""

    def __init__(self, future, writer: RecordingWriter, group=None):
        self.future: Future = getattr(future, "upload_completion", future)
        self._writer = writer
        self.group = group

    def result(self) -> None:
        self.future.result()

    def files(self) -> list[str]:
        """Paths relative to the checkpoint folder of the files this rank wrote (after result())."""
        return [f"{STATE_DIR}/{name}" for name in self._writer.written]


class RecordingWriter(FileSystemWriter):
    """DCP's file writer, remembering the shard files this rank wrote, so that this rank can
    hash them for the checkpoint's manifest (the index, written by rank 0, is rank 0's to hash)."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.written: list[str] = []

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)  # returns once the files are written
        self.written += sorted({result.storage_data.relative_path for result in future.wait()})
        return future


class PartsWriter(RecordingWriter):
    """RecordingWriter over several DCP calls into one folder (write_in_parts): the files of
    part k > 0 get their own prefix, and the coordinator collects each call's index instead
    of writing it, to write one index for all (write_index) once every part is written."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.part = 0
        self._metadata: Metadata | None = None
        self._results: list = []

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        plans = super().prepare_global_plan(plans)
        if self.part == 0:  # a one-part write names its files as write_sharded does
            return plans
        return [
            replace(plan, storage_data=replace(plan.storage_data, prefix=f"{plan.storage_data.prefix}p{self.part}_"))
            for plan in plans
        ]

    def finish(self, metadata: Metadata, results: list) -> None:
        """Coordinator, at the end of each part: keep its index (keys are disjoint between parts)."""
        if self._metadata is None:
            self._metadata = metadata
        else:
            self._metadata.state_dict_metadata.update(metadata.state_dict_metadata)
            if isinstance(self._metadata.planner_data, dict) and isinstance(metadata.planner_data, dict):
                self._metadata.planner_data.update(metadata.planner_data)
        self._results += results

    def write_index(self) -> None:
        """Coordinator (no-op elsewhere): DCP's index of every part, written as DCP writes it."""
        if self._metadata is not None:
            super().finish(self._metadata, self._results)


_GROUP = None
_GROUP_LOCK = threading.Lock()


def _checkpoint_group():
    """A gloo group for the background writes, so their collectives never interleave with
    training's on the default group (created collectively at the first async checkpoint)."""
    global _GROUP
    with _GROUP_LOCK:
        if _GROUP is None and tdist.is_initialized():
            _GROUP = tdist.new_group(backend="gloo")
    return _GROUP


def torch_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
    """This rank's view of the state of a torch strategy (DDP, FSDP2), keyed by name: plain
    tensors, or DTensors holding this rank's shard. Also the optimizer's param_groups (names)."""
    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions())
    return {MODEL: model_state, OPTIM: optim_state["state"]}, optim_state["param_groups"]


def save_torch_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, asynchronous: bool = False
) -> PendingWrite | None:
    state, _ = torch_state(model, optimizer)
    return write_sharded(state, folder, asynchronous)


def load_torch_state(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Collective: each rank reads the pieces its tensors cover (all of them under DDP, its
    shard under FSDP2) from whatever layout wrote them."""
    state, groups = torch_state(model, optimizer)
    # A parameter that never had a gradient (a vision tower's layer no caption reaches) has no
    # optimizer state in the checkpoint; torch's state dict gives every parameter one (a step
    # at lr 0), dropped again below so that its first gradient starts it as in the
    # uninterrupted run.
    held = stored_keys(folder)
    fresh = [
        name
        for name, fields in state[OPTIM].items()
        if isinstance(fields, dict) and not any(f"{OPTIM}.{name}.{field}" in held for field in fields)
    ]
    read_into({MODEL: state[MODEL], OPTIM: {k: v for k, v in state[OPTIM].items() if k not in fresh}}, folder)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state[MODEL],
        optim_state_dict={"state": state[OPTIM], "param_groups": groups},
        options=StateDictOptions(),
    )
    if fresh:
        by_name = {name.removeprefix("module."): p for name, p in model.named_parameters()}
        for name in fresh:
            optimizer.state.pop(by_name.get(name), None)


# ------------------------------------------------------------------ reading


def read_into(state: dict, folder: Path) -> None:
    """Collective (with a process group): fill `state`'s tensors in place from the checkpoint,
    each rank reading the pieces its tensors cover."""
    dcp.load(state, storage_reader=FileSystemReader(folder / STATE_DIR), no_dist=not tdist.is_initialized())


def stored_keys(folder: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every tensor the checkpoint holds: flattened key -> (global shape, dtype)."""
    metadata = FileSystemReader(folder / STATE_DIR).read_metadata()
    out = {}
    for key, entry in metadata.state_dict_metadata.items():
        size = getattr(entry, "size", None)
        if size is not None:
            out[key] = (size, entry.properties.dtype)
    return out


def read_whole(
    folder: Path, keys: list[str], stored: dict[str, tuple[torch.Size, torch.dtype]]
) -> Iterator[dict[str, torch.Tensor]]:
    """Whole tensors for `keys`, read by this rank alone (no collective), in batches of
    at most READ_BUFFER_BYTES (or one tensor): the bounded buffer of a rank that needs whole
    tensors to keep its part of them (DeepSpeed's partitions). The caller empties each batch
    before asking for the next (else two are held)."""
    batch: dict[str, torch.Tensor] = {}
    size = 0
    for key in keys:
        shape, dtype = stored[key]
        tensor = torch.empty(shape, dtype=dtype)
        if batch and size + tensor.nbytes > READ_BUFFER_BYTES:
            yield _read(folder, batch)
            batch, size = {}, 0
        batch[key] = tensor
        size += tensor.nbytes
    if batch:
        yield _read(folder, batch)


def _read(
    folder: Path, batch: dict[str, torch.Tensor], planner: DefaultLoadPlanner | None = None
) -> dict[str, torch.Tensor]:
    dcp.load(batch, storage_reader=FileSystemReader(folder / STATE_DIR), planner=planner, no_dist=True)
    return batch


def read_flat_ranges(
    folder: Path, ranges: dict[str, tuple[int, int]], stored: dict[str, tuple[torch.Size, torch.dtype]]
) -> Iterator[dict[str, torch.Tensor]]:
    """Elements [start, stop) of each tensor of `ranges` as if flattened (a DeepSpeed ZeRO-3
    partition), read by this rank alone, in batches of at most READ_BUFFER_BYTES (or one
    range). DCP reads a stored piece and copies out the rows that cover a range (the first
    dimension's), so a rank holds the rows around its partition, not the whole tensor,
    plus one stored piece while it is read (a whole tensor where DeepSpeed wrote it). The
    caller empties each batch before asking for the next (else two are held)."""
    batch: dict[str, torch.Tensor] = {}
    chunks: dict[str, ChunkStorageMetadata] = {}
    cuts: dict[str, tuple[int, int]] = {}
    size = 0
    for key, (start, stop) in ranges.items():
        shape, dtype = stored[key]
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        first, last = (start // row, -(-stop // row)) if shape else (0, 1)
        rows = torch.empty((last - first, *shape[1:]) if shape else (), dtype=dtype)
        if batch and size + rows.nbytes > READ_BUFFER_BYTES:
            yield _cut(_read(folder, batch, _ChunkPlanner(chunks)), cuts)
            batch, chunks, cuts, size = {}, {}, {}, 0
        batch[key] = rows
        chunks[key] = ChunkStorageMetadata(
            offsets=torch.Size((first, *[0] * (len(shape) - 1))) if shape else torch.Size(), sizes=rows.shape
        )
        cuts[key] = (start - first * row, stop - start)
        size += rows.nbytes
    if batch:
        yield _cut(_read(folder, batch, _ChunkPlanner(chunks)), cuts)


def _cut(batch: dict[str, torch.Tensor], cuts: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    return {key: rows.reshape(-1).narrow(0, *cuts[key]) for key, rows in batch.items()}


class _ChunkPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading each tensor of the state dict as the piece of the stored
    tensor that `chunks` places (offsets and sizes in the stored tensor) instead of whole."""

    def __init__(self, chunks: dict[str, ChunkStorageMetadata]):
        super().__init__()
        self.chunks = chunks

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        return LoadPlan(
            [
                item
                for key, chunk in self.chunks.items()
                for item in create_read_items_for_chunk_list(key, stored[key], [chunk])
            ]
        )

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]  # the piece itself (DCP's lookup takes an offset for a ShardedTensor's)


# ------------------------------------------------------------------ checking a checkpoint's files


def missing_file_problem(path: Path) -> str:
    """How state_problems words a missing file (its default `missing`)."""
    return f"{path} is missing"


def state_problems(folder: Path, missing: Callable[[Path], str] = missing_file_problem) -> list[str]:
    """What makes a checkpoint's state unreadable, found without reading the tensors: a
    missing index, a shard file that is missing or shorter than the index says (one reason
    per problem, naming the file; `missing` words a missing file's)."""
    state_dir = folder / STATE_DIR
    if not state_dir.is_dir():
        if is_legacy(folder):
            return []  # converted when the run resumes from it (convert_legacy)
        return [f"{folder} has no {STATE_DIR}/ folder"]
    if not (state_dir / ".metadata").is_file():
        return [missing(state_dir / ".metadata")]
    try:
        metadata = FileSystemReader(state_dir).read_metadata()
    except Exception as e:  # a truncated or garbled index
        return [f"{state_dir / '.metadata'} cannot be read ({type(e).__name__})"]
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, end in sorted(needed.items()):
        path = state_dir / name
        if not path.is_file():
            problems.append(missing(path))
        elif path.stat().st_size < end:
            problems.append(f"{path} is truncated ({path.stat().st_size:,} of {end:,} bytes)")
    return problems


def is_legacy(folder: Path) -> bool:
    """The single-file format of accord before sharded checkpoints (whole tensors by name)."""
    return not (folder / STATE_DIR).is_dir() and all((folder / name).is_file() for name in LEGACY_FILES)


def convert_legacy(folder: Path) -> None:
    """Rank 0, before a run resumes from a single-file checkpoint: the same tensors written
    as `state/` next to the old files (into a temporary folder, renamed into place), so every
    strategy then reads it as any other. The old format held the whole model and optimizer
    in one process already; so does this one-time conversion."""
    from safetensors.torch import load_file

    model = load_file(folder / LEGACY_FILES[0])
    optim = torch.load(folder / LEGACY_FILES[1], weights_only=True, map_location="cpu").get("state", {})
    optim = {
        name: {
            key: torch.as_tensor(entry[key], dtype=torch.float32) if key == "step" else entry[key]
            for key in ADAM_KEYS
            if key in entry
        }
        for name, entry in optim.items()
    }
    tmp = folder / f".{STATE_DIR}.converting"
    shutil.rmtree(tmp, ignore_errors=True)
    dcp.save({MODEL: model, OPTIM: optim}, storage_writer=FileSystemWriter(tmp), no_dist=True)
    os.rename(tmp, folder / STATE_DIR)


# ------------------------------------------------------------------ schedule


def save_schedule(folder: Path, scheduler, scaler: torch.amp.GradScaler | None = None, **extra) -> None:
    torch.save(
        {"scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler else None, **extra},
        folder / SCHEDULE_FILE,
    )


def load_schedule(folder: Path, scheduler, scaler: torch.amp.GradScaler | None = None) -> dict:
    """Restores the scheduler (and the GradScaler when both sides have one), and sets each
    optimizer group's learning rate to the scheduler's last one (what the groups had when
    the checkpoint was written); returns the whole record."""
    extra = torch.load(folder / SCHEDULE_FILE, weights_only=True)
    scheduler.load_state_dict(_fit_groups(extra["scheduler"], len(scheduler.optimizer.param_groups)))
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
    if scaler is not None and extra.get("scaler") is not None:
        scaler.load_state_dict(extra["scaler"])
    return extra


def _fit_groups(state: dict, groups: int) -> dict:
    """The scheduler's per-group lists for this optimizer's number of groups: strategies group
    differently (DeepSpeed ZeRO-3 flattens into one), and accord's groups share one learning
    rate schedule (they differ in weight decay only), so any entry stands for all."""
    for key in SCHEDULER_GROUP_KEYS:
        values = state.get(key)
        if isinstance(values, list) and values and len(values) != groups:
            state[key] = [values[0]] * groups
    return state
