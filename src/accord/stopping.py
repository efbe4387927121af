"""Requests to stop early: SIGTERM (preemption, `kill`) and SIGUSR1 (SLURM's warning before
the time limit). The handler only records the request; the loop finishes its optimizer
step, writes a checkpoint and exits with PREEMPTED_EXIT_CODE. Also how a run ends: its
result, or the error that stops it."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from accord.errors import RunStopped

# Distinct from errors (1, 2) so a job script can requeue on it: "checkpointed, resume me".
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

# How a worker process ends; anything else is a crash (its traceback is on stderr).
STOPPED_EXIT_CODE = 3  # the run cannot continue; the reason was printed on rank 0
REFUSED_EXIT_CODE = 4  # bad input found by the workers before writing anything; the command exits 2
EXIT_CODES = {
    "completed": 0,
    "preempted": PREEMPTED_EXIT_CODE,
    "stopped": STOPPED_EXIT_CODE,
    "refused": REFUSED_EXIT_CODE,
}


class TrainingStopped(RunStopped):
    """The run cannot continue (non-finite loss, a failed checkpoint write); the message
    says why and what is intact. Raised on every rank alike, so shutdown stays orderly."""

    status = "stopped"  # how the worker ends (EXIT_CODES)


class StartRefused(TrainingStopped):
    """Bad input that only the workers can find, before the run wrote anything (no checkpoint
    to resume from verifies: checking every file's checksum is their work, in parallel)."""

    status = "refused"
    exit_code = 2


@dataclass
class RunResult:
    status: str  # completed | preempted | stopped | refused
    step: int
    eval: dict[str, float] = field(default_factory=dict)
    message: str = ""


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None

    def install(self) -> StopRequest:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal_name is not None
