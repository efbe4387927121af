"""How the `accord` process ends: without the interpreter's teardown exactly when it trained
(its workers ended, or it trained as the worker), marked by the launch where that happens
rather than guessed from the modules the process imported."""

from types import SimpleNamespace

import pytest

from accord.cli import main as cli
from accord.launch import agent, ending
from accord.launch import worker as worker_module
from accord.launch.plan import Where
from accord.launch.planning import plan_launch
from accord.recipe.schema import validate_recipe
from conftest import TINY_RECIPE


@pytest.fixture
def exits(monkeypatch):
    """The codes the command left with, as ("teardown" | "now", code)."""
    seen = []

    def now(code):
        seen.append(("now", code))
        raise SystemExit(code)

    monkeypatch.setattr(ending, "_trained", False)
    monkeypatch.setattr(ending, "exit_now", now)
    monkeypatch.setattr(cli, "main", lambda: 3)
    return seen


def test_a_command_that_trained_nothing_exits_through_the_interpreter(exits):
    with pytest.raises(SystemExit) as left:
        cli.entry()
    assert left.value.code == 3 and exits == []


def test_a_process_that_trained_leaves_without_the_interpreters_teardown(exits):
    ending.trained()
    with pytest.raises(SystemExit):
        cli.entry()
    assert exits == [("now", 3)]


@pytest.mark.parametrize("how, marked", [("completed", True), ("before its group", False), ("after its group", True)])
def test_training_here_marks_the_end_unless_it_failed_before_joining_a_group(monkeypatch, tmp_path, exits, how, marked):
    recipe = validate_recipe(
        TINY_RECIPE | {"engine": TINY_RECIPE["engine"] | {"processes": 1}, "output": {"dir": str(tmp_path)}}
    )
    plan = plan_launch(recipe, Where())
    assert plan.trains_here

    def train_worker(recipe, batch):
        if how == "completed":
            return SimpleNamespace(status="completed")
        raise RuntimeError(how)

    monkeypatch.setattr(agent, "_set_worker_environment", lambda *_: None)
    monkeypatch.setattr(worker_module, "train_worker", train_worker)
    monkeypatch.setattr(agent.dist, "left_a_group", lambda: how == "after its group")
    if how == "completed":
        assert agent.run(plan) == "completed"
    else:
        with pytest.raises(RuntimeError):
            agent.run(plan)
    assert ending.skips_teardown() is marked
