"""The recipe's `distill:` section: knowledge distillation from a frozen teacher (task: distill), named as
TRL 1.16's GKDConfig names its keys (lmbda, beta, seq_kd, temperature, max_new_tokens), with its defaults
but temperature's: here it also sets the divergence's temperature, so its default is 1 (GKD's 0.9 only samples)."""

from __future__ import annotations

from pydantic import Field

from accord.recipe.section import Section


class DistillConfig(Section):
    """Knowledge distillation (GKD): the student learns the teacher's next-token distribution on the completions of
    the data (prompt/completion or chat messages, as sft reads them), on its own sampled completions (lmbda) or on
    the teacher's (seq_kd), through the generalized Jensen-Shannon divergence."""

    teacher: str | None = Field(
        None,
        description="The frozen teacher: a model folder or a hub name (ORG/NAME). Its vocabulary must be the "
        "student's. Required by task distill.",
    )
    teacher_revision: str | None = Field(
        None, description="The teacher's hub branch, tag or commit (a hub name only; default: main)."
    )
    beta: float = Field(
        0.5,
        ge=0,
        le=1,
        description="The generalized JSD's interpolation: 0 the forward KL(teacher ‖ student), 1 the reverse "
        "KL(student ‖ teacher), in between the JSD with mixture beta·teacher + (1 − beta)·student.",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        description="Softmax temperature of both models' distributions in the divergence, and the sampling "
        "temperature of generated completions (as TRL's DistillationTrainer; GKDTrainer samples at it but "
        "compares at 1).",
    )
    lmbda: float = Field(
        0.5,
        ge=0,
        le=1,
        description="The probability that a step's completions are sampled from the student (on-policy) instead "
        "of taken from the data; 0: off-policy only, 1: on-policy only. The choice is one per optimizer step, "
        "drawn from the seed and the step.",
    )
    seq_kd: bool = Field(
        False,
        description="On the steps that are not on-policy, train on completions sampled from the teacher "
        "(sequence-level KD) instead of the data's.",
    )
    max_new_tokens: int = Field(128, gt=0, description="Longest sampled completion (lmbda > 0 or seq_kd), in tokens.")
