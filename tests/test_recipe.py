from pathlib import Path

import pytest

from accord.recipe.schema import Recipe, RecipeError, apply_override, load_recipe, validate_recipe
from conftest import REPO, TINY_RECIPE, write_recipe

SHIPPED = sorted((REPO / "recipes").glob("*.yaml"))


def test_recipes_are_shipped():
    assert any(p.name == "quickstart.yaml" for p in SHIPPED)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_recipe_loads_and_validates(path: Path):
    from accord.distributed.batch_plan import BatchPlan

    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe)
    # The batch must also split over the processes the recipe asks for.
    BatchPlan.derive(recipe.batch.global_batch_size, recipe.batch.micro_batch_size, recipe.engine.processes)


def test_a_shipped_recipe_missing_its_starting_run_names_the_recipe_to_train_first(monkeypatch, tmp_path):
    """grpo-addition starts from addition-sft's final/: without it, the one line says which
    shipped recipe writes that folder (found by its output.dir), not only the folder."""
    import shutil

    from accord.launch.preflight import check_model_source

    shutil.copytree(REPO / "recipes", tmp_path / "recipes")  # a fresh checkout: no runs/ yet
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(REPO / "recipes" / "grpo-addition.yaml")
    assert recipe.model.path == f"{load_recipe(REPO / 'recipes' / 'addition-sft.yaml').output.dir}/final"
    (line,) = check_model_source(recipe.model)
    assert line == (
        f"model.path: folder not found: {recipe.model.path} "
        "(the final model of recipes/addition-sft.yaml: run `accord train recipes/addition-sft.yaml` first)"
    )
    (line,) = check_model_source(
        load_recipe(REPO / "recipes" / "grpo-addition.yaml", ["model.path=runs/no-such-run/final"]).model
    )
    assert line.endswith(
        "(the final model of an accord run: train the recipe whose output.dir is runs/no-such-run first)"
    )


def test_overrides_take_precedence_over_the_file(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", TINY_RECIPE)
    recipe = load_recipe(
        path, ["batch.micro_batch_size=4", "optim.lr=1e-3", "engine.devices=[0,1]", "output.dir=elsewhere"]
    )
    assert recipe.batch.micro_batch_size == 4
    assert recipe.optim.lr == pytest.approx(1e-3)
    assert recipe.engine.devices == [0, 1]
    assert recipe.output.dir == "elsewhere"
    assert recipe.batch.global_batch_size == TINY_RECIPE["batch"]["global_batch_size"]


def test_override_creates_missing_sections():
    raw: dict = {}
    apply_override(raw, "model.config.hidden_size=64")
    assert raw == {"model": {"config": {"hidden_size": 64}}}


@pytest.mark.parametrize("bad", ["batch.micro_batch_size", "=4", "batch..x=1"])
def test_malformed_override_is_a_recipe_error(bad):
    with pytest.raises(RecipeError, match="expected key.sub=value"):
        apply_override({}, bad)


def test_override_into_a_value_is_refused():
    with pytest.raises(RecipeError, match="seed is a value"):
        apply_override({"seed": 1}, "seed.x=2")


def test_unknown_key_suggests_the_close_one():
    raw = {**TINY_RECIPE, "batch": {"global_batch_sise": 32}}
    with pytest.raises(RecipeError) as e:
        validate_recipe(raw, source="r.yaml")
    assert "unknown key batch.global_batch_sise; did you mean batch.global_batch_size?" in str(e.value)
    assert str(e.value).startswith("r.yaml: ")


def test_unknown_top_level_section_suggests_the_close_one():
    raw = {**TINY_RECIPE, "optimizer": {"lr": 1.0}}
    with pytest.raises(RecipeError, match="unknown key optimizer; did you mean optim"):
        validate_recipe(raw)


def test_key_in_the_wrong_section_names_the_section_that_has_it():
    raw = {**TINY_RECIPE, "train": {**TINY_RECIPE.get("train", {}), "lr": 1e-3}}
    with pytest.raises(RecipeError, match=r"unknown key train.lr; did you mean optim.lr\?"):
        validate_recipe(raw)


def test_wrong_type_names_key_and_expected_type():
    raw = {**TINY_RECIPE, "batch": {"global_batch_size": "lots"}}
    with pytest.raises(RecipeError, match=r"batch.global_batch_size: expected an integer, got 'lots'"):
        validate_recipe(raw)


def test_missing_required_section_is_named():
    raw = {k: v for k, v in TINY_RECIPE.items() if k != "batch"}
    with pytest.raises(RecipeError, match="batch is required"):
        validate_recipe(raw)


def test_model_needs_exactly_one_source():
    raw = {**TINY_RECIPE, "model": {"path": "x", "config": {"architecture": "llama"}}}
    with pytest.raises(RecipeError, match="exactly one of model.path"):
        validate_recipe(raw)


def test_unquoted_yaml_no_means_fp32(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", TINY_RECIPE)
    assert load_recipe(path, ["engine.precision=no"]).engine.precision == "no"


def test_bad_precision_lists_the_choices():
    raw = {**TINY_RECIPE, "engine": {"precision": "fp8"}}
    with pytest.raises(RecipeError, match="engine.precision: input should be 'no', 'bf16' or 'fp16'"):
        validate_recipe(raw)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_recipe_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="a recipe is a mapping"):
        load_recipe(path)


def test_resolved_recipe_round_trips(tmp_path):
    import yaml

    from accord.recipe.schema import recipe_to_yaml

    recipe = validate_recipe(TINY_RECIPE)
    assert validate_recipe(yaml.safe_load(recipe_to_yaml(recipe))) == recipe


def test_a_recipe_validates_the_same_on_any_machine(monkeypatch):
    """Whether DeepSpeed or a GPU is here is preflight's question (check_environment), not the schema's."""
    import importlib.util

    import torch

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name == "deepspeed" else real(name, *a, **k)
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    engine = TINY_RECIPE["engine"] | {
        "strategy": "zero3",
        "offload": "optimizer+params",
        "precision": "fp16",
        "device": "auto",
    }
    assert validate_recipe(TINY_RECIPE | {"engine": engine}).engine.strategy == "zero3"


@pytest.mark.parametrize(
    ("override", "expected"),
    [("optim.extend=keep", "optim.extend"), ("checkpoint.async=sometimes", "checkpoint.async: expected true or false")],
)
def test_new_fields_name_bad_values_in_one_line(override, expected):
    import copy

    from accord.recipe.schema import RecipeError, apply_override, validate_recipe

    raw = copy.deepcopy(TINY_RECIPE)
    apply_override(raw, override)
    with pytest.raises(RecipeError) as e:
        validate_recipe(raw)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_more_generated_sums_than_can_be_drawn_distinct_is_one_line_before_any_work():
    raw = {
        **TINY_RECIPE,
        "data": {"generate": {"kind": "addition", "train_examples": 4000, "eval_examples": 20000, "max_digits": 2}},
    }
    with pytest.raises(
        RecipeError, match=r"data.generate: 4000 train \+ 20000 eval examples asked for, but at most 5000 distinct sums"
    ):
        validate_recipe(raw)
