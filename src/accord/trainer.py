"""The training loop: build -> train_step -> train -> evaluate -> save -> close.

It knows nothing of YAML or launchers and has no strategy branches: the engine hides them.
Every rank computes the same global plan (which examples form each global batch, how many
targets it has), so the loss normaliser needs no communication.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from accord import dist
from accord.batching import BatchPlan
from accord.data.order import GlobalOrder
from accord.data.sources import load_rows
from accord.engine import Engine, build_engine
from accord.models import build_model, build_tokenizer
from accord.observe.metrics import MetricsWriter
from accord.observe.progress import Progress
from accord.outputs import save_final_model
from accord.recipe import Recipe
from accord.tasks import build_task
from accord.tasks.base import Example, Task


@dataclass
class StepStats:
    loss_sum: torch.Tensor  # this rank's summed loss (on device; reduced at log time)
    grad_norm: torch.Tensor
    targets: int  # targets in the whole global batch
    tokens: int  # non-pad tokens in the whole global batch
    lr: float


class Trainer:
    def __init__(
        self,
        recipe: Recipe,
        info: dist.DistInfo,
        task: Task,
        train_examples: list[Example],
        eval_examples: list[Example],
        eval_rows: list[dict[str, str]],
        engine: Engine,
        plan: BatchPlan,
        order: GlobalOrder,
        total_steps: int,
        tokenizer,
    ):
        self.recipe = recipe
        self.info = info
        self.task = task
        self.train_examples = train_examples
        self.eval_examples = eval_examples
        self.eval_rows = eval_rows
        self.engine = engine
        self.plan = plan
        self.order = order
        self.total_steps = total_steps
        self.tokenizer = tokenizer
        self.out_dir = Path(recipe.output.dir)
        self.step = 0
        self._targets = np.array([e.num_targets for e in train_examples], dtype=np.int64)
        self._lengths = np.array([len(e.input_ids) for e in train_examples], dtype=np.int64)
        self.metrics = MetricsWriter(self.out_dir) if info.is_main else None

    # ------------------------------------------------------------------ build

    @classmethod
    def build(cls, recipe: Recipe, info: dist.DistInfo, device: torch.device) -> Trainer:
        tokenizer = build_tokenizer(recipe.model)
        task = build_task(recipe, tokenizer)
        train_rows, eval_rows = load_rows(recipe.data, recipe.seed, task.required_fields)
        train_examples = [task.encode(row) for row in train_rows]
        eval_examples = [task.encode(row) for row in eval_rows]
        plan = BatchPlan.derive(recipe.batch.global_batch_size, recipe.batch.micro_batch_size, info.world_size)
        order = GlobalOrder(len(train_examples), plan.global_batch_size, recipe.seed, recipe.data.shuffle)
        total_steps = total_training_steps(recipe, order)
        model = build_model(recipe.model, tokenizer, recipe.seed)
        engine = build_engine(recipe, model, info, device, plan, total_steps)
        trainer = cls(recipe, info, task, train_examples, eval_examples, eval_rows, engine, plan, order, total_steps, tokenizer)
        trainer._announce(model)
        return trainer

    def _announce(self, model: torch.nn.Module) -> None:
        params = sum(p.numel() for p in model.parameters())
        dropped = sum(1 for e in self.train_examples if e.num_targets == 0)
        lines = [
            f"accord: {self.recipe.task} on {type(model).__name__} ({params / 1e6:.2f}M parameters), "
            f"{self.recipe.engine.strategy} on {self.engine.device.type}, precision {self.recipe.engine.precision}",
            f"accord: batch {self.plan.describe()}",
            f"accord: {len(self.train_examples)} training examples ({self.order.steps_per_epoch} steps per epoch), "
            f"{len(self.eval_examples)} held out; {self.total_steps} steps",
        ]
        if dropped:
            lines.append(f"accord: {dropped} training examples have no target tokens left after truncation to data.max_length")
        for line in lines:
            dist.print0(line)

    # ------------------------------------------------------------------ one step

    def train_step(self) -> StepStats:
        """One optimizer step over global batch `self.step`."""
        global_batch = self.order.batch(self.step)
        # The normaliser: targets in the whole global batch, known to every rank from the plan.
        targets = int(self._targets[global_batch].sum())
        loss_sum = torch.zeros((), device=self.engine.device)
        for micro_step in range(self.plan.grad_accum):
            indices = global_batch[self.plan.micro_slice(self.info.rank, micro_step)]
            batch = self._to_device(self.task.collate([self.train_examples[i] for i in indices]))
            with self.engine.sync_context(last_micro_step=micro_step == self.plan.grad_accum - 1):
                with self.engine.autocast():
                    micro_loss, _ = self.task.loss(self.engine.model, batch)
                self.engine.backward(micro_loss, max(targets, 1))
            loss_sum += micro_loss.detach()
        lr = self.engine.lr
        grad_norm = self.engine.step()
        self.step += 1
        return StepStats(loss_sum, grad_norm.detach(), targets, int(self._lengths[global_batch].sum()), lr)

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.engine.device, non_blocking=True) for k, v in batch.items()}

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict[str, float]:
        cfg = self.recipe.train
        self.engine.model.train()
        progress = Progress(self.total_steps, self.step, enabled=self.info.is_main)
        pending: list[StepStats] = []
        last_log = time.perf_counter()
        start = last_log
        final_eval: dict[str, float] = {}
        try:
            while self.step < self.total_steps:
                pending.append(self.train_step())
                progress.advance()
                at_end = self.step == self.total_steps
                if self.step % cfg.log_every == 0 or at_end:
                    now = time.perf_counter()
                    self._log(pending, now - last_log, progress)
                    pending, last_log = [], now
                if self.eval_examples and ((cfg.eval_every and self.step % cfg.eval_every == 0) or at_end):
                    results = self.evaluate()
                    progress.write(_format_eval(self.step, results))
                    final_eval = results
                    last_log = time.perf_counter()  # evaluation time is not training throughput
        finally:
            progress.close()
        dist.print0(f"accord: trained {self.step} steps in {time.perf_counter() - start:.1f} s")
        return final_eval

    def _log(self, pending: list[StepStats], seconds: float, progress: Progress) -> None:
        # One collective for the whole interval: each step's loss summed over ranks.
        loss_sums = dist.all_reduce_sum(torch.stack([s.loss_sum for s in pending]).double()).tolist()
        grad_norms = torch.stack([s.grad_norm.float() for s in pending]).tolist()
        tokens = sum(s.tokens for s in pending)
        targets = sum(s.targets for s in pending)
        first = self.step - len(pending) + 1
        if self.metrics is not None:
            for offset, (stats, loss_sum, grad_norm) in enumerate(zip(pending, loss_sums, grad_norms)):
                self.metrics.write(
                    {
                        "kind": "train",
                        "step": first + offset,
                        "loss": loss_sum / max(stats.targets, 1),
                        "lr": stats.lr,
                        "grad_norm": grad_norm,
                        "targets": stats.targets,
                        "tokens": stats.tokens,
                    }
                )
            self.metrics.write(
                {
                    "kind": "throughput",
                    "step": self.step,
                    "tokens_per_s": tokens / seconds,
                    "target_tokens_per_s": targets / seconds,
                    "samples_per_s": len(pending) * self.plan.global_batch_size / seconds,
                    "seconds_per_step": seconds / len(pending),
                }
            )
        progress.show(loss_sums[-1] / max(pending[-1].targets, 1), pending[-1].lr, tokens / seconds)

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Token-normalised loss on the held-out set (and generation metrics when the recipe
        asks for them), over all ranks."""
        model = self.engine.module
        was_training = model.training
        model.eval()
        try:
            shard = self.eval_examples[self.info.rank :: self.info.world_size]
            size = self.recipe.train.eval_micro_batch_size
            totals = torch.zeros(2, dtype=torch.float64, device=self.engine.device)
            for start in range(0, len(shard), size):
                batch = self._to_device(self.task.collate(shard[start : start + size]))
                with self.engine.autocast():
                    loss_sum, targets = self.task.loss(model, batch)
                totals += torch.stack([loss_sum.double(), targets.double()])
            dist.all_reduce_sum(totals)
            loss_sum, targets = totals.tolist()
            results = {"loss": loss_sum / max(targets, 1.0)}
            results["perplexity"] = math.exp(min(results["loss"], 50.0))
            if self.recipe.train.eval_generate:
                results.update(self._generation_metrics(model))
        finally:
            model.train(was_training)
        if self.metrics is not None:
            self.metrics.write({"kind": "eval", "step": self.step, **results})
        return results

    def _generation_metrics(self, model: torch.nn.Module) -> dict[str, float]:
        rows = self.eval_rows[: self.recipe.train.eval_generate]
        shard = rows[self.info.rank :: self.info.world_size]
        with self.engine.autocast():
            sums = self.task.evaluate_generation(model, shard, self.engine.device, self.recipe.train.max_new_tokens)
        names = sorted(sums)
        totals = dist.all_reduce_sum(torch.tensor([sums[n] for n in names], dtype=torch.float64, device=self.engine.device))
        reduced = dict(zip(names, totals.tolist()))
        count = reduced.pop("count")
        return {f"{name}_accuracy": value / max(count, 1.0) for name, value in reduced.items()} | {"generated": count}

    # ------------------------------------------------------------------ save / close

    def save(self) -> Path:
        final = self.out_dir / "final"
        if self.info.is_main:
            save_final_model(self.engine.module, self.tokenizer, final)
        dist.barrier()
        return final

    def close(self) -> None:
        self.engine.close()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None


def total_training_steps(recipe: Recipe, order: GlobalOrder) -> int:
    if recipe.train.max_steps is not None:
        return recipe.train.max_steps
    assert recipe.train.epochs is not None
    return max(1, math.ceil(recipe.train.epochs * order.steps_per_epoch))


def _format_eval(step: int, results: dict[str, float]) -> str:
    parts = [f"eval loss {results['loss']:.4f}"]
    for name, value in results.items():
        if name.endswith("_accuracy"):
            parts.append(f"{name.removesuffix('_accuracy').replace('_', '-')} {100 * value:.1f}% of {int(results['generated'])}")
    return f"accord: step {step}: " + ", ".join(parts)
