"""Training methods: how a micro-batch becomes (loss_sum, n_targets). Tasks know nothing of ranks.

Which class a recipe's `task` names comes from accord.registry (built-in names), or from
`task: {class: package.module:Class}` for a task defined outside accord.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accord.errors import UserInputError
from accord.registry import TASKS, load_object

if TYPE_CHECKING:
    from accord.recipe.schema import Recipe
    from accord.tasks.base import Task


def task_class(recipe: Recipe) -> type[Task]:
    """The Task class the recipe names; a class that is not a Task is one line."""
    from accord.tasks.base import Task

    if isinstance(recipe.task, str):
        if recipe.task not in TASKS:
            raise UserInputError(f"task: unknown task {recipe.task!r} (known: {', '.join(sorted(TASKS))})")
        target, what = TASKS[recipe.task], f"task {recipe.task}"
    else:
        target, what = recipe.task.class_, "task.class"
    cls = load_object(target, what)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise UserInputError(f"{what}: {target} is not a subclass of accord.tasks.base.Task")
    return cls


def build_task(recipe: Recipe, tokenizer) -> Task:
    return task_class(recipe)(tokenizer, recipe)


def groups_by_length(recipe: Recipe) -> bool:
    """Whether the global order groups examples by length (data.group_by_length applies to
    unpacked rows only)."""
    return recipe.data.group_by_length and not task_class(recipe).packs(recipe)
