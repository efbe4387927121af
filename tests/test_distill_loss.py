"""The generalized JSD of distillation against TRL's own GKDTrainer.generalized_jsd_loss."""

from __future__ import annotations

import pytest
import torch

from accord.tasks.distill_loss import generalized_jsd


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_summed_token_divergence_and_gradient_equal_trls_gkd_loss(beta, temperature):
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    torch.manual_seed(0)
    student = torch.randn(3, 5, 11, requires_grad=True)
    teacher = torch.randn(3, 5, 11)
    labels = torch.randint(0, 11, (3, 5))
    labels[0, :2] = labels[2, 4] = -100
    theirs = gkd.GKDTrainer.generalized_jsd_loss(
        student, teacher, labels=labels, beta=beta, temperature=temperature, reduction="sum"
    )
    (their_grad,) = torch.autograd.grad(theirs, student)
    ours = (generalized_jsd(student, teacher, beta, temperature) * (labels != -100)).sum()
    (our_grad,) = torch.autograd.grad(ours, student)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-7)
    assert torch.allclose(our_grad, their_grad, atol=1e-7)
    assert ours.item() > 0
