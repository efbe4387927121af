"""Preference losses on per-pair log-probability sums: DPO's family, as TRL 1.16's DPOTrainer
names them (recipe.dpo.DPO_LOSSES).

Each loss maps a pair's summed answer log-probabilities (policy and reference, chosen and
rejected) and answer lengths to one value per pair, and nothing else: no statistic of the
batch enters, so a sum of them over any split of the global batch is the same sum. The task
returns that sum and the trainer divides by the global batch's pairs, which is TRL's
per-batch mean when the batch is one forward pass. Other pairwise methods can reuse PairLogps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PairLogps:
    """Per-pair tensors (one value per pair): summed answer log-probabilities and answer tokens."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    @property
    def chosen_logratio(self) -> torch.Tensor:
        return self.chosen - self.ref_chosen

    @property
    def rejected_logratio(self) -> torch.Tensor:
        return self.rejected - self.ref_rejected

    @property
    def delta(self) -> torch.Tensor:
        """The chosen-minus-rejected log-ratio, what DPO's own loss scores."""
        return self.chosen_logratio - self.rejected_logratio

    @property
    def mean_delta(self) -> torch.Tensor:
        """The same with each log-ratio averaged over its answer's tokens (ipo, sigmoid_norm)."""
        return self.chosen_logratio / self.chosen_tokens.clamp(min=1) - self.rejected_logratio / (
            self.rejected_tokens.clamp(min=1)
        )


@dataclass(frozen=True)
class LossParams:
    beta: float
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05


Loss = Callable[[PairLogps, LossParams], torch.Tensor]


def _sigmoid(p: PairLogps, k: LossParams) -> torch.Tensor:
    return -F.logsigmoid(k.beta * p.delta)


def _hinge(p: PairLogps, k: LossParams) -> torch.Tensor:
    return torch.relu(1 - k.beta * p.delta)


def _ipo(p: PairLogps, k: LossParams) -> torch.Tensor:
    # IPO's squared loss on the per-token log-ratios: TRL averages each answer's log-ratio over
    # its tokens so that beta (IPO's τ) means the same at every answer length.
    return (p.mean_delta - 1 / (2 * k.beta)) ** 2


def _exo_pair(p: PairLogps, k: LossParams) -> torch.Tensor:
    # KL(q || p_ε) over {chosen, rejected}, q = softmax of the two rewards, p_ε = [1-ε, ε].
    z = k.beta * p.delta
    eps = torch.tensor(k.label_smoothing, dtype=z.dtype, device=z.device)
    return torch.sigmoid(z) * (F.logsigmoid(z) - torch.log1p(-eps)) + torch.sigmoid(-z) * (
        F.logsigmoid(-z) - torch.log(eps)
    )


def _nca_pair(p: PairLogps, k: LossParams) -> torch.Tensor:
    chosen, rejected = k.beta * p.chosen_logratio, k.beta * p.rejected_logratio
    return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)


def _robust(p: PairLogps, k: LossParams) -> torch.Tensor:
    z, eps = k.beta * p.delta, k.label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


def _bco_pair(p: PairLogps, k: LossParams) -> torch.Tensor:
    # TRL 1.16's form has no running reward mean: each pair alone.
    return -F.logsigmoid(k.beta * p.chosen_logratio) - F.logsigmoid(-k.beta * p.rejected_logratio)


def _sppo_hard(p: PairLogps, k: LossParams) -> torch.Tensor:
    return (p.chosen_logratio - 0.5 / k.beta) ** 2 + (p.rejected_logratio + 0.5 / k.beta) ** 2


def _apo_zero(p: PairLogps, k: LossParams) -> torch.Tensor:
    return 1 - torch.sigmoid(k.beta * p.chosen_logratio) + torch.sigmoid(k.beta * p.rejected_logratio)


def _apo_down(p: PairLogps, k: LossParams) -> torch.Tensor:
    return torch.sigmoid(k.beta * p.chosen_logratio) + 1 - torch.sigmoid(k.beta * p.delta)


def _discopop(p: PairLogps, k: LossParams) -> torch.Tensor:
    z = k.beta * p.delta
    mix = torch.sigmoid(z / k.discopop_tau)
    return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix


def _sft(p: PairLogps, k: LossParams) -> torch.Tensor:
    # Each chosen answer's mean token NLL. TRL averages over the chosen tokens of the whole
    # forward pass instead, a statistic of the batch: the two agree when a batch's chosen
    # answers have one length.
    return -p.chosen / p.chosen_tokens.clamp(min=1)


def _sigmoid_norm(p: PairLogps, k: LossParams) -> torch.Tensor:
    return -F.logsigmoid(k.beta * p.mean_delta)


LOSSES: dict[str, Loss] = {
    "sigmoid": _sigmoid,
    "hinge": _hinge,
    "ipo": _ipo,
    "exo_pair": _exo_pair,
    "nca_pair": _nca_pair,
    "robust": _robust,
    "bco_pair": _bco_pair,
    "sppo_hard": _sppo_hard,
    "apo_zero": _apo_zero,
    "apo_down": _apo_down,
    "discopop": _discopop,
    "sft": _sft,
    "sigmoid_norm": _sigmoid_norm,
}


def pair_loss(p: PairLogps, terms: list[tuple[str, float]], params: LossParams) -> torch.Tensor:
    """Per-pair loss: the weighted sum of the named losses (TRL's loss_type with loss_weights)."""
    return sum(weight * LOSSES[name](p, params) for name, weight in terms)
