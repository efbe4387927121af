"""The generation half of an online step (task: grpo, rloo): each rank has its prompts of the
global batch sampled and scored by the task, then one reduction gives every rank the step's
totals, among them the loss normaliser (the whole global batch's completion tokens under grpo,
its completions under rloo)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from accord.data.fetch import fetch
from accord.distributed import group as dist
from accord.errors import RunStopped
from accord.stopping import TrainingStopped


@dataclass(frozen=True)
class OnlineStep:
    targets: int  # the loss normaliser over the whole global batch (the task's RolloutSummary.targets)
    tokens: int  # prompt + completion tokens of the whole global batch
    means: dict[str, float]  # per-completion means over the global batch, and per-rank mean seconds


def rollout_step(run, task, step: int, global_batch) -> OnlineStep:
    """Collective: sample this rank's block of prompts (the same block size on every rank, so
    sharded forwards stay in step), then reduce the counts and metrics once."""
    info, plan = run.info, run.plan
    mine = [int(r) for r in global_batch[info.rank * plan.per_rank : (info.rank + 1) * plan.per_rank]]
    failure: RunStopped | None = None
    try:
        with run.engine.autocast():
            summary = task.rollout(step, mine, fetch(run.train_data, mine))
    except RunStopped as e:  # a reward function failed here: the other ranks learn it below
        failure, summary = e, None
    names = sorted(summary.sums) if summary is not None else sorted(task.rollout_metric_names())
    local = [0.0] * (5 + len(names))
    if summary is not None:
        local = [summary.targets, summary.tokens, summary.completions, 0.0, summary.generation_s] + [
            summary.sums[n] for n in names
        ]
    else:
        local[3] = 1.0
    totals = dist.all_reduce_sum(torch.tensor(local, dtype=torch.float64, device=run.engine.device)).tolist()
    if totals[3]:
        if failure is not None and not info.leads_node:
            print(f"accord: error: {failure}", file=sys.stderr, flush=True)  # the worker prints only local rank 0's
        raise TrainingStopped(
            str(failure) if failure is not None else "a reward function failed on another rank (its line is above)"
        )
    completions = max(totals[2], 1.0)
    means = task.rollout_means({n: v / completions for n, v in zip(names, totals[5:])}, completions)
    means["generation_s"] = totals[4] / info.world_size
    if info.is_main and (step + 1) % run.recipe.train.log_every == 0 and summary is not None:
        with open(Path(run.out_dir) / "samples.jsonl", "a", encoding="utf-8") as f:
            f.writelines(json.dumps({"step": step + 1, **s}) + "\n" for s in summary.samples)
    return OnlineStep(int(totals[0]), int(totals[1]), means)
