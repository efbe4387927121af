"""The recipe's `kto:` section: Kahneman-Tversky optimisation (task: kto), named as TRL 1.16's KTOConfig names it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from accord.recipe.section import Section

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


class KTOConfig(Section):
    """Kahneman-Tversky optimisation: rows have `prompt`, `completion` and a boolean `label` (desirable or not),
    or `prompt`, `chosen`, `rejected` (each pair becomes a desirable and an undesirable row)."""

    beta: float = Field(
        0.1, gt=0, description="Strength of the anchor to the reference model (higher: less deviation from it)."
    )
    loss_type: Literal["kto", "apo_zero_unpaired"] = Field(
        "kto",
        description="kto: the KTO loss, each reward measured against the global batch's KL estimate; "
        "apo_zero_unpaired: APO-zero's unpaired loss, without the KL estimate.",
    )
    desirable_weight: float = Field(
        1.0, gt=0, description="Weight of the desirable rows' losses (to balance unequal counts of the two kinds)."
    )
    undesirable_weight: float = Field(
        1.0, gt=0, description="Weight of the undesirable rows' losses (to balance unequal counts of the two kinds)."
    )
    reference: str | None = Field(
        None,
        description="Folder of the frozen reference model (default: the starting model itself; with LoRA, the "
        "model with its adapters off).",
    )
