"""Metrics to `metrics.jsonl` and the experiment trackers (TensorBoard by default); written by rank 0 only."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from accord.atomic import write_atomic
from accord.observe.trackers import Tracker


class MetricsWriter:
    def __init__(self, out_dir: Path, resume_step: int = 0, trackers: Sequence[Tracker] = ()):
        """Append to the run's metrics; a resumed run first drops what was logged after
        the step it resumes from (those steps are trained again), but not the hang records
        that explain why it resumed. `trackers`: the experiment trackers rank 0 opened (observe.report_to)."""
        path = out_dir / "metrics.jsonl"
        if resume_step and path.exists():
            kept = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and _kept_on_resume(json.loads(line), resume_step)
            ]
            write_atomic(path, "".join(line + "\n" for line in kept))
        self._jsonl = path.open("a", encoding="utf-8")
        self._trackers = list(trackers)
        self._last: dict[str, float] = {}  # each scalar's latest value, for the final metrics
        self._step = resume_step

    def write(self, record: dict[str, Any]) -> None:
        """One record: `kind` (train/eval/...), `step`, then named numbers."""
        # Strict JSON: a non-finite number (a skipped step's loss) is written as null.
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in record.items()}
        clean.setdefault("time", time.time())  # wall clock when written (after the step's sync)
        self._jsonl.write(json.dumps(clean) + "\n")
        self._jsonl.flush()
        kind, step = record["kind"], record["step"]
        scalars = {
            f"{kind}/{key}": value
            for key, value in record.items()
            if key not in ("kind", "step", "time") and isinstance(value, (int, float)) and math.isfinite(value)
        }
        if scalars:
            for tracker in list(self._trackers):
                self._call(tracker, step, tracker.log, scalars, step)
            self._last |= scalars
            self._step = max(self._step, step)

    def flush(self) -> None:
        """A logging interval's records are all written: the trackers that batch write them now."""
        for tracker in list(self._trackers):
            self._call(tracker, self._step, tracker.flush)

    def _call(self, tracker: Tracker, step: int, method, *args) -> bool:
        """A tracker that fails mid-run (its server gone, its disk full) is dropped with one warning:
        the run goes on, and metrics.jsonl still holds every record."""
        try:
            method(*args)
            return True
        except Exception as e:  # any library's error: the tracker is dropped, never the run
            self._trackers.remove(tracker)
            reason = " ".join(str(e).split())[:300]
            print(
                f"accord: warning: {tracker.name} stopped recording at step {step}: {type(e).__name__}: {reason} "
                f"(metrics.jsonl holds every record)",
                file=sys.stderr,
                flush=True,
            )
            return False

    def final_metrics(self) -> dict[str, float]:
        """What the trackers are given at the end: the last training loss, the last evaluation's
        metrics and the step reached, under `final/`."""
        kept = {tag: v for tag, v in self._last.items() if tag == "train/loss" or tag.startswith("eval/")}
        return {f"final/{tag}": v for tag, v in kept.items()} | {"final/step": self._step}

    def close(self, status: str = "completed") -> None:
        """`status`: how the run ended (completed, preempted, stopped, failed), for the trackers."""
        final = self.final_metrics()
        try:
            for tracker in list(self._trackers):
                self._call(tracker, self._step, tracker.finish, final, status)
        finally:
            self._trackers = []
            self._jsonl.close()


def _kept_on_resume(record: dict[str, Any], resume_step: int) -> bool:
    return record["step"] <= resume_step or record["kind"] == "hang"


def read_metrics(out_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
