"""The generalized Jensen-Shannon divergence of knowledge distillation (GKD, arXiv 2306.13649
eq. 1), per target token, for a future `task: distill`.

With p_s the student's and p_t the teacher's next-token distribution (both at `temperature`)
and the mixture m = (1 - beta)·p_s + beta·p_t, a token's divergence is
beta·KL(p_t ‖ m) + (1 - beta)·KL(p_s ‖ m); beta = 0 is taken as the forward KL(p_t ‖ p_s) and
beta = 1 as the reverse KL(p_s ‖ p_t), the limits TRL's GKDTrainer and DistillationTrainer use.
Returned per position (summed over the vocabulary), so a task sums it over its targets and the
trainer divides by the targets of the whole global batch.
"""

from __future__ import annotations

import math

import torch


def generalized_jsd(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float = 1.0
) -> torch.Tensor:
    """(..., V) logits of both models -> (...) divergence per position, in fp32."""
    log_s = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if beta == 0:
        return (log_t.exp() * (log_t - log_s)).sum(-1)
    if beta == 1:
        return (log_s.exp() * (log_s - log_t)).sum(-1)
    log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
    return (beta * log_t.exp() * (log_t - log_m) + (1 - beta) * log_s.exp() * (log_s - log_m)).sum(-1)
