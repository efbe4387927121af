"""Training methods: how a micro-batch becomes (loss_sum, n_targets). Tasks know nothing of ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from accord.recipe import Recipe

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from accord.tasks.base import Task


def task_class(name: str) -> type:
    if name == "sft":
        from accord.tasks.sft import SFTTask

        return SFTTask
    raise ValueError(f"unknown task {name!r}")


def build_task(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> Task:
    return task_class(recipe.task)(tokenizer, recipe.data)
