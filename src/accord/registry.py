"""The names a recipe may choose from for `task` and `engine.strategy`, and where each lives.

Entries are `module:attribute` strings, imported only when a run uses them, so reading a
recipe never imports a model or a strategy. The recipe accepts exactly the names registered
here: the built-in ones below, and those user code adds with `register_task` /
`register_strategy` (or a task written as `task: {class: pkg.mod:Cls}`).

A strategy is registered with its traits (what it shards, whether it runs on DeepSpeed,
what it can offload, which model-parallel layouts it combines with) and its memory model for
`accord plan`; a task with the layouts that may split the model it trains. The recipe's
checks, the preflight, `accord config` and the planner ask these instead of comparing names,
so a new strategy, task or layout is declared here, not added to lists elsewhere.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

from accord.errors import UserInputError

# name -> "module:Class"; a task class takes (tokenizer, recipe).
TASKS: dict[str, str] = {
    "sft": "accord.tasks.sft:SFTTask",
    "pretrain": "accord.tasks.pretrain:PretrainTask",
    "classify": "accord.tasks.classify:ClassifyTask",
    "dpo": "accord.tasks.dpo:DPOTask",
    "orpo": "accord.tasks.reference_free:ORPOTask",
    "cpo": "accord.tasks.reference_free:CPOTask",
    "kto": "accord.tasks.kto:KTOTask",
    "reward": "accord.tasks.reward:RewardTask",
    "grpo": "accord.tasks.grpo:GRPOTask",
    "rloo": "accord.tasks.rloo:RLOOTask",
    "distill": "accord.tasks.distill:DistillTask",
}

# What engine.offload may ask, least first.
OFFLOADS = ("none", "optimizer", "optimizer+params")

# The model-parallel layouts a strategy or a task declares it combines with (`combines_with`),
# each named by its engine key: engine.tensor_parallel splits every layer over a group of ranks,
# engine.pipeline_parallel splits the decoder layers into stages on different ranks,
# engine.expert_parallel splits each mixture-of-experts layer's experts over a group of ranks.
LAYOUTS = ("tensor_parallel", "pipeline_parallel", "expert_parallel")


@dataclass(frozen=True)
class TaskTraits:
    """What a task is, as far as the recipe's checks must know before its class is imported."""

    # The layouts that may split the model it trains (tensor_parallel: it trains one model,
    # with no frozen reference or rollout copy beside it that the layout would not split;
    # pipeline_parallel: also one forward and backward per row, a causal LM's token loss on the
    # last stage).
    combines_with: tuple[str, ...] = ()


# name -> traits; a task without an entry has none (a user's task, unless registered with some).
TASK_TRAITS: dict[str, TaskTraits] = {
    "sft": TaskTraits(combines_with=("tensor_parallel", "pipeline_parallel", "expert_parallel")),
    "pretrain": TaskTraits(combines_with=("tensor_parallel", "pipeline_parallel", "expert_parallel")),
    "classify": TaskTraits(combines_with=("tensor_parallel",)),
    "reward": TaskTraits(combines_with=("tensor_parallel",)),
}


@dataclass(frozen=True)
class Strategy:
    """One `engine.strategy`: where its engine is built, and what it is."""

    name: str
    # "module:function" taking (spec, model, info, device, plan, total_steps) and returning an Engine;
    # spec is an accord.engine.spec.EngineSpec: the recipe's engine and optim sections and data.max_length.
    factory: str
    shards_params: bool = False
    shards_grads: bool = False
    shards_optimizer: bool = False
    # The DeepSpeed ZeRO stage it runs as (None: not DeepSpeed).
    zero_stage: int | None = None
    # Runs as torch's ZeroRedundancyOptimizer over DDP instead of DeepSpeed when DeepSpeed is
    # absent or engine.zero1_implementation says torch (accord.engine.runs_deepspeed decides).
    torch_fallback: bool = False
    # The engine.offload levels it can run (DeepSpeed ZeRO-Offload).
    offloads: tuple[str, ...] = ("none",)
    # "module:attribute" of its accord.engine.memory.MemoryModel (None: left out of `accord plan`).
    memory: str | None = None
    # The layouts (LAYOUTS) it runs as the data parallelism over: torch's own data parallelism,
    # which takes the TP groups' DTensors and the pipeline stages as they are.
    combines_with: tuple[str, ...] = ()

    @property
    def deepspeed(self) -> bool:
        """Whether it can run on DeepSpeed (zero1 may run on torch instead: runs_deepspeed)."""
        return self.zero_stage is not None

    @property
    def shards(self) -> bool:
        """Whether each rank holds a share of something rather than all of it."""
        return self.shards_params or self.shards_grads or self.shards_optimizer

    def offload_for(self, asked: str) -> str:
        """The most of engine.offload=`asked` this strategy can carry out."""
        levels = [level for level in self.offloads if OFFLOADS.index(level) <= OFFLOADS.index(asked)]
        return max(levels, key=OFFLOADS.index, default="none")


# In the order `accord plan` lists and recommends them: least communication first.
STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(
            "ddp",
            "accord.engine.ddp:build",
            memory="accord.engine.memory:DDP",
            combines_with=("tensor_parallel", "pipeline_parallel", "expert_parallel"),
        ),
        Strategy(
            "zero1",
            "accord.engine.zero1:build",
            shards_optimizer=True,
            zero_stage=1,
            torch_fallback=True,
            offloads=OFFLOADS[:2],
            memory="accord.engine.deepspeed.memory:ZERO1",
        ),
        Strategy(
            "zero2",
            "accord.engine.deepspeed.engine:build",
            shards_grads=True,
            shards_optimizer=True,
            zero_stage=2,
            offloads=OFFLOADS[:2],
            memory="accord.engine.deepspeed.memory:ZERO2",
        ),
        Strategy(
            "zero3",
            "accord.engine.deepspeed.engine:build",
            shards_params=True,
            shards_grads=True,
            shards_optimizer=True,
            zero_stage=3,
            offloads=OFFLOADS,
            memory="accord.engine.deepspeed.memory:ZERO3",
        ),
        Strategy(
            "fsdp",
            "accord.engine.fsdp:build",
            shards_params=True,
            shards_grads=True,
            shards_optimizer=True,
            memory="accord.engine.memory:FSDP",
            combines_with=("tensor_parallel", "pipeline_parallel", "expert_parallel"),
        ),
    )
}

_BUILT_IN = {"task": frozenset(TASKS), "strategy": frozenset(STRATEGIES)}

# Registrations reach the worker processes through the environment. Every way accord's
# workers start (torch's elastic agent spawning them, torchrun or srun started from this
# process, a fork) inherits it, and nothing between the user's call and the workers has to
# carry them: the recipe keeps the name the user wrote (`task: my_sft` in recipe.yaml and in
# every checkpoint), and this module reads them back when a worker imports it.
HANDED_OVER = "ACCORD_REGISTERED"


def register_task(name: str, target: str | type, *, combines_with: Iterable[str] = ()) -> None:
    """Make `task: NAME` resolve to a Task subclass (or its `module:Class` path), here and in
    the worker processes this process starts.

    combines_with: the layouts (LAYOUTS, e.g. "tensor_parallel") that may split the model the
    task trains; none by default."""
    # Checked by name: this module sits below the tasks layer and imports none of it.
    if isinstance(target, type):
        if not any(f"{c.__module__}.{c.__qualname__}" == "accord.tasks.base.Task" for c in target.__mro__):
            raise UserInputError(
                f"register_task({name!r}): {target.__qualname__} is not a subclass of accord.tasks.base.Task"
            )
    _check_new(name, "task")
    layouts = _layouts(combines_with, f"register_task({name!r})")
    TASKS[name] = _importable(target, f"register_task({name!r})")
    TASK_TRAITS[name] = TaskTraits(combines_with=layouts)
    _hand_over()


def register_strategy(name: str, target: str | object, *, like: str | None = None, **traits: object) -> None:
    """Make `engine.strategy: NAME` resolve to an engine factory (or its `module:function`
    path), here and in the worker processes this process starts. The factory is called as
    `factory(spec, model, info, device, plan, total_steps)` (spec: accord.engine.spec.EngineSpec,
    the recipe's engine and optim sections and data.max_length) and returns an Engine.

    like: a registered strategy whose traits and memory model this one shares (e.g. a factory
    wrapping ddp's: like="ddp"); without it the strategy shards nothing, runs without
    DeepSpeed and is left out of `accord plan`. traits: Strategy fields to set (shards_params,
    zero_stage, offloads, memory, ...)."""
    _check_new(name, "strategy")
    factory = _importable(target, f"register_strategy({name!r})")
    base = Strategy(name, factory) if like is None else strategy(like)
    fields = {f.name for f in dataclasses.fields(Strategy)} - {"name", "factory"}
    unknown = sorted(set(traits) - fields)
    if unknown:
        raise UserInputError(
            f"register_strategy({name!r}): unknown trait {', '.join(unknown)} (traits: {', '.join(sorted(fields))})"
        )
    if "offloads" in traits:
        traits["offloads"] = tuple(traits["offloads"])  # type: ignore[arg-type]
    if "combines_with" in traits:
        traits["combines_with"] = _layouts(traits["combines_with"], f"register_strategy({name!r})")  # type: ignore[arg-type]
    STRATEGIES[name] = dataclasses.replace(base, name=name, factory=factory, **traits)  # type: ignore[arg-type]
    _hand_over()


def task_traits(name: object) -> TaskTraits:
    """The traits of `task: NAME` (none for a task given as {class: ...}, or registered without)."""
    return TASK_TRAITS.get(name, TaskTraits()) if isinstance(name, str) else TaskTraits()


def combining(layout: str) -> tuple[list[str], list[str]]:
    """The registered strategies and tasks that declare they combine with `layout`, in their order."""
    strategies = [name for name, spec in STRATEGIES.items() if layout in spec.combines_with]
    tasks = [name for name in TASKS if layout in task_traits(name).combines_with]
    return strategies, tasks


def strategy(name: str) -> Strategy:
    """The registered strategy `name`; an unknown name is one line with a did-you-mean."""
    if name not in STRATEGIES:
        raise UserInputError(unknown_name("engine.strategy", "strategy", name, STRATEGIES))
    return STRATEGIES[name]


def unknown_name(key: str, kind: str, name: object, names: dict) -> str:
    """One line for a name that is not registered: the closest registered one and all of them."""
    close = difflib.get_close_matches(str(name), list(names), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    plural = {"task": "tasks", "strategy": "strategies"}[kind]
    return (
        f"{key}: unknown {kind} {name!r}{hint} (registered {plural}: {', '.join(names)}; "
        f"add one with accord.register_{kind})"
    )


def _check_new(name: str, kind: str) -> None:
    """A user's name is a new one (registering it again replaces it); a built-in keeps its meaning."""
    if not isinstance(name, str) or not name:
        raise UserInputError(f"register_{kind}({name!r}): the name must be a non-empty string")
    if name in _BUILT_IN[kind]:
        raise UserInputError(f"register_{kind}({name!r}): {name} is a built-in {kind}; choose another name")


def _layouts(names: Iterable[str], what: str) -> tuple[str, ...]:
    """`combines_with` as given to a register call: known layouts only."""
    layouts = (names,) if isinstance(names, str) else tuple(names)
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        raise UserInputError(f"{what}: unknown layout {', '.join(map(repr, unknown))} (layouts: {', '.join(LAYOUTS)})")
    return layouts


def _importable(target: str | object, what: str) -> str:
    """`module:attribute` for a class or function the workers can import by that path; a
    string is taken as that path already (checked when a run uses it)."""
    if isinstance(target, str):
        if ":" not in target:
            raise UserInputError(f"{what}: {target!r} should be module:attribute, e.g. my_package.tasks:MyTask")
        return target
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if module is None or qualname is None:
        raise UserInputError(f"{what}: expected a class, a function or a module:attribute path, got {target!r}")
    if module == "__main__":
        raise UserInputError(
            f"{what}: {qualname} is defined in the script being run (__main__), which the worker processes cannot "
            f"import; move it into a module on PYTHONPATH and import it from there"
        )
    if "<locals>" in qualname:
        raise UserInputError(
            f"{what}: {qualname} is defined inside a function, which the worker processes cannot import; "
            f"define it at the top level of a module"
        )
    return f"{module}:{qualname}"


def _hand_over() -> None:
    """The user's registrations, in the environment the workers inherit (HANDED_OVER)."""
    os.environ[HANDED_OVER] = json.dumps(
        {
            "tasks": {name: path for name, path in TASKS.items() if name not in _BUILT_IN["task"]},
            "task_traits": {
                name: dataclasses.asdict(TASK_TRAITS[name])
                for name in TASKS
                if name not in _BUILT_IN["task"] and name in TASK_TRAITS
            },
            "strategies": {
                name: dataclasses.asdict(spec) for name, spec in STRATEGIES.items() if name not in _BUILT_IN["strategy"]
            },
        }
    )


def _take_over() -> None:
    """The registrations of the process that started this one (HANDED_OVER)."""
    text = os.environ.get(HANDED_OVER)
    if not text:
        return
    handed = json.loads(text)
    for name, path in handed.get("tasks", {}).items():
        TASKS.setdefault(name, path)
    for name, fields in handed.get("task_traits", {}).items():
        TASK_TRAITS.setdefault(name, TaskTraits(combines_with=tuple(fields["combines_with"])))
    for name, fields in handed.get("strategies", {}).items():
        tuples = {key: tuple(fields[key]) for key in ("offloads", "combines_with") if key in fields}
        STRATEGIES.setdefault(name, Strategy(**(fields | tuples)))


_take_over()


def load_object(path: str, what: str) -> object:
    """The object at `module:attribute`; a bad path is one line naming `what`."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise UserInputError(f"{what}: {path!r} should be module:attribute, e.g. my_package.tasks:MyTask")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserInputError(
            f"{what}: cannot import {module_name!r} ({e}); is it installed or on PYTHONPATH?"
        ) from None
    obj: object = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise UserInputError(f"{what}: {module_name!r} has no {attribute!r}")
        obj = getattr(obj, part)
    return obj
