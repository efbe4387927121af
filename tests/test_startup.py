"""Start-up: the workers start (and import torch and transformers) while the checks run, and
train only once the checks passed; when they fail, the workers leave quietly and the checks'
one line is what the user sees."""

import sys

import pytest

from conftest import TINY_RECIPE, accord_env, run_process, write_recipe

# Runs the launcher with checks that end only once both workers exist: the run can finish
# only if the workers started before the checks were done.
LAUNCHER = """
import os, sys, time
from pathlib import Path

from accord.errors import UserInputError
from accord.launch.agent import run
from accord.launch.plan import Where
from accord.launch.planning import plan_launch
from accord.recipe.schema import load_recipe


def workers():
    mine = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                if b"accord.launch.worker_start" in (entry / "cmdline").read_bytes():
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


plan = plan_launch(load_recipe(sys.argv[1]), Where())
try:
    print("status:", run(plan, checks=ChecksThatEndAfterTheWorkersStarted(sys.argv[2:])))
except UserInputError as e:
    print("refused:", e)
"""


def _launch(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml", TINY_RECIPE | {"train": {"max_steps": 2}, "output": {"dir": str(tmp_path / "out")}}
    )
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    return run_process([sys.executable, str(script), str(recipe)], env=accord_env(), timeout=300)


@pytest.mark.distributed
def test_workers_start_before_the_checks_end_and_train_once_they_pass(tmp_path):
    proc = _launch(tmp_path)
    assert "status: completed" in proc.stdout, proc.stderr[-3000:]
    assert proc.stderr.index("checks: both workers are running") < proc.stderr.index("accord: loading model")
    assert (tmp_path / "out" / "final" / "config.json").is_file()


@pytest.mark.distributed
def test_the_first_worker_checks_the_data_and_a_refusal_stops_the_run_quietly_writing_nothing(tmp_path):
    """The checks that need transformers and datasets run in local rank 0's worker, which
    imports them to train anyway: the launcher (which watches the workers for the whole run)
    never imports them, and bad data still ends the run with one line, exit 2, before the
    other worker passes its gate and before anything is written."""
    recipe = write_recipe(tmp_path / "r.yaml", TINY_RECIPE | {"output": {"dir": str(tmp_path / "out")}})
    # -X importtime: the launcher's own imports only (the agent starts the workers without it).
    command = [
        sys.executable,
        "-X",
        "importtime",
        "-m",
        "accord",
        "train",
        str(recipe),
        "data.generate.train_examples=8",
    ]
    proc = run_process(command, env=accord_env(), timeout=300)
    launcher_imports = {
        line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")
    }
    said = [line for line in proc.stderr.splitlines() if line.startswith("accord: ")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        said[-1] == "accord: error: only 3 training rows (8 examples packed into rows of 32 tokens) "
        "but batch.global_batch_size=32; lower the global batch or add data"
    )
    assert said.index("accord: starting 2 workers…") < said.index("accord: preparing data…")  # checked in a worker
    assert "Traceback" not in proc.stderr and "accord: loading model…" not in said, proc.stderr[-3000:]
    assert "torch" in launcher_imports and not launcher_imports & {
        "transformers",
        "datasets",
        "torch.distributed.checkpoint",
    }
    assert not (tmp_path / "out").exists()


@pytest.mark.subprocess
def test_a_worker_told_to_abort_leaves_at_once_without_a_word(tmp_path):
    from accord.launch.worker_start import ABORT, open_gate

    gate = tmp_path / "gate"
    open_gate(gate, ABORT)
    proc = run_process(
        [sys.executable, "-m", "accord.launch.worker_start", str(gate), str(tmp_path / "recipe.json")],
        env=accord_env(),
        timeout=120,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_a_held_out_split_or_a_rows_task_is_what_makes_the_run_read_datasets():
    from accord.data.prepare import reads_datasets
    from accord.recipe.schema import validate_recipe
    from accord.tasks import task_class

    def reads(**changes):
        recipe = validate_recipe(TINY_RECIPE | changes)
        return reads_datasets(recipe.data, task_class(recipe.task, recipe.model))

    no_held_out = {"generate": {"kind": "addition", "train_examples": 512, "eval_examples": 0}, "max_length": 32}
    assert reads()  # generated addition data keeps 32 held-out examples with their raw columns
    assert not reads(data=no_held_out)  # token shards only
    assert not reads(task="classify") and not reads(task="dpo")  # held-out pairs and labels are token shards too
    assert reads(
        data=no_held_out, task="grpo"
    )  # grpo keeps its rows as a datasets.Dataset (its rewards read raw columns)


@pytest.mark.subprocess
def test_a_worker_waiting_at_its_gate_imports_neither_datasets_nor_zero1s_optimizer_when_the_run_needs_neither(
    tmp_path,
):
    """What a worker imports before its gate opens is on the path to the first step: an sft
    run under ddp without held-out data reads only token shards, and ddp's AdamW is not
    ZeRO-1's ZeroRedundancyOptimizer (whose package compiles TorchScript at import)."""
    from accord.launch.plan import Where
    from accord.launch.planning import plan_launch
    from accord.recipe.schema import validate_recipe

    data = {"generate": {"kind": "addition", "train_examples": 512, "eval_examples": 0}, "max_length": 32}
    recipe = validate_recipe(TINY_RECIPE | {"data": data, "output": {"dir": str(tmp_path / "out")}})
    plan = tmp_path / "plan.json"  # what the launcher hands its workers (worker_start reads it so)
    plan.write_text(plan_launch(recipe, Where()).to_json())
    script = (
        "import sys; from accord.launch import worker, worker_start; "
        "from accord.launch.plan import read_plan; "
        "worker_start._import_what_the_run_builds(read_plan(sys.argv[1]).recipe); "
        "print(sorted(m for m in ('datasets', 'torch.distributed.optim', 'accord.engine.ddp', 'accord.tasks.sft') "
        "if m in sys.modules))"
    )
    proc = run_process([sys.executable, "-c", script, str(plan)], env=accord_env(), timeout=300)
    assert proc.stdout.split("\n")[-2] == "['accord.engine.ddp', 'accord.tasks.sft']", proc.stderr[-3000:]


# Counts each process's tokenizer builds (the first link of the tokenizer -> task -> data ->
# rows chain) into $ACCORD_TEST_BUILDS, one pid a line: imported at every Python start of the
# run (launcher and workers) through PYTHONPATH, it wraps accord.models.build.build_tokenizer
# as that module is first imported, before any caller takes the name.
COUNTING_SITECUSTOMIZE = """
import importlib.abc, importlib.util, os, sys


class _WrapBuild(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "accord.models.build":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            build = module.build_tokenizer

            def counted(*args, **kwargs):
                with open(os.environ["ACCORD_TEST_BUILDS"], "a") as log:
                    log.write(f"{os.getpid()}\\n")
                return build(*args, **kwargs)

            module.build_tokenizer = counted

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _WrapBuild())
"""


@pytest.mark.distributed
def test_the_checks_and_the_run_share_one_tokenizer_task_and_data_build_per_process(tmp_path):
    """The node's first worker checks the data and then trains: it builds the chain once, as
    the other worker does; the launcher builds none."""
    import os
    from collections import Counter

    from conftest import assert_ok, run_accord

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(COUNTING_SITECUSTOMIZE)
    log = tmp_path / "builds.txt"
    recipe = write_recipe(
        tmp_path / "r.yaml", TINY_RECIPE | {"train": {"max_steps": 1}, "output": {"dir": str(tmp_path / "out")}}
    )
    path = os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = run_accord("train", recipe, env_extra={"PYTHONPATH": path, "ACCORD_TEST_BUILDS": str(log)})
    assert_ok(proc)
    builds = Counter(log.read_text().split())
    assert sorted(builds.values()) == [1, 1], builds  # two workers, once each
