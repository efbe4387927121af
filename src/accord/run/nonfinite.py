"""train.on_nonfinite: what a NaN/inf loss or gradient norm does to the run, the same under
every strategy.

- stop: the run stops at the next logging flush, naming the step; the last checkpoint is
  intact. This holds whether or not the engine applied the update (DeepSpeed drops a
  non-finite update itself; torch's optimizers apply it).
- skip: the engine leaves the update out (it reads the gradient norm every step for that);
  the run stops after train.max_skipped_steps such steps.
An fp16 overflow is the loss scaler's business (it skips and rescales), never a stop.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from accord.distributed import group as dist
from accord.observe.steplog import LoggedStep, StepStats
from accord.recipe.schema import TrainConfig
from accord.stopping import TrainingStopped


class NonFiniteGuard:
    def __init__(self, cfg: TrainConfig, handles_overflow: bool, intact_note: Callable[[], str]):
        self.skip = cfg.on_nonfinite == "skip"
        self.max_skipped = cfg.max_skipped_steps
        self.handles_overflow = handles_overflow
        self.intact_note = intact_note  # what is safe on disk, for the message
        self.skipped = 0

    def after_step(self, stats: StepStats) -> None:
        """Count an update left out under `skip` (the engine's decision, the same on every rank)."""
        if not (self.skip and stats.skipped):
            return
        self.skipped += 1
        dist.print0(f"accord: step {stats.step}: non-finite gradient norm; update skipped ({self.skipped} so far)")
        if self.skipped > self.max_skipped:
            raise TrainingStopped(
                f"step {stats.step}: {self.skipped} updates skipped for non-finite values "
                f"(train.max_skipped_steps={self.max_skipped}); {self.intact_note()}"
            )

    def after_flush(self, logged: list[LoggedStep]) -> None:
        # The values are reduced / identical on every rank, so every rank stops together.
        for entry in logged:
            if self.skip and entry.stats.skipped:
                continue  # already handled
            loss_bad = not math.isfinite(entry.loss)
            if loss_bad or (not math.isfinite(entry.grad_norm) and not self.handles_overflow):
                what = f"loss {entry.loss}" if loss_bad else f"gradient norm {entry.grad_norm}"
                raise TrainingStopped(
                    f"step {entry.stats.step}: {what} is not finite; stopping "
                    "(train.on_nonfinite=skip skips such updates "
                    f"instead; a lower optim.lr or max_grad_norm often helps). {self.intact_note()}"
                )
