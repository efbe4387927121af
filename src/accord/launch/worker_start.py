"""How a worker that accord's launcher started begins: it imports the training code (torch,
transformers: seconds) while the checks of the recipe and the data still run, then waits
for their verdict in a gate file — `go`, or `abort` when the checks failed.

    python -m accord.launch.worker_start GATE PLAN.json [REPORT]

PLAN.json is the launcher's LaunchPlan (accord.launch.plan): the resolved recipe and its batch
plan, read once here and not derived again.

With REPORT, the checks are the workers' own: local rank 0 runs them (accord.launch.plan.run_checks)
once it has imported what they need — the same libraries training needs, so they are
imported once, not again in the launcher — and writes their outcome to REPORT; the
launcher reads it (WorkerChecks), takes the output folder and writes the verdict.

On `abort` the worker leaves at once (mid-import if need be), quietly and with exit code 0,
so the agent neither reports nor restarts it: the launcher prints the checks' one-line
error. Nothing before the gate opens touches the output folder; only the checks write the
data cache.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accord.launch.plan import LaunchPlan
    from accord.recipe.schema import Recipe

from accord.atomic import write_atomic
from accord.errors import RunStopped
from accord.recipe.hub import local_path
from accord.registry import STRATEGIES

GO, ABORT = "go", "abort"
_POLL_S = 0.01  # a stat per poll: the wait costs nothing, and "go" is seen within 10 ms


def open_gate(gate: str | os.PathLike, verdict: str) -> None:
    """The launcher's side: write `go` or `abort` in one step (a worker never reads half)."""
    write_atomic(gate, verdict)


class _Watcher(threading.Thread):
    """Reads the gate beside the import, so an `abort` ends the process without waiting for
    the import to finish; ends itself once the gate says `go`."""

    def __init__(self, gate: Path) -> None:
        super().__init__(name="accord-gate", daemon=True)
        self.gate, self.opened = gate, threading.Event()
        self.parent = os.getppid()

    def run(self) -> None:
        while True:
            try:
                verdict = self.gate.read_text()
            except FileNotFoundError:  # not written yet
                verdict = None
            if verdict == GO:
                self.opened.set()
                return
            if verdict == ABORT:
                os._exit(0)
            if os.getppid() != self.parent:  # the launcher died: nobody will ever open the gate
                os._exit(1)
            time.sleep(_POLL_S)


def main(argv: list[str] | None = None) -> int:
    gate, plan_path, *report = sys.argv[1:] if argv is None else argv
    watcher = _Watcher(Path(gate))
    watcher.start()
    # After the watcher started: what these import (torch) takes seconds, and an `abort` may come first.
    from accord.distributed import rank_env
    from accord.launch.plan import read_plan

    plan = None
    # Once: a restarted worker group finds the report of the checks that let the first one through.
    if report and not os.path.exists(report[0]) and rank_env.env_info().leads_node:
        plan = read_plan(plan_path)
        _check_and_report(plan, report[0])  # before the rest: bad input is found sooner
    from accord.launch import worker  # the slow part, overlapping the checks

    if plan is None:
        # Read only now: a worker told to abort at once never looks at the plan.
        plan = read_plan(plan_path)
    if not watcher.opened.is_set():
        _import_what_the_run_builds(plan.recipe)
    # The imported libraries' objects (hundreds of thousands) live as long as the process: kept
    # out of the collector's full scans from here on (each scan over them takes seconds on a
    # loaded machine).
    gc.freeze()
    watcher.opened.wait()
    watcher.join()
    return worker.run_worker(plan.recipe, plan.batch)


def _check_and_report(plan: LaunchPlan, report: str) -> None:
    """Run the launcher's checks here, in the node's first worker (before the process group
    exists: the environment says this is global rank 0's node), and leave their outcome (the
    problems, or what they raised) in `report` for the launcher."""
    from accord.launch.fork_call import packed_outcome
    from accord.launch.plan import run_checks

    payload = packed_outcome(run_checks, plan, keep_for_run=True, where="local rank 0's checks")
    write_atomic(report, payload)  # the launcher never reads half


class WorkerChecks:
    """The launcher's side of checks run by local rank 0's worker (a PendingChecks): `result()`
    waits for its report, then, when it found nothing, returns `then()`'s problems — the
    launcher taking the output folder, before the gate opens. `report` is set by the launcher
    to a file in the run's private folder before the workers start."""

    def __init__(self, then: Callable[[], list[str]]) -> None:
        self.then, self.report = then, None
        self._cancelled = threading.Event()

    def result(self) -> list[str]:
        from accord.launch.fork_call import unpack_outcome

        assert self.report is not None, "the launcher sets the report's path before the workers start"
        while not os.path.exists(self.report):
            if self._cancelled.wait(_POLL_S):
                raise RunStopped("the workers stopped before their checks were done")
        # A pickle, read from the run's private folder (mode 0700: only this user writes there).
        return unpack_outcome(Path(self.report).read_bytes()) or self.then()

    def cancel(self) -> None:
        self._cancelled.set()


def _import_what_the_run_builds(recipe: Recipe) -> None:
    """Import the recipe's task, model class and strategy, and datasets where the prepared
    data is read with it, while the checks run (each another second or more on a loaded
    machine). Best effort: the run itself reports what fails."""
    try:
        from transformers.models.auto.configuration_auto import model_type_to_module_name

        from accord.data.prepare import reads_datasets
        from accord.tasks import task_class

        if reads_datasets(recipe.data, task_class(recipe.task, recipe.model)):
            import datasets  # noqa: F401 - pandas & co.: imported once the run loads the data anyway
        model = recipe.model
        if model.config:
            model_type = model.config["architecture"]
        else:
            config = local_path(model.path, model.revision) / "config.json"
            model_type = json.loads(config.read_text(encoding="utf-8"))["model_type"]
        name = model_type_to_module_name(model_type)
        importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        strategy_module = STRATEGIES[recipe.engine.strategy].factory.split(":")[0]
        if "deepspeed" not in strategy_module:  # DeepSpeed picks its accelerator at import: left to build_engine
            importlib.import_module(strategy_module)
    except Exception:  # noqa: BLE001 - a GGUF file, pkg: paths, remote code: imported when built
        pass


if __name__ == "__main__":
    code = main()
    from accord.distributed import group as dist

    dist.exit_after_shutdown(code)  # this process is only a worker: no interpreter teardown
