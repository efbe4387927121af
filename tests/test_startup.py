"""Start-up: the workers start (and import torch and transformers) while the launcher's checks
run, and train only once the checks passed; when they fail, the workers leave quietly and the
checks' one line is what the user sees."""

import sys

import pytest

from conftest import TINY_RECIPE, accord_env, run_process, write_recipe

# Runs the launcher with checks that end only once both workers exist: the run can finish
# only if the workers started before the checks were done.
LAUNCHER = """
import os, sys, time
from pathlib import Path

from accord.errors import UserInputError
from accord.launch import run
from accord.recipe import load_recipe


def workers():
    mine = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                if b"accord.worker_start" in (entry / "cmdline").read_bytes():
                    mine.append(entry.name)
        except (OSError, IndexError):
            pass
    return mine


class ChecksThatEndAfterTheWorkersStarted:
    def __init__(self, problems):
        self.problems = problems

    def result(self):
        deadline = time.time() + 120
        while len(workers()) < 2:
            if time.time() > deadline:
                return ["the workers never started while the checks ran"]
            time.sleep(0.05)
        print("checks: both workers are running", file=sys.stderr, flush=True)
        return self.problems

    def cancel(self):
        pass


recipe = load_recipe(sys.argv[1])
try:
    print("status:", run(recipe, checks=ChecksThatEndAfterTheWorkersStarted(sys.argv[2:])))
except UserInputError as e:
    print("refused:", e)
"""


def _launch(tmp_path, *problems):
    recipe = write_recipe(tmp_path / "r.yaml", TINY_RECIPE | {"train": {"max_steps": 2}, "output": {"dir": str(tmp_path / "out")}})
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    return run_process([sys.executable, str(script), str(recipe), *problems], env=accord_env(), timeout=300)


@pytest.mark.distributed
def test_workers_start_before_the_checks_end_and_train_once_they_pass(tmp_path):
    proc = _launch(tmp_path)
    assert "status: completed" in proc.stdout, proc.stderr[-3000:]
    assert proc.stderr.index("checks: both workers are running") < proc.stderr.index("accord: loading model")
    assert (tmp_path / "out" / "final" / "config.json").is_file()


@pytest.mark.distributed
def test_failed_checks_stop_the_waiting_workers_quietly_and_write_nothing(tmp_path):
    proc = _launch(tmp_path, "data.train: row 2 is bad")
    assert "refused: data.train: row 2 is bad" in proc.stdout, proc.stderr[-3000:]
    assert "checks: both workers are running" in proc.stderr
    assert "Traceback" not in proc.stderr and "accord: loading model" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_a_worker_told_to_abort_leaves_at_once_without_a_word(tmp_path):
    from accord.worker_start import ABORT, open_gate

    gate = tmp_path / "gate"
    open_gate(gate, ABORT)
    proc = run_process([sys.executable, "-m", "accord.worker_start", str(gate), str(tmp_path / "recipe.json")], env=accord_env(), timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
