"""task: rloo — the leave-one-out objective against TRL's RLOOTrainer code, its bad input, and
(slow tier) the update's independence of the layout: world size and accumulation, fsdp and
zero3 against ddp, and resume on another world size."""

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
from test_grpo import GRPO_RUN


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


# ---------------------------------------------------------------- runs (slow tier)

RLOO_RUN = {
    **GRPO_RUN,  # grpo's run: the same model, prompts, sampling and rewards
    "task": "rloo",
    "checkpoint": {"every_steps": 2},
    # normalised over the whole global batch: the one statistic that spans ranks and micro batches
    "rloo": {"normalize_advantages": True},
}


@pytest.fixture(scope="module")
def rloo_runs(tmp_path_factory):
    """rloo on 1 process × 4 prompts and on 2 processes × 1 prompt × 2 accumulation steps, the
    same recipe, checkpoints at step 2; the layout tests below compare against these two runs."""
    from conftest import assert_ok, run_accord, write_recipe

    root = tmp_path_factory.mktemp("rloo")
    recipe = write_recipe(root / "rloo.yaml", {**RLOO_RUN, "data": {**RLOO_RUN["data"], "cache_dir": str(root / "c")}})
    outs = {}
    for processes, micro in ((1, 4), (2, 1)):
        outs[processes] = root / f"p{processes}"
        args = (f"engine.processes={processes}", f"batch.micro_batch_size={micro}", f"output.dir={outs[processes]}")
        assert_ok(run_accord("train", recipe, *args, timeout=600))
    return outs


def _samples(out) -> set[tuple]:
    lines = (out / "samples.jsonl").read_text().splitlines()
    return {(s["step"], s["prompt"], s["completion"]) for s in map(json.loads, lines)}


@pytest.mark.slow
@pytest.mark.distributed
def test_rloo_on_two_processes_with_accumulation_makes_the_one_process_updates(rloo_runs):
    """Completions are seeded per sample and the advantages normalised over the global batch:
    1 × 4 and 2 × 1 × 2 sample the same completions, log the same losses and rewards, and end
    with the same weights."""
    from accord.observe.metrics import read_metrics
    from conftest import final_params, max_param_diff, step_losses

    one, two = (step_losses(rloo_runs[p]) for p in (1, 2))
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    for step in one:
        assert abs(one[step] - two[step]) < 1e-5, (step, one[step], two[step])
    assert max_param_diff(final_params(rloo_runs[1]), final_params(rloo_runs[2])) < 1e-5
    by_two = _samples(rloo_runs[2])
    assert by_two and by_two <= _samples(rloo_runs[1])  # rank 0 writes its own prompts' samples
    records = {p: [r for r in read_metrics(rloo_runs[p]) if r["kind"] == "train"] for p in (1, 2)}
    for name in ("reward", "reward_std", "kl", "completion_length"):
        for a, b in zip(records[1], records[2]):
            assert abs(a[name] - b[name]) < 1e-5, name
    for a, b in zip(records[1], records[2]):  # the loss of normalised advantages is near 0; the gradient is not
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * a["grad_norm"], (a["step"], a["grad_norm"], b["grad_norm"])
    assert any(r["reward_std"] > 0 for r in records[1])  # some advantages are not 0: the updates test something


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_rloo_under_a_sharded_strategy_makes_the_ddp_updates(rloo_runs, strategy, tmp_path):
    """Generation and the policy's and reference's forwards run on every rank in step (their
    all-gathers are collective under fsdp and zero3) and give the ddp run's losses and weights."""
    from conftest import assert_ok, final_params, max_param_diff, run_accord, step_losses

    if strategy == "zero3":
        pytest.importorskip("deepspeed")
    out = tmp_path / strategy
    args = ("engine.processes=2", "batch.micro_batch_size=1", f"engine.strategy={strategy}", f"output.dir={out}")
    assert_ok(run_accord("train", rloo_runs[2].parent / "rloo.yaml", *args, timeout=600))
    ddp, sharded = step_losses(rloo_runs[2]), step_losses(out)
    assert sorted(ddp) == sorted(sharded)
    for step in ddp:
        assert abs(ddp[step] - sharded[step]) < 1e-5, (step, ddp[step], sharded[step])
    assert max_param_diff(final_params(rloo_runs[2]), final_params(out)) < 1e-5


@pytest.mark.slow
@pytest.mark.distributed
def test_rloo_resumed_on_one_process_ends_as_the_uninterrupted_two_process_run(rloo_runs, tmp_path):
    from conftest import assert_ok, final_params, max_param_diff, run_accord, step_losses

    out = tmp_path / "resumed"
    checkpoint = rloo_runs[2] / "checkpoints" / "step-000002"
    args = ("engine.processes=1", "batch.micro_batch_size=4", f"resume={checkpoint}", f"output.dir={out}")
    assert_ok(run_accord("train", rloo_runs[2].parent / "rloo.yaml", *args, timeout=600))
    whole, resumed = step_losses(rloo_runs[2]), step_losses(out)
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert abs(whole[step] - resumed[step]) < 1e-5, (step, whole[step], resumed[step])
    assert max_param_diff(final_params(rloo_runs[2]), final_params(out)) < 1e-5
    later = {s for s in _samples(rloo_runs[2]) if s[0] > 2}
    assert later and later <= _samples(out)
