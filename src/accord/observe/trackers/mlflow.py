"""MLflow: MLFLOW_TRACKING_URI when set, else a SQLite store in output.dir/mlflow.db (MLflow 3's
own default backend, kept in the run's folder); experiment observe.project, else
MLFLOW_EXPERIMENT_NAME, else `accord`."""

from __future__ import annotations

import os
import time

from accord.observe.trackers import Tracker, TrackerStart, flat_params

# MLflow refuses longer parameter values (mlflow.utils.validation's limit).
_MAX_PARAM_CHARS = 6000
_STATUS = {"completed": "FINISHED", "preempted": "KILLED"}  # anything else: FAILED


class MLflow(Tracker):
    name = "mlflow"

    def __init__(self, context: TrackerStart):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        own_store = not uri
        if own_store:
            uri = f"sqlite:///{(context.out_dir / 'mlflow.db').resolve()}"
        self._client = MlflowClient(tracking_uri=uri)
        name = context.project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "accord"
        found = self._client.get_experiment_by_name(name)
        if found is not None:
            experiment = found.experiment_id
        else:
            # In accord's own store, artifacts (none are logged today) would go beside it, not to ./mlruns.
            where = (context.out_dir / "mlartifacts").resolve().as_uri() if own_store else None
            experiment = self._client.create_experiment(name, artifact_location=where)
        self.run_id = self._client.create_run(experiment, run_name=context.run_name).info.run_id
        params = [Param(k, v[:_MAX_PARAM_CHARS]) for k, v in flat_params(context.config).items()]
        self._client.log_batch(self.run_id, params=params)
        self._pending: list = []

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending += [Metric(tag, float(value), now, step) for tag, value in scalars.items()]

    def flush(self) -> None:
        # One write per logging interval: each write to a SQL store is a transaction (~25 ms on SQLite).
        if self._pending:
            pending, self._pending = self._pending, []
            self._client.log_batch(self.run_id, metrics=pending)

    def finish(self, final: dict[str, float], status: str) -> None:
        step = int(final.get("final/step", 0))
        self.log(final, step)
        self.flush()
        self._client.set_terminated(self.run_id, _STATUS.get(status, "FAILED"))


def start(context: TrackerStart) -> MLflow:
    return MLflow(context)
