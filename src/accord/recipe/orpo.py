"""The recipe's `orpo:` section: odds-ratio preference optimisation (task: orpo), named as TRL names it."""

from __future__ import annotations

from pydantic import Field

from accord.recipe.section import Section


class ORPOConfig(Section):
    """Odds-ratio preference optimisation: rows have `prompt`, `chosen` and `rejected`; no reference model."""

    beta: float = Field(
        0.1,
        gt=0,
        description="Weight of the odds-ratio term next to the chosen sequences' NLL (the paper's lambda; TRL's beta).",
    )
