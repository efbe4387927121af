"""A task and a strategy as a user's package would define them, registered by name in
tests/test_registry.py (importable by the worker processes: tests/ is on their PYTHONPATH)."""

from __future__ import annotations

import os
from pathlib import Path

from accord.engine import ddp
from accord.tasks.sft import SFTTask

MARKS = "ACCORD_TEST_STRATEGY_MARKS"  # folder where build_my_ddp leaves one file per rank


class MySFT(SFTTask):
    name = "my-sft"

    def loss(self, model, batch):
        out = super().loss(model, batch)
        # Reported as its sum over the step's targets: 1.0 exactly when this loss ran every micro-step.
        out.metrics["my_sft_targets"] = out.num_targets.float()
        return out


def build_my_ddp(spec, model, info, device, plan, total_steps):
    """ddp's engine, leaving a mark that this factory built it (`spec`: accord.engine.spec.EngineSpec)."""
    Path(os.environ[MARKS], f"rank{info.rank}").write_text(spec.engine.strategy, encoding="utf-8")
    return ddp.build(spec, model, info, device, plan, total_steps)
