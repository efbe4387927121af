"""REINFORCE leave-one-out (online RL, TRL's RLOOTrainer): grpo's rollouts — the same prompts,
per-sample seeded sampling, rewards and recipe keys — with the advantage and loss that differ.

A completion's reward (the weighted sum, optionally clipped to rloo.reward_clip, minus beta ×
its summed log-ratio Σ_t log π_old − log π_ref: the KL penalty sits in the reward, not in the
loss) less the mean reward of the other G − 1 completions of its prompt is its advantage,
optionally scaled to mean 0 and standard deviation 1 over the whole global batch (from the
step's one reduction, rollout_means). The loss is per completion: −min(r·A, clip(r, 1±ε)·A)
with r = exp(Σ_t log π − Σ_t log π_old), summed over completions; the trainer divides by the
completions of the whole global batch (TRL's mean over the batch's sequences).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from accord.tasks.base import LossOutput
from accord.tasks.grpo import GRPOTask
from accord.tasks.grpo_loss import clipped, clipped_surrogate
from accord.tasks.rollout import completion_logprobs
from accord.tasks.rollout_groups import Rollout


def leave_one_out(rewards: torch.Tensor) -> torch.Tensor:
    """(G,) advantages: each reward less the mean of the group's other G − 1."""
    baseline = (rewards.sum() - rewards) / (rewards.numel() - 1)
    return rewards - baseline


def summed_log_ratio(old_logps: torch.Tensor, ref_logps: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """(G,) Σ_t log π_old − log π_ref over each completion's own tokens (TRL's RLOO KL penalty:
    the first-order estimator, which may be negative)."""
    keep = torch.arange(old_logps.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    return ((old_logps - ref_logps) * keep).sum(1)


def _std(mean: float, mean_square: float, n: float) -> float:
    """Sample standard deviation (Bessel's correction, as TRL's nanstd) from the two means."""
    return math.sqrt(max(mean_square - mean * mean, 0.0) * n / (n - 1))


class RLOOTask(GRPOTask):
    name = "rloo"
    token_targets = False  # the loss is a mean over completions, not tokens
    sections = ("grpo", "rloo")  # grpo's keys (prompts, sampling, rewards) and its own

    def __init__(self, tokenizer, config):
        super().__init__(tokenizer, config)
        self.loo = config.section("rloo")
        self._scaled: int | None = None  # the generation batch whose advantages rollout_means scaled

    def describe(self) -> list[str]:
        c, o = self.cfg, self.loo
        clip = f", rewards clipped to [{o.reward_clip[0]:g}, {o.reward_clip[1]:g}]" if o.reward_clip else ""
        return [
            f"rloo: {c.group_size} completions per prompt, up to {c.max_new_tokens} tokens; "
            f"rewards {', '.join(self.rewards.names)}{clip}; leave-one-out baseline"
            f"{', advantages normalised over the batch' if o.normalize_advantages else ''}; "
            f"beta {c.beta:g} (in the reward), epsilon {c.epsilon:g}, {c.num_iterations} step(s) per generation batch"
        ]

    # ---------------------------------------------------------------- rollout

    @property
    def _logps_at_rollout(self) -> bool:
        # The KL penalty is in the reward: it needs the sampling policy's log-probabilities now.
        return self.cfg.num_iterations > 1 or self.cfg.beta > 0

    @torch.no_grad()
    def _add_old_logps(self, model: nn.Module, rollouts: list[Rollout]) -> None:
        super()._add_old_logps(model, rollouts)
        if self.cfg.beta > 0:
            # Over the same group shapes as the policy's just now: while the policy is the
            # reference (the first step) the penalty is exactly 0.
            for r, ref in zip(rollouts, self._rollout_logps(self._reference_logps, rollouts)):
                assert r.old_logps is not None
                r.kl = summed_log_ratio(r.old_logps, ref, [len(c) for c in r.completions])

    def _advantages(self, r: Rollout) -> torch.Tensor:
        assert r.total is not None
        rewards = r.total
        if self.loo.reward_clip is not None:
            rewards = rewards.clamp(*self.loo.reward_clip)
        if r.kl is not None:
            rewards = rewards - self.cfg.beta * r.kl.double()
        return leave_one_out(rewards).float()

    def rollout_metric_names(self) -> list[str]:
        # reward_sq and advantage(_sq) only carry the batch's spreads to rollout_means.
        return super().rollout_metric_names() + ["kl", "reward_sq", "advantage", "advantage_sq"]

    def _summarise(self, row_ids, seconds):
        summary = super()._summarise(row_ids, seconds)
        sums = summary.sums
        for rid in row_ids:
            r = self._rollouts[rid]
            assert r.total is not None and r.advantages is not None
            advantages = r.advantages.double()
            sums["reward_sq"] += float((r.total**2).sum())
            sums["advantage"] += float(advantages.sum())
            sums["advantage_sq"] += float((advantages**2).sum())
            sums["kl"] += float(r.kl.sum()) if r.kl is not None else 0.0
        self._label_samples(summary)
        return summary

    def _label_samples(self, summary) -> None:
        """Each sample's advantage (samples.jsonl, TRL's completions table): the samples follow
        _rollouts' order, a group's completions in turn."""
        advantages = [a for r in self._rollouts.values() if r.advantages is not None for a in r.advantages.tolist()]
        for sample, value in zip(summary.samples, advantages):
            sample["advantage"] = value

    def rollout_means(self, means: dict[str, float], completions: float) -> dict[str, float]:
        """TRL's metrics: reward_std over the whole batch, kl per completion token (beta > 0);
        and with normalize_advantages the advantages scaled by the batch's mean and std, once
        per generation batch (its later steps, num_iterations > 1, train on the same values)."""
        means = dict(means)
        means["reward_std"] = _std(means["reward"], means.pop("reward_sq"), completions)
        mean, mean_square, kl = means.pop("advantage"), means.pop("advantage_sq"), means.pop("kl")
        if self.cfg.beta > 0:
            means["kl"] = kl / max(means["completion_length"], 1e-30)  # per completion -> per token
        if self.loo.normalize_advantages and self._scaled != self._generation:
            std = _std(mean, mean_square, completions)
            for r in self._rollouts.values():
                assert r.advantages is not None
                r.advantages = (r.advantages - mean) / (std + 1e-4)
            if self._summary is not None:
                self._label_samples(self._summary)
            self._scaled = self._generation
        return means

    # ---------------------------------------------------------------- the loss

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        mask = batch["completion_mask"]
        token_logps = self._group_logps(lambda p: completion_logprobs(model, p, self.cfg.temperature), batch)
        logps = (token_logps * mask).sum(1)
        # The sampling policy's, taken at rollout (beta > 0 or num_iterations > 1); else the
        # ratio is 1 and its gradient the same.
        old = (batch["old_logps"] * mask).sum(1) if "old_logps" in batch else logps.detach()
        advantages, eps = batch["advantages"], self.cfg.epsilon
        ratio = torch.exp(logps - old)
        metrics = {"clip_fraction": clipped(ratio, advantages, eps).float().sum()}
        return LossOutput(clipped_surrogate(ratio, advantages, eps).sum(), mask.new_tensor(float(len(ratio))), metrics)
