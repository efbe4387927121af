"""The loop's side of checkpoints: when one is due, writing the run's state at a step, and
continuing from one. The files and their atomic protocol are accord.checkpoint.store's."""

from __future__ import annotations

import time
from pathlib import Path

from accord.checkpoint.node_folders import complete_from_peers
from accord.checkpoint.resume import order_change
from accord.checkpoint.store import (
    CHECKPOINTS,
    CheckpointError,
    PendingCheckpoint,
    TrainingState,
    read_state,
    restore_rng,
    save_checkpoint,
    step_name,
)
from accord.distributed import group as dist
from accord.engine.state import convert_legacy, is_legacy
from accord.recipe.schema import CheckpointConfig
from accord.stopping import TrainingStopped


class CheckpointSchedule:
    """checkpoint.every_steps and every_minutes (rank 0's clock decides the latter), and the
    checkpoint being written: with checkpoint.async it is sealed in the background, and the
    next one (or the end of the run) waits for it."""

    def __init__(self, cfg: CheckpointConfig):
        self.cfg = cfg
        self._last = time.monotonic()
        self._pending: PendingCheckpoint | None = None

    def step_due(self, step: int) -> bool:
        return self.cfg.every_steps is not None and step % self.cfg.every_steps == 0

    def time_due(self) -> bool:
        minutes = self.cfg.every_minutes
        return minutes is not None and time.monotonic() - self._last >= 60 * minutes

    def save(self, run, step: int) -> Path:
        """Collective: the checkpoint of `step` (model, optimizer, schedule, RNG, data position),
        after the previous one is sealed; the folder it has (or will have, once sealed)."""
        self.finish()
        position = run.order.position(step)
        state = TrainingState(
            step, position.epoch, position.index, run.info.world_size, run.plan.micro_batch_size, run.order.version
        )
        try:
            pending = save_checkpoint(
                run.engine, run.recipe, state, run.out_dir, run.info, asynchronous=self.cfg.async_
            )
        except CheckpointError as e:  # raised on every rank alike by save_checkpoint
            raise TrainingStopped(str(e)) from None
        self._pending = pending if self.cfg.async_ else None  # a synchronous one is sealed already
        self._last = time.monotonic()
        return run.out_dir / CHECKPOINTS / step_name(step)

    def finish(self) -> None:
        """Collective: wait until the checkpoint being written is sealed (nothing to wait for
        when checkpoints are synchronous)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.wait()
            except CheckpointError as e:
                raise TrainingStopped(str(e)) from None


def restore_run(run, folder: Path) -> int:
    """Weights, optimizer, schedule, RNG and the data position from `folder`; the step to continue at."""
    state = read_state(folder)
    # Rank 0's answer for all: its conversion renames `state/` into place, so a rank that
    # looked later would see the new format, skip the barrier and hang its peers.
    (legacy,) = dist.any_rank(run.info.is_main and is_legacy(folder))
    if legacy:
        if run.info.is_main:
            dist.print0(f"accord: converting {folder} from the single-file checkpoint format to the sharded one")
            convert_legacy(folder)
        dist.barrier()
    missing = complete_from_peers(folder, run.info)  # a folder per node: the files other nodes wrote
    if missing:
        raise TrainingStopped("\n".join(missing))
    refusal = order_change(folder, run.recipe)  # the launcher checked; a restart or outer launcher may not have
    if refusal:
        raise TrainingStopped(refusal)
    run.engine.load_state(folder)
    position = run.order.position(state.step)
    if state.started_from:
        dist.print0(
            f"accord: resumed from the transformers.Trainer checkpoint {state.started_from} at step {state.step} "
            "(weights, AdamW state, schedule); not carried over: Trainer's data position and RNG — accord goes on "
            f"with step {state.step + 1} of its own global order (epoch {position.epoch}, example {position.index}), "
            "as a run of its own would"
        )
        restore_rng(folder, state, run.info, run.recipe.seed)
        return state.step
    if (position.epoch, position.index) != (state.epoch, state.index):
        raise TrainingStopped(
            f"{folder}: recorded data position (epoch {state.epoch}, index {state.index}) does not match "
            f"step {state.step} of this recipe's data order; was the data changed?"
        )
    same_rng = restore_rng(folder, state, run.info, run.recipe.seed)
    now = (run.info.world_size, run.plan.micro_batch_size)
    layout = f"{state.world_size} × {state.micro_batch_size}" + (
        ""
        if (state.world_size, state.micro_batch_size) == now
        else f" -> now {now[0]} × {now[1]} (same global batches)"
    )
    dist.print0(
        f"accord: resumed from {folder} at step {state.step} (epoch {state.epoch}, example {state.index} of the "
        f"global order; processes × micro batch {layout})"
        + ("" if same_rng else "; RNG re-seeded for the new world size")
    )
    return state.step
