"""The training loop: build -> train_step -> train -> evaluate -> save -> close.

It knows nothing of YAML or launchers and has no strategy branches: the engine hides them.
Every rank computes the same global plan (which examples form each global batch, how many
targets it has), so the loss normaliser needs no communication.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from accord import dist, faults
from accord.batching import BatchPlan
from accord.checkpoint import CheckpointError, TrainingState, latest_checkpoint, read_state, restore_rng, save_checkpoint, seed_for
from accord.data.order import GlobalOrder
from accord.data.sources import load_rows
from accord.engine import Engine, build_engine
from accord.models import build_model, build_tokenizer
from accord.observe.metrics import MetricsWriter
from accord.observe.progress import Progress
from accord.outputs import save_final_model
from accord.recipe import Recipe
from accord.stopping import StopRequest
from accord.tasks import build_task
from accord.tasks.base import PADDING, Example, Task


class TrainingStopped(RuntimeError):
    """The run cannot continue (non-finite loss, a failed checkpoint write); the message
    says why and what is intact."""


@dataclass
class StepStats:
    step: int
    loss_sum: torch.Tensor  # this rank's summed loss (on device; reduced at log time)
    grad_norm: torch.Tensor
    targets: int  # targets in the whole global batch
    tokens: int  # non-pad tokens in the whole global batch
    lr: float
    skipped: bool = False


@dataclass
class RunResult:
    status: str  # completed | preempted
    step: int
    eval: dict[str, float] = field(default_factory=dict)
    message: str = ""


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
        self.skipped_steps = 0
        self.metrics: MetricsWriter | None = None
        self._targets = np.array([e.num_targets for e in train_examples], dtype=np.int64)
        self._lengths = np.array([len(e.input_ids) for e in train_examples], dtype=np.int64)
        self._pending: list[StepStats] = []
        self._last_log = time.perf_counter()
        self._last_checkpoint = time.monotonic()
        torch.manual_seed(seed_for(recipe.seed, 0, info.rank))  # dropout etc.: distinct per rank

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

    def restore(self, folder: Path) -> None:
        """Continue from a checkpoint: weights, optimizer, schedule, RNG, and the data position."""
        state = read_state(folder)
        self.engine.load_state(folder)
        self.step = state.step
        position = self.order.position(state.step)
        if (position.epoch, position.index) != (state.epoch, state.index):
            raise TrainingStopped(
                f"{folder}: recorded data position (epoch {state.epoch}, index {state.index}) does not match "
                f"step {state.step} of this recipe's data order; was the data changed?"
            )
        same_rng = restore_rng(folder, state, self.info, self.recipe.seed)
        layout = f"{state.world_size} × {state.micro_batch_size}" + (
            "" if (state.world_size, state.micro_batch_size) == (self.info.world_size, self.plan.micro_batch_size) else
            f" -> now {self.info.world_size} × {self.plan.micro_batch_size} (same global batches)"
        )
        dist.print0(
            f"accord: resumed from {folder} at step {state.step} (epoch {state.epoch}, example {state.index} of the "
            f"global order; processes × micro batch {layout})" + ("" if same_rng else "; RNG re-seeded for the new world size")
        )

    def open_metrics(self) -> None:
        if self.info.is_main:
            self.metrics = MetricsWriter(self.out_dir, resume_step=self.step)

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
                if faults.nan_loss_at(self.step + 1):
                    micro_loss = micro_loss * float("nan")
                self.engine.backward(micro_loss, max(targets, 1))
            loss_sum += micro_loss.detach()
        lr = self.engine.lr
        grad_norm, stepped = self.engine.step(skip_nonfinite=self.recipe.train.on_nonfinite == "skip")
        self.step += 1
        tokens = int(self._lengths[global_batch].sum())
        return StepStats(self.step, loss_sum, grad_norm.detach(), targets, tokens, lr, skipped=not stepped)

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.engine.device, non_blocking=True) for k, v in batch.items()}

    # ------------------------------------------------------------------ the loop

    def train(self, stop: StopRequest | None = None) -> RunResult:
        cfg = self.recipe.train
        self.engine.model.train()
        progress = Progress(self.total_steps, self.step, enabled=self.info.is_main)
        start_step, start = self.step, time.perf_counter()
        final_eval: dict[str, float] = {}
        self._last_log = time.perf_counter()
        try:
            if self.step >= self.total_steps:
                dist.print0(f"accord: the run is already complete at step {self.step}")
            while self.step < self.total_steps:
                stats = self.train_step()
                self._pending.append(stats)
                self._count_skip(stats)
                progress.advance()
                at_end = self.step == self.total_steps
                if self.step % cfg.log_every == 0 or at_end:
                    self._flush_metrics(progress)
                if self.eval_examples and ((cfg.eval_every and self.step % cfg.eval_every == 0) or at_end):
                    self._flush_metrics(progress)
                    final_eval = self.evaluate()
                    progress.write(_format_eval(self.step, final_eval))
                    self._last_log = time.perf_counter()  # evaluation time is not training throughput
                # One small collective per step: did any rank get a stop signal, is a
                # timed checkpoint due (rank 0's clock decides)?
                stopping, time_due = dist.any_rank(stop is not None and stop.requested, self.info.is_main and self._checkpoint_time_due())
                if at_end or stopping or time_due or self._checkpoint_step_due():
                    self._flush_metrics(progress)
                    self.save_checkpoint()
                if stopping and not at_end:
                    progress.close()
                    dist.print0(f"accord: stop requested ({stop.signal_name if stop and stop.signal_name else 'signal on another rank'}): checkpoint of step {self.step} written")
                    return RunResult("preempted", self.step, final_eval, "checkpointed on request")
        finally:
            progress.close()
        seconds = time.perf_counter() - start
        dist.print0(f"accord: trained {self.step - start_step} steps in {seconds:.1f} s")
        return RunResult("completed", self.step, final_eval)

    def _count_skip(self, stats: StepStats) -> None:
        if not stats.skipped:
            return
        self.skipped_steps += 1
        dist.print0(f"accord: step {stats.step}: non-finite gradient norm; update skipped ({self.skipped_steps} so far)")
        if self.skipped_steps > self.recipe.train.max_skipped_steps:
            raise TrainingStopped(
                f"step {stats.step}: {self.skipped_steps} updates skipped for non-finite values "
                f"(train.max_skipped_steps={self.recipe.train.max_skipped_steps}); {self._intact_note()}"
            )

    def _checkpoint_step_due(self) -> bool:
        every = self.recipe.checkpoint.every_steps
        return every is not None and self.step % every == 0

    def _checkpoint_time_due(self) -> bool:
        minutes = self.recipe.checkpoint.every_minutes
        return minutes is not None and time.monotonic() - self._last_checkpoint >= 60 * minutes

    def _flush_metrics(self, progress: Progress) -> None:
        """Reduce and record the steps since the last flush; stop on a non-finite loss."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        now = time.perf_counter()
        seconds, self._last_log = max(now - self._last_log, 1e-9), now
        # One collective for the whole interval: each step's loss summed over ranks.
        loss_sums = dist.all_reduce_sum(torch.stack([s.loss_sum for s in pending]).double()).tolist()
        grad_norms = torch.stack([s.grad_norm.float() for s in pending]).tolist()
        losses = [loss_sum / max(s.targets, 1) for s, loss_sum in zip(pending, loss_sums)]
        self._stop_if_nonfinite(pending, losses, grad_norms)
        tokens = sum(s.tokens for s in pending)
        if self.metrics is not None:
            for stats, loss, grad_norm in zip(pending, losses, grad_norms):
                record = {"kind": "train", "step": stats.step, "loss": loss, "lr": stats.lr, "grad_norm": grad_norm}
                self.metrics.write(record | {"targets": stats.targets, "tokens": stats.tokens, "skipped": stats.skipped})
            self.metrics.write(
                {
                    "kind": "throughput",
                    "step": self.step,
                    "tokens_per_s": tokens / seconds,
                    "target_tokens_per_s": sum(s.targets for s in pending) / seconds,
                    "samples_per_s": len(pending) * self.plan.global_batch_size / seconds,
                    "seconds_per_step": seconds / len(pending),
                }
            )
        progress.show(losses[-1], pending[-1].lr, tokens / seconds)

    def _stop_if_nonfinite(self, pending: list[StepStats], losses: list[float], grad_norms: list[float]) -> None:
        # The values are reduced / identical on every rank, so every rank stops together.
        # A skipped step (on_nonfinite=skip) and the fp16 scaler's overflow steps were
        # already handled by the engine.
        for stats, loss, grad_norm in zip(pending, losses, grad_norms):
            if stats.skipped:
                continue
            if not math.isfinite(loss) or (not math.isfinite(grad_norm) and not self.engine.handles_overflow):
                what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}"
                raise TrainingStopped(
                    f"step {stats.step}: {what} is not finite; stopping (train.on_nonfinite=skip skips such updates "
                    f"instead; a lower optim.lr or max_grad_norm often helps). {self._intact_note()}"
                )

    def _intact_note(self) -> str:
        latest = latest_checkpoint(self.out_dir)
        return f"The last checkpoint ({latest}) is intact." if latest else "No checkpoint was written yet."

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Token-normalised loss on the held-out set (and generation metrics when the recipe
        asks for them), over all ranks."""
        model = self.engine.module
        was_training = model.training
        model.eval()
        try:
            size = self.recipe.train.eval_micro_batch_size
            totals = torch.zeros(2, dtype=torch.float64, device=self.engine.device)
            for chunk, weight in lockstep_batches(self.eval_examples, self.info, size):
                batch = self._to_device(self.task.collate(chunk))
                with self.engine.autocast():
                    loss_sum, targets = self.task.loss(model, batch)
                totals += weight * torch.stack([loss_sum.double(), targets.double()])
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
        per_rank = -(-len(rows) // self.info.world_size)
        shard = rows[self.info.rank * per_rank : (self.info.rank + 1) * per_rank]
        shard = shard + [{**rows[0], PADDING: True}] * (per_rank - len(shard))  # same count on every rank
        with self.engine.autocast():
            sums = self.task.evaluate_generation(
                model, shard, self.engine.device, self.recipe.train.max_new_tokens, lockstep=self.engine.lockstep
            )
        names = sorted(sums)
        totals = dist.all_reduce_sum(torch.tensor([sums[n] for n in names], dtype=torch.float64, device=self.engine.device))
        reduced = dict(zip(names, totals.tolist()))
        count = reduced.pop("count")
        return {f"{name}_accuracy": value / max(count, 1.0) for name, value in reduced.items()} | {"generated": count}

    # ------------------------------------------------------------------ save / close

    def save_checkpoint(self) -> Path:
        position = self.order.position(self.step)
        state = TrainingState(self.step, position.epoch, position.index, self.info.world_size, self.plan.micro_batch_size)
        try:
            folder = save_checkpoint(self.engine, self.recipe, state, self.out_dir, self.info)
        except CheckpointError as e:  # raised on every rank alike by save_checkpoint
            raise TrainingStopped(str(e)) from None
        self._last_checkpoint = time.monotonic()
        if self.metrics is not None:
            self.metrics.write({"kind": "checkpoint", "step": self.step, "path": str(folder)})
        return folder

    def save(self) -> Path:
        final = self.out_dir / "final"
        state = self.engine.full_model_state()  # collective under sharded strategies
        if self.info.is_main:
            save_final_model(self.engine.module, self.tokenizer, final, state_dict=state)
        dist.barrier()
        return final

    def close(self) -> None:
        self.engine.close()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None


def lockstep_batches(examples: list[Example], info: dist.DistInfo, size: int):
    """This rank's contiguous share of `examples` in micro-batches, as (batch, weight).

    Every rank yields the same number of batches: a rank with fewer examples repeats one
    with weight 0, because under sharded strategies each forward pass is a collective.
    """
    per_rank = -(-len(examples) // info.world_size)
    shard = examples[info.rank * per_rank : (info.rank + 1) * per_rank]
    for start in range(0, per_rank, size):
        chunk = shard[start : start + size]
        yield (chunk, 1.0) if chunk else (examples[:1], 0.0)


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
