"""Requests to stop early: SIGTERM (preemption, `kill`) and SIGUSR1 (SLURM's warning before
the time limit). The handler only records the request; the loop finishes its optimizer
step, writes a checkpoint and exits with PREEMPTED_EXIT_CODE."""

from __future__ import annotations

import signal

# Distinct from errors (1, 2) so a job script can requeue on it: "checkpointed, resume me".
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

# How a worker process ends; anything else is a crash (its traceback is on stderr).
STOPPED_EXIT_CODE = 3  # the run cannot continue; the reason was printed on rank 0
EXIT_CODES = {"completed": 0, "preempted": PREEMPTED_EXIT_CODE, "stopped": STOPPED_EXIT_CODE}


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
