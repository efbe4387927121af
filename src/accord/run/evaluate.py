"""Evaluation on the held-out set: the task's metrics summed over every rank's share, and
optionally greedy generation scored by the task.

Under sharded strategies every forward pass is a collective, so every rank runs the same
number of batches (lockstep_batches pads the short ones with weight-0 repeats).

A stop request (SIGTERM, SLURM's SIGUSR1) is agreed between batches: a long evaluation
(thousands of held-out rows, greedy generation) would otherwise outlast a scheduler's grace
period, and the checkpoint the request asks for does not need the metrics.
"""

from __future__ import annotations

import torch

from accord.data.fetch import fetch, lockstep_batches, to_device
from accord.distributed import group as dist
from accord.distributed.batch_plan import BatchPlan
from accord.observe import heartbeat
from accord.recipe.schema import TrainConfig
from accord.stopping import StopRequest
from accord.tasks.base import PADDING, Task

# Rows per generation call between two stop checks (the tasks batch within a call).
GENERATION_ROWS_PER_CHECK = 64


class EvaluationStopped(Exception):
    """A stop was requested on some rank during the evaluation; every rank raises it together."""


class Evaluator:
    def __init__(self, task: Task, engine, info: dist.DistInfo, plan: BatchPlan, eval_data, cfg: TrainConfig):
        self.task = task
        self.engine = engine
        self.info = info
        self.plan = plan
        self.data = eval_data
        self.cfg = cfg

    @torch.no_grad()
    def evaluate(self, stop: StopRequest | None = None) -> dict[str, float]:
        """The held-out metrics; raises EvaluationStopped (on every rank) once a stop is requested."""
        self._stop = stop
        model = self.engine.module
        was_training = model.training
        model.eval()
        try:
            results = self._task_metrics(model) if self.task.eval_loss else {}
            if self.cfg.eval_generate:
                results.update(self._generation_metrics(model))
        finally:
            model.train(was_training)
        return results

    def _task_metrics(self, model: torch.nn.Module) -> dict[str, float]:
        totals: dict[str, torch.Tensor] = {}
        rank, world, share = self._data_parallel()
        batches = lockstep_batches(len(self.data), rank, world, self.cfg.eval_micro_batch_size)
        for indices, weight in batches:
            weight = weight * share
            heartbeat.tick()  # a long evaluation is progress, batch by batch
            self._check_stop()
            batch = to_device(self.task.collate([[e] for e in fetch(self.data, indices)]), self.engine.device)
            with self.engine.autocast():
                sums = self.task.eval_sums(model, batch)
            for name, value in sums.items():
                totals[name] = totals.get(name, 0) + weight * value.double()
        names = sorted(totals)
        reduced = dist.all_reduce_sum(torch.stack([totals[n] for n in names])).tolist()
        return self.task.eval_summary(dict(zip(names, reduced)))

    def _generation_metrics(self, model: torch.nn.Module) -> dict[str, float]:
        rows = fetch(self.data, range(min(self.cfg.eval_generate, len(self.data))))
        rank, world, share = self._data_parallel()
        per_rank = -(-len(rows) // world)
        shard = rows[rank * per_rank : (rank + 1) * per_rank]
        shard = shard + [{**rows[0], PADDING: True}] * (per_rank - len(shard))  # same count on every rank
        sums: dict[str, float] = {}
        # Every rank's shard has the same length, so every rank makes the same calls (lockstep).
        for start in range(0, per_rank, GENERATION_ROWS_PER_CHECK):
            heartbeat.tick()
            self._check_stop()
            with self.engine.autocast():
                part = self.task.evaluate_generation(
                    model,
                    shard[start : start + GENERATION_ROWS_PER_CHECK],
                    self.engine.device,
                    self.cfg.max_new_tokens,
                    lockstep=self.engine.lockstep,
                )
            for name, value in part.items():
                sums[name] = sums.get(name, 0.0) + value * share
        if not sums:
            return {}
        names = sorted(sums)
        totals = dist.all_reduce_sum(
            torch.tensor([sums[n] for n in names], dtype=torch.float64, device=self.engine.device)
        )
        reduced = dict(zip(names, totals.tolist()))
        count = reduced.pop("count")
        return self.task.generation_results(reduced, count)

    def _data_parallel(self) -> tuple[int, int, float]:
        """This rank's data-parallel group, their number, and whether its sums count: the ranks
        of a tensor-parallel group evaluate the same rows together (their forward is one
        collective), and only the first one's sums count."""
        tp = self.plan.tensor_parallel
        return self.info.rank // tp, self.info.world_size // tp, 1.0 if self.plan.counts(self.info.rank) else 0.0

    def _check_stop(self) -> None:
        if self._stop is None:
            return
        (requested,) = dist.any_rank(self._stop.requested)  # the same answer on every rank
        if requested:
            raise EvaluationStopped
