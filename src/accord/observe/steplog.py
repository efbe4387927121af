"""Each optimizer step's numbers, reduced over the ranks once per logging interval.

Steps keep their loss on the device; a flush turns the interval's steps into one
all-reduce, then rank 0 writes a `train` record per step and one `throughput` record.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from accord.distributed import group as dist
from accord.observe.metrics import MetricsWriter
from accord.observe.trackers import Tracker


@dataclass
class StepStats:
    step: int
    loss_sum: torch.Tensor  # this rank's summed loss (on device; reduced at flush)
    grad_norm: torch.Tensor
    targets: int  # targets in the whole global batch
    tokens: int  # non-pad tokens in the whole global batch
    padded_tokens: int  # tokens computed on, padding included
    lr: float
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # this rank's sums
    skipped: bool = False  # the update was not applied (non-finite gradient)
    means: dict[str, float] = field(default_factory=dict)  # already reduced over ranks (online tasks' rewards, times)


@dataclass(frozen=True)
class LoggedStep:
    stats: StepStats
    loss: float  # summed over ranks / targets of the global batch
    grad_norm: float


@dataclass(frozen=True)
class Throughput:
    """What one run reports about its speed; MFU only where the device's peak is known."""

    global_batch_size: int
    world_size: int
    flops_per_token: float
    peak_tflops: float | None
    device: torch.device

    def numbers(self, steps: list[StepStats], seconds: float) -> dict[str, float]:
        tokens = sum(s.tokens for s in steps)
        numbers = {
            "tokens_per_s": tokens / seconds,
            "target_tokens_per_s": sum(s.targets for s in steps) / seconds,
            "padded_tokens_per_s": sum(s.padded_tokens for s in steps) / seconds,
            "samples_per_s": len(steps) * self.global_batch_size / seconds,
            "seconds_per_step": seconds / len(steps),
            "peak_memory_gib": peak_memory_gib(self.device),
        }
        if self.peak_tflops:
            achieved = self.flops_per_token * tokens / seconds
            numbers["mfu"] = achieved / (self.peak_tflops * 1e12 * self.world_size)
        return numbers


class StepLog:
    """Collects steps between flushes; every rank calls flush() together (it all-reduces)."""

    def __init__(
        self,
        out_dir: Path,
        resume_step: int,
        throughput: Throughput,
        writer: bool,
        trackers: list[Tracker] | None = None,
    ):
        """`writer`: this rank writes the metrics (rank 0), to metrics.jsonl and `trackers`."""
        self.throughput = throughput
        self.metrics = MetricsWriter(out_dir, resume_step=resume_step, trackers=trackers or ()) if writer else None
        self._pending: list[StepStats] = []
        self._since = time.perf_counter()

    def add(self, stats: StepStats) -> None:
        self._pending.append(stats)

    def restart_clock(self) -> None:
        """Time spent since (evaluating, checkpointing) is not training throughput."""
        self._since = time.perf_counter()

    def flush(self) -> tuple[list[LoggedStep], float]:
        """The pending steps with their reduced loss, and the interval's tokens per second."""
        steps, self._pending = self._pending, []
        if not steps:
            return [], 0.0
        now = time.perf_counter()
        seconds, self._since = max(now - self._since, 1e-9), now
        # One collective for the whole interval: each step's loss (and task metrics) summed over ranks.
        names = sorted(steps[0].metrics)
        table = torch.stack(
            [torch.stack([s.loss_sum.double(), *(s.metrics[n].double() for n in names)]) for s in steps]
        )
        reduced = dist.all_reduce_sum(table).tolist()
        grad_norms = torch.stack([s.grad_norm.float() for s in steps]).tolist()
        logged = [LoggedStep(s, row[0] / max(s.targets, 1), g) for s, row, g in zip(steps, reduced, grad_norms)]
        if self.metrics is not None:
            for entry, row in zip(logged, reduced):
                s = entry.stats
                record = {"kind": "train", "step": s.step, "loss": entry.loss, "lr": s.lr, "grad_norm": entry.grad_norm}
                record |= {name: value / max(s.targets, 1) for name, value in zip(names, row[1:])}
                counts = {"targets": s.targets, "tokens": s.tokens, "padded_tokens": s.padded_tokens}
                self.metrics.write(record | s.means | counts | {"skipped": s.skipped})
            self.metrics.write(
                {"kind": "throughput", "step": steps[-1].step, **self.throughput.numbers(steps, seconds)}
            )
            self.metrics.flush()
        return logged, sum(s.tokens for s in steps) / seconds

    def record_model_state(self, step: int, held: dict[str, int]) -> None:
        """Collective: the largest per-rank bytes of parameters, optimizer state and master weights."""
        names = sorted(held)
        values = torch.tensor([float(held[n]) for n in names], dtype=torch.float64, device=self.throughput.device)
        largest = dist.all_reduce_max(values)
        self.write({"kind": "model_state", "step": step} | {f"{n}_bytes": v for n, v in zip(names, largest.tolist())})

    def write(self, record: dict) -> None:
        if self.metrics is not None:
            self.metrics.write(record)
            self.metrics.flush()

    def close(self, status: str = "completed") -> None:
        """`status`: how the run ended, for the trackers."""
        if self.metrics is not None:
            self.metrics.close(status)
            self.metrics = None


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak: allocated device memory on GPU, resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
