"""Issue 13: a rank that hangs is named (rank, host, operation) within engine.hang_timeout_s,
every rank's stacks are kept in output.dir/hang-<time>/, and the run exits 1 or, under
engine.max_restarts, restarts from the last checkpoint and ends as if never interrupted."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from accord.launch.watchdog import StallClock, diagnose
from accord.observe import heartbeat
from accord.observe.metrics import read_metrics
from accord.recipe.schema import RecipeError, load_recipe
from conftest import (
    TINY_RECIPE,
    _tree_members,
    accord_env,
    final_params,
    finish,
    max_param_diff,
    start_accord,
    start_process,
    wait_for,
    write_recipe,
)

TIMEOUT_S = 5  # small, so that a hang costs the test seconds; progress comes every few ms
STOP_AT_STEP = 7  # the tiny reference checkpoints at step 5: the restart redoes steps 6-10


# ---------------------------------------------------------------- the recipe field


@pytest.mark.parametrize("value", ["600", "0.5", "-3"])
def test_hang_timeout_outside_its_range_is_refused_naming_the_field(tmp_path, value):
    recipe = write_recipe(tmp_path / "r.yaml", TINY_RECIPE)
    with pytest.raises(RecipeError, match=r"engine.hang_timeout_s=.* below 600 s .*null turns the watchdog off"):
        load_recipe(recipe, [f"engine.hang_timeout_s={value}"])


def test_hang_timeout_null_turns_the_watchdog_off(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", TINY_RECIPE)
    assert load_recipe(recipe, ["engine.hang_timeout_s=null"]).engine.hang_timeout_s is None
    assert load_recipe(recipe).engine.hang_timeout_s == 300


# ---------------------------------------------------------------- what counts as progress


def _record(rank: int, seq: int, op: str = "forward", ticks: int = 0, step: int = 3) -> dict:
    return {
        "rank": rank,
        "local_rank": rank,
        "host": "h",
        "pid": 100 + rank,
        "seq": seq,
        "ticks": ticks,
        "op": op,
        "step": step,
    }


def test_one_rank_progressing_while_the_others_wait_is_not_a_hang():
    """Rank 0 evaluates (ticks) or writes for longer than the timeout while rank 1 waits in a
    collective: the run is slow, not stuck."""
    clock = StallClock(nproc=2, timeout_s=4)
    for t in range(0, 20):
        clock.update({0: _record(0, 5, "eval", ticks=t), 1: _record(1, 5, "eval")}, set(), now=float(t))
        assert not clock.stalled(float(t))
    clock.update({0: _record(0, 5, "eval", ticks=19), 1: _record(1, 5, "eval")}, set(), now=23.0)
    assert clock.stalled(23.0) and clock.stalled_for(23.0) == 4.0


def test_the_loop_is_watched_only_between_every_rank_entering_it_and_one_leaving_it():
    clock = StallClock(nproc=2, timeout_s=4)
    clock.update({0: _record(0, 0, "start-up")}, set(), now=0.0)  # loading: silent, however long
    clock.update({0: _record(0, 0, "start-up"), 1: _record(1, 4)}, set(), now=1.0)
    assert not clock.stalled(100.0)
    clock.update({0: _record(0, 9, heartbeat.DONE), 1: _record(1, 9, heartbeat.DONE)}, set(), now=101.0)  # export
    assert not clock.stalled(200.0)


def test_a_stopped_process_is_a_hang_in_any_phase_and_a_stopped_launcher_is_not():
    clock = StallClock(nproc=2, timeout_s=4)
    clock.update({0: _record(0, 0, "start-up"), 1: _record(1, 0, "start-up")}, {1}, now=0.0)
    clock.update({0: _record(0, 0, "start-up"), 1: _record(1, 0, "start-up")}, {1}, now=4.0)
    assert clock.stalled(4.0)

    clock = StallClock(nproc=2, timeout_s=4)
    clock.update({0: _record(0, 5), 1: _record(1, 5)}, set(), now=0.0)
    clock.update({0: _record(0, 5), 1: _record(1, 5)}, set(), now=60.0)  # the whole job was suspended
    assert not clock.stalled(60.0)
    assert clock.stalled(64.0)


def test_the_stopped_rank_is_named_else_the_one_behind_else_all():
    a, b = _record(0, 12, "backward/all-reduce"), _record(1, 12, "backward/all-reduce")
    assert diagnose([a, b], stopped={101}) == ([b], "stopped by a signal (SIGSTOP)")
    behind = _record(1, 10, "forward")
    assert diagnose([a, behind], stopped=set())[0] == [behind]
    assert diagnose([a, b], stopped=set())[0] == [a, b]


def test_progress_is_read_back_exactly_as_the_rank_wrote_it(tmp_path, monkeypatch):
    import faulthandler

    monkeypatch.setenv(heartbeat.DUMP_DIR_ENV, str(tmp_path))
    try:
        heartbeat.start(4.0, rank=3, local_rank=1, world_size=4, restart=2)
        path = heartbeat.progress_file(tmp_path, 2, 3)
        assert heartbeat.read_progress(path)["op"].startswith("start-up")
        heartbeat.phase("optimizer step", 41)
        heartbeat.tick()
        record = heartbeat.read_progress(path)
        assert (record["rank"], record["local_rank"], record["op"], record["step"], record["ticks"]) == (
            3,
            1,
            "optimizer step",
            41,
            1,
        )
        assert heartbeat.progress_files(tmp_path, 2) == [path]
    finally:
        faulthandler.unregister(heartbeat.DUMP_SIGNAL)
        heartbeat._beat.mapped = None


# ---------------------------------------------------------------- a stopped worker, end to end


def _run_with_a_stopped_rank(
    recipe: Path,
    out: Path,
    *extra: str,
    fault: str = "",
    launcher: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> tuple[str, int]:
    """Train with rank 1 SIGSTOPping itself in step STOP_AT_STEP, under accord's launcher or
    `launcher` (a command that starts `-m accord ...` as its workers): (output, exit code)."""
    faults = {"ACCORD_FAULTS": f"stop_rank=1,stop_at_step={STOP_AT_STEP}{fault}", **(env or {})}
    args = ["train", recipe, f"engine.hang_timeout_s={TIMEOUT_S}", "checkpoint.every_steps=5", *extra]
    args.append(f"output.dir={out}")
    if launcher is None:
        proc = start_accord(*args, env_extra=faults)
    else:
        command = [*launcher, "-m", "accord", *map(str, args)]
        proc = start_process(command, merge_output=True, env=accord_env() | faults)
    output, _ = finish(proc, timeout=240)
    if launcher is None and "engine.launcher=ray" not in extra:
        assert not _tree_members(proc.tree_token), "processes of the run outlived it"
    else:  # the launcher's own processes (Ray's) and the node's watcher: within a margin
        wait_for(lambda: not _tree_members(proc.tree_token), timeout=60)
    return output, proc.returncode


def _stopped_at(output: str) -> float:
    """When the fault stopped the rank (its line says, in Unix time)."""
    (line,) = [line for line in output.splitlines() if "[fault injection]" in line]
    return float(line.rsplit("at unix time ", 1)[1])


@pytest.mark.distributed
def test_a_stopped_worker_is_named_with_its_operation_and_the_run_exits_1(tmp_path):
    out = tmp_path / "hung"
    recipe = write_recipe(tmp_path / "tiny.yaml", TINY_RECIPE)
    output, code = _run_with_a_stopped_rank(recipe, out)
    assert code == 1, output
    (hang,) = [r for r in read_metrics(out) if r["kind"] == "hang"]
    named = f"stuck: rank 1 (host {socket.gethostname()}, pid {hang['ranks'][1]['pid']}), stopped by a signal (SIGSTOP)"
    assert named in output and f'rank 1 in "forward" of step {STOP_AT_STEP}' in output
    assert "the run hung and its workers were stopped" in output and "Traceback" not in output
    assert hang["stuck"] == [1] and hang["stalled_s"] >= TIMEOUT_S
    # Named within the timeout + 10 s of the stop (the fault's line says when it stopped).
    assert hang["time"] - _stopped_at(output) <= TIMEOUT_S + 10
    folder = Path(hang["folder"])
    assert folder.parent == out and json.loads((folder / "hang.json").read_text())["stuck"] == [1]
    for rank in (0, 1):  # the stopped rank too: continued just long enough to dump
        assert "accord/run/trainer.py" in (folder / f"stacks-rank-{rank:05d}.txt").read_text()


# Two worker start-ups: slow. The default tier has the hang (test above) and the restart from
# the last checkpoint after a killed worker (test_resume.py) separately.
@pytest.mark.slow
@pytest.mark.distributed
def test_a_hang_under_max_restarts_resumes_and_ends_as_the_uninterrupted_run(tiny_reference, tmp_path):
    """Restarted, the run also makes it through resume, checkpoints and export without a second
    (false) hang under the same 5 s timeout."""
    recipe, reference = tiny_reference
    out = tmp_path / "restarted"
    output, code = _run_with_a_stopped_rank(recipe, out, "engine.max_restarts=1")
    assert code == 0, output
    assert "hang:" in output and "worker group restarted (1 of 1)" in output and "at step 5 " in output
    assert [r["stuck"] for r in read_metrics(out) if r["kind"] == "hang"] == [[1]]  # kept, and no second one
    assert max_param_diff(final_params(reference), final_params(out)) <= 1e-5


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_stuck_while_running_is_named_as_behind_the_others(tmp_path):
    """No stopped process (a deadlock, a lost message): the rank that did not reach the phase
    its peers wait in is named, and its live stack shows where it is."""
    out = tmp_path / "hung"
    recipe = write_recipe(tmp_path / "tiny.yaml", TINY_RECIPE)
    output, code = _run_with_a_stopped_rank(recipe, out, fault=",stop_by_sleeping=1")
    assert code == 1, output
    (hang,) = [r for r in read_metrics(out) if r["kind"] == "hang"]
    assert hang["stuck"] == [1] and hang["why"] == "behind the other ranks", output
    assert f'rank 1 in "forward" of step {STOP_AT_STEP}' in output
    assert hang["time"] - _stopped_at(output) <= TIMEOUT_S + 10
    assert "in loss" in (Path(hang["folder"]) / "stacks-rank-00001.txt").read_text()


# ---------------------------------------------------------------- under an outer launcher

# torchrun & co. start the workers themselves: each node's local rank 0 starts the watcher
# (launch/node_watch.py). Margin for a loaded machine: the watcher polls every 0.25 s, then
# waits up to 5 s for each group of ranks' stacks.
OUTER_MARGIN_S = 15


def assert_named_with_stacks(output: str, out: Path, stuck_pid_named: bool = True) -> None:
    """The hang of rank 1 (stopped in step STOP_AT_STEP) was named within the timeout + margin,
    with every rank's stacks in output.dir/hang-<time>/ (shared with test_slurm.py)."""
    (hang,) = [r for r in read_metrics(out) if r["kind"] == "hang"]
    assert hang["stuck"] == [1] and hang["why"] == "stopped by a signal (SIGSTOP)", hang
    if stuck_pid_named:
        named = f"stuck: rank 1 (host {socket.gethostname()}, pid {hang['ranks'][1]['pid']})"
        assert named in output and f'rank 1 in "forward" of step {STOP_AT_STEP}' in output, output[-4000:]
    assert TIMEOUT_S <= hang["stalled_s"] and hang["time"] - _stopped_at(output) <= TIMEOUT_S + OUTER_MARGIN_S
    folder = Path(hang["folder"])
    assert folder.parent == out and json.loads((folder / "hang.json").read_text())["stuck"] == [1]
    for rank in (0, 1):
        assert "accord/run/trainer.py" in (folder / f"stacks-rank-{rank:05d}.txt").read_text()


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


@pytest.mark.distributed
def test_a_stopped_worker_under_torchrun_is_named_by_the_nodes_watcher_and_the_job_exits_1(tmp_path):
    out = tmp_path / "hung"
    recipe = write_recipe(tmp_path / "tiny.yaml", TINY_RECIPE)
    output, code = _run_with_a_stopped_rank(recipe, out, launcher=TORCHRUN)
    assert code == 1, output[-6000:]
    assert_named_with_stacks(output, out)
    assert "the run hung and this node's workers were stopped" in output


@pytest.mark.slow  # Ray's start and its workers' (~60 s on 2 cores)
@pytest.mark.distributed
def test_a_stopped_ray_worker_is_named_by_the_nodes_watcher_and_the_run_exits_1(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "hung"
    recipe = write_recipe(tmp_path / "tiny.yaml", TINY_RECIPE)
    output, code = _run_with_a_stopped_rank(recipe, out, "engine.launcher=ray")
    assert code == 1, output[-6000:]
    assert "a Ray worker failed" in output, output[-6000:]
    # Ray forwards its workers' output to the driver as it can: the line may come too late to print.
    assert_named_with_stacks(output, out, stuck_pid_named=False)
