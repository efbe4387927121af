"""Training methods: how a micro-batch becomes (loss_sum, n_targets). Tasks know nothing of ranks.

Which class a recipe's `task` names comes from accord.registry (built-in names), or from
`task: {class: package.module:Class}` for a task defined outside accord. A task is built from
a TaskConfig (accord.tasks.config), made from the Recipe here (task_config), never from the
whole Recipe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accord import registry
from accord.errors import UserInputError
from accord.registry import load_object

if TYPE_CHECKING:
    from accord.recipe.schema import DataConfig, ModelConfig, Recipe, TaskClassConfig
    from accord.tasks.base import Task
    from accord.tasks.config import TaskConfig


def task_class(task: str | TaskClassConfig, model: ModelConfig | None = None) -> type[Task]:
    """The Task class a recipe's `task` (a registered name, or {class: ...}) names, for the
    recipe's `model` section where given (sft on a vision-language model is its own class); a
    class that is not a Task is one line."""
    from accord.tasks.base import Task

    if isinstance(task, str):
        if task not in registry.TASKS:
            raise UserInputError(registry.unknown_name("task", "task", task, registry.TASKS))
        target, what = registry.TASKS[task], f"task {task}"
    else:
        target, what = task.class_, "task.class"
    cls = load_object(target, what)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise UserInputError(f"{what}: {target} is not a subclass of accord.tasks.base.Task")
    if task == "sft" and model is not None:
        from accord.models.vision import is_vision_language

        if is_vision_language(model):  # the same method on image rows (tasks/vision_sft.py)
            from accord.tasks.vision_sft import VisionSFTTask

            return VisionSFTTask
    return cls


def task_config(recipe: Recipe) -> TaskConfig:
    """What the recipe's task is built from: the one place a Recipe becomes a TaskConfig."""
    from accord.tasks.config import TaskConfig

    cls = task_class(recipe.task, recipe.model)
    sections = {}
    for name in cls.sections:
        readable = [key for key in type(recipe).model_fields if key not in _NOT_SECTIONS]
        if name not in readable:
            raise UserInputError(
                f"task: {cls.__module__}.{cls.__qualname__}.sections names {name!r}, which is not a recipe "
                f"section a task may read (those are: {', '.join(readable)})"
            )
        sections[name] = getattr(recipe, name)
    engine = recipe.engine
    return TaskConfig(
        task_class=cls,
        data=recipe.data,
        seed=recipe.seed,
        model=recipe.model,
        lora=recipe.lora,
        loss_chunk_size=recipe.train.loss_chunk_size,
        eval_micro_batch_size=recipe.train.eval_micro_batch_size,
        eval_generate=recipe.train.eval_generate,
        micro_batch_size=recipe.batch.micro_batch_size,
        device=engine.device,
        compile=engine.compile,
        splits_rows_or_model=max(engine.sequence_parallel, engine.tensor_parallel, engine.pipeline_parallel) > 1,
        strategy=engine.strategy,
        sections=sections,
    )


# Recipe keys that are values, not sections (TaskConfig carries the seed).
_NOT_SECTIONS = frozenset({"seed", "task", "resume"})


def build_task(config: TaskConfig, tokenizer) -> Task:
    return config.task_class(tokenizer, config)


def groups_by_length(data: DataConfig, cls: type[Task]) -> bool:
    """Whether the global order groups examples by length (data.group_by_length applies to
    unpacked rows only)."""
    return data.group_by_length and not cls.packs(data)
