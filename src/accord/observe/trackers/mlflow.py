"""MLflow: MLFLOW_TRACKING_URI when set, else a SQLite store in output.dir/mlflow.db (MLflow 3's
own default backend, kept in the run's folder); experiment observe.project, else
MLFLOW_EXPERIMENT_NAME, else `accord`. A resumed run continues its MLflow run when the store still
holds it; its parameters stay those it started with (MLflow's parameters cannot change)."""

from __future__ import annotations

import logging
import os
import time

from accord.observe.trackers import Tracker, TrackerStart, flat_params

# MLflow's limits (mlflow.utils.validation): a parameter's value, and what one log_batch call takes.
_MAX_PARAM_CHARS = 6000
_PARAMS_PER_CALL = 100
_METRICS_PER_CALL = 1000
# A preempted run is resumed later (it runs again then); stopped and failed runs are FAILED.
_STATUS = {"completed": "FINISHED", "preempted": "KILLED"}


class MLflow(Tracker):
    name = "mlflow"

    def __init__(self, context: TrackerStart):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        own_store = not uri
        if own_store:
            uri = f"sqlite:///{(context.out_dir / 'mlflow.db').resolve()}"
        # MLflow logs two INFO lines as it creates a new store's tables: the run's last line says where it is.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        self._client = MlflowClient(tracking_uri=uri)
        self.run_id = self._resumed(context.resume_id)
        if self.run_id is None:
            experiment = self._experiment(context, own_store)
            self.run_id = self._client.create_run(experiment, run_name=context.run_name).info.run_id
            known: dict[str, str] = {}
        else:
            known = self._client.get_run(self.run_id).data.params
        params = [Param(k, v[:_MAX_PARAM_CHARS]) for k, v in flat_params(context.config).items() if k not in known]
        for first in range(0, len(params), _PARAMS_PER_CALL):
            self._client.log_batch(self.run_id, params=params[first : first + _PARAMS_PER_CALL])
        self._pending: list = []

    def _experiment(self, context: TrackerStart, own_store: bool) -> str:
        name = context.project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "accord"
        found = self._client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        # In accord's own store, artifacts (none are logged today) would go beside it, not to ./mlruns.
        where = (context.out_dir / "mlartifacts").resolve().as_uri() if own_store else None
        return self._client.create_experiment(name, artifact_location=where)

    def _resumed(self, run_id: str | None) -> str | None:
        """The earlier attempt's run, running again; None when the store no longer has it."""
        from mlflow.exceptions import MlflowException

        if run_id is None:
            return None
        try:
            self._client.get_run(run_id)
        except MlflowException:
            return None
        self._client.update_run(run_id, status="RUNNING")
        return run_id

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending += [Metric(tag, float(value), now, step) for tag, value in scalars.items()]

    def flush(self) -> None:
        # One write per logging interval: each write to a SQL store is a transaction (slow on SQLite).
        if self._pending:
            pending, self._pending = self._pending, []
            for first in range(0, len(pending), _METRICS_PER_CALL):
                self._client.log_batch(self.run_id, metrics=pending[first : first + _METRICS_PER_CALL])

    def finish(self, final: dict[str, float], status: str) -> None:
        step = int(final.get("final/step", 0))
        self.log(final, step)
        self.flush()
        self._client.set_terminated(self.run_id, _STATUS.get(status, "FAILED"))


def start(context: TrackerStart) -> MLflow:
    return MLflow(context)
