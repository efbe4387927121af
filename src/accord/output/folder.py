"""The run's output folder: refuse to clobber an earlier run, write atomically."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from accord.atomic import replacing_folder, write_atomic
from accord.observe.trackers import TRACKER_ARTEFACTS
from accord.output.lock import lock_problem
from accord.recipe.schema import OutputConfig

# What a run writes; only these are removed by --overwrite (never the whole folder, which
# may hold the user's own files).
RUN_STATUS = "run-status.json"
RUN_ARTEFACTS = (
    ("recipe.yaml", RUN_STATUS, "metrics.jsonl", "samples.jsonl", "checkpoints", "final")
    + ("adapter", "base")  # a LoRA run's adapter and the base it names, when no lasting folder holds it
    + TRACKER_ARTEFACTS  # the experiment trackers' default stores (TensorBoard's too)
)
# Folders a run writes under a time-stamped name (the hang watchdog's stack dumps).
RUN_ARTEFACT_PATTERNS = ("hang-*",)
# The final model's safetensors shards: at most this many bytes of tensors each.
SHARD_BYTES = 2**30
# Where --overwrite moves an earlier run's artefacts until the new run has completed a step
# (then they are deleted) or has failed before that (then they are moved back).
PREVIOUS_RUN = ".previous-run"


def earlier_run(out_dir: Path) -> list[str]:
    named = [name for name in RUN_ARTEFACTS if (out_dir / name).exists()]
    stamped = sorted(p.name for pattern in RUN_ARTEFACT_PATTERNS for p in out_dir.glob(pattern))
    return named + stamped


def remove_refused_run(out_dir: Path) -> None:
    """A run refused by its workers before its first step, into a folder that held no run:
    what it wrote goes, so fixing the input and starting again needs no --overwrite."""
    for name in earlier_run(out_dir):
        target = out_dir / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()


def check_output_dir(output: OutputConfig, resume: str, run_id: str = "") -> list[str]:
    """Problems with output.dir, found before any work starts, for the recipe's output section
    and its `resume`. `run_id`: this run's, whose own lock on the folder is no problem."""
    out_dir = Path(output.dir)
    if out_dir.exists() and not out_dir.is_dir():
        return [f"output.dir: {out_dir} exists and is not a folder"]
    found = earlier_run(out_dir)
    if (out_dir / PREVIOUS_RUN).exists():
        # A live run replacing the earlier one holds it there until its first step: moving
        # or deleting it then would lose that run's way back, so only the lock is named.
        in_use = lock_problem(out_dir, run_id)
        if in_use:
            return [in_use]
        return [
            f"output.dir: {out_dir / PREVIOUS_RUN} holds the run an interrupted --overwrite set aside "
            f"(the run replacing it never completed a step); move its contents back into {out_dir}, or delete it"
        ]
    if output.overwrite and resume != "never":
        return ["--overwrite starts over and --resume / resume continues: choose one"]
    if found and not output.overwrite and resume == "never":
        return [
            f"output.dir: {out_dir} already holds a run ({', '.join(found)}); "
            f"pass --resume to continue it, --overwrite to replace it, or choose another output.dir=..."
        ]
    parent = out_dir if out_dir.exists() else _existing_parent(out_dir)
    if not os.access(parent, os.W_OK):
        return [f"output.dir: cannot write under {parent}"]
    return []


def prepare_output_dir(out_dir: Path, recipe_yaml: str) -> Path:
    """Create output.dir and save the resolved recipe (`recipe_to_yaml`) in it as recipe.yaml
    (an earlier run was set aside by the launcher)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "recipe.yaml", recipe_yaml)
    return out_dir


def write_run_status(out_dir: Path, status: str, step: int | None = None) -> None:
    """How the run stands, in a file a job script can test where a launcher hides accord's exit code
    (torchrun exits 1 and accelerate launch 143 whatever the workers returned): "running" from the
    start, then "completed", "preempted" (checkpointed on request: resume it) or "stopped" (could not
    go on; the reason is in the log). A run killed outright stays "running"."""
    record = {"status": status, **({"step": step} if step is not None else {})}
    write_atomic(out_dir / RUN_STATUS, json.dumps(record) + "\n")


def set_aside_earlier_run(out_dir: Path) -> Path | None:
    """--overwrite: move the earlier run's artefacts into out_dir/PREVIOUS_RUN (renames in one
    folder: nothing is copied or deleted yet); None when there was no earlier run."""
    found = earlier_run(out_dir)
    if not found:
        return None
    aside = out_dir / PREVIOUS_RUN
    aside.mkdir()
    for name in found:
        os.rename(out_dir / name, aside / name)
    return aside


def discard_earlier_run(out_dir: Path) -> bool:
    """The new run completed a step: the set-aside earlier run goes. True if there was one."""
    aside = out_dir / PREVIOUS_RUN
    if not aside.exists():
        return False
    # Renamed first, so a crash while deleting never leaves a half-deleted PREVIOUS_RUN
    # that a later start would offer to move back.
    doomed = Path(tempfile.mkdtemp(prefix=".discarded-", dir=out_dir))
    os.rename(aside, doomed / PREVIOUS_RUN)
    shutil.rmtree(doomed)
    return True


def restore_earlier_run(out_dir: Path) -> bool:
    """The new run failed before completing a step: its artefacts go, the earlier run's
    come back as they were. True if there was one to restore."""
    aside = out_dir / PREVIOUS_RUN
    if not aside.is_dir():
        return False
    for name in earlier_run(out_dir):
        target = out_dir / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    for item in sorted(aside.iterdir()):
        os.rename(item, out_dir / item.name)
    aside.rmdir()
    return True


def save_final_model(module, tokenizer, final: Path, state_dict: dict | None = None) -> None:
    """save_pretrained (safetensors) into a temporary sibling, then rename into place.
    `state_dict`: what to save when the module itself holds only a shard (a LoRA adapter's
    tensors: small; the whole model goes through save_streamed_model)."""
    with replacing_folder(final) as tmp:
        module.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)


def save_streamed_model(
    tensors: Iterable[tuple[str, torch.Tensor]], model, tokenizer, final: Path, shard_bytes: int = SHARD_BYTES
) -> None:
    """A save_pretrained folder from whole tensors handed over one at a time: transformers'
    sharded safetensors (model-0000k-of-0000n.safetensors + model.safetensors.index.json, or one
    model.safetensors) of at most `shard_bytes` each, every tensor written as it arrives, so the
    writer holds one tensor at a time. `model` gives the config (and generation config) only."""
    with streamed_model(model, tokenizer, final, shard_bytes) as add:
        for name, tensor in tensors:
            add(name, tensor)


@contextlib.contextmanager
def streamed_model(model, tokenizer, final: Path, shard_bytes: int = SHARD_BYTES) -> Iterator[Callable]:
    """save_streamed_model as a block that yields the function taking each (name, tensor): for
    two folders written from one pass over the tensors (a LoRA run's merged model and its base)."""
    # Here, not at the top: the writer imports torch, which the launcher's checks of the folder never need.
    from accord.output.safetensors_writer import ShardedSafetensorsWriter

    with replacing_folder(final) as tmp:
        shards = ShardedSafetensorsWriter(tmp, shard_bytes)
        yield shards.add
        shards.close()
        config = copy.deepcopy(model.config)
        config.architectures = [_model_class(model).__name__]
        config.save_pretrained(tmp)
        generation = getattr(model, "generation_config", None)
        if generation is not None and model.can_generate():
            generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def _model_class(model) -> type:
    """The model's transformers class (FSDP2 swaps in a subclass named FSDP<class>)."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path
