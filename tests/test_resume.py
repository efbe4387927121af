"""Contract 3: a run resumes anywhere — on another number of processes, after preemption,
after a worker dies, after a crash mid-checkpoint — and ends as if never interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from accord.checkpoint.manifest import MANIFEST, verify
from accord.checkpoint.store import COMPLETE, complete_checkpoints, read_state
from accord.stopping import PREEMPTED_EXIT_CODE
from conftest import (
    TINY_RECIPE,
    assert_ok,
    final_params,
    finish,
    logged_steps,
    max_param_diff,
    run_accord,
    run_accord_here,
    start_accord,
    step_losses,
    wait_for,
    write_recipe,
)
from test_cli_errors import HERE

pytestmark = pytest.mark.distributed
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return write_recipe(tmp_path_factory.mktemp("recipe") / "tiny.yaml", TINY_RECIPE)


# ---------------------------------------------------------------- a different world size


@pytest.mark.parametrize(
    "before, step, position, after",
    # an epoch boundary; mid-epoch (slow: default-suite budget; test_strategies resumes 2 -> 1 mid-run too)
    [(2, 5, "epoch 1, example 0", 1), pytest.param(1, 6, "epoch 1, example 32", 2, marks=pytest.mark.slow)],
    ids=["2-to-1", "1-to-2"],
)
def test_resume_on_another_world_size_continues_same_data(
    tiny_reference, one_process_reference, recipe, tmp_path, before, step, position, after
):
    """The session's uninterrupted runs (2 processes, checkpoint at step 5; 1 process, at
    step 6) resumed on the other world size end where they ended."""
    reference = (tiny_reference if before == 2 else one_process_reference)[1]
    checkpoint = reference / "checkpoints" / f"step-{step:06d}"
    out = tmp_path / "resumed"
    proc = run_accord("train", recipe, f"engine.processes={after}", f"resume={checkpoint}", f"output.dir={out}")
    assert_ok(proc)
    assert "resumed from" in proc.stderr and f"at step {step} ({position} of the global order" in proc.stderr
    assert max_param_diff(final_params(reference), final_params(out)) <= TOLERANCE
    resumed, original = step_losses(out), step_losses(reference)
    assert sorted(resumed) == list(range(step + 1, TINY_RECIPE["train"]["max_steps"] + 1))  # only the steps it trained
    assert max(abs(resumed[s] - original[s]) for s in resumed) <= TOLERANCE


# ---------------------------------------------------------------- faults during a long run

# Long enough that a signal sent at step 15-25 lands well before the end, even on a loaded
# machine (a tiny step takes ~30 ms); every step and checkpoint beyond costs the suite CPU.
LONG_STEPS = 60
LONG = [f"train.max_steps={LONG_STEPS}", "train.log_every=1", "checkpoint.every_steps=10"]
# What a finished long run keeps (checkpoint.keep_last=2).
LAST_TWO = [f"step-{LONG_STEPS - 10:06d}", f"step-{LONG_STEPS:06d}"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, recipe) -> Path:
    """The long run, never interrupted, writing its checkpoints asynchronously: what every
    interrupted run (asynchronous or not) must end as, and the checkpoints whose manifests
    test_an_async_checkpoint_records_every_ranks_files_in_its_manifest reads."""
    out = tmp_path_factory.mktemp("long") / "uninterrupted"
    assert_ok(run_accord("train", recipe, *LONG, "checkpoint.async=true", f"output.dir={out}"))
    return out


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    output, _ = finish(proc, timeout)  # on timeout: the launcher and its workers are killed
    return output


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, pytest.param(signal.SIGUSR1, marks=pytest.mark.slow)], ids=lambda s: s.name
)
def test_stop_signal_checkpoints_exits_75_and_resume_matches(uninterrupted, recipe, tmp_path, sig):
    out = tmp_path / "preempted"
    proc = start_accord("train", recipe, *LONG, f"output.dir={out}")
    wait_for(lambda: logged_steps(out) >= 15)
    os.kill(proc.pid, sig)  # what a scheduler sends to the launcher (SLURM: USR1 before the limit)
    output = _finish(proc)
    assert proc.returncode == PREEMPTED_EXIT_CODE, output
    assert f"stop requested ({sig.name})" in output and "continue with --resume" in output
    stopped_at = read_state(complete_checkpoints(out / "checkpoints")[-1]).step
    assert 15 <= stopped_at < LONG_STEPS  # the step it was on when the signal came, not the last periodic one
    assert not (out / "final").exists()
    # What a job script tests where a launcher hides the exit code (torchrun exits 1).
    assert json.loads((out / "run-status.json").read_text()) == {"status": "preempted", "step": stopped_at}

    resumed = run_accord("train", recipe, *LONG, f"output.dir={out}", "--resume")
    assert_ok(resumed)
    assert f"at step {stopped_at} " in resumed.stderr
    assert max_param_diff(final_params(uninterrupted), final_params(out)) <= TOLERANCE
    assert sorted(step_losses(out)) == list(range(1, LONG_STEPS + 1))  # one record per step, none twice
    assert json.loads((out / "run-status.json").read_text()) == {"status": "completed", "step": LONG_STEPS}


def test_killed_worker_restarts_the_group_and_ends_as_uninterrupted(uninterrupted, recipe, tmp_path):
    out = tmp_path / "restarted"
    proc = start_accord("train", recipe, *LONG, "engine.max_restarts=1", f"output.dir={out}")
    wait_for(lambda: logged_steps(out) >= 25)
    workers = _worker_pids(proc.pid)
    assert len(workers) == 2
    os.kill(workers[-1], signal.SIGKILL)
    output = _finish(proc)
    assert proc.returncode == 0, output
    assert "worker group restarted (1 of 1)" in output and "resumed from" in output
    assert max_param_diff(final_params(uninterrupted), final_params(out)) <= TOLERANCE


@pytest.mark.slow  # default-suite budget: the asynchronous variant below runs the same seal protocol by default
def test_kill_during_checkpoint_write_keeps_the_previous_one(uninterrupted, recipe, tmp_path):
    out = tmp_path / "crashed"
    proc = start_accord(
        "train", recipe, *LONG, f"output.dir={out}", env_extra={"ACCORD_FAULTS": "checkpoint_pause_at_step=20"}
    )
    partial = out / "checkpoints" / ".tmp-step-000020"
    wait_for(lambda: (partial / "state" / ".metadata").exists() and (partial / "rng" / "rank-00001.pt").exists())
    for pid in [*_worker_pids(proc.pid), proc.pid]:  # the whole job dies at once, mid-write
        os.kill(pid, signal.SIGKILL)
    _finish(proc)
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step-000010"]
    assert (out / "checkpoints" / "step-000010" / COMPLETE).is_file() and partial.is_dir()

    resumed = run_accord("train", recipe, *LONG, f"output.dir={out}", "--resume")
    assert_ok(resumed)
    assert "ignoring incomplete checkpoint" in resumed.stderr and "at step 10 " in resumed.stderr
    assert max_param_diff(final_params(uninterrupted), final_params(out)) <= TOLERANCE


@pytest.mark.slow  # the default tier keeps a synchronous write's failure (test_faults) and a kill's restart
def test_kill_during_an_async_checkpoint_write_keeps_the_previous_one(uninterrupted, recipe, tmp_path):
    """checkpoint.async: training goes on while step 20's files are written (the write is held
    open by the fault); the job killed then leaves step 10 as the latest, and resuming ends as
    the uninterrupted run."""
    out = tmp_path / "crashed-async"
    env = {"ACCORD_FAULTS": "checkpoint_pause_at_step=20"}
    proc = start_accord("train", recipe, *LONG, "checkpoint.async=true", f"output.dir={out}", env_extra=env)
    partial = out / "checkpoints" / ".tmp-step-000020"
    wait_for(lambda: (partial / "state" / ".metadata").exists() and logged_steps(out) >= 24)
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step-000010"]  # 20 is not sealed yet
    for pid in [*_worker_pids(proc.pid), proc.pid]:
        os.kill(pid, signal.SIGKILL)
    _finish(proc)
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step-000010"]

    resumed = run_accord("train", recipe, *LONG, "checkpoint.async=true", f"output.dir={out}", "--resume")
    assert_ok(resumed)
    assert "at step 10 " in resumed.stdout + resumed.stderr
    assert max_param_diff(final_params(uninterrupted), final_params(out)) <= TOLERANCE
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == LAST_TWO


# ---------------------------------------------------------------- damaged and old checkpoints


def _damage(state: Path, damage: str) -> Path:
    """Damage one file of a checkpoint's state/ folder as a disk or a copy might; the file."""
    target = {"missing shard": state / "__1_0.distcp", "missing index": state / ".metadata"}.get(
        damage, state / "__0_0.distcp"
    )
    if damage == "truncated shard":
        os.truncate(target, target.stat().st_size // 2)
    elif damage == "corrupt bytes":  # the same length, 16 bytes in the middle inverted
        with target.open("r+b") as f:
            f.seek(target.stat().st_size // 2)
            chunk = f.read(16)
            f.seek(-len(chunk), os.SEEK_CUR)
            f.write(bytes(b ^ 0xFF for b in chunk))
    else:
        target.unlink()
    return target


def _snapshot(folder: Path) -> dict[Path, tuple[bytes, int]]:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("damage", ["corrupt bytes", pytest.param("truncated shard", marks=pytest.mark.slow)])
def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(tiny_reference, recipe, tmp_path, damage):
    """The latest checkpoint's shard changed (same length) or cut short: the run names it in
    one line, resumes from the one before and ends as the uninterrupted run; the damaged
    checkpoint is left for the user (set aside when the run writes that step again)."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(tiny_reference[1], out)
    target = _damage(out / "checkpoints" / "step-000010" / "state", damage)
    damaged = target.read_bytes()
    proc = run_accord("train", recipe, "checkpoint.every_steps=5", f"output.dir={out}", "--resume")
    assert_ok(proc)
    (skipped,) = [line for line in proc.stderr.splitlines() if "skipped" in line]
    reason = (
        "does not match its sha256 checksum" if damage == "corrupt bytes" else f"is {len(damaged):,} bytes, expected"
    )
    assert skipped.startswith(f"accord: warning: checkpoint step-000010 skipped: state/{target.name} {reason}"), skipped
    assert skipped.endswith("; resuming from step-000005") and "at step 5 " in proc.stderr
    assert max_param_diff(final_params(tiny_reference[1]), final_params(out)) <= TOLERANCE
    (kept,) = (out / "checkpoints").glob("replaced-step-000010-*")
    assert (kept / "state" / target.name).read_bytes() == damaged
    assert verify(out / "checkpoints" / "step-000010") == []  # written again by the resumed run


@pytest.mark.parametrize(
    "damage",
    [
        "missing shard",
        pytest.param("truncated shard", marks=pytest.mark.slow),
        pytest.param("missing index", marks=pytest.mark.slow),
        "corrupt bytes",
    ],
)
def test_with_every_checkpoint_damaged_resume_is_refused_naming_the_files(tiny_reference, recipe, tmp_path, damage):
    """Every checkpoint damaged: one line naming each one's damaged file, exit 2, no traceback,
    and not a byte of the run's folder changed. Missing and cut-short files are found before
    any worker starts; changed bytes by the workers' checksums."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(tiny_reference[1], out)
    names = [_damage(out / "checkpoints" / step / "state", damage).name for step in ("step-000005", "step-000010")]
    before = _snapshot(out)
    args = ("train", recipe, "train.max_steps=12", f"output.dir={out}", "--resume")
    # Changed bytes are found by the workers' checksums; the rest by the first worker's checks
    # on 2 processes, which on 1 process this process makes (test_cli_errors).
    proc = run_accord(*args, timeout=120) if damage == "corrupt bytes" else run_accord_here(*args, HERE)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("accord: error")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"no checkpoint in {out / 'checkpoints'} verifies" in errors[0]
    assert f"step-000010: state/{names[1]}" in errors[0] and f"step-000005: state/{names[0]}" in errors[0]
    assert (
        "missing" if "missing" in damage else "checksum" if damage == "corrupt bytes" else "bytes, expected"
    ) in errors[0]
    assert _snapshot(out) == before  # nothing written, nothing removed


def test_an_async_checkpoint_records_every_ranks_files_in_its_manifest(uninterrupted):
    """checkpoint.async: each rank hashes its own files in its writer thread, and the
    manifest lists every file of the checkpoint with the rank that wrote it."""
    folders = complete_checkpoints(uninterrupted / "checkpoints")
    assert [p.name for p in folders] == LAST_TWO
    for folder in folders:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {MANIFEST, COMPLETE}
        assert set(files) == on_disk
        written_by = {name: entry["rank"] for name, entry in files.items()}
        assert written_by["state/__1_0.distcp"] == written_by["rng/rank-00001.pt"] == 1
        assert written_by["state/__0_0.distcp"] == written_by["state/.metadata"] == written_by["schedule.pt"] == 0
        assert verify(folder) == []


def test_a_single_file_checkpoint_of_an_earlier_accord_still_resumes(tiny_reference, recipe, tmp_path):
    """The format before sharded checkpoints (model.safetensors + optimizer.pt, whole tensors
    by name) is converted once when a run resumes from it, and the run ends as uninterrupted."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    reference = tiny_reference[1]
    old = tmp_path / "step-000005"
    shutil.copytree(reference / "checkpoints" / "step-000005", old)
    dcp_to_torch_save(old / "state", tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    save_file(whole["model"], old / "model.safetensors")
    groups = [{"lr": 0.0, "params": list(whole["optim"])}]
    torch.save({"state": whole["optim"], "param_groups": groups}, old / "optimizer.pt")
    shutil.rmtree(old / "state")
    (old / MANIFEST).unlink()  # that format had none either

    out = tmp_path / "resumed"
    proc = run_accord("train", recipe, "engine.strategy=fsdp", f"resume={old}", f"output.dir={out}")
    assert_ok(proc)
    assert "converting" in proc.stdout + proc.stderr and (old / "state" / ".metadata").is_file()
    assert max_param_diff(final_params(reference), final_params(out)) <= TOLERANCE


def _worker_pids(launcher: int) -> list[int]:
    """The training workers the launcher started (`python -m accord.launch.worker_start ...`)."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    return sorted(
        pid for pid in map(int, children) if b"accord.launch.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    )
