"""Resuming with a different train.max_steps: what happens to the learning-rate schedule.

The schedule is a list of segments (start step, end step); each runs the recipe's schedule
(warm-up, then cosine / linear / constant) from optim.lr over its own length. A fresh run has
one segment (0, max_steps). On resume with another length, optim.extend chooses:

- continue: the last segment now ends at the new max_steps, i.e. the schedule is recomputed as
  if the run had been planned that long (the learning rate at the resume step moves to the
  new curve; a cosine that had decayed to ~0 comes back up part of the way);
- restart_decay: the segments so far are kept as they ran, and a new one from the resume step
  to the new max_steps warms up again to optim.lr and decays to the end.

Each segment's multipliers are transformers' (engine.optim.schedule_multiplier, the function
the engines' schedulers apply). The segments travel inside the scheduler's own state
(LambdaLR saves a callable object's attributes), so a later resume continues the same
piecewise schedule.
"""

from __future__ import annotations

from pathlib import Path

import torch

from accord.checkpoint.store import read_checkpoint_recipe
from accord.compat.torch import set_last_lr
from accord.distributed import group as dist
from accord.engine.optim import schedule_multiplier
from accord.engine.state import SCHEDULE_FILE
from accord.recipe.schema import OptimConfig


class SegmentedSchedule:
    """LambdaLR multiplier over segments; the state LambdaLR saves is this object's __dict__."""

    def __init__(self, segments: list[list[int]], schedule: str, warmup_steps: int):
        self.segments = [list(s) for s in segments]
        self.schedule = schedule
        self.warmup_steps = warmup_steps

    def __call__(self, step: int) -> float:
        start, end = next(s for s in reversed(self.segments) if s[0] <= step or s is self.segments[0])
        return schedule_multiplier(self.schedule, self.warmup_steps, end - start)(step - start)


def saved_segments(folder: Path, planned_steps: int | None) -> list[list[int]] | None:
    """The segments of the checkpoint's schedule: those it saved, or (a checkpoint of a run
    never extended) one segment over the max_steps its recipe planned."""
    try:
        saved = torch.load(folder / SCHEDULE_FILE, map_location="cpu", weights_only=True)["scheduler"]
        for fn in saved.get("lr_lambdas") or []:
            if isinstance(fn, dict) and "segments" in fn:
                return [list(s) for s in fn["segments"]]
    except (OSError, KeyError, RuntimeError):
        pass
    return [[0, planned_steps]] if planned_steps else None


def apply_on_resume(run, folder: Path, step: int) -> None:
    """After the run's state is restored from `folder` at `step`: say what a changed
    train.max_steps does to the schedule, and install the schedule optim.extend chose."""
    cfg: OptimConfig = run.recipe.optim
    total = run.total_steps
    try:
        old_recipe = read_checkpoint_recipe(folder) or {}
    except OSError:
        old_recipe = {}
    planned = (old_recipe.get("train") or {}).get("max_steps") or total
    segments = saved_segments(folder, planned)
    if segments is None:
        return
    scheduler = getattr(run.engine, "scheduler", None)
    if not hasattr(scheduler, "lr_lambdas"):  # not a LambdaLR (every engine's today): nothing to change
        return
    before = _lr_at(cfg, segments, step)
    if segments[-1][1] != total:
        if cfg.extend == "restart_decay" and step > segments[-1][0]:
            new = [s for s in segments if s[0] < step] + [[step, total]]
        else:
            new = segments[:-1] + [[segments[-1][0], total]]
        after = _lr_at(cfg, new, step)
        old_end = segments[-1][1]
        if cfg.schedule == "constant":
            what = f"the {cfg.schedule} schedule is unchanged (lr {after:.3g})"
        elif cfg.extend == "restart_decay":
            what = (
                f"optim.extend=restart_decay: a new {cfg.schedule} decay from step {step} to {total}"
                + (f" after {cfg.warmup_steps} warm-up steps" if cfg.warmup_steps else "")
                + f" (peak lr {cfg.lr:.3g}); the steps so far keep the schedule they ran"
            )
        else:
            what = (
                f"optim.extend=continue: the {cfg.schedule} schedule is recomputed as if planned for {total} steps, "
                f"so the lr moves from {before:.3g} to {after:.3g} at step {step}; "
                f"optim.extend=restart_decay starts a new decay from the peak lr instead"
            )
        dist.print0(f"accord: resuming at step {step} with train.max_steps {old_end} → {total}: {what}")
        segments = new
    if len(segments) > 1:
        _install(scheduler, SegmentedSchedule(segments, cfg.schedule, cfg.warmup_steps))
    else:
        # One segment (0, total): the schedule the engine built is that one; the restored
        # learning rate is the old schedule's, so the next step's comes from the new curve.
        _install(scheduler, None)


def _lr_at(cfg: OptimConfig, segments: list[list[int]], step: int) -> float:
    return cfg.lr * SegmentedSchedule(segments, cfg.schedule, cfg.warmup_steps)(step)


def _install(scheduler, fn: SegmentedSchedule | None) -> None:
    """Replace a LambdaLR's multipliers (None: keep them) and set the current learning rates
    from them."""
    if fn is not None:
        scheduler.lr_lambdas = [fn] * len(scheduler.optimizer.param_groups)
    step = scheduler.last_epoch
    lrs = [base * f(step) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    set_last_lr(scheduler, lrs)
