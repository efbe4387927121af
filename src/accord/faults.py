"""Fault injection for accord's own tests: ACCORD_FAULTS="name=value,...".

Crash-safety claims (a SIGKILL while a checkpoint is being written, a NaN at a given
step) need the fault to land at an exact point; these hooks put it there. Unset, they
cost one dictionary lookup.

  checkpoint_pause_at_step=N
                         sleep (checkpoint_pause_s, default 60) seconds after the files
                         of step N's checkpoint are written, before it is sealed: a
                         window to kill the run mid-write (under checkpoint.async in
                         the background writer, while training goes on)
  nan_loss_at_step=N     make the loss of optimizer step N (1-based) NaN on every rank
  stop_rank=R,stop_at_step=N
                         rank R SIGSTOPs itself in the forward pass of step N (1-based), in
                         the first worker group only (a restarted group runs on): a hang
                         for the watchdog at an exact point
  stop_by_sleeping=1     ... sleeps there instead: a rank that hangs while running (a
                         deadlock, a lost message)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import cache


@cache
def _faults() -> dict[str, float]:
    spec = os.environ.get("ACCORD_FAULTS", "")
    pairs = (item.split("=", 1) for item in spec.split(",") if "=" in item)
    return {name.strip(): float(value) for name, value in pairs}


def pause_before_sealing_checkpoint(step: int) -> None:
    if _faults().get("checkpoint_pause_at_step") == step:
        seconds = _faults().get("checkpoint_pause_s", 60.0)
        print(f"accord: [fault injection] pausing {seconds:g} s inside the checkpoint write of step {step}", flush=True)
        time.sleep(seconds)


def maybe_poison_loss(task, current_step: Callable[[], int]):
    """The task, or (under nan_loss_at_step) a stand-in whose training loss is NaN at that
    step: the loop itself carries no fault hook."""
    at = _faults().get("nan_loss_at_step")
    return task if at is None else _NaNLoss(task, int(at), current_step)


def maybe_stop_rank(task, current_step: Callable[[], int], rank: int, restart: int):
    """The task, or (under stop_rank / stop_at_step, for this rank in the first worker group)
    a stand-in that SIGSTOPs this process when the loss of that step is computed."""
    at = _faults().get("stop_at_step")
    if at is None or _faults().get("stop_rank", 0) != rank or restart > 0:
        return task
    return _StopInLoss(task, int(at), current_step)


class _NaNLoss:
    """Delegates everything to the task; only `loss` at the chosen step is poisoned."""

    def __init__(self, task, at_step: int, current_step: Callable[[], int]):
        self._task, self._at_step, self._current_step = task, at_step, current_step

    def __getattr__(self, name: str):
        return getattr(self._task, name)

    def loss(self, model, batch):
        out = self._task.loss(model, batch)
        if self._current_step() == self._at_step:
            out.loss_sum = out.loss_sum * float("nan")
        return out


class _StopInLoss(_NaNLoss):  # delegates like _NaNLoss; only `loss` at the chosen step differs
    _stopped = False

    def loss(self, model, batch):
        if self._current_step() == self._at_step and not self._stopped:
            import signal

            self._stopped = True  # once: continued to dump its stacks, it must not stop again
            how = "sleeping" if _faults().get("stop_by_sleeping") else "stopping this process (SIGSTOP)"
            print(
                f"accord: [fault injection] {how} in the forward pass of step {self._at_step} "
                f"at unix time {time.time():.3f}",
                flush=True,
            )
            if _faults().get("stop_by_sleeping"):
                time.sleep(3600)
            else:
                os.kill(os.getpid(), signal.SIGSTOP)
        return self._task.loss(model, batch)
