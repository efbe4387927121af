"""The recipe's `observe` section: where the run's metrics go besides metrics.jsonl."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import Field, field_validator

from accord.recipe.section import Section

# observe.report_to's names; accord.observe.trackers has one module for each.
TRACKERS = ("tensorboard", "mlflow", "wandb", "trackio")


class ObserveConfig(Section):
    """Where the run's metrics go besides `metrics.jsonl`: experiment trackers, written by rank 0."""

    report_to: list[str] = Field(
        ["tensorboard"],
        description="Experiment trackers given every scalar of metrics.jsonl at its step, the resolved recipe as "
        "parameters and the final metrics: any of " + ", ".join(TRACKERS) + " (mlflow, wandb and trackio are "
        "extras: pip install 'accord[mlflow]' ...); [] or none for none. Each keeps its data under output.dir "
        "unless its own environment variables say otherwise (MLFLOW_TRACKING_URI, WANDB_MODE / WANDB_DIR, "
        "TRACKIO_DIR / TRACKIO_SPACE_ID); nothing leaves the machine by default.",
    )
    project: str | None = Field(
        None,
        description="The project (MLflow: experiment) the run is filed under; default: the tracker's own "
        "environment variable (MLFLOW_EXPERIMENT_NAME, WANDB_PROJECT), else `accord`. The run is named after "
        "output.dir's last folder.",
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        # `none` (transformers' report_to spelling) and one bare name are accepted as well as a list.
        if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("report_to")
    @classmethod
    def _known(cls, names: list[str]) -> list[str]:
        for name in names:
            if name not in TRACKERS:
                close = difflib.get_close_matches(name, TRACKERS, n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ValueError(
                    f"observe.report_to: unknown tracker {name!r}{hint} (known: {', '.join(TRACKERS)}; or none)"
                )
        return list(dict.fromkeys(names))  # a name given twice is one tracker
