"""Metrics to `metrics.jsonl` and TensorBoard; written by rank 0 only."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, out_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._jsonl = (out_dir / "metrics.jsonl").open("a", encoding="utf-8")
        self._tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        """One record: `kind` (train/eval/...), `step`, then named numbers."""
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        kind, step = record["kind"], record["step"]
        for key, value in record.items():
            if key not in ("kind", "step") and isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        # SummaryWriter owns a writer thread; closing joins it so no thread outlives the run.
        self._tb.close()
        self._jsonl.close()


def read_metrics(out_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
