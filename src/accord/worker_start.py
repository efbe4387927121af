"""How a worker that accord's launcher started begins: it imports the training code (torch,
transformers: seconds) while the launcher's checks of the recipe and the data still run,
then waits for their verdict in a gate file — `go`, or `abort` when the checks failed.

    python -m accord.worker_start GATE RECIPE.json

On `abort` the worker leaves at once (mid-import if need be), quietly and with exit code 0,
so the agent neither reports nor restarts it: the launcher prints the checks' one-line
error. Nothing before the gate opens touches the output folder or the data cache.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

GO, ABORT = "go", "abort"
_POLL_S = 0.01  # a stat per poll: the wait costs nothing, and "go" is seen within 10 ms


def open_gate(gate: str | os.PathLike, verdict: str) -> None:
    """The launcher's side: write `go` or `abort` in one step (a worker never reads half)."""
    path = Path(gate)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(verdict)
    os.replace(partial, path)


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
    gate, recipe_path = sys.argv[1:] if argv is None else argv
    watcher = _Watcher(Path(gate))
    watcher.start()
    from accord import worker  # the slow part, overlapping the launcher's checks

    if not watcher.opened.is_set():
        _import_what_the_run_builds(recipe_path)
    watcher.opened.wait()
    watcher.join()
    return worker.main([recipe_path])


def _import_what_the_run_builds(recipe_path: str) -> None:
    """Import the recipe's model class and strategy while the checks run (each another
    second or more on a loaded machine). Best effort: the run itself reports what fails."""
    import importlib
    import json

    try:
        from transformers.models.auto.configuration_auto import model_type_to_module_name

        from accord.registry import STRATEGIES

        recipe = json.loads(Path(recipe_path).read_text(encoding="utf-8"))
        model, engine = recipe["model"], recipe["engine"]
        if model.get("config"):
            model_type = model["config"]["architecture"]
        else:
            model_type = json.loads((Path(model["path"]) / "config.json").read_text(encoding="utf-8"))["model_type"]
        name = model_type_to_module_name(model_type)
        importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        strategy_module = STRATEGIES[engine["strategy"]].split(":")[0]
        if "deepspeed" not in strategy_module:  # DeepSpeed picks its accelerator at import: left to build_engine
            importlib.import_module(strategy_module)
    except Exception:  # noqa: BLE001 - a GGUF file, pkg: paths, remote code: imported when built
        pass


if __name__ == "__main__":
    code = main()
    from accord import dist

    dist.exit_after_shutdown(code)  # this process is only a worker: no interpreter teardown
