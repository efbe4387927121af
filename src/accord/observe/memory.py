"""Each rank's peak memory at the end of a run's phases (build, train, checkpoint, export).

The peak so far is monotonic (RSS high-water mark on the CPU, max_memory_allocated on a
GPU), so the value recorded at the end of a phase is the peak of everything up to it; the
phase that raised it is the first whose value is higher. Every rank's figure is gathered
(one tiny collective per phase), so a sharded run shows whether any rank held more than
its share.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from accord.distributed import group as dist
from accord.observe.steplog import peak_memory_gib


def memory_record(step: int, phase: str, device: torch.device) -> dict:
    """Collective: a `memory` record for metrics.jsonl."""
    peaks = dist.all_gather_value(peak_memory_gib(device), device)
    return {
        "kind": "memory",
        "step": step,
        "phase": phase,
        "peak_gib_per_rank": peaks,
        "peak_gib_max": max(peaks),
        "peak_gib_total": sum(peaks),
    }


def phase_peaks(metrics: Path) -> dict[str, float]:
    """The largest rank's recorded peak (GiB) at the end of each phase of the run(s) logged
    in `metrics` (a metrics.jsonl); a resumed run's build is reported as `resume`."""
    found: dict[str, float] = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "memory":
            phase = "resume" if record["phase"] == "build" and "build" in found else record["phase"]
            found.setdefault(phase, record["peak_gib_max"])
    return found
