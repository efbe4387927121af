"""Runs that cannot continue stop with one clear line and leave every checkpoint intact."""

from __future__ import annotations

import json
import sys

import pytest

from accord.checkpoint.store import complete_checkpoints, incomplete_checkpoints
from conftest import (
    REPO,
    TINY_RECIPE,
    accord_env,
    assert_ok,
    run_accord,
    run_accord_here,
    run_process,
    step_losses,
    write_recipe,
)
from test_cli_errors import HERE


@pytest.fixture
def recipe(tmp_path):
    return write_recipe(tmp_path / "tiny.yaml", TINY_RECIPE)


def _accord_faults(monkeypatch, spec: str) -> None:
    monkeypatch.setenv("ACCORD_FAULTS", spec)


@pytest.mark.distributed
def test_nonfinite_loss_stops_naming_the_step(recipe, tmp_path, monkeypatch):
    _accord_faults(monkeypatch, "nan_loss_at_step=7")
    out = tmp_path / "nan"
    proc = run_accord(
        "train", recipe, "train.max_steps=12", "train.log_every=4", "checkpoint.every_steps=5", f"output.dir={out}"
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "accord: error: step 7: loss nan is not finite; stopping" in proc.stderr
    assert "step-000005) is intact" in proc.stderr
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step-000005"]
    assert not (out / "final").exists()


@pytest.mark.distributed
def test_nonfinite_skip_mode_skips_that_update_and_finishes(recipe, tmp_path, monkeypatch):
    _accord_faults(monkeypatch, "nan_loss_at_step=7")
    out = tmp_path / "skip"
    proc = run_accord("train", recipe, "train.max_steps=12", "train.on_nonfinite=skip", f"output.dir={out}")
    assert_ok(proc)
    assert "step 7: non-finite gradient norm; update skipped (1 so far)" in proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in records if r["kind"] == "train" and r["skipped"]]
    assert skipped == [7]
    losses = step_losses(out)
    assert losses[7] is None and all(isinstance(losses[s], float) for s in losses if s != 7)


DISK_FULL = """
import errno, json, sys
import accord.engine.state as engine_state
from accord.recipe.schema import validate_recipe
from accord.launch.worker import train_worker
from conftest import TINY_RECIPE

calls = {"n": 0}

class DiskFullOnTheSecondWrite(engine_state.RecordingWriter):
    # the sharded state's writer, failing in its second checkpoint as on a full disk

    def write_data(self, plan, planner):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return super().write_data(plan, planner)

engine_state.RecordingWriter = DiskFullOnTheSecondWrite
raw = TINY_RECIPE | {"output": {"dir": sys.argv[1]}, "checkpoint": {"every_steps": 4}}
raw["engine"] = TINY_RECIPE["engine"] | {"processes": 1}
print("result: " + json.dumps(train_worker(validate_recipe(raw)).__dict__))
"""


@pytest.mark.distributed
def test_checkpoint_write_failure_stops_cleanly_and_keeps_the_previous(tmp_path):
    """A disk that fills up mid-run: the error names the cause, the earlier checkpoint survives.
    The worker runs in a child process (its signal handlers and gc.freeze() stay there), with
    the second checkpoint's state write failing as on a full disk."""
    out = tmp_path / "full"
    proc = run_process([sys.executable, "-c", DISK_FULL, str(out)], cwd=REPO / "tests", env=accord_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(
        next(line for line in proc.stdout.splitlines() if line.startswith("result: "))[len("result: ") :]
    )
    assert result["status"] == "stopped"
    assert "could not write the checkpoint of step 8: No space left on device" in result["message"]
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step-000004"]
    assert incomplete_checkpoints(out / "checkpoints") == []  # the partial one was removed
    assert not (out / "final").exists()


FULL_DISK_UNSAID = """
import json, shutil, sys
from collections import namedtuple
import accord.engine.state as engine_state
from accord.recipe.schema import validate_recipe
from accord.launch.worker import train_worker
from conftest import TINY_RECIPE

mode, calls = sys.argv[2], {"n": 0}
usage, real_usage = namedtuple("usage", "total used free"), shutil.disk_usage

class ZipWriterOnAFullDisk(engine_state.RecordingWriter):
    # torch.save's zip writer loses the OSError of a full disk and reports a position mismatch

    def write_data(self, plan, planner):
        calls["n"] += 1
        if calls["n"] == 1 and mode == "first":
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return super().write_data(plan, planner)

def disk_usage(path):  # 1000 bytes free where the checkpoints go, once the run has written one (or from the start)
    real = real_usage(path)
    full = "checkpoints" in str(path) and (mode == "first" or calls["n"] >= 1)
    return usage(real.total, real.used, 1000) if full else real

engine_state.RecordingWriter = ZipWriterOnAFullDisk
shutil.disk_usage = disk_usage
raw = TINY_RECIPE | {"output": {"dir": sys.argv[1]}, "checkpoint": {"every_steps": 4}}
raw["engine"] = TINY_RECIPE["engine"] | {"processes": 1}
print("result: " + json.dumps(train_worker(validate_recipe(raw)).__dict__))
"""


@pytest.mark.distributed
@pytest.mark.parametrize(
    "mode, step, kept",
    # the second save's refusal (a checkpoint kept on disk, counted in the space needed): slow
    [("first", 4, []), pytest.param("second", 8, ["step-000004"], marks=pytest.mark.slow)],
)
def test_a_full_disk_is_named_with_the_space_free_and_needed(tmp_path, mode, step, kept):
    """The first checkpoint fails with torch's zip-writer message on a full disk, and the cause is named from the
    space left; a later one is not started when the disk cannot hold another of the last one's size."""
    out = tmp_path / "full"
    command = [sys.executable, "-c", FULL_DISK_UNSAID, str(out), mode]
    proc = run_process(command, cwd=REPO / "tests", env=accord_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(
        next(line for line in proc.stdout.splitlines() if line.startswith("result: "))[len("result: ") :]
    )
    assert result["status"] == "stopped"
    expected = f"could not write the checkpoint of step {step}: No space left on device: {out / 'checkpoints'} has"
    assert result["message"].startswith(expected), result["message"]
    assert "1,000 B free, a checkpoint needs ~" in result["message"]
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == kept
    assert incomplete_checkpoints(out / "checkpoints") == []


@pytest.mark.distributed
def test_resume_refuses_a_different_run(recipe, tmp_path, tiny_reference):
    """(Extending a run with more steps: test_resume_schedule.)"""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(tiny_reference[1], out)  # a finished 10-step run (checkpoints 5 and 10), copied

    # The first worker's checks on 2 processes; this process's on 1 (test_cli_errors).
    fresh = run_accord_here("train", recipe, f"output.dir={out}", HERE)
    assert fresh.returncode == 2 and "already holds a run" in fresh.stderr and "--resume" in fresh.stderr

    changed = run_accord_here("train", recipe, "train.max_steps=12", "seed=8", f"output.dir={out}", "--resume", HERE)
    assert changed.returncode == 2
    assert "resume: " in changed.stderr and "seed (checkpoint: 7, recipe: 8)" in changed.stderr
    assert "Traceback" not in changed.stderr

    both = run_accord_here("train", recipe, f"output.dir={out}", "--resume", "--overwrite", HERE)
    assert both.returncode == 2 and "choose one" in both.stderr
