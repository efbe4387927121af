"""TensorBoard event files in output.dir/tensorboard (accord's default tracker)."""

from __future__ import annotations

import yaml

from accord.observe.trackers import Tracker, TrackerStart


class TensorBoard(Tracker):
    name = "tensorboard"

    def __init__(self, context: TrackerStart):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides the events of the steps a resumed run trains again.
        resume = context.resume_step
        self._writer = SummaryWriter(
            log_dir=str(context.out_dir / "tensorboard"), purge_step=resume + 1 if resume else None
        )
        if context.config:
            # The recipe in TensorBoard's Text tab (markdown: indented by four spaces, a code block).
            recipe = yaml.safe_dump(context.config, sort_keys=False)
            self._writer.add_text("recipe", "".join(f"    {line}\n" for line in recipe.splitlines()), resume)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)

    def finish(self, final: dict[str, float], status: str) -> None:
        # SummaryWriter owns a writer thread; closing joins it so no thread outlives the run.
        # The final metrics are the last points of each scalar already.
        self._writer.close()


def start(context: TrackerStart) -> TensorBoard:
    return TensorBoard(context)
