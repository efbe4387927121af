"""`accord slurm`: the script it writes, and a real single-host SLURM running it (needs root,
slurm-wlm and munge; .ci/run installs them, the test starts the daemons)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from accord.launch.slurm_script import JobRequest, SlurmError, job_script
from conftest import TINY_RECIPE, accord_env, final_params, max_param_diff, run_accord, run_accord_here, write_recipe


def test_script_runs_one_task_per_node_signals_and_requeues(tmp_path):
    job = JobRequest(
        tmp_path / "r.yaml",
        ("output.dir=runs/a b", "optim.lr=1e-3"),
        nodes=4,
        gpus_per_node=8,
        partition="gpu",
        time="04:00:00",
        account="team x",
    )
    script = job_script(job, output_dir="/data/runs/a b", workdir=tmp_path)
    assert (
        "#SBATCH --nodes=4" in script
        and "#SBATCH --ntasks-per-node=1" in script
        and "#SBATCH --gpus-per-node=8" in script
    )
    assert "#SBATCH --signal=USR1@120" in script and "#SBATCH --requeue" in script
    assert "#SBATCH --account='team x'" in script and "#SBATCH --output='/data/runs/a b/slurm-%j.out'" in script
    assert "resume=auto 'output.dir=runs/a b' optim.lr=1e-3" in script  # --resume would refuse the first start
    assert 'if [ "$status" -eq 75 ]; then' in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    with pytest.raises(SlurmError, match="--time 'soon'"):
        job_script(JobRequest(tmp_path / "r.yaml", (), 1, 0, time="soon"), "/o", tmp_path)


def test_cli_refuses_a_batch_that_does_not_split_over_the_nodes(tiny_recipe, tmp_path):
    proc = run_accord_here("slurm", tiny_recipe, "--nodes", "3", "--gpus-per-node", "0", "--out", tmp_path / "j.sbatch")
    assert proc.returncode == 2 and "cannot be split over 6 processes" in proc.stderr
    assert not (tmp_path / "j.sbatch").exists()


def test_slurm_environment_gives_the_topology(monkeypatch):
    import accord.launch.cluster as cluster

    monkeypatch.setattr(cluster.shutil, "which", lambda name: None)  # expand the node list by hand
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "1",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
    }
    topology = cluster.resolve_topology(env=env)
    assert (topology.nnodes, topology.node_rank, topology.master_addr, topology.source) == (2, 1, "gpu07", "slurm")
    assert topology.master_port == 20000 + 4242 and topology.run_id == "accord-slurm-4242"
    with pytest.raises(cluster.ClusterError, match="run one task per node"):
        cluster.resolve_topology(env=env | {"SLURM_NTASKS": "16"})
    assert cluster.slurm_hostnames("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]


def test_flags_and_environment_give_the_topology():
    from accord.launch.cluster import ClusterError, resolve_topology

    flags = resolve_topology(2, 1, "10.0.0.1", 29601, env={})
    env = resolve_topology(env={"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29601"})
    assert (flags.nnodes, flags.node_rank, flags.master_addr, flags.master_port) == (2, 1, "10.0.0.1", 29601)
    assert (env.nnodes, env.node_rank, env.master_addr, env.master_port) == (2, 1, "10.0.0.1", 29601)
    assert flags.run_id == env.run_id  # every node derives the same id
    with pytest.raises(ClusterError, match="need --node-rank and --master-addr"):
        resolve_topology(2, env={})
    with pytest.raises(ClusterError, match="outside 0..1"):
        resolve_topology(2, 2, "10.0.0.1", env={})
    with pytest.raises(ClusterError, match="at least 1, got 0"):
        resolve_topology(0, env={})
    with pytest.raises(ClusterError, match="NNODES='two' is not a whole number"):
        resolve_topology(env={"NNODES": "two"})
    with pytest.raises(ClusterError, match="SLURM_NNODES='' is not a whole number"):
        resolve_topology(env={"SLURM_NNODES": "", "SLURM_JOB_ID": "7", "SLURM_PROCID": "0"})


# ---------------------------------------------------------------- a real SLURM on this host


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    needed = ["slurmctld", "slurmd", "sbatch", "squeue", "munged"]
    missing = [tool for tool in needed if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        pytest.skip(f"real SLURM test needs root and slurm-wlm + munge ({', '.join(missing) or 'not root'})")
    root = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname()
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=accordtest",
                f"SlurmctldHost={host}(127.0.0.1)",
                "SlurmUser=root",
                "AuthType=auth/munge",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "SelectType=select/cons_tres",
                "MpiDefault=none",
                "ReturnToService=2",
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool'}",
                f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'slurmd.pid'}",
                f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
                f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN",
                f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    env = dict(os.environ, SLURM_CONF=str(conf))
    started = []
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
    for daemon in ("slurmctld", "slurmd"):
        subprocess.run([daemon, "-f", str(conf)], env=env, check=True)
        started.append(daemon)
    deadline = time.monotonic() + 60
    while subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout.strip() not in (
        "idle",
        "idle*",
    ):
        if time.monotonic() > deadline:
            pytest.skip("SLURM did not come up: " + (root / "log" / "slurmctld.log").read_text()[-500:])
        time.sleep(1)
    yield env
    for daemon in started:  # by the pid each wrote, never by name: another SLURM may run here
        try:
            os.kill(int((root / f"{daemon}.pid").read_text()), signal.SIGTERM)
        except (OSError, ValueError):
            pass


@pytest.mark.distributed
def test_sbatch_of_the_written_script_trains(slurm_cluster, tmp_path, tiny_reference):
    recipe = write_recipe(tmp_path / "tiny.yaml", TINY_RECIPE)
    out = tmp_path / "out"
    script = tmp_path / "job.sbatch"
    proc = run_accord(
        "slurm",
        recipe,
        f"output.dir={out}",
        "--nodes",
        "1",
        "--gpus-per-node",
        "0",
        "--time",
        "10",
        "--out",
        script,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    env = accord_env() | {"SLURM_CONF": slurm_cluster["SLURM_CONF"]}
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 300
    try:
        while subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True).stdout.strip():
            assert time.monotonic() < deadline, "job did not finish in 300 s"
            time.sleep(0.25)
    finally:
        subprocess.run(["scancel", job], env=env, capture_output=True)  # no job outlives the test
    log = (out / f"slurm-{job}.out").read_text()
    assert "accord: batch 2 processes" in log, log[-3000:]
    # The job trained the same run as `accord train` of the same recipe without SLURM.
    diff = max_param_diff(final_params(tiny_reference[1]), final_params(out))
    print(f"sbatch vs accord train: max |Δparam| = {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.slow  # a job's start plus a hang's timeout; the default tier has the same hang under torchrun
@pytest.mark.distributed
def test_a_stopped_worker_under_srun_is_named_and_the_job_exits_1(slurm_cluster, tmp_path):
    """srun starts accord's launcher once per node, which watches its workers: rank 1 stopped
    mid-step is named within the timeout + margin, and srun passes the run's exit 1 on."""
    from test_hang_watchdog import _run_with_a_stopped_rank, assert_named_with_stacks

    out = tmp_path / "hung"
    recipe = write_recipe(tmp_path / "tiny.yaml", TINY_RECIPE)
    srun = ["srun", "--nodes", "1", "--ntasks", "1", "--export", "ALL", sys.executable]
    output, code = _run_with_a_stopped_rank(recipe, out, launcher=srun, env={"SLURM_CONF": slurm_cluster["SLURM_CONF"]})
    assert code == 1, output[-6000:]
    assert_named_with_stacks(output, out)
    assert "the run hung and its workers were stopped" in output
