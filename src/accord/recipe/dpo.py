"""The recipe's `dpo:` section: direct preference optimisation and its loss family (task: dpo).

Kept out of schema.py because the loss family is a small language of its own: a list of TRL's
loss names, their weights, and the few parameters some of them take. Every loss here is a sum
over pairs of a function of that pair's log-probability sums, so the trainer's division by
the global batch's pairs keeps the update the same at every world and micro-batch size.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from accord.recipe.section import Section

# TRL 1.16's DPOTrainer loss names that accord computes (accord.tasks.preference_losses
# holds their maths); `sft` is the chosen answers' NLL (RPO's term, also dpo.rpo_alpha).
DPO_LOSSES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
# TRL's losses that sort the log-ratios over the batch: their update depends on which pairs
# share a forward pass, so no split of the global batch can reproduce another's.
_BATCH_SORTED = ("aot", "aot_unpaired", "aot_pair")
# The losses that read dpo.label_smoothing (TRL 1.16: the others ignore it).
SMOOTHED = ("robust", "exo_pair")


class DPOConfig(Section):
    """Direct preference optimisation: rows have `prompt`, `chosen` and `rejected`."""

    beta: float = Field(
        0.1,
        gt=0,
        description="Strength of the KL anchor to the reference model (ipo: the regulariser τ; sppo_hard: the "
        "margins are ±0.5/beta).",
    )
    reference: str | None = Field(
        None, description="Folder of the frozen reference model (default: the starting model itself)."
    )
    precompute_reference: bool = Field(
        False,
        description="Compute the reference log-probabilities once before training instead of running the reference "
        "every step.",
    )
    loss_type: list[str] = Field(
        ["sigmoid"],
        description="TRL's DPO loss, or a list of them summed with dpo.loss_weights: "
        + ", ".join(DPO_LOSSES)
        + " (docs/tasks-and-data.md says what each is).",
    )
    loss_weights: list[float] | None = Field(
        None, description="One weight per dpo.loss_type entry (default: 1 each), as TRL's loss_weights."
    )
    label_smoothing: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="robust: the probability that a preference label is flipped, in [0, 0.5); exo_pair: its ε, "
        "above 0 (the EXO paper uses 1e-3). The other losses take none.",
    )
    reference_free: bool = Field(
        False,
        description="Score the pairs against a uniform reference (reference log-probabilities 0): no reference "
        "model is built or run.",
    )
    rpo_alpha: float | None = Field(
        None,
        gt=0,
        description="Add this times the chosen answers' NLL (each answer's mean token NLL; RPO): TRL's `sft` loss "
        "with this weight.",
    )
    discopop_tau: float = Field(
        0.05, gt=0, description="discopop: the temperature of the log-ratio modulation (the paper's 0.05)."
    )

    @field_validator("loss_type", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("loss_type")
    @classmethod
    def _known_losses(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError(f"dpo.loss_type is empty; give one of: {', '.join(DPO_LOSSES)}")
        for name in value:
            if name in _BATCH_SORTED:
                raise ValueError(
                    f"dpo.loss_type={name}: it sorts the log-ratios over each forward pass's pairs, so its update "
                    f"changes with micro_batch_size and world size; accord does not offer it (valid: "
                    f"{', '.join(DPO_LOSSES)})"
                )
            if name not in DPO_LOSSES:
                raise ValueError(f"dpo.loss_type: unknown loss {name!r} (valid: {', '.join(DPO_LOSSES)})")
        if len(set(value)) < len(value):
            raise ValueError(f"dpo.loss_type={value} names a loss twice; give each once and weigh it in loss_weights")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> DPOConfig:
        losses = self.loss_type
        if self.loss_weights is not None and len(self.loss_weights) != len(losses):
            raise ValueError(
                f"dpo.loss_weights has {len(self.loss_weights)} weights for {len(losses)} loss types {losses}; "
                "give one weight per dpo.loss_type entry"
            )
        if self.label_smoothing > 0 and not set(losses) & set(SMOOTHED):
            raise ValueError(
                f"dpo.label_smoothing={self.label_smoothing} has no effect on dpo.loss_type={losses} (only "
                f"{' and '.join(SMOOTHED)} read it, as in TRL); remove it or add one of them"
            )
        if "robust" in losses and self.label_smoothing >= 0.5:
            raise ValueError(
                f"dpo.label_smoothing={self.label_smoothing} with loss_type robust: the flip probability must be in "
                "[0, 0.5)"
            )
        if "exo_pair" in losses and self.label_smoothing == 0:
            raise ValueError("dpo.loss_type exo_pair needs dpo.label_smoothing > 0 (its ε; the EXO paper uses 1e-3)")
        if self.rpo_alpha is not None and "sft" in losses:
            raise ValueError(
                "dpo.rpo_alpha and dpo.loss_type sft are the same NLL term; give one (rpo_alpha is sft with its weight)"
            )
        if self.reference_free and (self.reference is not None or self.precompute_reference):
            key = "dpo.reference" if self.reference is not None else "dpo.precompute_reference"
            raise ValueError(f"dpo.reference_free=true uses no reference model; remove {key}")
        return self

    def weighted_losses(self) -> list[tuple[str, float]]:
        """(loss name, weight) of every term of the loss, dpo.rpo_alpha's NLL included."""
        weights = self.loss_weights or [1.0] * len(self.loss_type)
        terms = list(zip(self.loss_type, weights))
        return terms + ([("sft", self.rpo_alpha)] if self.rpo_alpha is not None else [])
