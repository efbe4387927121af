"""The training loop: step -> loop -> save. It reads a RunSetup (accord.run.setup) and has no
strategy branches: the engine hides them. Every rank computes the same global plan (which
rows form each global batch, how many targets it has), so the loss normaliser needs no
communication."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from accord import faults
from accord.checkpoint.schedule import CheckpointSchedule, restore_run
from accord.checkpoint.store import latest_checkpoint, seed_for
from accord.data.fetch import fetch, to_device
from accord.distributed import group as dist
from accord.observe import heartbeat
from accord.observe.memory import memory_record
from accord.observe.progress import Progress
from accord.observe.steplog import StepLog, StepStats, Throughput
from accord.observe.trackers import Tracker
from accord.output.export import export_final
from accord.run.batch_pass import batch_pass
from accord.run.evaluate import EvaluationStopped, Evaluator
from accord.run.nonfinite import NonFiniteGuard
from accord.run.pipeline_step import pipeline_padded, pipeline_pass
from accord.run.rollout_step import rollout_step
from accord.run.setup import RunSetup
from accord.stopping import RunResult, StopRequest


class Trainer:
    def __init__(self, run: RunSetup, trackers: list[Tracker] | None = None):
        """`trackers`: rank 0's open experiment trackers (observe.report_to; None on the other ranks)."""
        self.run = run
        self.trackers = trackers
        self.engine, self.plan, self.rows, self.order = run.engine, run.plan, run.rows, run.order
        self.task = faults.maybe_poison_loss(run.task, lambda: self.step + 1)  # only under ACCORD_FAULTS
        self.task = faults.maybe_stop_rank(self.task, lambda: self.step + 1, run.info.rank, dist.restart_count())
        self.step = 0
        self.evaluator = (
            Evaluator(run.task, run.engine, run.info, run.plan, run.eval_data, run.recipe.train)
            if run.eval_data is not None
            else None
        )
        self.guard = NonFiniteGuard(run.recipe.train, run.engine.handles_overflow, self._intact_note)
        self.schedule = CheckpointSchedule(run.recipe.checkpoint)
        self.log: StepLog | None = None
        self._after_first_step: Callable[[], None] | None = None
        torch.manual_seed(seed_for(run.recipe.seed, 0, run.info.rank))  # dropout etc.: distinct per rank

    def restore(self, folder: Path) -> None:
        self.step = restore_run(self.run, folder)

    # ------------------------------------------------------------------ one step

    def train_step(self) -> StepStats:
        """One optimizer step over global batch `self.step` (grpo.num_iterations > 1: several
        steps share one batch of prompts)."""
        global_batch = self.order.batch(self.step // self.task.steps_per_batch)
        started = time.perf_counter()
        # An online task samples its targets first; its normaliser comes from one reduction.
        online = rollout_step(self.run, self.task, self.step, global_batch) if self.task.online else None
        if self.task.batch_statistics:
            batch_pass(self.run, self.task, global_batch, self._rows)
        training_started = time.perf_counter()
        # The normaliser: targets in the whole global batch, known to every rank from the plan.
        targets = online.targets if online else int(self.rows.targets[global_batch].sum())
        if self.engine.pipelined:
            loss_sum, metrics = pipeline_pass(self.run, self.task, self.step + 1, global_batch, targets, self._rows)
        else:
            loss_sum, metrics = self._micro_steps(global_batch, targets, online)
        lr = self.engine.lr
        heartbeat.phase("optimizer step", self.step + 1)
        grad_norm, applied = self.engine.step(skip_nonfinite=self.guard.skip)
        self.step += 1
        if online:
            tokens, padded = online.tokens, online.tokens
            means = online.means | {
                "training_s": time.perf_counter() - training_started,
                "step_s": time.perf_counter() - started,
            }
        else:
            tokens, means = int(self.rows.lengths[global_batch].sum()), {}
            # Flattened micro-batches (CausalLMTask.flatten) compute no padding.
            padded = tokens if getattr(self.run.task, "flatten", False) else self._padded(global_batch)
            if self.engine.pipelined:  # a pipeline pads its rows to one width per step
                padded = pipeline_padded(self.plan, self.rows.lengths, global_batch)
        means = means | self.task.step_means()  # a mixture-of-experts router's balance, say
        return StepStats(
            self.step,
            loss_sum,
            grad_norm.detach(),
            targets,
            tokens,
            padded,
            lr,
            metrics,
            skipped=not applied,
            means=means,
        )

    def _micro_steps(self, global_batch: np.ndarray, targets: int, online) -> tuple[torch.Tensor, dict]:
        """Forward and backward of this rank's micro-batches, one after another; the logged loss
        and metric sums."""
        loss_sum = torch.zeros((), device=self.engine.device)
        metrics: dict[str, torch.Tensor] = {}
        for micro_step in range(self.plan.grad_accum):
            last = micro_step == self.plan.grad_accum - 1
            heartbeat.phase("forward", self.step + 1)
            # The ranks of a sequence-parallel group take the same rows, each a slice of their tokens.
            row_ids = global_batch[self.plan.micro_slice(self.plan.data_rank(self.run.info.rank), micro_step)]
            rows = self.task.rollout_batch(row_ids) if online else self.task.collate(self._rows(row_ids))
            batch = to_device(self.run.sequence.shard(rows), self.engine.device)
            with self.engine.sync_context(last_micro_step=last):
                with self.engine.autocast():
                    out = self.task.loss(self.engine.train_model, batch)
                heartbeat.phase(
                    "backward/all-reduce" if last else "backward", self.step + 1
                )  # gradients sync on the last
                # A row term (ORPO's, CPO's pair losses) rides on the target normaliser.
                micro_loss, micro_metrics = out.over_targets(targets, len(global_batch))
                self.engine.backward(micro_loss, max(targets, 1))
            # A tensor-parallel group computes one loss on every rank: it counts once in the logged sums.
            share = 1.0 if self.plan.counts(self.run.info.rank) else 0.0
            loss_sum += micro_loss.detach() * share
            for name, value in micro_metrics.items():
                metrics[name] = metrics.get(name, 0) + value.detach().float() * share
        return loss_sum, metrics

    def _rows(self, row_ids) -> list[list[dict]]:
        """The examples of each row (one, or several when packed), fetched in one read."""
        members = [self.rows.members[r] for r in row_ids]
        examples = fetch(self.run.train_data, [i for m in members for i in m])
        out, at = [], 0
        for m in members:
            out.append(examples[at : at + len(m)])
            at += len(m)
        return out

    def _padded(self, global_batch: np.ndarray) -> int:
        """Tokens computed on over all ranks: each micro-batch is padded to its longest row."""
        total = 0
        for rank in range(self.plan.world_size):
            for micro_step in range(self.plan.grad_accum):
                lengths = self.rows.lengths[global_batch[self.plan.micro_slice(rank, micro_step)]]
                total += int(lengths.max()) * len(lengths)
        return total

    # ------------------------------------------------------------------ the loop

    def train(self, stop: StopRequest | None = None, after_first_step: Callable[[], None] | None = None) -> RunResult:
        """`after_first_step`: called once, when this run's first steps are logged and found
        finite (how --overwrite knows the new run trains before it deletes the earlier one)."""
        self._after_first_step = after_first_step
        run, cfg = self.run, self.run.recipe.train
        throughput = Throughput(
            self.plan.global_batch_size,
            run.info.world_size,
            run.model.flops_per_token,
            run.model.peak_tflops,
            self.engine.device,
        )
        self.log = StepLog(run.out_dir, self.step, throughput, writer=run.info.is_main, trackers=self.trackers)
        self.log.write(memory_record(self.step, "build", self.engine.device))  # construction, loading, resume
        self.engine.module.train()
        progress = Progress(run.total_steps, self.step, enabled=run.info.is_main)
        start_step, start = self.step, time.perf_counter()
        final_eval: dict[str, float] = {}
        # What is built by now (model, data, libraries) lives for the whole run: keep it out of
        # the collector's full scans, which otherwise walk it again and again during training.
        gc.collect()
        gc.freeze()
        try:
            if self.step >= run.total_steps:
                dist.print0(f"accord: the run is already complete at step {self.step}")
            if cfg.eval_on_start and self.step == 0 and self.evaluator is not None:
                self._evaluate(progress, stop)
            while self.step < run.total_steps:
                stats = self.train_step()
                if stats.step == start_step + 1:
                    self.log.record_model_state(
                        self.step, self.engine.model_state_bytes()
                    )  # optimizer state exists now
                self.log.add(stats)
                self.guard.after_step(stats)
                progress.advance()
                at_end = self.step == run.total_steps
                eval_due = self.evaluator is not None and (
                    (cfg.eval_every and self.step % cfg.eval_every == 0) or at_end
                )
                if self.step % cfg.log_every == 0 or at_end or eval_due:
                    self._flush(progress)
                if eval_due:
                    final_eval = self._evaluate(progress, stop)
                # One small collective per step: did any rank get a stop signal, is a
                # timed checkpoint due (rank 0's clock decides)?
                heartbeat.phase("stop/checkpoint flags", self.step)
                stopping, time_due = dist.any_rank(
                    stop is not None and stop.requested, run.info.is_main and self.schedule.time_due()
                )
                if at_end or stopping or time_due or self.schedule.step_due(self.step):
                    self._flush(progress)
                    heartbeat.phase("checkpoint save", self.step)
                    self.save_checkpoint()
                if stopping and not at_end:
                    self.schedule.finish()  # an asynchronous checkpoint sealed before exiting
                    progress.close()
                    why = stop.signal_name if stop and stop.signal_name else "signal on another rank"
                    dist.print0(f"accord: stop requested ({why}): checkpoint of step {self.step} written")
                    return RunResult("preempted", self.step, final_eval, "checkpointed on request")
        finally:
            heartbeat.phase(heartbeat.DONE, self.step)  # export and shutdown are not watched
            progress.close()
        dist.print0(f"accord: trained {self.step - start_step} steps in {time.perf_counter() - start:.1f} s")
        return RunResult("completed", self.step, final_eval)

    def _flush(self, progress: Progress) -> None:
        logged, tokens_per_s = self.log.flush()
        if logged:
            self.guard.after_flush(logged)
            if self._after_first_step is not None:
                self._after_first_step, proven = None, self._after_first_step
                proven()
            progress.show(logged[-1].loss, logged[-1].stats.lr, tokens_per_s)

    def _evaluate(self, progress: Progress, stop: StopRequest | None) -> dict[str, float]:
        heartbeat.phase("eval", self.step)
        try:
            results = self.evaluator.evaluate(stop)
        except EvaluationStopped:  # the loop's next stop check writes the checkpoint and exits
            progress.write(f"accord: step {self.step}: evaluation left unfinished (stop requested)")
            self.log.restart_clock()
            return {}
        self.log.write({"kind": "eval", "step": self.step, **results})
        progress.write(f"accord: step {self.step}: {self.task.format_eval(results)}")
        self.log.restart_clock()
        return results

    def _intact_note(self) -> str:
        latest = latest_checkpoint(self.run.out_dir)
        return f"The last checkpoint ({latest}) is intact." if latest else "No checkpoint was written yet."

    # ------------------------------------------------------------------ save / close

    def save_checkpoint(self) -> Path:
        self.log.write(memory_record(self.step, "train", self.engine.device))
        start = time.perf_counter()
        folder = self.schedule.save(self.run, self.step)
        # How long training waited for it (with checkpoint.async: until the write went to the background).
        blocked = time.perf_counter() - start
        self.log.write({"kind": "checkpoint", "step": self.step, "path": str(folder), "seconds": round(blocked, 3)})
        self.log.write(memory_record(self.step, "checkpoint", self.engine.device))
        self.log.restart_clock()
        return folder

    def save(self) -> Path:
        run = self.run
        self.schedule.finish()  # the last checkpoint sealed (written in the background under checkpoint.async)
        final = export_final(self.engine, run.recipe, run.task, run.tokenizer, run.out_dir, run.info)
        self.log.write(memory_record(self.step, "export", self.engine.device))
        return final

    def close(self, status: str = "failed") -> None:
        """`status`: how the run ended (completed, preempted, stopped, failed), for the trackers."""
        gc.unfreeze()  # the run's objects become collectable again (a caller's process lives on)
        self.engine.close()
        if self.log is not None:
            self.log.close(status)
        else:
            for tracker in self.trackers or []:  # opened, but the loop never started
                tracker.finish({}, status)
