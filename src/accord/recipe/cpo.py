"""The recipe's `cpo:` section: contrastive preference optimisation and SimPO (task: cpo), named as TRL names it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from accord.recipe.section import Section

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


class CPOConfig(Section):
    """Contrastive preference optimisation: rows have `prompt`, `chosen` and `rejected`; no reference model."""

    beta: float = Field(
        0.1, gt=0, description="Temperature of the preference term (for ipo: its regularisation, the paper's tau)."
    )
    loss_type: Literal["sigmoid", "hinge", "ipo", "simpo"] = Field(
        "sigmoid",
        description="sigmoid: -log σ(β·margin) of the summed answer log-probabilities; hinge: relu(1 − β·margin); "
        "ipo: (margin − 1/(2β))² of the mean log-probabilities per answer token; simpo: the sigmoid loss of the "
        "mean log-probabilities with the target margin simpo_gamma.",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        le=0.5,
        description="sigmoid and simpo: the assumed probability that a pair's preference is flipped (conservative "
        "loss); ignored by hinge and ipo.",
    )
    simpo_gamma: float = Field(0.5, description="simpo: the target reward margin.")
    cpo_alpha: float = Field(
        1.0, ge=0, description="Weight of the chosen answers' NLL next to the preference term (0: none, pure SimPO)."
    )
