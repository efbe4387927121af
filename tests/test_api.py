"""accord from Python: accord.train and accord.plan do what the commands do, and raise
AccordError subclasses where the commands print one-line errors."""

from __future__ import annotations

import copy
import json
import sys

import pytest

import accord
from accord.recipe.schema import RecipeError, validate_recipe
from conftest import REPO, TINY_RECIPE, accord_env, run_process

# A plain Python program (no `accord` command, its own sys.argv) that trains through the API
# with 2 workers; the result comes back as one JSON line.
TRAIN_FROM_PYTHON = """
import json, sys
import accord
from conftest import TINY_RECIPE

result = accord.train(TINY_RECIPE, {"train.max_steps": 3, "output.dir": sys.argv[1]}, processes=2)
summary = {"status": result.status, "output_dir": str(result.output_dir), "final": str(result.final)}
print("result: " + json.dumps(summary))
"""


@pytest.mark.distributed
def test_train_from_a_plain_python_program_writes_the_final_model(tmp_path):
    out = tmp_path / "run"
    proc = run_process(
        [sys.executable, "-c", TRAIN_FROM_PYTHON, str(out)], cwd=REPO / "tests", env=accord_env(), timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(
        next(line for line in proc.stdout.splitlines() if line.startswith("result: "))[len("result: ") :]
    )
    assert result == {"status": "completed", "output_dir": str(out), "final": str(out / "final")}
    assert (out / "final" / "config.json").is_file()
    assert "accord: batch " in proc.stderr  # the workers ran, 2 of them
    assert "2 processes" in proc.stderr


def test_a_bad_key_raises_a_recipe_error_with_the_close_key():
    with pytest.raises(RecipeError, match=r"unknown key batch.micro_batch_sise; did you mean batch.micro_batch_size\?"):
        accord.train(TINY_RECIPE, {"batch.micro_batch_sise": 4})
    assert issubclass(RecipeError, accord.UserInputError) and issubclass(RecipeError, accord.AccordError)


def test_problems_found_before_start_raise_one_user_input_error(tmp_path):
    with pytest.raises(accord.UserInputError, match=r"valid micro_batch_size values for 2 processes") as error:
        accord.train(TINY_RECIPE, ["batch.micro_batch_size=5", f"output.dir={tmp_path / 'o'}"])
    assert error.value.exit_code == 2
    assert not (tmp_path / "o").exists()


def test_overrides_as_a_mapping_or_as_command_line_text_are_the_same():
    from accord.api import load

    as_mapping = load(TINY_RECIPE, {"optim.lr": 1e-3, "engine.devices": None, "output.dir": "runs/x y"})
    as_text = load(TINY_RECIPE, ["optim.lr=1e-3", "engine.devices=null", "output.dir=runs/x y"])
    assert as_mapping == as_text and as_mapping.output.dir == "runs/x y" and as_mapping.optim.lr == 1e-3
    recipe = validate_recipe(TINY_RECIPE)
    assert load(recipe) is recipe
    assert load(recipe, {"train.max_steps": 3}).train.max_steps == 3
    assert TINY_RECIPE["train"]["max_steps"] == 10  # the caller's dict is left as it was


def test_a_recipe_file_is_read_with_its_overrides(tmp_path):
    from accord.api import load
    from conftest import write_recipe

    path = write_recipe(tmp_path / "r.yaml", TINY_RECIPE)
    assert load(path, {"seed": 3}).seed == 3
    with pytest.raises(RecipeError, match="recipe file not found"):
        load(tmp_path / "nope.yaml")


def test_plan_returns_a_row_per_strategy_and_advice():
    raw = copy.deepcopy(TINY_RECIPE)
    result = accord.plan(raw, gpus=2, gpu_memory="1GB")
    assert [row.strategy for row in result.rows] == ["ddp", "zero1", "zero2", "zero3", "fsdp"]
    assert result.world_size == 2 and result.advice.startswith("recommended: engine.strategy=ddp")
    assert all(row.total > 0 for row in result.rows)
    with pytest.raises(accord.UserInputError, match="expected a size such as 80GB"):
        accord.plan(raw, gpus=2, gpu_memory="1.2.3GB")
    with pytest.raises(accord.UserInputError, match="gpus and nodes must be at least 1"):
        accord.plan(raw, gpus=0)
    # The estimates live in accord.planner.estimate: a submodule named accord.plan would replace the
    # function on the package as soon as it was imported.
    assert callable(accord.plan) and accord.plan is accord.api.plan


@pytest.mark.subprocess
def test_importing_accord_stays_cheap():
    code = "import sys, accord; print(sorted(m for m in ('torch', 'pydantic', 'transformers') if m in sys.modules))"
    proc = run_process([sys.executable, "-c", code], env=accord_env(), timeout=60)
    assert proc.stdout.strip() == "[]", proc.stderr
