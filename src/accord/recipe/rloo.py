"""The recipe's `rloo:` section (task: rloo): only what REINFORCE leave-one-out adds to the
`grpo:` section, whose sampling, reward, beta, epsilon and num_iterations keys it reads, so a
recipe switches between the two methods by its `task` alone."""

from __future__ import annotations

from pydantic import Field, field_validator

from accord.recipe.section import Section


class RLOOConfig(Section):
    """REINFORCE leave-one-out: each completion's advantage is its reward minus the mean reward
    of the other completions of its prompt (TRL's RLOOTrainer)."""

    normalize_advantages: bool = Field(
        False,
        description="Scale the advantages to mean 0 and standard deviation 1 over the whole global batch "
        "(TRL's normalize_advantages).",
    )
    reward_clip: tuple[float, float] | None = Field(
        None,
        description="Clip each completion's weighted reward to [min, max] before the KL penalty and the "
        "baseline (TRL's reward_clip_range); null: no clipping.",
    )

    @field_validator("reward_clip")
    @classmethod
    def _ordered(cls, bounds: tuple[float, float] | None) -> tuple[float, float] | None:
        if bounds is not None and not bounds[0] < bounds[1]:
            raise ValueError(f"rloo.reward_clip={list(bounds)}: give [min, max] with min < max, e.g. [-1, 1]")
        return bounds
