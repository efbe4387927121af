"""The recipe's `moe:` section: how a mixture-of-experts model's router is kept balanced."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from accord.recipe.section import Section

BALANCE_LOSSES = ("global_batch", "per_forward", "off")


class MoEConfig(Section):
    """Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE, ...): the router's load-balancing loss. Ignored by a
    dense model only while left at its defaults."""

    balance_loss: Literal["global_batch", "per_forward", "off"] = Field(
        "global_batch",
        description="global_batch: the Switch-style balancing loss from the router statistics of the whole global "
        "batch (every token of every micro-batch on every rank), so the objective does not depend on micro-batch "
        "size, accumulation or process count (costs one gradient-free forward per step); per_forward: the model's "
        "own aux_loss of each forward, averaged over the step's forwards (what transformers.Trainer adds with "
        "output_router_logits, which changes with the split); off: no balancing loss.",
    )
    aux_loss_coef: float | None = Field(
        None,
        ge=0,
        description="Weight of the balancing loss (default: the model config's router_aux_loss_coef, else 0.001).",
    )
    z_loss_coef: float | None = Field(
        None,
        ge=0,
        description="Weight of the router z-loss, the mean squared log-sum-exp of the router logits (default: the "
        "model config's router_z_loss_coef, else 0: off). Counted over the same tokens as the balancing loss.",
    )
