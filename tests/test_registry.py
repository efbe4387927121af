"""The task and strategy registries: the recipe's choices and the tables agree, and a task
written outside accord trains through `task: {class: module:Class}`."""

from __future__ import annotations

import copy
import json
import os
import typing

import pytest

from accord import registry
from accord.errors import UserInputError
from accord.recipe.schema import EngineConfig, TaskName, validate_recipe
from accord.tasks import task_class
from conftest import TINY_RECIPE, assert_ok, run_accord, write_recipe


def test_recipe_task_names_are_the_registered_tasks():
    assert set(typing.get_args(TaskName)) == set(registry.TASKS)


def test_recipe_strategies_are_the_registered_strategies():
    assert set(typing.get_args(EngineConfig.model_fields["strategy"].annotation)) == set(registry.STRATEGIES)


@pytest.mark.parametrize("name", sorted(registry.TASKS))
def test_every_registered_task_resolves_to_a_task_class(name):
    recipe = validate_recipe(TINY_RECIPE | {"task": name})
    assert task_class(recipe).name == name


@pytest.mark.parametrize("name", sorted(registry.STRATEGIES))
def test_every_registered_strategy_factory_imports(name):
    pytest.importorskip("deepspeed") if name in ("zero2", "zero3") else None
    assert callable(registry.load_object(registry.STRATEGIES[name], f"engine.strategy {name}"))


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_such_module_xyz:Task", "cannot import 'no_such_module_xyz'"),
        ("accord.tasks.base:NoSuchTask", "has no 'NoSuchTask'"),
        ("accord.tasks.base:pad_rows", "is not a subclass of accord.tasks.base.Task"),
        ("accord.tasks.base", "should be module:attribute"),
    ],
)
def test_bad_task_class_is_one_line(target, message):
    recipe = validate_recipe(TINY_RECIPE | {"task": {"class": target}})
    with pytest.raises(UserInputError, match="^task.class: .*") as caught:
        task_class(recipe)
    assert message in str(caught.value) and "\n" not in str(caught.value)


# A task accord did not write: a causal LM trained on every token of prompt + completion,
# reporting its own per-step metric.
CUSTOM_TASK = """
import torch
from accord.tasks.base import IGNORE, LossOutput
from accord.tasks.causal import CausalLMTask


class EveryTokenTask(CausalLMTask):
    name = "every-token"
    text_fields = ("prompt", "completion")

    def encode_batch(self, batch):
        out = {"input_ids": [], "labels": [], "num_targets": [], "length": [], "over_length": []}
        for prompt, completion in zip(batch["prompt"], batch["completion"]):
            ids = self.tokenizer(prompt + completion, add_special_tokens=False)["input_ids"][: self.max_length]
            out["input_ids"].append(ids)
            out["labels"].append([IGNORE] + ids[1:])
            out["num_targets"].append(len(ids) - 1)
            out["length"].append(len(ids))
            out["over_length"].append(False)
        return out

    def loss(self, model, batch):
        out = super().loss(model, batch)
        out.metrics["targets_seen"] = out.num_targets.float()
        return out
"""


@pytest.mark.distributed
def test_task_defined_outside_accord_trains(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(CUSTOM_TASK)
    recipe = copy.deepcopy(TINY_RECIPE)
    recipe["task"] = {"class": "my_tasks:EveryTokenTask"}
    recipe["train"] = {"max_steps": 4, "log_every": 2}
    recipe["engine"] = recipe["engine"] | {"device": "cpu"}
    recipe["data"] = recipe["data"] | {"cache_dir": str(tmp_path / "cache")}
    out = tmp_path / "out"
    path = write_recipe(tmp_path / "custom.yaml", recipe)
    # Importable by the launcher and its workers, as a user's package would be.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    proc = run_accord("train", path, f"output.dir={out}")
    assert_ok(proc)
    assert "every-token on LlamaForCausalLM" in proc.stdout + proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    # Every token but the first of each row is a target, so the metric (targets / targets) is 1.
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(r["targets_seen"] == pytest.approx(1.0) for r in train)
    assert "class: my_tasks:EveryTokenTask" in (out / "recipe.yaml").read_text()
    assert (out / "final" / "model.safetensors").is_file()
