"""Evaluation: a stop request (SIGTERM, SLURM's SIGUSR1) ends a long evaluation between
batches instead of after it; generation is scored in parts whose sums equal one call's."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from datasets import Dataset

from accord.distributed import group as dist
from accord.distributed.batch_plan import BatchPlan
from accord.recipe.schema import TrainConfig
from accord.run.evaluate import GENERATION_ROWS_PER_CHECK, EvaluationStopped, Evaluator
from accord.stopping import StopRequest
from accord.tasks.base import PADDING


class _CountingTask:
    """Counts the batches and generated rows it is asked for; asks to stop after `stop_after` of them."""

    eval_loss = True

    def __init__(self, stop: StopRequest, stop_after: int | None):
        self.stop, self.stop_after = stop, stop_after
        self.batches = 0
        self.generation_calls: list[int] = []

    def _maybe_signal(self, done: int) -> None:
        if self.stop_after is not None and done >= self.stop_after:
            self.stop.signal_name = "SIGTERM"  # what StopRequest's handler records

    def collate(self, examples):
        return {"x": torch.tensor([e[0]["x"] for e in examples], dtype=torch.float64)}

    def eval_sums(self, model, batch):
        self.batches += 1
        self._maybe_signal(self.batches)
        return {"loss_sum": batch["x"].sum(), "targets": torch.tensor(float(len(batch["x"])))}

    def eval_summary(self, sums):
        return {"loss": sums["loss_sum"] / sums["targets"]}

    def evaluate_generation(self, model, rows, device, max_new_tokens, lockstep=False):
        self.generation_calls.append(len(rows))
        self._maybe_signal(len(self.generation_calls))
        scored = [r for r in rows if not r.get(PADDING)]
        return {"exact_match": float(sum(r["x"] % 2 for r in scored)), "count": float(len(scored))}

    def generation_results(self, reduced, count):
        return {"exact_match_accuracy": reduced["exact_match"] / count, "generated": count}


def _evaluator(task, rows: int, eval_generate: int) -> Evaluator:
    engine = types.SimpleNamespace(
        module=torch.nn.Linear(1, 1), device=torch.device("cpu"), lockstep=False, autocast=contextlib.nullcontext
    )
    info = dist.DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1)
    cfg = TrainConfig(max_steps=1, eval_micro_batch_size=8, eval_generate=eval_generate)
    plan = BatchPlan.derive(8, 8, 1)
    return Evaluator(task, engine, info, plan, Dataset.from_dict({"x": list(range(rows))}), cfg)


def test_a_stop_request_ends_the_held_out_loss_between_batches():
    stop = StopRequest()
    task = _CountingTask(stop, stop_after=2)
    with pytest.raises(EvaluationStopped):
        _evaluator(task, rows=400, eval_generate=0).evaluate(stop)
    assert task.batches == 2  # of 50: the request is seen before the third batch


def test_a_stop_request_ends_greedy_generation_between_parts():
    stop = StopRequest()
    task = _CountingTask(stop, stop_after=1)
    task.eval_loss = False
    with pytest.raises(EvaluationStopped):
        _evaluator(task, rows=400, eval_generate=300).evaluate(stop)
    assert task.generation_calls == [GENERATION_ROWS_PER_CHECK]


def test_generation_in_parts_sums_to_every_row_once_and_the_model_is_left_training():
    stop = StopRequest()  # never signalled
    task = _CountingTask(stop, stop_after=None)
    evaluator = _evaluator(task, rows=400, eval_generate=300)
    results = evaluator.evaluate(stop)
    assert sum(task.generation_calls) == 300 and max(task.generation_calls) <= GENERATION_ROWS_PER_CHECK
    assert results["generated"] == 300 and results["exact_match_accuracy"] == 150 / 300
    assert results["loss"] == pytest.approx(sum(range(400)) / 400)
    assert evaluator.engine.module.training
