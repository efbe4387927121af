"""`accord import`: the inputs read, converted, validated as a recipe and written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from accord.interop.convert import convert
from accord.interop.job_keys import Job, Row
from accord.interop.sources import read_inputs

# The written recipe's sections, in the order the recipe reference lists them.
_ORDER = (
    "seed",
    "model",
    "task",
    "data",
    "batch",
    "optim",
    "train",
    "dpo",
    "kto",
    "grpo",
    "lora",
    "engine",
    "checkpoint",
    "output",
)


def build_job(
    paths: list[str], command: list[str], devices: int | None = None, nodes: int | None = None, task: str | None = None
) -> Job:
    job = read_inputs(paths, command, task)
    if devices is not None:
        job.devices = devices
    if nodes is not None:
        job.nodes = nodes
    return job


def import_recipe(job: Job, overrides: list[str] | tuple[str, ...] = ()) -> tuple[dict[str, Any], list[Row]]:
    """(the recipe as written, the report rows); the recipe validated with `overrides` applied."""
    from accord.recipe.schema import apply_override, validate_recipe

    recipe, rows = convert(job)
    if job.task == "trainer":
        recipe.setdefault("data", {}).setdefault("completion_only_loss", False)
        rows.append(
            Row(
                "(TrainingArguments)",
                "train.py",
                "Trainer",
                "changed",
                "task='sft', data.completion_only_loss=False",
                "transformers.Trainer trains on the labels its collator gives: every token of a causal LM",
            )
        )
    # The world the original ran on: the same micro batch and accumulation on CPU workers.
    recipe.setdefault("engine", {})["processes"] = job.world
    ordered = {k: recipe[k] for k in _ORDER if k in recipe} | {k: v for k, v in recipe.items() if k not in _ORDER}
    checked = yaml.safe_load(yaml.safe_dump(ordered, sort_keys=False))
    for item in overrides:
        apply_override(checked, item)
    validate_recipe(checked, source="imported recipe")
    return checked, rows


def write_recipe(recipe: dict[str, Any], path: Path) -> None:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
