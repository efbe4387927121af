"""The launcher's checks run in a forked child: results and errors come back, memory does not."""

from __future__ import annotations

import os
import sys

import pytest

from accord.launch.fork_call import call_in_fork
from accord.recipe.schema import RecipeError

pytestmark = pytest.mark.subprocess  # each test forks a child


def _load_a_module_and_answer(folder: str, name: str) -> tuple[int, bool]:
    sys.path.insert(0, folder)
    __import__(name)
    return os.getpid(), name in sys.modules


def test_the_result_comes_back_and_the_imports_stay_in_the_child(tmp_path):
    # A module of this test's own: no other test in this process can have imported it.
    name = f"fork_probe_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text("LOADED = True\n")
    pid, imported = call_in_fork(_load_a_module_and_answer, str(tmp_path), name)
    assert imported and pid != os.getpid()
    assert name not in sys.modules and str(tmp_path) not in sys.path


def _refuse(message: str) -> None:
    raise RecipeError(message)


def test_an_error_in_the_child_is_raised_here_with_its_message():
    with pytest.raises(RecipeError, match="batch.global_batch_size: must be positive"):
        call_in_fork(_refuse, "batch.global_batch_size: must be positive")


def _die() -> None:
    os._exit(9)


def test_a_child_that_dies_is_reported_as_one_line():
    with pytest.raises(RuntimeError, match=r"checks before start died \(exit code 9\)"):
        call_in_fork(_die)


def _killed() -> None:
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def test_a_child_killed_by_a_signal_is_reported_with_the_signal():
    with pytest.raises(RuntimeError, match=r"checks before start died \(signal 9\)"):
        call_in_fork(_killed)
