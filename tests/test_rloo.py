"""task: rloo — the leave-one-out objective against TRL's RLOOTrainer code, and its bad input."""

from __future__ import annotations

import json
import types
from collections import defaultdict

import pytest
import torch

from accord.recipe.schema import RecipeError, validate_recipe
from accord.tasks.grpo_loss import clipped_surrogate
from accord.tasks.rloo import leave_one_out
from conftest import TINY_RECIPE


def test_sequence_loss_and_gradient_equal_trl_rloo_trainer_compute_loss():
    """TRL's RLOOTrainer._compute_loss (per-sequence ratio of summed log-probs, mean over the
    batch) on the same log-probabilities, old values and advantages (fed to TRL directly);
    the advantages are accord's leave-one-out ones of random rewards."""
    trainer_mod = pytest.importorskip("trl.trainer.rloo_trainer")
    torch.manual_seed(0)
    b, t, eps = 6, 5, 0.2
    logps = (torch.randn(b, t) * 0.5 - 1.0).requires_grad_(True)
    mask = (torch.rand(b, t) > 0.25).float()
    mask[:, 0] = 1
    old_seq = (logps.detach() * mask).sum(1) + torch.randn(b) * 0.3  # ratios outside 1 ± eps: clipping active
    advantages = torch.cat([leave_one_out(torch.randn(3)) for _ in range(2)])
    fake = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros(b, t), None),
        epsilon_low=eps,
        epsilon_high=eps,
        aux_loss_enabled=False,
        model=types.SimpleNamespace(training=True),
        accelerator=types.SimpleNamespace(reduce=lambda x, reduction: x, gather=lambda x: x),
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    inputs = {
        "prompt_ids": torch.ones(b, 2, dtype=torch.long),
        "prompt_mask": torch.ones(b, 2, dtype=torch.long),
        "completion_ids": torch.ones(b, t, dtype=torch.long),
        "completion_mask": mask,
        "old_logps": old_seq,
        "advantages": advantages,
    }
    trl_loss = trainer_mod.RLOOTrainer._compute_loss(fake, None, inputs)
    (trl_grad,) = torch.autograd.grad(trl_loss, logps)
    ours = clipped_surrogate(torch.exp((logps * mask).sum(1) - old_seq), advantages, eps).sum() / b
    (our_grad,) = torch.autograd.grad(ours, logps)
    assert abs(ours.item() - trl_loss.item()) < 1e-6 and abs(trl_loss.item()) > 1e-3
    assert torch.allclose(our_grad, trl_grad, atol=1e-7)


def test_leave_one_out_baseline_is_the_mean_of_the_other_completions():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0], dtype=torch.float64)
    expected = torch.tensor([1 - 2 / 3, 0 - 1.0, 0 - 1.0, 2 - 1 / 3], dtype=torch.float64)
    assert torch.allclose(leave_one_out(rewards), expected)


def test_a_group_of_one_is_one_line():
    raw = json.loads(json.dumps({**TINY_RECIPE, "task": "rloo", "grpo": {"group_size": 1}}))
    with pytest.raises(RecipeError) as e:
        validate_recipe(raw)
    assert "grpo.group_size" in str(e.value) and "\n" not in str(e.value), str(e.value)
