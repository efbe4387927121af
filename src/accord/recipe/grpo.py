"""The recipe's `grpo:` section: online RL with group-relative advantages (task: grpo), and the
sampling, rewards and objective keys task: rloo reads too (recipe/rloo.py holds what rloo adds).

Kept out of recipe.py because the reward list is a small language of its own: each entry
names a kind (a built-in check, a Python callable, a reward-model folder) and a weight.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Reward(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)

    weight: float = Field(1.0, description="Factor of this reward in the sum that forms each completion's reward.")


class ExactMatchReward(_Reward):
    """1 when the completion (stripped) equals the row's `column` (stripped), else 0."""

    kind: Literal["exact_match"]
    column: str = Field("completion", description="The row's column holding the expected answer.")


class RegexReward(_Reward):
    """1 when the whole completion matches `pattern` (Python re.fullmatch, DOTALL), else 0."""

    kind: Literal["regex"]
    pattern: str = Field(..., description="Python regular expression the completion must match in full.")


class LengthReward(_Reward):
    """A length penalty: -(completion tokens / grpo.max_new_tokens), in [-1, 0]."""

    kind: Literal["length"]


class FunctionReward(_Reward):
    """A Python callable `module:function(prompts, completions, **columns) -> list[float]`
    (the columns are the rows' columns, one list each, as TRL's reward functions get them)."""

    kind: Literal["function"]
    function: str = Field(
        ..., description="Where the callable lives, as package.module:function (importable on every node)."
    )


class ModelReward(_Reward):
    """A reward model: a local AutoModelForSequenceClassification folder with one output,
    scoring prompt + completion."""

    kind: Literal["model"]
    path: str = Field(
        ...,
        description="Local folder or hub name ORG/NAME of the reward model (a sequence classifier, num_labels=1).",
    )
    revision: str | None = Field(None, description="A hub reward model: branch, tag or commit (default: main).")


RewardSpec = Annotated[
    ExactMatchReward | RegexReward | LengthReward | FunctionReward | ModelReward, Field(discriminator="kind")
]


class GRPOConfig(BaseModel):
    """Group relative policy optimisation: rows have a `prompt` (or chat `messages`) plus the
    columns the rewards read. task: rloo reads these keys too."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    group_size: int = Field(
        4,
        ge=2,
        description="Completions sampled per prompt (G); advantages are normalised within each group (rloo: each "
        "completion's baseline is the mean reward of the other G - 1).",
    )
    max_new_tokens: int = Field(32, gt=0, description="Longest sampled completion, in tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(
        1.0,
        gt=0,
        le=1.0,
        description="Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p.",
    )
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [ExactMatchReward(kind="exact_match")],
        min_length=1,
        description="Reward functions, summed with their weights: {kind: exact_match, column}, {kind: regex, pattern}, "
        "{kind: length}, {kind: function, function: pkg.mod:fn}, {kind: model, path: folder}.",
    )
    beta: float = Field(
        0.04,
        ge=0,
        description="Weight of the KL penalty to the reference (the starting model; adapters off under LoRA); "
        "0: no reference. grpo adds beta × the k3 estimator to each token's loss; rloo subtracts beta × the "
        "summed log-ratio of each completion from its reward (TRL's RLOO).",
    )
    epsilon: float = Field(
        0.2, gt=0, lt=1, description="Clipping range of the probability ratio: [1 - epsilon, 1 + epsilon]."
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="Optimizer steps per generation batch (each step reuses the batch's completions; "
        "ratios against the policy that generated them).",
    )
