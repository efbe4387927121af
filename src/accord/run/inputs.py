"""What a run is built from before any model exists: tokenizer -> task -> prepared data ->
training rows, the one chain every command that reads a recipe's data walks (the checks,
the run's assembly, `accord prepare`, `accord data`; `accord plan` its first half).

Built once per process: where the checks that stop a bad run (launch/preflight.py) run in
the process that then trains (the node's first worker, or every worker under an outer
launcher), they keep what they built and the assembly (run/assemble.py) takes it instead of
building it again; anywhere else nothing is kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from accord.data.nodeshare import NodeShare
from accord.data.packing import Rows, training_rows
from accord.data.prepare import PreparedData, prepare_data
from accord.errors import UserInputError
from accord.models.build import build_tokenizer
from accord.tasks import build_task
from accord.tasks.base import Task
from accord.tasks.config import TaskConfig


@dataclass(frozen=True)
class RunInputs:
    tokenizer: Any
    task: Task
    data: PreparedData
    rows: Rows  # the training rows the global order draws its batches from


# What this process's checks built for the run it is about to train, and the task config it was built from.
_kept: tuple[TaskConfig, RunInputs] | None = None


class TokenizerError(UserInputError):
    """The recipe's tokenizer cannot be loaded; the message names it and why."""


def tokenizer_and_task(config: TaskConfig) -> tuple[Any, Task]:
    """The tokenizer of the task's model (config.model) and the task built with it."""
    model = config.model
    try:
        tokenizer = build_tokenizer(model)
    except UserInputError:
        raise
    except Exception as e:  # transformers and tokenizers raise many kinds; all mean the same to the user
        where = "model.tokenizer" if model.tokenizer else "model.path"
        reason = " ".join(str(e).split())[:300]
        raise TokenizerError(
            f"{where}: the tokenizer in {model.tokenizer or model.path} cannot be loaded: {type(e).__name__}: {reason}"
        ) from None
    return tokenizer, build_task(config, tokenizer)


def build_inputs(config: TaskConfig, preparer: bool, share: NodeShare | None = None) -> RunInputs:
    """The chain for a task's config (everything the chain reads: the model's tokenizer, the
    task, the data section and seed): what this process's checks kept for it, else built here.
    `preparer`: this process tokenizes (else it waits for the node's first process to)."""
    global _kept
    if _kept is not None and _kept[0] == config:
        inputs, _kept = _kept[1], None  # taken once: nothing lingers for the rest of the run
        return inputs
    tokenizer, task = tokenizer_and_task(config)
    data = prepare_data(config.data, config.seed, tokenizer, task, preparer=preparer, share=share)
    return RunInputs(tokenizer, task, data, training_rows(data.train, task.row_capacity))


def keep(config: TaskConfig, inputs: RunInputs) -> None:
    """This process trains the task of `config` next: its assembly takes `inputs` instead of
    rebuilding them."""
    global _kept
    _kept = (config, inputs)
