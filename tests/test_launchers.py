"""Launchers that put their own arguments into the script's argv: torch.distributed.launch
(`--local-rank=N`) and DeepSpeed's launcher (`--local_rank=N` before the subcommand, and the
`--deepspeed FILE` convention) run the same training as `accord train` on 2 processes."""

from __future__ import annotations

import os
import shutil
import socket
import sys

import pytest

from conftest import accord_env, assert_ok, final_params, finish, max_param_diff, run_process, start_process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--local_rank=0", "train", "r.yaml", "a.b=1"], ["train", "r.yaml", "a.b=1"]),
        (["train", "r.yaml", "--local-rank=1", "--overwrite"], ["train", "r.yaml", "--overwrite"]),
        (["train", "--local_rank", "3", "r.yaml"], ["train", "r.yaml"]),
        (["train", "r.yaml", "--deepspeed", "ds.json"], ["train", "r.yaml", "engine.deepspeed_config=ds.json"]),
        (
            ["--local_rank=0", "train", "r.yaml", "--deepspeed=ds.json"],
            ["train", "r.yaml", "engine.deepspeed_config=ds.json"],
        ),
    ],
)
def test_launcher_arguments_are_read_wherever_they_are(argv, expected):
    from accord.cli.main import launcher_arguments

    assert launcher_arguments(argv) == expected


def test_deepspeed_flag_sets_the_recipe_field(tmp_path, tiny_recipe):
    """`--deepspeed FILE` reaches the recipe as engine.deepspeed_config (a missing file is one line)."""
    from conftest import run_accord_here

    proc = run_accord_here(
        "--local_rank=0",
        "train",
        tiny_recipe,
        "--deepspeed",
        str(tmp_path / "missing.json"),
        f"output.dir={tmp_path / 'o'}",
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "missing.json" in proc.stderr and proc.stderr.count("accord: error:") == 1


@pytest.mark.distributed
def test_torch_distributed_launch_equals_accord_train(tiny_reference, tmp_path):
    recipe, reference = tiny_reference
    out = tmp_path / "tdl"
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.launch",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
    ]
    proc = run_process(
        launcher + ["-m", "accord", "train", str(recipe), f"output.dir={out}"], env=accord_env(), timeout=300
    )
    assert_ok(proc)
    assert proc.stderr.count("accord: batch 2 processes × 8 sequences × 2 accumulation steps") == 1
    assert max_param_diff(final_params(reference), final_params(out)) <= 1e-5


@pytest.mark.distributed
@pytest.mark.slow  # ~75 s on 2 cores: DeepSpeed's launcher and its imports in every worker
def test_deepspeed_launcher_on_cpu_equals_accord_train(tiny_reference, tmp_path):
    """`deepspeed --num_gpus 2 --module accord train R.yaml` with DS_ACCELERATOR=cpu starts 2
    gloo processes (its launcher passes --local_rank=N before `train`)."""
    pytest.importorskip("deepspeed")
    runner = shutil.which("deepspeed", path=os.path.dirname(sys.executable))
    if runner is None:
        pytest.skip("no deepspeed launcher next to this Python")
    recipe, reference = tiny_reference
    out = tmp_path / "ds"
    env = accord_env() | {
        "DS_ACCELERATOR": "cpu",
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
    }
    command = [
        runner,
        "--num_gpus",
        "2",
        "--master_port",
        str(_free_port()),
        "--module",
        "accord",
        "train",
        str(recipe),
        f"output.dir={out}",
    ]
    proc = run_process(command, env=env, timeout=300)
    assert_ok(proc)
    assert proc.stderr.count("accord: batch 2 processes × 8 sequences × 2 accumulation steps") == 1
    assert max_param_diff(final_params(reference), final_params(out)) <= 1e-5


def _outer_launcher_env(monkeypatch, master: str, world: int, local_world: int) -> None:
    """A worker's environment as torchrun sets it (node 0 of world // local_world nodes)."""
    # Set, then removed: monkeypatch then remembers the original (absent) value and puts it
    # back, also over what choose_gloo_interface writes into os.environ (else later tests'
    # workers inherit this machine's interface, which a network namespace lacks).
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "unset")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    for name, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "TORCHELASTIC_RUN_ID": "t",
        "MASTER_ADDR": master,
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(name, value)


def test_outer_launcher_multi_node_with_a_loopback_master_stops_with_one_line(monkeypatch):
    from accord.distributed import group as dist
    from accord.launch.cluster import ClusterError

    _outer_launcher_env(monkeypatch, "localhost", world=4, local_world=2)
    with pytest.raises(
        ClusterError,
        match=r"MASTER_ADDR=localhost is a loopback address, which the other nodes of this 2-node job cannot reach",
    ):
        dist.choose_gloo_interface()


def test_outer_launcher_binds_gloo_to_the_interface_towards_master(monkeypatch):
    """Under torchrun & co. gloo gets the interface whose address routes to MASTER_ADDR
    (else it binds the host name's, often 127.0.0.1); on one node a loopback master needs
    nothing, and GLOO_SOCKET_IFNAME set by the user is kept."""
    from accord.distributed import group as dist
    from accord.distributed.network import _ipv4_of

    outward = [(name, _ipv4_of(name)) for _, name in socket.if_nameindex() if name != "lo" and _ipv4_of(name)]
    if not outward:
        pytest.skip("no network interface with an IPv4 address besides loopback")
    name, address = outward[0]
    _outer_launcher_env(monkeypatch, address, world=4, local_world=2)
    dist.choose_gloo_interface()
    assert os.environ["GLOO_SOCKET_IFNAME"] == name

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine0")
    dist.choose_gloo_interface()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "mine0"

    _outer_launcher_env(monkeypatch, "127.0.0.1", world=2, local_world=2)
    dist.choose_gloo_interface()
    assert "GLOO_SOCKET_IFNAME" not in os.environ


@pytest.mark.subprocess
@pytest.mark.parametrize("refusing_node", [0, 1])
def test_a_refusal_on_any_node_is_printed_by_the_other_nodes(monkeypatch, refusing_node):
    """A node refusing a multi-node run under torchrun (rank 0's output.dir holds a run, node
    1's data file is missing) leaves its line in the agent's store; the other node's local
    rank 0 (here a separate process watching the same store) prints it naming the node and
    host, and ends its node's workers with exit 2 instead of waiting out the group set-up."""
    import socket
    from datetime import timedelta

    from torch.distributed import TCPStore

    from accord.launch import refusal_relay as refusals

    store = TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False
    )  # the agent's
    env = {
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "1",
        "TORCHELASTIC_RUN_ID": "t",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
    }
    watching = (
        "import time; from accord.launch import refusal_relay; refusal_relay.watch(); "
        "print('watching', flush=True); time.sleep(60)"
    )
    watcher_env = env | {"RANK": str(1 - refusing_node), "GROUP_RANK": str(1 - refusing_node)}
    watcher = start_process([sys.executable, "-c", watching], env=accord_env() | watcher_env)
    assert watcher.stdout.readline().strip() == "watching"
    for name, value in (env | {"RANK": str(refusing_node), "GROUP_RANK": str(refusing_node)}).items():
        monkeypatch.setenv(name, value)
    refusals.publish("data: train.jsonl not found")  # returns once the other node has read it
    out, err = finish(watcher, timeout=30)
    assert watcher.returncode == 2
    host = socket.gethostname()
    assert err.strip() == f"accord: error: node {refusing_node} ({host}) refused the run: data: train.jsonl not found"
    assert store.add(refusals.SEEN, 0) == 2  # the refusing node and the one that printed it


def test_the_agent_keeps_its_worker_files_in_the_runs_folder_and_leaves_nothing_behind(monkeypatch, tmp_path):
    """torch's agent makes a /tmp/torchelastic_* folder per launch by default and never removes
    it; accord's launches give it a folder inside the run's private one, removed with it."""
    import tempfile

    import torch.distributed.launcher.api as launcher_api

    from accord.launch import agent as launch
    from accord.launch.cluster import Topology

    seen = []

    def agent(config, entrypoint):
        seen.append(config.logs_specs.root_log_dir)
        assert os.path.isdir(seen[-1])
        return lambda *args: {}

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(launcher_api, "elastic_launch", agent)
    assert launch._elastic_launch("{}", 2, 0, Topology(), None) == "completed"
    assert len(seen) == 1 and seen[0].startswith(str(tmp_path / "accord-run-"))
    assert os.listdir(tmp_path) == []  # the run's folder and the agent's went together
