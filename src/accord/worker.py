"""What each worker process runs: join the group, train, save, leave cleanly."""

from __future__ import annotations

from typing import Any

from accord import dist
from accord.engine.device import select_device
from accord.outputs import prepare_output_dir
from accord.recipe import Recipe
from accord.trainer import Trainer


def train_worker(recipe_data: dict[str, Any]) -> dict[str, float]:
    """Entry point of one worker; `recipe_data` is a validated recipe's model_dump()."""
    recipe = Recipe.model_validate(recipe_data)
    info = dist.env_info()
    _quiet_libraries(info)
    device = select_device(recipe.engine, info.local_rank)
    dist.init(device)
    clean = False
    try:
        if info.is_main:
            out_dir = prepare_output_dir(recipe)
        dist.barrier()
        trainer = Trainer.build(recipe, info, device)
        try:
            results = trainer.train()
            final = trainer.save()
        finally:
            trainer.close()
        if info.is_main:
            dist.print0(f"accord: outputs in {out_dir}/ (final model: {final}/, metrics: {out_dir}/metrics.jsonl, TensorBoard: {out_dir}/tensorboard)")
        clean = True
        return results
    finally:
        # After an error a peer may never reach the barrier: only tear down.
        dist.shutdown(clean=clean)


def _quiet_libraries(info: dist.DistInfo) -> None:
    """accord draws its own progress bar; libraries' bars and per-rank chatter are noise."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if not info.is_main:
        hf_logging.set_verbosity_error()
