"""Training methods: how a micro-batch becomes (loss_sum, n_targets). Tasks know nothing of ranks.

Which class a recipe's `task` names comes from accord.registry (built-in names), or from
`task: {class: package.module:Class}` for a task defined outside accord.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accord import registry
from accord.errors import UserInputError
from accord.registry import load_object

if TYPE_CHECKING:
    from accord.recipe.schema import Recipe
    from accord.tasks.base import Task


def task_class(recipe: Recipe | str) -> type[Task]:
    """The Task class a recipe (or a registered task name) names; a class that is not a Task
    is one line."""
    from accord.tasks.base import Task

    task = recipe if isinstance(recipe, str) else recipe.task
    if isinstance(task, str):
        if task not in registry.TASKS:
            raise UserInputError(registry.unknown_name("task", "task", task, registry.TASKS))
        target, what = registry.TASKS[task], f"task {task}"
    else:
        target, what = task.class_, "task.class"
    cls = load_object(target, what)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise UserInputError(f"{what}: {target} is not a subclass of accord.tasks.base.Task")
    if task == "sft" and not isinstance(recipe, str):
        from accord.models.vision import is_vision_language

        if is_vision_language(recipe.model):  # the same method on image rows (tasks/vision_sft.py)
            from accord.tasks.vision_sft import VisionSFTTask

            return VisionSFTTask
    return cls


def build_task(recipe: Recipe, tokenizer) -> Task:
    return task_class(recipe)(tokenizer, recipe)


def groups_by_length(recipe: Recipe) -> bool:
    """Whether the global order groups examples by length (data.group_by_length applies to
    unpacked rows only)."""
    return recipe.data.group_by_length and not task_class(recipe).packs(recipe)
