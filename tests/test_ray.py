"""engine.launcher=ray: accord's workers as Ray Train workers (a local Ray started for the run,
or a cluster at RAY_ADDRESS) train as accord's own launcher does at the same world size, write
their checkpoints in output.dir, resume on another worker count and restart from the latest
checkpoint after a lost worker; what Ray cannot run is refused in one line before Ray starts."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from accord.checkpoint.store import complete_checkpoints, read_state
from accord.stopping import PREEMPTED_EXIT_CODE
from conftest import (
    accord_env,
    assert_ok,
    final_params,
    finish,
    logged_steps,
    max_param_diff,
    run_accord,
    run_accord_here,
    start_process,
    step_losses,
    wait_for,
)

# Only the runs need Ray; the refusals are the driver's, before it imports Ray.
needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="engine.launcher=ray needs the ray extra: pip install 'accord[ray]'"
)

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
TOLERANCE = 1e-5
# The quickstart, cut to a few steps: one checkpoint mid-run, one evaluation at the end.
SHORT = ["train.max_steps=8", "train.log_every=1", "train.eval_every=8", "train.eval_generate=16"]
SHORT += ["checkpoint.every_steps=4", "engine.device=cpu"]
RAY = ["engine.launcher=ray"]
BATCH_LINE = "accord: batch 2 processes × 32 sequences × 1 accumulation step"


@pytest.fixture(scope="module")
def quick(tmp_path_factory, data_cache) -> list[str]:
    """The overrides every run here shares (the session's data cache, not ~/.cache)."""
    return [*SHORT, f"data.cache_dir={data_cache}"]


@pytest.fixture(scope="module")
def own_launcher(tmp_path_factory, quick) -> Path:
    """The short quickstart on 2 processes under accord's own launcher: what Ray must match."""
    out = tmp_path_factory.mktemp("own") / "run"
    assert_ok(run_accord("train", QUICKSTART, *quick, "engine.processes=2", f"output.dir={out}"))
    return out


def _same_run(reference: Path, out: Path) -> None:
    assert max_param_diff(final_params(reference), final_params(out)) <= TOLERANCE
    ours, theirs = step_losses(out), step_losses(reference)
    assert sorted(ours) == sorted(theirs)
    assert max(abs(ours[s] - theirs[s]) for s in ours) <= TOLERANCE


# ---------------------------------------------------------------- refused before Ray starts


def _closed_port() -> int:
    """A port nothing listens on (bound for a moment, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "overrides, env, expected",
    [
        (["engine.ray.nodes=2"], {}, "engine.ray.nodes applies to Ray workers: add engine.launcher=ray"),
        ([*RAY, "engine.devices=[0]"], {}, "set engine.ray.gpus_per_worker instead"),
        ([*RAY, "engine.ray.resources_per_worker={CPU: 2}"], {}, "set engine.ray.cpus_per_worker instead"),
        ([*RAY, "engine.ray.gpus_per_worker=1", "engine.device=cpu"], {}, "hold GPUs they never use"),
        ([*RAY, "engine.ray.placement_strategy=ANYWHERE"], {}, "engine.ray.placement_strategy"),
        (
            RAY,
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"},
            "torchrun already started this process as one worker of many",
        ),
        pytest.param(
            RAY,
            {"RAY_ADDRESS": f"127.0.0.1:{_closed_port()}"},
            "no Ray cluster answers there (ConnectionRefusedError",
            marks=needs_ray,  # asked only where ray is installed
        ),
    ],
    ids=["ray-option-without-ray", "devices", "cpu-resource", "gpus-on-cpu", "placement", "under-torchrun", "address"],
)
def test_a_bad_ray_setting_is_one_line_before_ray_starts(tmp_path, quick, overrides, env, expected):
    proc = run_accord_here("train", QUICKSTART, *quick, *overrides, f"output.dir={tmp_path / 'o'}", env_extra=env)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr and proc.stderr.count("accord: error:") == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_without_ray_installed_the_ray_launcher_is_one_line(tmp_path, quick, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what importlib finds where ray is not installed
    proc = run_accord_here("train", QUICKSTART, *quick, *RAY, f"output.dir={tmp_path / 'o'}")
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'accord[ray]'" in proc.stderr and proc.stderr.count("accord: error:") == 1
    assert not (tmp_path / "o").exists()


def test_accord_train_takes_the_launcher_as_the_command_takes_engine_launcher(quick, tmp_path):
    import accord
    from accord.errors import UserInputError

    with pytest.raises(UserInputError, match="set engine.ray.gpus_per_worker instead"):
        accord.train(QUICKSTART, [*quick, "engine.devices=[0]", f"output.dir={tmp_path / 'o'}"], launcher="ray")


# ---------------------------------------------------------------- Ray workers train as accord's


@needs_ray
@pytest.mark.distributed
@pytest.mark.slow  # default-suite budget (two runs, ~60 s on 2 cores): the default tier keeps the refusals
def test_ray_workers_train_the_quickstart_as_accords_own_launcher(own_launcher, quick, tmp_path):
    """`accord train recipes/quickstart.yaml engine.launcher=ray engine.processes=2` on a local
    Ray: the same losses and weights as accord's launcher, its checkpoints in output.dir, and
    rank 0's lines once."""
    out = tmp_path / "ray"
    proc = run_accord("train", QUICKSTART, *quick, *RAY, "engine.processes=2", f"output.dir={out}", timeout=400)
    assert_ok(proc)
    _same_run(own_launcher, out)
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000004", "step-000008"]
    assert proc.stderr.count(BATCH_LINE) == 1 and "starting 2 Ray Train workers" in proc.stderr
    assert "State API may be temporarily unavailable" not in proc.stderr  # Ray's cleaner, quietened


# ---------------------------------------------------------------- slow: a cluster, resume, a lost worker


@pytest.fixture
def two_node_cluster():
    """A Ray cluster of two nodes of 1 CPU each on this machine (ray.cluster_utils)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


@needs_ray
@pytest.mark.distributed
@pytest.mark.slow  # a two-node Ray cluster's start (~30 s on 2 cores) and one run on it
def test_two_ray_nodes_train_as_one_host(own_launcher, quick, tmp_path, two_node_cluster):
    out = tmp_path / "two-nodes"
    command = [sys.executable, "-m", "accord", "train", str(QUICKSTART), *quick, *RAY]
    command += ["engine.ray.nodes=2", "engine.processes=1", f"output.dir={out}"]
    proc = start_process(command, env=accord_env() | {"RAY_ADDRESS": two_node_cluster.address})
    stdout, stderr = finish(proc, 400)
    assert proc.returncode == 0, stderr[-6000:]
    assert "joining the Ray cluster" in stderr
    _same_run(own_launcher, out)


@needs_ray
@pytest.mark.distributed
@pytest.mark.slow  # two Ray runs
def test_a_ray_run_on_two_workers_resumes_on_one(own_launcher, quick, tmp_path):
    first = tmp_path / "two"
    assert_ok(run_accord("train", QUICKSTART, *quick, *RAY, "engine.processes=2", f"output.dir={first}", timeout=400))
    checkpoint = first / "checkpoints" / "step-000004"
    out = tmp_path / "one"
    resume = ["engine.processes=1", f"resume={checkpoint}", f"output.dir={out}"]
    proc = run_accord("train", QUICKSTART, *quick, *RAY, *resume, timeout=400)
    assert_ok(proc)
    assert "resumed from" in proc.stderr and "at step 4 " in proc.stderr
    assert max_param_diff(final_params(own_launcher), final_params(out)) <= TOLERANCE
    resumed, original = step_losses(out), step_losses(own_launcher)
    assert sorted(resumed) == [5, 6, 7, 8]
    assert max(abs(resumed[s] - original[s]) for s in resumed) <= TOLERANCE


LONG = ["train.max_steps=60", "checkpoint.every_steps=10"]


def _ray_workers(root: int) -> list[int]:
    """The Ray Train worker processes under `root` (the accord command that started Ray)."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            todo.append(child)
            try:
                if b"RayTrainWorker" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.append(child)
            except OSError:
                pass
    return sorted(found)


@pytest.fixture(scope="module")
def long_reference(tmp_path_factory, quick) -> Path:
    """The 60-step quickstart under accord's launcher, never interrupted."""
    out = tmp_path_factory.mktemp("long") / "uninterrupted"
    assert_ok(run_accord("train", QUICKSTART, *quick, *LONG, "engine.processes=2", f"output.dir={out}"))
    return out


@needs_ray
@pytest.mark.distributed
@pytest.mark.slow  # a 60-step run under Ray with a restart, and the same run under accord's launcher
def test_a_killed_ray_worker_restarts_the_group_from_the_checkpoint(quick, long_reference, tmp_path):
    reference = long_reference
    out = tmp_path / "restarted"
    command = [sys.executable, "-m", "accord", "train", str(QUICKSTART), *quick, *LONG, *RAY]
    command += ["engine.processes=2", "engine.max_restarts=1", f"output.dir={out}"]
    proc = start_process(command, merge_output=True, env=accord_env())
    wait_for(lambda: logged_steps(out) >= 25, timeout=300)
    workers = _ray_workers(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)
    output, _ = finish(proc, 400)
    assert proc.returncode == 0, output[-6000:]
    assert "worker group restarted (1 of 1)" in output and "resumed from" in output
    assert max_param_diff(final_params(reference), final_params(out)) <= TOLERANCE


@needs_ray
@pytest.mark.distributed
@pytest.mark.slow  # a local Ray's start, then the refusal
def test_a_ray_cluster_without_the_resources_is_refused_in_one_line(quick, tmp_path):
    proc = run_accord(
        "train",
        QUICKSTART,
        *quick,
        *RAY,
        "engine.ray.resources_per_worker={accelerator_x: 1}",
        f"output.dir={tmp_path / 'o'}",
        timeout=400,
    )
    assert proc.returncode == 2, proc.stderr
    assert "the Ray cluster has 0 accelerator_x" in proc.stderr and proc.stderr.count("accord: error:") == 1
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()


@needs_ray
@pytest.mark.distributed
@pytest.mark.slow  # a Ray run stopped mid-way, then resumed under Ray
def test_sigterm_to_a_ray_run_checkpoints_exits_75_and_resume_matches(quick, long_reference, tmp_path):
    out = tmp_path / "preempted"
    command = [sys.executable, "-m", "accord", "train", str(QUICKSTART), *quick, *LONG, *RAY]
    proc = start_process([*command, "engine.processes=2", f"output.dir={out}"], merge_output=True, env=accord_env())
    wait_for(lambda: logged_steps(out) >= 15, timeout=300)
    os.kill(proc.pid, signal.SIGTERM)  # to the `accord train` process, as a scheduler sends it
    output, _ = finish(proc, 400)
    assert proc.returncode == PREEMPTED_EXIT_CODE, output[-6000:]
    assert "stop requested (SIGTERM)" in output and "continue with --resume" in output
    stopped_at = read_state(complete_checkpoints(out / "checkpoints")[-1]).step
    assert 15 <= stopped_at < 60 and not (out / "final").exists()
    resumed = run_accord("train", QUICKSTART, *quick, *LONG, *RAY, f"output.dir={out}", "--resume", timeout=400)
    assert_ok(resumed)
    assert f"at step {stopped_at} " in resumed.stderr
    assert max_param_diff(final_params(long_reference), final_params(out)) <= TOLERANCE
