"""A step's forward and backward under engine.pipeline_parallel: this pipeline's rows of the
global batch (its data-parallel group's, the same on each of its ranks) collated once and
run through the stages by the engine's schedule, in the micro-batches the BatchPlan gives.

The micro-batches are the plan's (micro_slice of the group's block, in order) and the loss is
the task's summed token loss over the targets of the whole global batch, so the update is the
one of a single process. Collated together, the rows are padded to one width per step: the
stages' receive buffers have fixed shapes."""

from __future__ import annotations

import numpy as np
import torch

from accord.data.fetch import to_device
from accord.observe import heartbeat
from accord.tasks.base import token_loss_sum
from accord.tasks.chunked_loss import shifted_targets


def pipeline_pass(run, task, step: int, global_batch: np.ndarray, targets: int, rows_of) -> tuple[torch.Tensor, dict]:
    """The step's micro-batches through the stages (forward and backward); this rank's share of
    the logged loss sum. `rows_of(row_ids)`: the examples of each row."""
    plan = run.plan
    group = plan.data_rank(run.info.rank)
    row_ids = global_batch[group * plan.per_rank : (group + 1) * plan.per_rank]
    batch = to_device(task.collate(rows_of(row_ids)), run.engine.device)
    heartbeat.phase("pipeline forward/backward", step)
    loss = run.engine.train_batch(batch, plan.grad_accum, max(targets, 1), causal_loss_sum)
    return loss, {}


def pipeline_padded(plan, lengths: np.ndarray, global_batch: np.ndarray) -> int:
    """Tokens computed on over all pipelines: each pads its rows to their longest."""
    total = 0
    for group in range(plan.world_size):
        block = lengths[global_batch[group * plan.per_rank : (group + 1) * plan.per_rank]]
        total += int(block.max()) * len(block)
    return total


def causal_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A micro-batch's summed next-token loss from the last stage's logits (CausalLMTask's)."""
    return token_loss_sum(logits, shifted_targets(labels))
