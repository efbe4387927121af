"""The task and strategy registries: a recipe accepts exactly the registered names, a task or
strategy registered from user code trains (its workers resolve the name too), and a task
written outside accord trains through `task: {class: module:Class}`."""

from __future__ import annotations

import copy
import json
import os
import sys
import types

import pytest

import accord
from accord import registry
from accord.errors import UserInputError
from accord.recipe.schema import RecipeError, validate_recipe
from accord.tasks import task_class
from conftest import REPO, TINY_RECIPE, accord_env, assert_ok, run_accord, run_process, write_recipe


@pytest.fixture
def clean_registry(monkeypatch):
    """Registrations made by the test are gone after it (the tables and the handed-over copy)."""
    monkeypatch.setattr(registry, "TASKS", dict(registry.TASKS))
    monkeypatch.setattr(registry, "STRATEGIES", dict(registry.STRATEGIES))
    monkeypatch.setattr(registry, "TASK_TRAITS", dict(registry.TASK_TRAITS))
    monkeypatch.delenv(registry.HANDED_OVER, raising=False)


@pytest.mark.parametrize("name", sorted(registry.TASKS))
def test_every_registered_task_validates_and_resolves_to_a_task_class(name):
    # A section the task cannot do without.
    required = {"distill": {"distill": {"teacher": "teacher-folder", "max_new_tokens": 8}}}
    recipe = validate_recipe(TINY_RECIPE | {"task": name} | required.get(name, {}))
    assert task_class(recipe.task, recipe.model).name == name and task_class(name) is task_class(recipe.task)


@pytest.mark.parametrize("name", sorted(registry.STRATEGIES))
def test_every_registered_strategy_validates_and_its_factory_imports(name):
    pytest.importorskip("deepspeed") if name in ("zero2", "zero3") else None
    recipe = validate_recipe(TINY_RECIPE | {"engine": TINY_RECIPE["engine"] | {"strategy": name}})
    assert recipe.engine.strategy == name
    assert callable(registry.load_object(registry.STRATEGIES[name].factory, f"engine.strategy {name}"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"task": "sfft"},
            "recipe: task: unknown task 'sfft'; did you mean sft? (registered tasks: sft, pretrain, classify, dpo, "
            "orpo, cpo, kto, reward, grpo, rloo, distill; add one with accord.register_task)",
        ),
        (
            {"engine": {"strategy": "zero4"}},
            "recipe: engine.strategy: unknown strategy 'zero4'; did you mean zero3? (registered strategies: ddp, "
            "zero1, zero2, zero3, fsdp; add one with accord.register_strategy)",
        ),
        (
            {"engine": {"strategy": "megatron"}},
            "recipe: engine.strategy: unknown strategy 'megatron' (registered strategies: ddp, zero1, zero2, zero3, "
            "fsdp; add one with accord.register_strategy)",
        ),
    ],
)
def test_an_unregistered_name_is_one_line_with_the_registered_ones(change, message):
    with pytest.raises(RecipeError) as caught:
        validate_recipe(TINY_RECIPE | change)
    assert str(caught.value) == message


@pytest.mark.subprocess
def test_a_registered_name_validates_here_and_in_the_processes_started_from_here(clean_registry):
    from user_extensions import MySFT, build_my_ddp

    raw = TINY_RECIPE | {"task": "my_sft", "engine": TINY_RECIPE["engine"] | {"strategy": "my_ddp"}}
    with pytest.raises(RecipeError, match="unknown task 'my_sft'"):
        validate_recipe(raw)
    accord.register_task("my_sft", MySFT)
    accord.register_strategy("my_ddp", build_my_ddp, like="ddp")
    recipe = accord.load_recipe(raw)
    assert accord.task_class("my_sft") is MySFT and task_class(recipe.task, recipe.model) is MySFT
    assert registry.STRATEGIES["my_ddp"].factory == "user_extensions:build_my_ddp"
    assert registry.strategy("my_ddp").memory == registry.STRATEGIES["ddp"].memory
    # A fresh interpreter started from here (as the workers are) knows both names.
    code = (
        "import json, sys; from accord.recipe.schema import validate_recipe; from accord.tasks import task_class;"
        "r = validate_recipe(json.loads(sys.argv[1])); print(task_class(r.task, r.model).__name__, r.engine.strategy)"
    )
    env = accord_env() | {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = run_process([sys.executable, "-c", code, json.dumps(raw)], env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["MySFT", "my_ddp"], proc.stderr[-2000:]


def test_a_registered_task_has_the_traits_of_its_class_not_of_its_name(clean_registry):
    """What the planner and sequence parallelism ask of a task (its loss is chunked, its rows
    may be split) comes from its class: an sft subclass plans and splits as sft does."""
    from accord.engine.sequence_parallel.ulysses import check_sequence_parallel
    from accord.planner.estimate import meta_model, plan
    from user_extensions import MySFT

    accord.register_task("my_sft", MySFT)
    chunked = {"train": {"max_steps": 1, "loss_chunk_size": 7}}
    sft, mine = (validate_recipe(TINY_RECIPE | chunked | {"task": task}) for task in ("sft", "my_sft"))
    whole = validate_recipe(TINY_RECIPE | {"train": {"max_steps": 1, "loss_chunk_size": 0}})
    assert task_class(mine.task, mine.model).chunked_loss
    assert plan(mine, 2)[0][0].activations == plan(sft, 2)[0][0].activations < plan(whole, 2)[0][0].activations
    split = mine.model_copy(update={"engine": mine.engine.model_copy(update={"sequence_parallel": 2})})
    assert check_sequence_parallel(split, meta_model(mine).config) == []


def test_a_strategy_registered_like_a_zero_stage_has_its_traits(clean_registry):
    """The recipe's checks, accord config and DeepSpeed's config ask the traits, not the name."""
    import torch

    from accord.distributed.batch_plan import BatchPlan
    from accord.engine.deepspeed.config import deepspeed_config
    from accord.engine.spec import EngineSpec
    from accord.launch.accelerate_config import accelerate_config

    accord.register_strategy("my_zero3", "accord.engine.deepspeed.engine:build", like="zero3")
    accord.register_strategy("my_plain", "accord.engine.ddp:build")
    engine = TINY_RECIPE["engine"] | {"strategy": "my_zero3", "offload": "optimizer+params"}
    recipe = validate_recipe(TINY_RECIPE | {"engine": engine})
    assert (
        deepspeed_config(EngineSpec.of(recipe), BatchPlan.derive(32, 8, 2), torch.device("cpu"))["zero_optimization"][
            "stage"
        ]
        == 3
    )
    config = accelerate_config(recipe, 2)
    assert config["distributed_type"] == "DEEPSPEED" and config["deepspeed_config"]["zero_stage"] == 3
    with pytest.raises(
        RecipeError, match=r"needs a DeepSpeed strategy \(engine.strategy=zero1, zero2, zero3 or my_zero3\)"
    ):
        validate_recipe(TINY_RECIPE | {"engine": engine | {"strategy": "my_plain"}})
    assert (
        accelerate_config(
            validate_recipe(TINY_RECIPE | {"engine": engine | {"strategy": "my_plain", "offload": "none"}}), 2
        )["distributed_type"]
        == "MULTI_GPU"
    )


def test_what_combines_with_tensor_parallelism_is_declared_by_the_strategies_and_tasks(clean_registry):
    """A strategy or task registered as combining with a layout is accepted with it, and named in
    the refusal of one that is not, without a list in the schema to edit; the declarations reach
    the worker processes with the names."""

    def recipe(task, strategy):
        engine = TINY_RECIPE["engine"] | {"strategy": strategy, "tensor_parallel": 2}
        return TINY_RECIPE | {"task": task, "engine": engine}

    accord.register_strategy("my_ddp", "accord.engine.ddp:build", like="ddp")  # ddp's traits: TP, PP and EP
    accord.register_strategy("my_plain", "accord.engine.ddp:build")
    accord.register_task("my_sft", "user_extensions:MySFT", combines_with=["tensor_parallel"])
    accord.register_task("my_other", "user_extensions:MySFT")
    assert validate_recipe(recipe("my_sft", "my_ddp")).engine.tensor_parallel == 2
    with pytest.raises(RecipeError, match=r"composes with engine.strategy=ddp, fsdp or my_ddp \(torch's own"):
        validate_recipe(recipe("sft", "my_plain"))
    with pytest.raises(RecipeError, match=r"supports task sft, pretrain, classify, reward, my_sft, not my_other"):
        validate_recipe(recipe("my_other", "ddp"))
    with pytest.raises(UserInputError, match=r"register_task\('x'\): unknown layout 'pipeline' \(layouts: "):
        accord.register_task("x", "user_extensions:MySFT", combines_with="pipeline")
    handed = json.loads(os.environ[registry.HANDED_OVER])
    del registry.TASK_TRAITS["my_sft"], registry.TASKS["my_sft"], registry.STRATEGIES["my_ddp"]
    registry._take_over()  # what a worker process does as it imports the registry
    assert registry.task_traits("my_sft").combines_with == ("tensor_parallel",)
    assert registry.STRATEGIES["my_ddp"].combines_with == ("tensor_parallel", "pipeline_parallel", "expert_parallel")
    assert handed["task_traits"]


def _defined_in(module: str, qualname: str) -> type:
    from accord.tasks.sft import SFTTask

    cls = types.new_class(qualname.rpartition(".")[2], (SFTTask,))
    cls.__module__, cls.__qualname__ = module, qualname
    return cls


@pytest.mark.parametrize(
    ("register", "message"),
    [
        (
            lambda: accord.register_task("mine", _defined_in("__main__", "Mine")),
            "register_task('mine'): Mine is defined in the script being run (__main__), which the worker processes "
            "cannot import; move it into a module on PYTHONPATH and import it from there",
        ),
        (
            lambda: accord.register_task("mine", _defined_in("pkg.mod", "make.<locals>.Mine")),
            "register_task('mine'): make.<locals>.Mine is defined inside a function, which the worker processes "
            "cannot import; define it at the top level of a module",
        ),
        (
            lambda: accord.register_task("mine", dict),
            "register_task('mine'): dict is not a subclass of accord.tasks.base.Task",
        ),
        (
            lambda: accord.register_task("sft", _defined_in("pkg.mod", "Mine")),
            "register_task('sft'): sft is a built-in task; choose another name",
        ),
        (
            lambda: accord.register_strategy("mine", "pkg.mod:build", like="dpp"),
            "engine.strategy: unknown strategy 'dpp'; did you mean ddp? (registered strategies: ddp, zero1, zero2, "
            "zero3, fsdp; add one with accord.register_strategy)",
        ),
        (
            lambda: accord.register_strategy("mine", "pkg.mod:build", shards_everything=True),
            "register_strategy('mine'): unknown trait shards_everything (traits: combines_with, memory, offloads, "
            "shards_grads, shards_optimizer, shards_params, torch_fallback, zero_stage)",
        ),
    ],
)
def test_what_the_workers_could_not_resolve_is_refused_in_one_line(clean_registry, register, message):
    with pytest.raises(UserInputError) as caught:
        register()
    assert str(caught.value) == message
    assert "mine" not in registry.TASKS and "mine" not in registry.STRATEGIES


# A user's program: it registers a task and a strategy from its package (tests/user_extensions.py),
# plans and trains a recipe that names them, through the API (2 worker processes).
TRAIN_REGISTERED = """
import json, sys
import accord
from conftest import TINY_RECIPE
from user_extensions import MySFT, build_my_ddp

accord.register_task("my_sft", MySFT)
accord.register_strategy("my_ddp", build_my_ddp, like="ddp")
recipe = accord.load_recipe(TINY_RECIPE, {"task": "my_sft", "engine.strategy": "my_ddp"})
plan = accord.plan(recipe, gpus=2)
result = accord.train(recipe, {"train.max_steps": 2, "train.log_every": 1, "output.dir": sys.argv[1]}, processes=2)
rows = {row.strategy: row.as_dict() for row in plan.rows}
print("result: " + json.dumps({"status": result.status, "plan": rows}))
"""


@pytest.mark.distributed
def test_a_registered_task_and_strategy_train_through_the_api(tmp_path):
    out, marks = tmp_path / "run", tmp_path / "marks"
    marks.mkdir()
    env = accord_env() | {
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
        "ACCORD_TEST_STRATEGY_MARKS": str(marks),
    }
    proc = run_process([sys.executable, "-c", TRAIN_REGISTERED, str(out)], cwd=REPO / "tests", env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("result: "))[8:])
    assert result["status"] == "completed"
    # The strategy planned as the one it is like, listed after the built-in ones.
    assert list(result["plan"]) == ["ddp", "zero1", "zero2", "zero3", "fsdp", "my_ddp"]
    assert result["plan"]["my_ddp"] | {"strategy": "ddp"} == result["plan"]["ddp"]
    # Each worker built its engine with the registered factory, and trained with the task's loss.
    assert sorted(p.name for p in marks.iterdir()) == ["rank0", "rank1"]
    assert {p.read_text() for p in marks.iterdir()} == {"my_ddp"}
    assert "my-sft on LlamaForCausalLM" in proc.stderr
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["my_sft_targets"] == pytest.approx(1.0) for r in train)
    written = (out / "recipe.yaml").read_text()
    assert "task: my_sft" in written and "strategy: my_ddp" in written


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
        task_class(recipe.task, recipe.model)
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
