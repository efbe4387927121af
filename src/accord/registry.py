"""The names a recipe may choose from for `task` and `engine.strategy`, and where each lives.

Entries are `module:attribute` strings, imported only when a run uses them, so reading a
recipe never imports a model or a strategy. The recipe's choices are checked against these
tables (tests/test_registry.py); user code adds tasks through `task: {class: pkg.mod:Cls}`
or `register_task`, and strategies through `register_strategy`.
"""

from __future__ import annotations

import importlib

from accord.errors import UserInputError

# name -> "module:Class"; a task class takes (tokenizer, recipe).
TASKS: dict[str, str] = {
    "sft": "accord.tasks.sft:SFTTask",
    "pretrain": "accord.tasks.pretrain:PretrainTask",
    "classify": "accord.tasks.classify:ClassifyTask",
    "dpo": "accord.tasks.dpo:DPOTask",
    "reward": "accord.tasks.reward:RewardTask",
    "grpo": "accord.tasks.grpo:GRPOTask",
}

# name -> "module:factory"; a factory takes (recipe, model, info, device, plan, total_steps)
# and returns an Engine.
STRATEGIES: dict[str, str] = {
    "ddp": "accord.engine.ddp:build",
    "fsdp": "accord.engine.fsdp:build",
    "zero1": "accord.engine.zero1:build",
    "zero2": "accord.engine.deepspeed.engine:build",
    "zero3": "accord.engine.deepspeed.engine:build",
}


def register_task(name: str, target: str | type) -> None:
    """Make `task: NAME` resolve to a Task class (or its `module:Class` path)."""
    TASKS[name] = target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def register_strategy(name: str, target: str) -> None:
    """Make `engine.strategy: NAME` resolve to an engine factory at `module:function`."""
    STRATEGIES[name] = target


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
