"""The loop's side of checkpoints: when one is due, writing the run's state at a step, and
continuing from one. The files and their atomic protocol are accord.checkpoint's."""

from __future__ import annotations

import time
from pathlib import Path

from accord import dist
from accord.checkpoint import CheckpointError, TrainingState, read_state, restore_rng, save_checkpoint
from accord.recipe import CheckpointConfig
from accord.stopping import TrainingStopped


class CheckpointSchedule:
    """checkpoint.every_steps and every_minutes (rank 0's clock decides the latter)."""

    def __init__(self, cfg: CheckpointConfig):
        self.cfg = cfg
        self._last = time.monotonic()

    def step_due(self, step: int) -> bool:
        return self.cfg.every_steps is not None and step % self.cfg.every_steps == 0

    def time_due(self) -> bool:
        minutes = self.cfg.every_minutes
        return minutes is not None and time.monotonic() - self._last >= 60 * minutes

    def written(self) -> None:
        self._last = time.monotonic()


def save_run(run, step: int) -> Path:
    """Collective: the checkpoint of `step` (model, optimizer, schedule, RNG, data position)."""
    position = run.order.position(step)
    state = TrainingState(step, position.epoch, position.index, run.info.world_size, run.plan.micro_batch_size)
    try:
        return save_checkpoint(run.engine, run.recipe, state, run.out_dir, run.info)
    except CheckpointError as e:  # raised on every rank alike by save_checkpoint
        raise TrainingStopped(str(e)) from None


def restore_run(run, folder: Path) -> int:
    """Weights, optimizer, schedule, RNG and the data position from `folder`; the step to continue at."""
    state = read_state(folder)
    run.engine.load_state(folder)
    position = run.order.position(state.step)
    if (position.epoch, position.index) != (state.epoch, state.index):
        raise TrainingStopped(
            f"{folder}: recorded data position (epoch {state.epoch}, index {state.index}) does not match "
            f"step {state.step} of this recipe's data order; was the data changed?"
        )
    same_rng = restore_rng(folder, state, run.info, run.recipe.seed)
    now = (run.info.world_size, run.plan.micro_batch_size)
    layout = f"{state.world_size} × {state.micro_batch_size}" + (
        "" if (state.world_size, state.micro_batch_size) == now else f" -> now {now[0]} × {now[1]} (same global batches)"
    )
    dist.print0(
        f"accord: resumed from {folder} at step {state.step} (epoch {state.epoch}, example {state.index} of the "
        f"global order; processes × micro batch {layout})" + ("" if same_rng else "; RNG re-seeded for the new world size")
    )
    return state.step
