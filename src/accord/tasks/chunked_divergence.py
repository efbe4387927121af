"""Distillation's divergence without either model's whole logits (train.loss_chunk_size).

Both models' logits are rows × length × vocabulary, and the plain loss holds the teacher's,
the student's and their log-softmaxes at every position until backward. Here the output layer
of each model gets a second mode for one forward, served inside that model's own forward (where
every strategy has the layer's weight in place: see accord.tasks.chunked_loss, whose reasons
hold here too, and whose HeadCall serves both):

- the teacher's returns its logits at the target positions only (no gradient: held once,
  targets × vocabulary, prompts and padding never projected);
- the student's takes those and returns each target position's generalized JSD and its own
  entropy, `chunk` positions at a time, each chunk under torch.utils.checkpoint, so neither
  its forward nor its backward holds more than one chunk of its logits.

Why not TRL's chunked divergence (DistillationTrainer): it projects both models' hidden states
through their output layers outside the models' forwards, which needs the teacher's weight
gathered there (strategy-specific under ZeRO-3); and its kernel is Triton on GPUs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from accord.tasks.distill_loss import generalized_jsd


def logits_at(positions: torch.Tensor) -> Callable:
    """For the teacher's HeadCall: its logits at the flat `positions` of (rows × length), (n, vocabulary)."""

    def project(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
        return F.linear(picked, weight, bias)

    return project


def divergence_at(
    positions: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float, chunk: int
) -> Callable:
    """For the student's HeadCall: (n, 2), each target position's divergence from the teacher's
    logits there and the student's entropy (no gradient), `chunk` positions at a time."""

    def project(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        if len(positions) == 0:
            # No target (a padding row): still a graph through the output layer, so every
            # strategy's gradient hooks fire for it, as with the plain loss.
            return F.linear(flat[:1], weight, bias).float().sum().mul(0).expand(1, 2)
        picked = flat.index_select(0, positions)
        if len(positions) <= chunk or not torch.is_grad_enabled():
            # One chunk holds them all: recomputing it in backward would save nothing.
            return _chunk(picked, weight, bias, teacher_logits, beta, temperature)
        pieces = []
        for start in range(0, len(positions), chunk):
            part = slice(start, start + chunk)
            args = (picked[part], weight, bias, teacher_logits[part], beta, temperature)
            # Recomputed in backward: only this chunk's logits live at any time (no randomness to replay).
            pieces.append(checkpoint(_chunk, *args, use_reentrant=False, preserve_rng_state=False))
        return torch.cat(pieces)

    return project


def _chunk(hidden, weight, bias, teacher_logits, beta: float, temperature: float) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()
    divergence = generalized_jsd(logits, teacher_logits, beta, temperature)
    return torch.stack([divergence, entropy(logits.detach(), temperature)], dim=1)


def entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(..., V) -> (...) entropy of softmax(logits / temperature), in nats (fp32)."""
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)
