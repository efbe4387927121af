"""Metrics to `metrics.jsonl` and TensorBoard; written by rank 0 only."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from accord.atomic import write_atomic


class MetricsWriter:
    def __init__(self, out_dir: Path, resume_step: int = 0):
        """Append to the run's metrics; a resumed run first drops what was logged after
        the step it resumes from (those steps are trained again), but not the hang records
        that explain why it resumed."""
        from torch.utils.tensorboard import SummaryWriter

        path = out_dir / "metrics.jsonl"
        if resume_step and path.exists():
            kept = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and _kept_on_resume(json.loads(line), resume_step)
            ]
            write_atomic(path, "".join(line + "\n" for line in kept))
        self._jsonl = path.open("a", encoding="utf-8")
        # purge_step hides TensorBoard events of the steps being trained again.
        self._tb = SummaryWriter(
            log_dir=str(out_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None
        )

    def write(self, record: dict[str, Any]) -> None:
        """One record: `kind` (train/eval/...), `step`, then named numbers."""
        # Strict JSON: a non-finite number (a skipped step's loss) is written as null.
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in record.items()}
        clean.setdefault("time", time.time())  # wall clock when written (after the step's sync)
        self._jsonl.write(json.dumps(clean) + "\n")
        self._jsonl.flush()
        kind, step = record["kind"], record["step"]
        for key, value in record.items():
            if key not in ("kind", "step") and isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        # SummaryWriter owns a writer thread; closing joins it so no thread outlives the run.
        self._tb.close()
        self._jsonl.close()


def _kept_on_resume(record: dict[str, Any], resume_step: int) -> bool:
    return record["step"] <= resume_step or record["kind"] == "hang"


def read_metrics(out_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
