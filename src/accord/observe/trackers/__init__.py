"""Experiment trackers (`observe.report_to`): rank 0 opens each before the model is built, gives it
every scalar that metrics.jsonl records (tagged `kind/name`, at its step), the resolved recipe as
parameters at the start and the final metrics at the end. Each run's id is kept in
output.dir/trackers.json, so that a resumed run (or a restarted worker group) continues the same
tracker runs.

One module per tracker, each with `start(context) -> Tracker`, importing its library there: a
recipe without a tracker never imports it. Data stays under output.dir unless the tracker's own
environment variables send it elsewhere; nothing goes over the network by default."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from accord.atomic import write_atomic
from accord.errors import UserInputError
from accord.recipe.observe import TRACKERS, ObserveConfig


@dataclass(frozen=True)
class Kind:
    module: str
    packages: tuple[str, ...]  # import names the tracker needs (checked before the run starts)
    extra: str | None  # accord's extra that installs them
    env: tuple[str, ...] = ()  # the library's own variables accord follows (named when it cannot start)


KINDS = {
    "tensorboard": Kind("accord.observe.trackers.tensorboard", ("tensorboard",), None),
    "mlflow": Kind(
        "accord.observe.trackers.mlflow", ("mlflow",), "mlflow", ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME")
    ),
    "wandb": Kind(
        "accord.observe.trackers.wandb", ("wandb",), "wandb", ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME")
    ),
    "trackio": Kind(
        "accord.observe.trackers.trackio",
        ("trackio",),
        "trackio",
        ("TRACKIO_DIR", "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"),
    ),
}
assert tuple(KINDS) == TRACKERS  # the recipe's names, one module each

# The tracker runs' ids, for a resumed run to continue them.
RUN_IDS = "trackers.json"
# output.dir entries the trackers write by default (so --overwrite and the earlier-run check see them).
TRACKER_ARTEFACTS = (RUN_IDS, "tensorboard", "mlflow.db", "mlartifacts", "wandb", "trackio")


class TrackerStartError(UserInputError):
    """A tracker could not start; the message is one line naming it and why."""


@dataclass(frozen=True)
class TrackerStart:
    """What every tracker is started with."""

    out_dir: Path
    run_name: str  # output.dir's last folder
    project: str | None  # observe.project (None: the tracker's environment, else "accord")
    config: dict[str, Any]  # the resolved recipe, as recipe.yaml holds it
    resume_step: int  # 0 for a fresh run
    resume_id: str | None = None  # an earlier attempt's id for this tracker's run (trackers.json)


class Tracker:
    """One open tracker run. Every call comes from rank 0 only."""

    name = ""
    run_id: str | None = None  # kept in trackers.json; None: nothing to continue (TensorBoard)

    def log(self, scalars: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """The metrics logged so far are written (called after each logging interval)."""

    def finish(self, final: dict[str, float], status: str) -> None:
        """`final`: the run's final metrics; `status`: completed, preempted, stopped or failed."""
        raise NotImplementedError


def check_trackers(observe: ObserveConfig) -> list[str]:
    """The trackers' libraries are installed (each is an extra); one line per missing one."""
    problems = []
    for name in observe.report_to:
        kind = KINDS[name]
        missing = [p for p in kind.packages if importlib.util.find_spec(p) is None]
        if name == "mlflow" and not missing and _mlflow_needs_sqlalchemy():
            missing = [p for p in ("sqlalchemy", "alembic") if importlib.util.find_spec(p) is None]
        if missing:
            how = f"pip install 'accord[{kind.extra}]'" if kind.extra else f"pip install {' '.join(missing)}"
            problems.append(
                f"observe.report_to: {name} needs {', '.join(missing)}, which is not installed: {how} "
                f"(or drop {name} from observe.report_to)"
            )
    return problems


def _mlflow_needs_sqlalchemy() -> bool:
    """MLflow's SQL stores (the default here: sqlite under output.dir) need SQLAlchemy and Alembic."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    return not uri or uri.split(":", 1)[0].split("+", 1)[0] in ("sqlite", "postgresql", "mysql", "mssql")


def start_trackers(
    observe: ObserveConfig, out_dir: Path, config: dict[str, Any], resume_step: int = 0
) -> list[Tracker]:
    """Open observe.report_to's trackers, in order, for the run in `out_dir` whose resolved
    recipe (as recipe.yaml holds it) is `config`; the first that cannot start closes the ones
    already open and raises TrackerStartError (one line)."""
    # The folder holds trackers.json only from an earlier attempt of this run (a resume, a restarted
    # worker group, a rerun before any checkpoint): --overwrite sets an earlier run's aside.
    ids = _saved_ids(out_dir)
    context = TrackerStart(
        out_dir=out_dir,
        run_name=out_dir.resolve().name,
        project=observe.project,
        config=config,
        resume_step=resume_step,
    )
    settings = {name: _settings(name) for name in observe.report_to}  # the user's, before any default
    started: list[Tracker] = []
    for name in observe.report_to:
        try:
            module = importlib.import_module(KINDS[name].module)
            started.append(module.start(replace(context, resume_id=ids.get(name))))
        except Exception as e:  # each library raises its own kinds; all mean "this tracker cannot start"
            for tracker in started:
                tracker.finish({}, "failed")
            raise TrackerStartError(f"observe.report_to: {name} cannot start{settings[name]}: {_reason(e)}") from e
    ids |= {t.name: t.run_id for t in started if t.run_id}
    if ids:
        write_atomic(out_dir / RUN_IDS, json.dumps(ids, indent=1) + "\n")
    return started


def _saved_ids(out_dir: Path) -> dict[str, str]:
    """The tracker runs' ids an earlier attempt of this run kept; none when unreadable (a new run each)."""
    try:
        ids = json.loads((out_dir / RUN_IDS).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}


def _settings(name: str) -> str:
    """The tracker's environment variables that are set, as the user typed them."""
    given = [f"{v}={os.environ[v]}" for v in KINDS[name].env if os.environ.get(v)]
    return f" with {', '.join(given)}" if given else ""


def _reason(error: Exception) -> str:
    """A library's error in one line: its first sentence, at most 300 characters."""
    text = " ".join(str(error).split())
    first = text.split(". ", 1)[0]
    return f"{type(error).__name__}: {first if len(first) <= 300 else first[:299] + '…'}"


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The recipe as `section.key` -> text, for trackers whose parameters are flat strings."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat |= flat_params(value, f"{name}.")
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value)
    return flat
