"""The pass over a global batch before its micro-batches, for a task whose loss reads a
statistic of the whole batch (task.batch_statistics: kto's KL estimate). Each rank scores
the micro-batches it is about to train on, without gradients and with the same number of
forward passes as every other rank (a sharded model's forward is collective), and one
reduction gives every rank the totals; so the statistic, and with it the update, does not
depend on how the global batch is split over ranks and micro-steps."""

from __future__ import annotations

import numpy as np
import torch

from accord.data.fetch import to_device
from accord.distributed import group as dist


def batch_pass(run, task, global_batch: np.ndarray, rows_of) -> None:
    """`rows_of(row_ids)`: the examples of those rows of the global order."""
    plan, engine = run.plan, run.engine
    # Each row's partner is the row one place before it in the global batch (the first's: the last).
    partners = np.roll(global_batch, 1)
    rank = run.info.rank
    sums = None
    for micro_step in range(plan.grad_accum):
        where = plan.micro_slice(plan.data_rank(rank), micro_step)
        batch = to_device(task.statistics_batch(rows_of(global_batch[where]), rows_of(partners[where])), engine.device)
        with torch.no_grad(), engine.autocast():
            part = task.statistics_sums(engine.train_model, batch)
        sums = part if sums is None else sums + part
    # A tensor-parallel group holds the same rows on every rank: they count once.
    share = 1.0 if plan.counts(rank) else 0.0
    task.use_statistics(dist.all_reduce_sum(sums * share).cpu())
