"""The clipped policy-gradient objective (per token for grpo, per completion for rloo) and the
k3 KL penalty."""

from __future__ import annotations

import torch


def grpo_token_loss(
    logps, old_logps, advantages, ref_logps, beta: float, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token GRPO loss (before masking) and the probability ratio: -min(r·A, clip(r, 1±ε)·A)
    + β·KL₃(π ‖ π_ref), with r = exp(log π − log π_old) (DeepSeekMath eq. 3, TRL's formula)."""
    ratio = torch.exp(logps - old_logps)
    per_token = clipped_surrogate(ratio, advantages, epsilon)
    if ref_logps is not None and beta > 0:
        per_token = per_token + beta * kl_k3(logps, ref_logps)
    return per_token, ratio


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π ‖ π_ref) per token: exp(ref − π) − (ref − π) − 1 ≥ 0."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, epsilon: float) -> torch.Tensor:
    """PPO's clipped objective as a loss: -min(r·A, clip(r, 1±ε)·A)."""
    return -torch.min(ratio * advantages, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * advantages)


def clipped(ratio: torch.Tensor, advantages: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Where the clip is active (the ratio's gradient is cut): TRL's clip-ratio metric."""
    return ((ratio < 1 - epsilon) & (advantages < 0)) | ((ratio > 1 + epsilon) & (advantages > 0))
