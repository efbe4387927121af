"""Evaluation on the held-out set: the task's metrics summed over every rank's share, and
optionally greedy generation scored by the task.

Under sharded strategies every forward pass is a collective, so every rank runs the same
number of batches (lockstep_batches pads the short ones with weight-0 repeats).
"""

from __future__ import annotations

import torch

from accord import dist, heartbeat
from accord.batches import fetch, lockstep_batches, to_device
from accord.recipe import TrainConfig
from accord.tasks.base import PADDING, Task


class Evaluator:
    def __init__(self, task: Task, engine, info: dist.DistInfo, eval_data, cfg: TrainConfig):
        self.task = task
        self.engine = engine
        self.info = info
        self.data = eval_data
        self.cfg = cfg

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
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
        batches = lockstep_batches(len(self.data), self.info.rank, self.info.world_size, self.cfg.eval_micro_batch_size)
        for indices, weight in batches:
            heartbeat.tick()  # a long evaluation is progress, batch by batch
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
        per_rank = -(-len(rows) // self.info.world_size)
        shard = rows[self.info.rank * per_rank : (self.info.rank + 1) * per_rank]
        shard = shard + [{**rows[0], PADDING: True}] * (per_rank - len(shard))  # same count on every rank
        with self.engine.autocast():
            sums = self.task.evaluate_generation(model, shard, self.engine.device, self.cfg.max_new_tokens, lockstep=self.engine.lockstep)
        names = sorted(sums)
        totals = dist.all_reduce_sum(torch.tensor([sums[n] for n in names], dtype=torch.float64, device=self.engine.device))
        reduced = dict(zip(names, totals.tolist()))
        count = reduced.pop("count")
        return self.task.generation_results(reduced, count)
