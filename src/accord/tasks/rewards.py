"""GRPO's reward functions: built-in checks, user callables and reward models, each scoring
one prompt's group of completions. Everything a user can get wrong in the list is found when
the task is built (before training); a callable that fails while training is one line naming
the function and the row."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from accord.data.rows import SOURCE, row_origin
from accord.errors import RunStopped, UserInputError
from accord.recipe.grpo import ExactMatchReward, FunctionReward, GRPOConfig, LengthReward, ModelReward, RegexReward
from accord.recipe.hub import local_path
from accord.recipe.paths import PathError
from accord.registry import load_object


class RewardFailed(RunStopped):
    """A reward function raised or gave a value that is not a finite number."""


@dataclass
class Group:
    """What every reward sees: one prompt, its row's columns, and its group of completions."""

    prompt: str
    row: dict[str, Any]
    completions: list[str]
    lengths: list[int]  # completion tokens (EOS included when sampled)
    index: int | None = None  # the row's index in the prepared data (named when it has no file and line)


Scorer = Callable[[Group], list[float]]


class RewardFunctions:
    def __init__(self, cfg: GRPOConfig):
        self.cfg = cfg
        self.names: list[str] = []
        self.weights: list[float] = []
        self._scorers: list[Scorer] = []
        self._models: list[tuple[int, ModelReward]] = []  # loaded in load(), where the device is known
        for i, spec in enumerate(cfg.rewards):
            self.names.append(self._unique(_name(spec)))
            self.weights.append(spec.weight)
            self._scorers.append(self._scorer(i, spec))

    def _unique(self, name: str) -> str:
        taken = set(self.names)
        return name if name not in taken else next(f"{name}_{k}" for k in range(2, 100) if f"{name}_{k}" not in taken)

    def _scorer(self, i: int, spec) -> Scorer:
        where = f"grpo.rewards[{i}]"
        if isinstance(spec, ExactMatchReward):
            return lambda g: [float(c.strip() == str(g.row.get(spec.column, "")).strip()) for c in g.completions]
        if isinstance(spec, RegexReward):
            try:
                pattern = re.compile(spec.pattern, re.DOTALL)
            except re.error as e:
                raise UserInputError(
                    f"{where}.pattern: {spec.pattern!r} is not a valid regular expression ({e})"
                ) from None
            return lambda g: [float(pattern.fullmatch(c) is not None) for c in g.completions]
        if isinstance(spec, LengthReward):
            return lambda g: [-n / self.cfg.max_new_tokens for n in g.lengths]
        if isinstance(spec, FunctionReward):
            fn = load_object(spec.function, f"{where}.function")
            if not callable(fn):
                raise UserInputError(f"{where}.function: {spec.function} is not callable")
            return _checked_callable(fn, spec.function)
        check_reward_model(spec.path, f"{where}.path", spec.revision)
        self._models.append((i, spec))
        return lambda g: []  # replaced in load()

    def load(self, device: torch.device) -> None:
        """Load the reward models (once the device is known)."""
        for i, spec in self._models:
            self._scorers[i] = _ModelScorer(spec.path, device, spec.revision)

    def columns(self) -> set[str]:
        """Row columns the built-in rewards read (checked against the data before training)."""
        return {spec.column for spec in self.cfg.rewards if isinstance(spec, ExactMatchReward)}

    def score(self, group: Group) -> torch.Tensor:
        """(functions, G) raw rewards of a group; a bad value is one line naming function and row."""
        rows = []
        for name, scorer in zip(self.names, self._scorers):
            values = scorer(group)
            if len(values) != len(group.completions):
                raise RewardFailed(
                    f"reward {name} returned {len(values)} values for {len(group.completions)} completions "
                    f"({_origin(group)})"
                )
            bad = [v for v in values if not isinstance(v, (int, float)) or not math.isfinite(v)]
            if bad:
                raise RewardFailed(f"reward {name} returned {bad[0]!r} (not a finite number) for {_origin(group)}")
            rows.append([float(v) for v in values])
        return torch.tensor(rows, dtype=torch.float64)


def _name(spec) -> str:
    if isinstance(spec, FunctionReward):
        return spec.function.rpartition(":")[2]
    if isinstance(spec, ModelReward):
        return f"model:{Path(spec.path).name}"
    return spec.kind


def _origin(g: Group) -> str:
    """The row's file and line, else its index in the data; with the start of its prompt."""
    where = row_origin(g.row) if SOURCE in g.row else f"data row {g.index}"
    prompt = g.prompt if len(g.prompt) <= 40 else g.prompt[:37] + "..."
    return f"{where} (prompt {prompt!r})"


def _checked_callable(fn: Callable, path: str) -> Scorer:
    def score(g: Group) -> list[float]:
        columns = {
            k: [v] * len(g.completions)
            for k, v in g.row.items()
            if not k.startswith("__") and k not in ("prompt", "completions")
        }
        try:
            values = fn(prompts=[g.prompt] * len(g.completions), completions=list(g.completions), **columns)
        except Exception as e:
            raise RewardFailed(f"reward function {path} raised {type(e).__name__}: {e} on {_origin(g)}") from None
        try:
            return list(values)
        except TypeError:
            raise RewardFailed(
                f"reward function {path} returned {type(values).__name__}, not a list of numbers, on {_origin(g)}"
            ) from None

    return score


def check_reward_model(path: str, where: str, revision: str | None = None) -> None:
    """A reward-model folder must hold a sequence classifier with one output."""
    from transformers import AutoConfig

    try:
        folder = local_path(path, revision, where=where)
        config = AutoConfig.from_pretrained(str(folder))
    except (PathError, OSError, ValueError) as e:
        raise UserInputError(f"{where}: {path} is not a model folder ({' '.join(str(e).split())[:200]})") from None
    architectures = config.architectures or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise UserInputError(
            f"{where}: {path} is not a sequence classifier (architectures {architectures or 'unknown'}); "
            "a reward model is an AutoModelForSequenceClassification folder with num_labels=1 "
            "(e.g. the final/ of task: reward)"
        )
    if config.num_labels != 1:
        raise UserInputError(f"{where}: {path} has {config.num_labels} outputs; a reward model has one (num_labels=1)")


class _ModelScorer:
    """Scores prompt + completion with a frozen sequence classifier (its own tokenizer)."""

    def __init__(self, path: str, device: torch.device, revision: str | None = None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        folder = str(local_path(path, revision))
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(folder).to(device).eval().requires_grad_(False)
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = device

    @torch.no_grad()
    def __call__(self, g: Group) -> list[float]:
        texts = [g.prompt + c for c in g.completions]
        batch = self.tokenizer(texts, return_tensors="pt", padding=True).to(self.device)
        return self.model(**batch).logits[:, 0].float().tolist()
