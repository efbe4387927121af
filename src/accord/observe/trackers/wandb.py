"""Weights & Biases, offline unless WANDB_MODE says otherwise: the run's files go to WANDB_DIR, else
output.dir (output.dir/wandb/offline-run-*; `wandb sync` uploads them later). Project
observe.project, else WANDB_PROJECT, else `accord`; the run is named WANDB_NAME, else after
output.dir. A resumed run continues its W&B run (the same run id: offline, `wandb sync` uploads
both attempts' folders into that one run)."""

from __future__ import annotations

import os

from accord.observe.trackers import Tracker, TrackerStart


class Wandb(Tracker):
    name = "wandb"

    def __init__(self, context: TrackerStart):
        import wandb

        # Arguments only where the user's environment says nothing: W&B reads its own variables.
        quiet = {} if "WANDB_QUIET" in os.environ else {"quiet": True}
        resume = {"id": context.resume_id, "resume": "allow", "allow_val_change": True} if context.resume_id else {}
        self._run = wandb.init(
            project=context.project or os.environ.get("WANDB_PROJECT") or "accord",
            name=os.environ.get("WANDB_NAME") or context.run_name,
            mode=None if os.environ.get("WANDB_MODE") else "offline",
            dir=None if os.environ.get("WANDB_DIR") else str(context.out_dir),
            config=context.config,
            # accord's own stdout / stderr stay as they are (W&B would otherwise wrap them), and
            # W&B's end-of-run table of every metric is left out unless WANDB_QUIET says otherwise.
            settings=wandb.Settings(console="off", **quiet),
            **resume,
        )
        self.run_id = self._run.id

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def finish(self, final: dict[str, float], status: str) -> None:
        self._run.summary.update(final)
        if status == "preempted":
            self._run.mark_preempting()  # W&B shows it as preempted, to be resumed
        self._run.finish(exit_code=0 if status == "completed" else 1)


def start(context: TrackerStart) -> Wandb:
    return Wandb(context)
