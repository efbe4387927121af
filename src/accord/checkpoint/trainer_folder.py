"""A `checkpoint-N/` folder written by transformers.Trainer (or TRL's trainers), brought in as an
accord checkpoint so that `resume: PATH/checkpoint-N` continues with its weights, AdamW state,
schedule and step through accord's own resume, on any strategy and number of processes.

The folder is read once per node, before the workers start: the weights from its safetensors,
optimizer.pt and scheduler.pt with `torch.load(weights_only=True)` (nothing in them is run). Trainer
keys AdamW's state by position in its two parameter groups (weight decay, then none); the
positions are turned into parameter names with Trainer's own rule for those groups, so the
state becomes the full, unsharded AdamW state keyed by name that accord's checkpoints hold, and
every strategy reads its part of it as it reads its own.

What does not carry over: Trainer's position in its data (its sampler's order is its own) and
its RNG. accord continues at step N of its own global order, as a run of its own would."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from accord.checkpoint import node_folders
from accord.checkpoint.manifest import unlisted_entries, write_manifest
from accord.checkpoint.store import COMPLETE, RECIPE_FILE, STATE_FILE, TrainingState, step_name
from accord.errors import UserInputError
from accord.recipe.schema import Recipe, recipe_to_yaml

TRAINER_STATE = "trainer_state.json"
OPTIMIZER, SCHEDULER = "optimizer.pt", "scheduler.pt"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


class TrainerCheckpointError(UserInputError):
    """A Trainer checkpoint folder accord cannot resume from; the message is one line."""


def is_trainer_checkpoint(folder: str | Path) -> bool:
    folder = Path(folder)
    return (folder / TRAINER_STATE).is_file() and not (folder / COMPLETE).exists()


def trainer_step(folder: Path) -> int:
    try:
        return int(json.loads((folder / TRAINER_STATE).read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TrainerCheckpointError(
            f"resume: {folder / TRAINER_STATE} cannot be read ({type(e).__name__}); "
            "is this a folder transformers.Trainer wrote?"
        ) from None


def problems(folder: Path, recipe: Recipe) -> list[str]:
    """Why `folder` cannot be resumed from: each a line naming the file and what to do."""
    missing = [name for name in (OPTIMIZER, SCHEDULER) if not (folder / name).is_file()]
    if not any((folder / name).is_file() for name in WEIGHTS):
        if (folder / "adapter_model.safetensors").is_file():
            return [f"resume: {folder} holds LoRA adapters, not a whole model; resume from a full fine-tune's"]
        missing.insert(0, WEIGHTS[0])
    if missing:
        return [
            f"resume: {folder} is not a complete transformers.Trainer checkpoint: {', '.join(missing)} missing "
            "(Trainer writes them unless save_only_model was set); resume from a checkpoint that has them, "
            "or start from its weights with model.path and resume: never"
        ]
    if recipe.lora is not None:
        return [f"resume: {folder} is a full-model Trainer checkpoint but the recipe trains LoRA adapters; drop lora"]
    trainer_step(folder)
    return []


def bring_in(folder: Path, recipe: Recipe) -> Path:
    """The accord checkpoint made from Trainer's `folder` (made once, reused while its sources are
    unchanged): a temporary folder on this node, keyed by the source's path and files."""
    folder = folder.resolve()
    found = problems(folder, recipe)
    if found:
        raise TrainerCheckpointError(found[0])
    step = trainer_step(folder)
    stamp = hashlib.sha256(
        "|".join(
            f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in sorted(folder.iterdir()) if p.is_file()
        ).encode()
        + str(folder).encode()
        + recipe.model_dump_json(include={"seed", "task", "model", "data", "batch"}).encode()
    ).hexdigest()[:16]
    root = Path(tempfile.gettempdir()) / f"accord-trainer-checkpoint-{stamp}"
    final = root / step_name(step)
    if (final / COMPLETE).is_file():
        return final
    tmp = root / f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write(folder, recipe, step, tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process on this node brought it in meanwhile
            if not (final / COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.exists():  # refused: nothing left behind
            shutil.rmtree(root, ignore_errors=True)
    return final


def _write(folder: Path, recipe: Recipe, step: int, out: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from accord.engine.state import ADAM_KEYS, MODEL, OPTIM, SCHEDULE_FILE, STATE_DIR

    weights = _weights(folder)
    names = _optimizer_names(folder, recipe, weights)  # also fills tied weights save_pretrained left out
    saved = _load(folder / OPTIMIZER)
    optim = {}
    for index, entry in saved.get("state", {}).items():
        name = names.get(int(index))
        if name is None or not all(key in entry for key in ADAM_KEYS):
            raise TrainerCheckpointError(
                f"resume: {folder / OPTIMIZER} is not an AdamW state of this model (entry {index}: "
                f"{sorted(entry)}); accord resumes AdamW (adamw_torch) checkpoints only"
            )
        if tuple(entry["exp_avg"].shape) != tuple(weights[name].shape):
            raise TrainerCheckpointError(
                f"resume: {folder / OPTIMIZER} does not fit the model: {name} is {tuple(weights[name].shape)} "
                f"but its AdamW state is {tuple(entry['exp_avg'].shape)}"
            )
        optim[name] = {
            key: torch.as_tensor(entry[key], dtype=torch.float32) if key == "step" else entry[key].float()
            for key in ADAM_KEYS
        }
    dcp.save({MODEL: weights, OPTIM: optim}, storage_writer=FileSystemWriter(out / STATE_DIR), no_dist=True)
    scheduler = _load(folder / SCHEDULER)
    if not isinstance(scheduler, dict) or "last_epoch" not in scheduler:
        raise TrainerCheckpointError(f"resume: {folder / SCHEDULER} is not a learning-rate scheduler's state")
    torch.save({"scheduler": scheduler, "scaler": None}, out / SCHEDULE_FILE)
    micro = recipe.batch.micro_batch_size or recipe.batch.global_batch_size
    # Position -1: the data position is accord's own at this step (checkpoint.schedule.restore_run).
    from accord.data.order import order_version
    from accord.tasks import groups_by_length, task_class

    grouped = groups_by_length(recipe.data, task_class(recipe.task, recipe.model))
    state = TrainingState(step, -1, -1, 1, micro, order_version(recipe.data.shuffle, grouped), started_from=str(folder))
    (out / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
    (out / RECIPE_FILE).write_text(recipe_to_yaml(recipe))
    node_folders.record(out)
    write_manifest(out, unlisted_entries(out, {}))
    (out / COMPLETE).write_text("")


def _load(path: Path) -> Any:
    import pickle

    import torch

    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        reason = " ".join(str(e).split())[:200]
        raise TrainerCheckpointError(
            f"resume: {path} cannot be read as plain tensors (torch.load weights_only=True): {type(e).__name__}: "
            f"{reason}; accord does not run code from a checkpoint"
        ) from None


def _weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    try:
        if (folder / WEIGHTS[0]).is_file():
            return dict(load_file(folder / WEIGHTS[0]))
        index = json.loads((folder / WEIGHTS[1]).read_text())["weight_map"]
        out: dict[str, Any] = {}
        for shard in sorted(set(index.values())):
            out |= load_file(folder / shard)
        return out
    except Exception as e:  # safetensors' own error type, JSON, a missing shard: all a damaged folder
        reason = " ".join(str(e).split())[:200]
        raise TrainerCheckpointError(
            f"resume: the weights in {folder} cannot be read ({type(e).__name__}: {reason}); "
            "copy the checkpoint again from where Trainer wrote it"
        ) from None


def _optimizer_names(folder: Path, recipe: Recipe, weights: dict[str, Any]) -> dict[int, str]:
    """Trainer's optimizer positions -> parameter names: its groups are the decayed parameters,
    then the others, each in the model's parameter order (Trainer.create_optimizer)."""
    import torch
    from transformers import AutoConfig

    from accord.compat.transformers import trainer_decay_parameter_names
    from accord.models.build import auto_class

    config = AutoConfig.from_pretrained(folder, trust_remote_code=recipe.model.trust_remote_code)
    with torch.device("meta"):
        model = auto_class("causal_lm").from_config(config, trust_remote_code=recipe.model.trust_remote_code)
    params = [name for name, p in model.named_parameters() if p.requires_grad]
    decay = set(trainer_decay_parameter_names(model))
    ordered = [n for n in params if n in decay] + [n for n in params if n not in decay]
    saved_groups = _load(folder / OPTIMIZER).get("param_groups", [])
    counts = [len(group.get("params", [])) for group in saved_groups]
    if sum(counts) != len(ordered):
        raise TrainerCheckpointError(
            f"resume: {folder / OPTIMIZER} holds {sum(counts)} parameters in {len(counts)} group(s) but the model "
            f"in {folder} has {len(ordered)} trainable ones; was it written for another model?"
        )
    positions = [index for group in saved_groups for index in group["params"]]
    # save_pretrained writes a tied tensor once (the output embedding is the input one): the
    # state accord reads holds every name of the model's state dict.
    tensors = model.state_dict(keep_vars=True)
    for name, tensor in tensors.items():
        if name not in weights:
            twin = next((k for k, t in tensors.items() if t is tensor and k in weights), None)
            if twin is not None:
                weights[name] = weights[twin]
    missing = [n for n in tensors if n not in weights]
    if missing:
        raise TrainerCheckpointError(f"resume: the weights in {folder} lack {missing[0]} (and {len(missing) - 1} more)")
    return dict(zip(positions, ordered))
