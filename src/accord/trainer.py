"""The training loop: build -> train_step -> train -> evaluate -> save -> close.

It knows nothing of YAML or launchers and has no strategy branches: the engine hides them.
Every rank computes the same global plan (which examples form each global batch, how many
targets it has), so the loss normaliser needs no communication.
"""

from __future__ import annotations

import gc
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
from accord.data.packing import Rows
from accord.engine import Engine
from accord.observe.metrics import MetricsWriter
from accord.observe.progress import Progress
from accord.outputs import save_final_model
from accord.recipe import Recipe
from accord.stopping import StopRequest
from accord.tasks.base import PADDING, Task


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
    padded_tokens: int  # tokens computed on, padding included
    lr: float
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # this rank's sums
    skipped: bool = False


@dataclass
class RunResult:
    status: str  # completed | preempted
    step: int
    eval: dict[str, float] = field(default_factory=dict)
    message: str = ""


class Trainer:
    """Built by accord.assemble.build_trainer; every rank holds the same global plan."""

    def __init__(
        self,
        recipe: Recipe,
        info: dist.DistInfo,
        task: Task,
        train_data,
        eval_data,
        rows: Rows,
        engine: Engine,
        plan: BatchPlan,
        order: GlobalOrder,
        total_steps: int,
        tokenizer,
    ):
        self.recipe = recipe
        self.info = info
        self.task = task
        self.train_data = train_data  # datasets.Dataset of encoded examples
        self.eval_data = eval_data
        self.rows = rows  # which examples form each row of the global order
        self.engine = engine
        self.plan = plan
        self.order = order
        self.total_steps = total_steps
        self.tokenizer = tokenizer
        self.out_dir = Path(recipe.output.dir)
        self.step = 0
        self.skipped_steps = 0
        self.metrics: MetricsWriter | None = None
        self.extra_columns: dict[str, dict[str, np.ndarray]] = {"train": {}, "eval": {}}
        self.num_params = 0  # set by assemble (before sharding: the whole model's count)
        self.flops_per_token = 0.0  # set by assemble: for MFU
        self.peak_tflops: float | None = None
        self._pending: list[StepStats] = []
        self._last_log = time.perf_counter()
        self._last_checkpoint = time.monotonic()
        torch.manual_seed(seed_for(recipe.seed, 0, info.rank))  # dropout etc.: distinct per rank

    def announce(self, name: str, num_params: int, trainable: int, report: dict) -> None:
        params = f"{_count(num_params)} parameters" + (f", {_count(trainable)} trained" if trainable != num_params else "")
        layout = "packed rows" if self.task.packable and getattr(self.task, "packing", False) else "rows"
        lines = [
            f"accord: {self.recipe.task} on {name} ({params}), {self.recipe.engine.strategy} on "
            f"{self.engine.device.type}, precision {self.recipe.engine.precision}",
            f"accord: batch {self.plan.describe()}",
            f"accord: {report['train_examples']} training examples in {len(self.rows)} {layout} "
            f"({self.order.steps_per_epoch} steps per epoch), {report['eval_examples']} held out"
            + (f" ({len(self.eval_data)} used)" if self.eval_data is not None and len(self.eval_data) < report["eval_examples"] else "")
            + f"; {self.total_steps} steps",
        ]
        if layout == "packed rows":
            fill = self.rows.lengths.sum() / (len(self.rows) * self.recipe.data.max_length)
            lines.append(f"accord: packing fills {100 * fill:.1f}% of each {self.recipe.data.max_length}-token row")
        if report.get("train_over_length"):
            policy = self.recipe.data.truncation
            lines.append(
                f"accord: {report['train_over_length']} training examples were longer than data.max_length="
                f"{self.recipe.data.max_length} ({'dropped' if policy == 'drop' else 'truncated'}; "
                f"{report['train_dropped']} left out in all)"
            )
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
        targets = int(self.rows.targets[global_batch].sum())
        loss_sum = torch.zeros((), device=self.engine.device)
        metrics: dict[str, torch.Tensor] = {}
        for micro_step in range(self.plan.grad_accum):
            row_ids = global_batch[self.plan.micro_slice(self.info.rank, micro_step)]
            batch = self.to_device(self.task.collate(self._rows(row_ids)))
            with self.engine.sync_context(last_micro_step=micro_step == self.plan.grad_accum - 1):
                with self.engine.autocast():
                    out = self.task.loss(self.engine.train_model, batch)
                micro_loss = out.loss_sum
                if faults.nan_loss_at(self.step + 1):
                    micro_loss = micro_loss * float("nan")
                self.engine.backward(micro_loss, max(targets, 1))
            loss_sum += micro_loss.detach()
            for name, value in out.metrics.items():
                metrics[name] = metrics.get(name, 0) + value.detach().float()
        lr = self.engine.lr
        grad_norm, stepped = self.engine.step(skip_nonfinite=self.recipe.train.on_nonfinite == "skip")
        self.step += 1
        tokens = int(self.rows.lengths[global_batch].sum())
        return StepStats(self.step, loss_sum, grad_norm.detach(), targets, tokens, self._padded(global_batch), lr, metrics, skipped=not stepped)

    def _padded(self, global_batch: np.ndarray) -> int:
        """Tokens computed on over all ranks: each micro-batch is padded to its longest row."""
        total = 0
        for rank in range(self.info.world_size):
            for micro_step in range(self.plan.grad_accum):
                lengths = self.rows.lengths[global_batch[self.plan.micro_slice(rank, micro_step)]]
                total += int(lengths.max()) * len(lengths)
        return total

    def _rows(self, row_ids) -> list[list[dict]]:
        """The examples of each row (one, or several when packed), fetched in one read."""
        members = [self.rows.members[r] for r in row_ids]
        examples = fetch(self.train_data, [i for m in members for i in m], self.extra_columns["train"])
        out, at = [], 0
        for m in members:
            out.append(examples[at : at + len(m)])
            at += len(m)
        return out

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.engine.device.type != "cuda":
            return batch
        # Pinned host memory lets the copy overlap the previous micro-step's compute.
        return {k: v.pin_memory().to(self.engine.device, non_blocking=True) for k, v in batch.items()}

    # ------------------------------------------------------------------ the loop

    def train(self, stop: StopRequest | None = None) -> RunResult:
        cfg = self.recipe.train
        self.engine.model.train()
        progress = Progress(self.total_steps, self.step, enabled=self.info.is_main)
        start_step, start = self.step, time.perf_counter()
        final_eval: dict[str, float] = {}
        self._last_log = time.perf_counter()
        # What is built by now (model, data, libraries) lives for the whole run: keep it out of
        # the collector's full scans, which otherwise walk it again and again during training.
        gc.collect()
        gc.freeze()
        try:
            if self.step >= self.total_steps:
                dist.print0(f"accord: the run is already complete at step {self.step}")
            if cfg.eval_on_start and self.step == 0 and self.eval_data is not None:
                progress.write(_format_eval(self.step, self.evaluate()))
                self._last_log = time.perf_counter()
            while self.step < self.total_steps:
                stats = self.train_step()
                if stats.step == start_step + 1:
                    self._record_model_state()  # optimizer state exists from the first step on
                self._pending.append(stats)
                self._count_skip(stats)
                progress.advance()
                at_end = self.step == self.total_steps
                if self.step % cfg.log_every == 0 or at_end:
                    self._flush_metrics(progress)
                if self.eval_data is not None and ((cfg.eval_every and self.step % cfg.eval_every == 0) or at_end):
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

    def _record_model_state(self) -> None:
        """The largest per-rank bytes of parameters, optimizer state and master weights."""
        held = self.engine.model_state_bytes()
        names = sorted(held)
        largest = dist.all_reduce_max(torch.tensor([float(held[n]) for n in names], dtype=torch.float64, device=self.engine.device))
        if self.metrics is not None:
            self.metrics.write({"kind": "model_state", "step": self.step} | {f"{n}_bytes": v for n, v in zip(names, largest.tolist())})

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
        # One collective for the whole interval: each step's loss (and task metrics) summed over ranks.
        names = sorted(pending[0].metrics)
        table = torch.stack([torch.stack([s.loss_sum.double(), *(s.metrics[n].double() for n in names)]) for s in pending])
        reduced = dist.all_reduce_sum(table).tolist()
        grad_norms = torch.stack([s.grad_norm.float() for s in pending]).tolist()
        losses = [row[0] / max(s.targets, 1) for s, row in zip(pending, reduced)]
        self._stop_if_nonfinite(pending, losses, grad_norms)
        tokens = sum(s.tokens for s in pending)
        if self.metrics is not None:
            for stats, loss, grad_norm, row in zip(pending, losses, grad_norms, reduced):
                record = {"kind": "train", "step": stats.step, "loss": loss, "lr": stats.lr, "grad_norm": grad_norm}
                record |= {name: value / max(stats.targets, 1) for name, value in zip(names, row[1:])}
                counts = {"targets": stats.targets, "tokens": stats.tokens, "padded_tokens": stats.padded_tokens}
                self.metrics.write(record | counts | {"skipped": stats.skipped})
            self.metrics.write({"kind": "throughput", "step": self.step, **self._throughput(pending, seconds)})
        progress.show(losses[-1], pending[-1].lr, tokens / seconds)

    def _throughput(self, pending: list[StepStats], seconds: float) -> dict[str, float]:
        tokens = sum(s.tokens for s in pending)
        numbers = {
            "tokens_per_s": tokens / seconds,
            "target_tokens_per_s": sum(s.targets for s in pending) / seconds,
            "padded_tokens_per_s": sum(s.padded_tokens for s in pending) / seconds,
            "samples_per_s": len(pending) * self.plan.global_batch_size / seconds,
            "seconds_per_step": seconds / len(pending),
            "peak_memory_gib": peak_memory_gib(self.engine.device),
        }
        if self.peak_tflops:
            achieved = self.flops_per_token * tokens / seconds
            numbers["mfu"] = achieved / (self.peak_tflops * 1e12 * self.info.world_size)
        return numbers

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
        """The task's metrics on the held-out set (and generation metrics when the recipe
        asks for them), over all ranks."""
        model = self.engine.module
        was_training = model.training
        model.eval()
        try:
            totals: dict[str, torch.Tensor] = {}
            size = self.recipe.train.eval_micro_batch_size
            for indices, weight in lockstep_batches(len(self.eval_data), self.info, size):
                rows = [[e] for e in fetch(self.eval_data, indices, self.extra_columns["eval"])]
                batch = self.to_device(self.task.collate(rows))
                with self.engine.autocast():
                    sums = self.task.eval_sums(model, batch)
                for name, value in sums.items():
                    totals[name] = totals.get(name, 0) + weight * value.double()
            names = sorted(totals)
            reduced = dist.all_reduce_sum(torch.stack([totals[n] for n in names])).tolist()
            results = self.task.eval_summary(dict(zip(names, reduced)))
            if self.recipe.train.eval_generate:
                results.update(self._generation_metrics(model))
        finally:
            model.train(was_training)
        if self.metrics is not None:
            self.metrics.write({"kind": "eval", "step": self.step, **results})
        return results

    def _generation_metrics(self, model: torch.nn.Module) -> dict[str, float]:
        count = min(self.recipe.train.eval_generate, len(self.eval_data))
        rows = fetch(self.eval_data, range(count), {})
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
            module = self.engine.module
            if self.recipe.lora is not None:
                # The adapter on its own, then the model with it merged in (plain transformers
                # loads that without peft).
                save_final_model(module, self.tokenizer, self.out_dir / "adapter", state_dict=state)
                if self.recipe.lora.merge_on_export:
                    module, state = self._merged(module, state), None
            save_final_model(module, self.tokenizer, final, state_dict=state)
        dist.barrier()
        return final

    def _merged(self, module, state):
        """The adapters merged into the weights. Training is over, so a full module is
        merged in place; a sharded one (fsdp, zero3) is rebuilt on the CPU from the
        gathered state first."""
        if state is None:
            return module.merge_and_unload()
        from accord.models import apply_lora, build_model

        plain = build_model(self.recipe.model, self.tokenizer, self.recipe.seed, self.task.model_kind, self.task.model_kwargs())
        plain = apply_lora(plain, self.recipe.lora, self.task.model_kind, self.recipe.seed)
        plain.load_state_dict(state)
        return plain.merge_and_unload()

    def close(self) -> None:
        self.engine.close()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak: allocated device memory on GPU, resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def fetch(ds, indices, extra: dict[str, np.ndarray]) -> list[dict]:
    """Examples `indices` of an Arrow dataset as dicts (one read), plus in-memory columns."""
    indices = [int(i) for i in indices]
    columns = ds[indices]
    examples = [{name: values[k] for name, values in columns.items()} for k in range(len(indices))]
    for name, values in extra.items():
        for example, i in zip(examples, indices):
            example[name] = values[i]
    return examples


def lockstep_batches(count: int, info: dist.DistInfo, size: int):
    """This rank's contiguous share of `count` examples in micro-batches, as (indices, weight).

    Every rank yields the same number of batches: a rank with fewer examples repeats one
    with weight 0, because under sharded strategies each forward pass is a collective.
    """
    per_rank = -(-count // info.world_size)
    start = info.rank * per_rank
    share = list(range(start, min(start + per_rank, count)))
    for at in range(0, per_rank, size):
        chunk = share[at : at + size]
        yield (chunk, 1.0) if chunk else ([0], 0.0)


def total_training_steps(recipe: Recipe, order: GlobalOrder) -> int:
    """train.max_steps, or the steps that train.epochs passes over the rows take."""
    if recipe.train.max_steps is not None:
        return recipe.train.max_steps
    assert recipe.train.epochs is not None
    return max(1, math.ceil(recipe.train.epochs * order.steps_per_epoch))


def _format_eval(step: int, results: dict[str, float]) -> str:
    parts = []
    for name, value in results.items():
        if name in ("perplexity", "generated"):
            continue
        if name == "exact_match_accuracy":
            parts.append(f"exact-match {100 * value:.1f}% of {int(results['generated'])}")
        elif name.endswith("accuracy") or name.endswith("f1"):
            parts.append(f"{name.replace('_', ' ')} {100 * value:.1f}%")
        else:
            parts.append(f"{name.replace('_', ' ')} {value:.4f}")
    return f"accord: step {step}: eval " + ", ".join(parts)
