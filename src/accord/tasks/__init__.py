"""Training methods: how a micro-batch becomes (loss_sum, n_targets). Tasks know nothing of ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from accord.recipe import Recipe

if TYPE_CHECKING:
    from accord.tasks.base import Task


def task_class(name: str) -> type:
    if name == "sft":
        from accord.tasks.sft import SFTTask

        return SFTTask
    if name == "pretrain":
        from accord.tasks.pretrain import PretrainTask

        return PretrainTask
    if name == "classify":
        from accord.tasks.classify import ClassifyTask

        return ClassifyTask
    if name == "dpo":
        from accord.tasks.dpo import DPOTask

        return DPOTask
    raise ValueError(f"unknown task {name!r}")


def build_task(recipe: Recipe, tokenizer) -> Task:
    return task_class(recipe.task)(tokenizer, recipe)
