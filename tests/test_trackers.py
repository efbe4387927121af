"""observe.report_to: TensorBoard, MLflow, W&B and Trackio each record what metrics.jsonl records,
read back by each library's own reader (MLflow's client on the local SQLite store, W&B's
`wandb leet inspect` on the offline run, Trackio's CLI on its local database, TensorBoard's
EventAccumulator); only rank 0 logs; a tracker that cannot start is one line before training."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_RECIPE, assert_ok, run_accord, write_recipe

ALL = ["tensorboard", "mlflow", "wandb", "trackio"]
# The trackers' own variables: the run must take accord's defaults (everything under output.dir).
TRACKER_ENV = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_NAME",
    "WANDB_MODE",
    "WANDB_DIR",
    "WANDB_PROJECT",
    "WANDB_NAME",
    "TRACKIO_DIR",
    "TRACKIO_SPACE_ID",
    "TRACKIO_SERVER_URL",
)


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """One 2-process run with all four trackers: 6 steps, a record every 2, evaluations at 3 and 6."""
    folder = tmp_path_factory.mktemp("trackers")
    recipe = write_recipe(folder / "tiny.yaml", TINY_RECIPE)
    out = folder / "run"
    with pytest.MonkeyPatch.context() as env:
        for name in TRACKER_ENV:
            env.delenv(name, raising=False)
        proc = run_accord(
            "train",
            recipe,
            "train.max_steps=6",
            "train.log_every=2",
            "train.eval_every=3",
            f"observe.report_to=[{','.join(ALL)}]",
            f"output.dir={out}",
        )
    assert_ok(proc)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
    assert list(losses) == [1, 2, 3, 4, 5, 6]
    return out, proc, losses


def _tool(name: str) -> str:
    """A console script of the venv running the tests."""
    return str(Path(sys.executable).with_name(name))


@pytest.fixture(scope="module")
def read_back(tracked_run) -> dict:
    """What each tracker holds, through its library's own reader: the command-line readers (W&B's
    `wandb leet inspect` on the offline run, Trackio's CLI on its database) run side by side."""
    out, _, _ = tracked_run
    (wandb_run,) = (out / "wandb").glob("offline-run-*")
    inspect = [_tool("wandb"), "leet", "inspect", "--json", str(wandb_run)]
    trackio = [_tool("trackio"), "--project", "accord", "--run", "run", "--json"]
    commands = {
        "wandb records": inspect,
        "wandb summary": [*inspect, "--summary"],
        "trackio loss": [*trackio[:1], "get", "metric", *trackio[1:], "--metric", "train/loss"],
        "trackio step 6": [*trackio[:1], "get", "snapshot", *trackio[1:], "--step", "6"],
        "trackio run": [*trackio[:1], "get", "run", *trackio[1:]],
        "trackio runs": [_tool("trackio"), "list", "runs", "--project", "accord", "--json"],
    }
    env = dict(os.environ, TRACKIO_DIR=str(out / "trackio"))
    started = {
        name: subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for name, command in commands.items()
    }
    found = {}
    for name, proc in started.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{commands[name]}: {stderr}"
        lines = stdout.splitlines()
        found[name] = [json.loads(line) for line in lines] if name == "wandb records" else json.loads(stdout)

    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    found["mlflow runs"] = client.search_runs([client.get_experiment_by_name("accord").experiment_id])
    run_id = found["mlflow runs"][0].info.run_id
    found["mlflow"] = {tag: client.get_metric_history(run_id, tag) for tag in found["mlflow runs"][0].data.metrics}
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    found["tensorboard"] = {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}
    return found


def _series(out: Path) -> dict[str, dict[int, float]]:
    """Every scalar metrics.jsonl records, as the trackers are given it: `kind/name` -> {step: value}."""
    series: dict[str, dict[int, float]] = {}
    for record in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()):
        for key, value in record.items():
            if key not in ("kind", "step", "time") and isinstance(value, (int, float)):
                # A flag (train/skipped) is a 0/1 scalar.
                series.setdefault(f"{record['kind']}/{key}", {})[record["step"]] = (
                    float(value) if isinstance(value, bool) else value
                )
    return series


@pytest.mark.distributed
def test_every_tracker_records_the_scalars_of_metrics_jsonl_at_their_steps(tracked_run, read_back):
    out, proc, losses = tracked_run
    assert proc.stdout == ""  # the trackers' own messages go to stderr, if anywhere
    series = _series(out)
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens", "eval/loss"} <= set(series)
    # TensorBoard keeps float32; MLflow and W&B every value as logged.
    tensorboard = {tag: {e.step: e.value for e in events} for tag, events in read_back["tensorboard"].items()}
    assert tensorboard == {tag: pytest.approx(values, rel=1e-6) for tag, values in series.items()}
    mlflow = {tag: {m.step: m.value for m in history} for tag, history in read_back["mlflow"].items()}
    assert {tag: mlflow[tag] for tag in series} == series
    history = [r["history"]["item"] for r in read_back["wandb records"] if r["type"] == "history"]
    wandb = {tag: {h["_step"]: h[tag] for h in history if tag in h} for tag in series}
    assert wandb == series
    assert set(series) <= set(read_back["trackio run"]["metrics"])
    assert {v["step"]: v["value"] for v in read_back["trackio loss"]["values"]} == losses


@pytest.mark.distributed
def test_only_rank_0_logs_one_run_per_tracker_named_after_the_output_folder(tracked_run, read_back):
    out, _, _ = tracked_run
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    (run,) = read_back["mlflow runs"]
    assert (run.info.run_name, run.info.status) == ("run", "FINISHED")
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1
    summary = read_back["wandb summary"]
    assert (summary["name"], summary["project"], summary["state"]) == ("run", "accord", "finished")
    assert read_back["trackio runs"]["runs"] == ["run"]


@pytest.mark.distributed
def test_trackers_record_the_resolved_recipe_and_the_final_metrics(tracked_run, read_back):
    out, _, losses = tracked_run
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    final = {"final/train/loss": losses[6], "final/eval/loss": evals[-1]["loss"], "final/step": 6}

    (run,) = read_back["mlflow runs"]
    assert run.data.params["optim.lr"] == "0.003" and run.data.params["observe.report_to"] == json.dumps(ALL)
    assert run.data.params["model.config.hidden_size"] == "32"
    assert {k: run.data.metrics[k] for k in final} == final

    summary = read_back["wandb summary"]
    assert summary["config"]["optim"]["lr"] == 0.003 and summary["config"]["train"]["max_steps"] == 6
    assert {k: summary["summary"][k] for k in final} == final

    config = read_back["trackio run"]["config"]
    assert config["optim"]["lr"] == 0.003 and config["model"]["config"]["hidden_size"] == 32
    at_end = read_back["trackio step 6"]["metrics"]
    assert {k: at_end[k][-1]["value"] for k in final} == final


# ------------------------------------------------------------------ what MetricsWriter gives a tracker


class _Recorder:
    """A tracker that keeps what it is given; `fail_at`: the step whose log raises."""

    name = "recorder"
    run_id = None

    def __init__(self, fail_at: int | None = None):
        self.fail_at, self.logged, self.flushes, self.finished = fail_at, [], 0, None

    def log(self, scalars, step):
        if step == self.fail_at:
            raise OSError("No space left on device")
        self.logged.append((step, scalars))

    def flush(self):
        self.flushes += 1

    def finish(self, final, status):
        self.finished = (final, status)


def test_trackers_get_finite_scalars_tagged_by_kind_and_the_final_metrics_with_the_status(tmp_path):
    from accord.observe.metrics import MetricsWriter

    tracker = _Recorder()
    writer = MetricsWriter(tmp_path, trackers=[tracker])
    writer.write({"kind": "train", "step": 1, "loss": 2.5, "lr": 0.1, "skipped": False, "time": 1.0})
    writer.write({"kind": "train", "step": 2, "loss": float("nan"), "lr": 0.2, "path": "x"})
    writer.flush()
    writer.write({"kind": "eval", "step": 2, "loss": 2.0, "accuracy": 0.5})
    writer.close("preempted")
    assert tracker.logged == [
        (1, {"train/loss": 2.5, "train/lr": 0.1, "train/skipped": False}),  # no wall-clock time, no text
        (2, {"train/lr": 0.2}),  # a skipped step's non-finite loss is left out
        (2, {"eval/loss": 2.0, "eval/accuracy": 0.5}),
    ]
    assert tracker.flushes == 1
    final = {"final/train/loss": 2.5, "final/eval/loss": 2.0, "final/eval/accuracy": 0.5, "final/step": 2}
    assert tracker.finished == (final, "preempted")


def test_a_tracker_failing_mid_run_is_dropped_with_one_warning_and_the_run_goes_on(tmp_path, capsys):
    from accord.observe.metrics import MetricsWriter, read_metrics

    failing, other = _Recorder(fail_at=2), _Recorder()
    writer = MetricsWriter(tmp_path, trackers=[failing, other])
    for step in (1, 2, 3):
        writer.write({"kind": "train", "step": step, "loss": 1.0})
    writer.close()
    assert [step for step, _ in failing.logged] == [1] and failing.finished is None
    assert [step for step, _ in other.logged] == [1, 2, 3] and other.finished[1] == "completed"
    assert capsys.readouterr().err.splitlines() == [
        "accord: warning: recorder stopped recording at step 2: OSError: No space left on device "
        "(metrics.jsonl holds every record)"
    ]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


@pytest.mark.slow  # MLflow's import and a new store: ~5 s in one process
def test_mlflow_takes_a_large_recipe_and_a_long_logging_interval_within_its_batch_limits(tmp_path, monkeypatch):
    """MLflow takes at most 100 parameters and 1,000 metrics a call: a recipe of 250 keys and
    an interval of 3,000 points arrive whole."""
    from mlflow import MlflowClient

    from accord.observe.trackers import TrackerStart
    from accord.observe.trackers import mlflow as tracker

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    config = {"section": {f"key{i}": i for i in range(250)}}
    run = tracker.start(TrackerStart(tmp_path, "run", None, config, 0))
    for step in range(1, 1001):
        run.log({"train/loss": 1.0 / step, "train/lr": 0.1, "train/grad_norm": 2.0}, step)
    run.flush()
    run.finish({"final/step": 1000}, "completed")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    logged = client.get_run(run.run_id)
    assert len(logged.data.params) == 250 and logged.data.params["section.key249"] == "249"
    assert len(client.get_metric_history(run.run_id, "train/loss")) == 1000
    assert logged.info.status == "FINISHED"


# ------------------------------------------------------------------ refused before any work


@pytest.fixture
def without(monkeypatch):
    def hide(package: str) -> None:
        real = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a, **k: None if name == package else real(name, *a, **k)
        )

    return hide


@pytest.mark.parametrize(
    "tracker, package", [("mlflow", "mlflow"), ("mlflow", "sqlalchemy"), ("wandb", "wandb"), ("trackio", "trackio")]
)
def test_a_tracker_without_its_library_names_its_extra(without, monkeypatch, tracker, package):
    from accord.launch.preflight import check_environment
    from accord.recipe.schema import validate_recipe

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    without(package)
    assert check_environment(validate_recipe(TINY_RECIPE)) == []  # TensorBoard only: nothing to install
    assert check_environment(validate_recipe(TINY_RECIPE | {"observe": {"report_to": ["tensorboard", tracker]}})) == [
        f"observe.report_to: {tracker} needs {package}, which is not installed: pip install 'accord[{tracker}]' "
        f"(or drop {tracker} from observe.report_to)"
    ]


@pytest.mark.parametrize(
    "value, trackers",
    [("none", []), ([], []), ("mlflow", ["mlflow"]), (["wandb", "tensorboard", "wandb"], ["wandb", "tensorboard"])],
)
def test_report_to_takes_a_list_one_name_or_none(value, trackers):
    from accord.recipe.schema import validate_recipe

    assert validate_recipe(TINY_RECIPE | {"observe": {"report_to": value}}).observe.report_to == trackers


def test_report_to_defaults_to_tensorboard_alone():
    from accord.recipe.schema import validate_recipe

    assert validate_recipe(TINY_RECIPE).observe.report_to == ["tensorboard"]


def test_an_unknown_tracker_is_named_with_the_closest_one():
    from accord.recipe.schema import RecipeError, validate_recipe

    with pytest.raises(RecipeError, match=r"observe.report_to: unknown tracker 'mlfow'; did you mean mlflow\?"):
        validate_recipe(TINY_RECIPE | {"observe": {"report_to": ["mlfow"]}})


def test_an_mlflow_store_that_cannot_open_is_one_line_naming_the_uri(tmp_path, monkeypatch):
    from accord.observe.trackers import TrackerStartError, start_trackers
    from accord.recipe.schema import validate_recipe

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://nowhere")
    recipe = validate_recipe(TINY_RECIPE | {"observe": {"report_to": ["tensorboard", "mlflow"]}})
    with pytest.raises(TrackerStartError) as refused:
        start_trackers(recipe.observe, tmp_path / "run", recipe.model_dump(mode="json"))
    message = str(refused.value)
    assert message.startswith("observe.report_to: mlflow cannot start with MLFLOW_TRACKING_URI=bogus://nowhere: ")
    assert "\n" not in message and "'bogus://nowhere'" in message


# ------------------------------------------------------------------ resume


@pytest.mark.slow  # two runs; the default tier has the one run above
@pytest.mark.distributed
def test_a_resumed_run_continues_each_trackers_run(tmp_path, monkeypatch):
    """Run 4 steps, then resume to 6: MLflow, W&B and Trackio continue the run whose id the
    first attempt kept in trackers.json; each holds the loss of steps 1-6 once."""
    for name in TRACKER_ENV:
        monkeypatch.delenv(name, raising=False)
    recipe = write_recipe(tmp_path / "tiny.yaml", TINY_RECIPE)
    out = tmp_path / "run"
    common = ["train", recipe, "train.log_every=2", f"observe.report_to=[{','.join(ALL)}]", f"output.dir={out}"]
    assert_ok(run_accord(*common, "train.max_steps=4"))
    ids = json.loads((out / "trackers.json").read_text())
    assert set(ids) == {"mlflow", "wandb", "trackio"}
    assert_ok(run_accord(*common, "train.max_steps=6", "resume=auto"))
    assert json.loads((out / "trackers.json").read_text()) == ids
    losses = {
        r["step"]: r["loss"]
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "train"
    }
    assert list(losses) == [1, 2, 3, 4, 5, 6]

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("accord").experiment_id])
    assert (run.info.run_id, run.info.status) == (ids["mlflow"], "FINISHED")
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")} == losses
    assert run.data.metrics["final/step"] == 6

    # Offline, each attempt is a folder of the same run id; `wandb sync` uploads them into one run.
    attempts = sorted((out / "wandb").glob("offline-run-*"))
    assert [a.name.rsplit("-", 1)[1] for a in attempts] == [ids["wandb"]] * 2

    env = dict(os.environ, TRACKIO_DIR=str(out / "trackio"))
    trackio = [_tool("trackio"), "get", "metric", "--project", "accord", "--run", "run", "--json"]
    read = subprocess.run([*trackio, "--metric", "train/loss"], capture_output=True, text=True, env=env, check=True)
    assert {v["step"]: v["value"] for v in json.loads(read.stdout)["values"]} == losses
