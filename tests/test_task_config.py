"""A task is built from its TaskConfig (accord.tasks.config): the data section, the recipe
sections its class declares (Task.sections), the seed and a few named facts, made from the
Recipe in one place (accord.tasks.task_config). No task holds or takes the whole Recipe."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import accord.tasks
from accord.errors import UserInputError
from accord.models.build import build_byte_tokenizer
from accord.recipe.schema import validate_recipe
from accord.tasks import build_task, task_config
from accord.tasks.sft import SFTTask
from conftest import TINY_RECIPE


class DPOBetaSFT(SFTTask):
    """A task written outside accord that reads a section of the recipe (dpo.beta)."""

    name = "dpo-beta-sft"
    sections = ("dpo",)

    def __init__(self, tokenizer, config):
        super().__init__(tokenizer, config)
        self.beta = config.section("dpo").beta


class MisnamedSection(SFTTask):
    sections = ("dpo_settings",)


@pytest.mark.parametrize(
    "task, sections",
    [
        ("sft", set()),
        ("pretrain", set()),
        ("reward", set()),
        ("classify", {"classify"}),
        ("dpo", {"dpo"}),
        ("kto", {"kto"}),
        ("orpo", {"orpo"}),
        ("cpo", {"cpo"}),
        ("grpo", {"grpo"}),
        ("rloo", {"grpo", "rloo"}),
    ],
)
def test_a_task_config_carries_the_sections_its_class_declares_and_no_other(task, sections):
    recipe = validate_recipe(TINY_RECIPE | {"task": task})
    config = task_config(recipe)
    assert config.task_class.name == task and set(config.sections) == sections
    for name in sections:
        assert config.section(name) is getattr(recipe, name)
    with pytest.raises(KeyError, match="without declaring it"):
        config.section("distill")


def test_a_task_config_names_what_it_reads_from_the_other_sections():
    recipe = validate_recipe(
        TINY_RECIPE
        | {
            "seed": 11,
            "train": {"max_steps": 1, "loss_chunk_size": 64, "eval_micro_batch_size": 5, "eval_generate": 3},
            "engine": {"strategy": "fsdp", "device": "cpu", "compile": True, "sequence_parallel": 2},
            "lora": {"r": 2},
        }
    )
    config = task_config(recipe)
    assert (config.seed, config.loss_chunk_size, config.eval_micro_batch_size, config.eval_generate) == (11, 64, 5, 3)
    assert (config.device, config.compile, config.strategy) == ("cpu", True, "fsdp")
    assert config.micro_batch_size == recipe.batch.micro_batch_size
    assert config.splits_rows_or_model and not task_config(validate_recipe(TINY_RECIPE)).splits_rows_or_model
    assert config.data is recipe.data and config.model is recipe.model and config.lora is recipe.lora


def test_a_task_written_outside_accord_reads_the_sections_it_declares():
    recipe = validate_recipe(TINY_RECIPE | {"task": {"class": "test_task_config:DPOBetaSFT"}, "dpo": {"beta": 0.25}})
    task = build_task(task_config(recipe), build_byte_tokenizer())
    assert type(task).__name__ == "DPOBetaSFT" and task.beta == 0.25 and task.packing


def test_a_task_declaring_no_such_section_is_one_line():
    recipe = validate_recipe(TINY_RECIPE | {"task": {"class": "test_task_config:MisnamedSection"}})
    with pytest.raises(UserInputError) as caught:
        task_config(recipe)
    message = str(caught.value)
    assert message.startswith("task: test_task_config.MisnamedSection.sections names 'dpo_settings'")
    assert "dpo, " in message and "\n" not in message


def test_a_task_given_the_whole_recipe_says_what_it_is_built_from():
    with pytest.raises(TypeError, match=r"SFTTask is built from a TaskConfig, not a Recipe: .*task_config\(recipe\)"):
        SFTTask(build_byte_tokenizer(), validate_recipe(TINY_RECIPE))


def test_only_task_config_takes_the_recipe_in_accord_tasks():
    """The one place a Recipe becomes what a task reads: no other function or method of
    accord.tasks has a `recipe` parameter (so none reaches into the whole recipe)."""
    takers = []
    modules = [importlib.import_module(i.name) for i in pkgutil.iter_modules(accord.tasks.__path__, "accord.tasks.")]
    for module in [accord.tasks, *modules]:
        for name, value in vars(module).items():
            if getattr(value, "__module__", None) != module.__name__:
                continue
            members = [(name, value)]
            if inspect.isclass(value):
                members = [(f"{name}.{attr}", v) for attr, v in vars(value).items()]
            for qualname, member in members:
                function = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                if inspect.isfunction(function) and "recipe" in inspect.signature(function).parameters:
                    takers.append(f"{module.__name__}:{qualname}")
    assert takers == ["accord.tasks:task_config"]
