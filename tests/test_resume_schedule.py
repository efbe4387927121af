"""Resuming with a larger train.max_steps: the run says what happens to the learning-rate
schedule, and optim.extend chooses it (continue: recomputed for the new length; restart_decay:
a new warm-up and decay over the added steps)."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from conftest import TINY_RECIPE, assert_ok, run_accord

pytestmark = pytest.mark.distributed

# The session's shared 1-process run (10 steps, checkpoints at 6 and 10) is the one extended.
ONE = ["engine.processes=1", "batch.micro_batch_size=8"]


def _cosine(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1 + math.cos(math.pi * progress)))


def _lrs(out) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in rows if r["kind"] == "train"}


# restart_decay in the slow tier (default-suite budget): continue, the default, runs the same path by default.
@pytest.mark.parametrize("extend", ["continue", pytest.param("restart_decay", marks=pytest.mark.slow)])
def test_resume_with_more_steps_says_and_applies_the_schedule(one_process_reference, tmp_path, extend):
    recipe, ten = one_process_reference
    out = tmp_path / extend
    shutil.copytree(ten, out)
    proc = run_accord(
        "train", recipe, *ONE, "train.max_steps=13", f"optim.extend={extend}", f"output.dir={out}", "--resume"
    )
    assert_ok(proc)
    assert f"accord: resuming at step 10 with train.max_steps 10 → 13: optim.extend={extend}" in proc.stderr
    lr, warmup = TINY_RECIPE["optim"]["lr"], TINY_RECIPE["optim"]["warmup_steps"]
    logged = _lrs(out)
    # The lr of step k is the schedule's value after k - 1 steps.
    assert [logged[k] for k in range(1, 11)] == pytest.approx([lr * _cosine(k - 1, 10, warmup) for k in range(1, 11)])
    if extend == "continue":
        expected = [lr * _cosine(k - 1, 13, warmup) for k in (11, 12, 13)]
    else:
        expected = [lr * _cosine(k - 1 - 10, 3, warmup) for k in (11, 12, 13)]
    assert [logged[k] for k in (11, 12, 13)] == pytest.approx(expected, abs=1e-12)

    if extend == "restart_decay":
        # The extended schedule travels with the checkpoint: a further resume keeps both segments.
        again = run_accord(
            "train", recipe, *ONE, "train.max_steps=15", "optim.extend=continue", f"output.dir={out}", "--resume"
        )
        assert_ok(again)
        logged = _lrs(out)
        assert [logged[k] for k in (11, 12, 13)] == pytest.approx(expected, abs=1e-12)
        assert [logged[k] for k in (14, 15)] == pytest.approx(
            [lr * _cosine(k - 1 - 10, 5, warmup) for k in (14, 15)], abs=1e-12
        )


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_each_segment_of_a_resumed_schedule_is_the_engines_schedule_to_the_bit(schedule):
    """One implementation of the schedule: a segment of a resumed run's schedule multiplies
    the learning rate exactly as the scheduler an engine builds for that segment's length."""
    from types import SimpleNamespace

    import torch

    from accord.checkpoint.lr_on_resume import SegmentedSchedule
    from accord.engine.optim import build_scheduler

    cfg = SimpleNamespace(schedule=schedule, warmup_steps=3)
    segmented = SegmentedSchedule([[0, 10], [10, 25]], schedule, cfg.warmup_steps)
    for start, end in ((0, 10), (10, 25)):
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        (engines,) = build_scheduler(optimizer, cfg, end - start).lr_lambdas
        for step in range(start, end + 1 if end == 25 else end):
            assert segmented(step) == engines(step - start), (schedule, step)
