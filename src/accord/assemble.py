"""Put a run together: tokenizer, task, prepared data, rows and order, model (+ LoRA, + a
DPO reference), engine — and hand them to the Trainer."""

from __future__ import annotations

import copy

import numpy as np
import torch

from accord import dist
from accord.batching import BatchPlan
from accord.data.order import GlobalOrder
from accord.data.packing import Rows
from accord.data.prepare import prepare_data
from accord.engine import build_engine
from accord.models import apply_lora, build_model, build_tokenizer
from accord.observe.throughput import flops_per_token, peak_tflops
from accord.recipe import ModelConfig, Recipe
from accord.tasks import build_task
from accord.trainer import Trainer, total_training_steps


def build_trainer(recipe: Recipe, info: dist.DistInfo, device: torch.device) -> Trainer:
    tokenizer = build_tokenizer(recipe.model)
    task = build_task(recipe, tokenizer)
    # Under accord's own launcher the data is already prepared (a cache hit); under an
    # outer launcher each node's first process prepares it and the others wait.
    data = prepare_data(recipe, tokenizer, task, preparer=info.local_rank == 0)
    plan = BatchPlan.derive(recipe.batch.global_batch_size, recipe.batch.micro_batch_size, info.world_size)
    packing = task.packable and recipe.data.packing is not False
    task.packing = packing
    lengths = np.asarray(data.train["length"], dtype=np.int64)
    rows = Rows.build(lengths, np.asarray(data.train["num_targets"], dtype=np.int64), recipe.data.max_length if packing else None)
    grouped = rows.lengths if recipe.data.group_by_length and not packing else None
    order = GlobalOrder(len(rows), plan.global_batch_size, recipe.seed, recipe.data.shuffle, group_lengths=grouped)
    total_steps = total_training_steps(recipe, order)

    model = build_model(recipe.model, tokenizer, recipe.seed, task.model_kind, task.model_kwargs())
    if hasattr(task, "configure_model"):
        task.configure_model(model)
    reference = _dpo_reference(recipe, model, tokenizer, task, device) if recipe.task == "dpo" else None
    num_params = sum(p.numel() for p in model.parameters())
    if recipe.lora is not None:
        model = apply_lora(model, recipe.lora, task.model_kind, recipe.seed)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    name = type(model).__name__
    # Counted before the engine shards the parameters (zero3 leaves local stubs).
    model_flops = flops_per_token(model, context=float(rows.lengths.mean()))
    engine = build_engine(recipe, model, info, device, plan, total_steps)
    if recipe.task == "dpo":
        task.attach_reference(reference, engine.module)
    eval_data = data.eval
    if eval_data is not None and recipe.train.eval_limit is not None and len(eval_data) > recipe.train.eval_limit:
        eval_data = eval_data.select(range(recipe.train.eval_limit))
    trainer = Trainer(recipe, info, task, data.train, eval_data, rows, engine, plan, order, total_steps, tokenizer)
    trainer.flops_per_token = model_flops
    trainer.peak_tflops = peak_tflops(device, recipe.engine.peak_tflops)
    trainer.announce(name, num_params, trainable, data.report)
    trainer.num_params = num_params
    if recipe.task == "dpo" and recipe.dpo.precompute_reference:
        precompute_reference(trainer)
    return trainer


def _dpo_reference(recipe: Recipe, model, tokenizer, task, device: torch.device):
    """The frozen reference policy: the given folder, or a copy of the starting model (with
    LoRA none is needed: the reference is the model with its adapters switched off)."""
    if recipe.dpo.reference is not None:
        reference = build_model(ModelConfig(path=recipe.dpo.reference), tokenizer, recipe.seed, task.model_kind)
    elif recipe.lora is not None:
        return None
    else:
        reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    return reference.eval().to(device)


@torch.no_grad()
def precompute_reference(trainer: Trainer) -> None:
    """Reference log-probabilities of every pair, computed once so training needs no
    reference forward pass; then the reference model is released."""
    from accord.trainer import fetch

    task, size = trainer.task, trainer.recipe.train.eval_micro_batch_size
    for split, ds in (("train", trainer.train_data), ("eval", trainer.eval_data)):
        if ds is None:
            continue
        values = np.zeros((len(ds), 2), dtype=np.float32)
        for start in range(0, len(ds), size):
            indices = list(range(start, min(start + size, len(ds))))
            batch = trainer.to_device(task.collate([[e] for e in fetch(ds, indices, {})]))
            with trainer.engine.autocast():
                logps = task.reference_logps(batch).float().cpu().numpy()
            values[indices, 0], values[indices, 1] = logps[: len(indices)], logps[len(indices) :]
        trainer.extra_columns[split]["ref_logp"] = values
    task.attach_reference(None, trainer.engine.module)
    dist.print0(f"accord: reference log-probabilities precomputed for {len(trainer.train_data)} training pairs")
