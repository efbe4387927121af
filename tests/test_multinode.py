"""Two nodes made of two network namespaces joined by a veth pair (needs root and iproute2):
one accord per node (or the guides' torchrun / accelerate launch), one process each, gloo —
the same result as one node with 2 processes, whether the nodes share output.dir or each
writes its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import (
    ADDRESSES,
    TINY_RECIPE,
    accord_env,
    final_params,
    finish,
    max_param_diff,
    run_accord,
    start_process,
    wait_for,
    write_recipe,
)

pytestmark = pytest.mark.distributed


def _start_node(namespace: str, args: list[str]) -> subprocess.Popen:
    command = ["ip", "netns", "exec", namespace, sys.executable, "-m", "accord", *args]
    return start_process(command, merge_output=True, env=accord_env())  # killed with its workers if the test fails


@pytest.fixture(scope="module")
def single(tiny_reference):
    return tiny_reference  # one node, 2 processes


# c10d is slow: the default tier keeps the same two-node run with the static rendezvous
# (the c10d meeting differs only in how the nodes find each other).
@pytest.mark.parametrize("meeting", ["static", pytest.param("c10d", marks=pytest.mark.slow)])
def test_two_nodes_match_one_node_with_two_processes(namespaces, single, tmp_path, meeting):
    recipe, reference = single
    # static: each node its own output.dir (node 1's crashed at the first checkpoint before);
    # c10d: one folder for both, as on shared storage.
    outs = [tmp_path / "out0", tmp_path / ("out1" if meeting == "static" else "out0")]
    out = outs[0]
    common = ["train", str(recipe), "engine.processes=1", "checkpoint.every_steps=5", "--nnodes", "2"]
    nodes = []
    for rank, namespace in enumerate(namespaces):
        common_here = common + [f"output.dir={outs[rank]}"]
        if meeting == "static":
            where = ["--node-rank", str(rank), "--master-addr", ADDRESSES[0], "--master-port", "29611"]
        else:
            where = ["--rdzv-endpoint", f"{ADDRESSES[0]}:29612"]
        nodes.append(_start_node(namespace, common_here + where))
    outputs = [finish(node, timeout=300)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-3000:]
    assert "batch 2 processes × 8 sequences × 2 accumulation steps" in outputs[0] + outputs[1]
    if meeting == "static":
        _assert_node_local_checkpoint(*outs)
    diff = max_param_diff(final_params(reference), final_params(out))
    print(f"two nodes ({meeting}) vs one node: max |Δparam| = {diff:.2e}")
    assert diff <= 1e-5


# ------------------------------------------------------------------ the guides' own launchers


def _launcher(kind: str, rank: int, port: int, nproc: int, config_dir) -> list[str]:
    """torchrun, or accelerate launch with its multi-node config (machine_rank 0/1), as
    the guides write them; no GLOO_SOCKET_IFNAME anywhere."""
    if kind == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node_rank",
            str(rank),
            "--nproc_per_node",
            str(nproc),
            "--master_addr",
            ADDRESSES[0],
            "--master_port",
            str(port),
        ]
    from accord.launch.accelerate_config import accelerate_config, write_accelerate_config
    from accord.recipe.schema import validate_recipe
    from conftest import TINY_RECIPE

    config = accelerate_config(validate_recipe(TINY_RECIPE), 2 * nproc, 2, rank, ADDRESSES[0], port)
    path = config_dir / f"multi_node-{rank}.yaml"
    write_accelerate_config(config, path)
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path)]


def _start_outer(
    namespace: str, launcher: list[str], args: list[str], env_extra: dict[str, str] | None = None
) -> subprocess.Popen:
    env = accord_env() | (env_extra or {})
    env.pop("GLOO_SOCKET_IFNAME", None)  # accord must find the interface itself
    command = ["ip", "netns", "exec", namespace, *launcher, "-m", "accord", *args]
    return start_process(command, merge_output=True, env=env)


def _run_two_nodes(namespaces, kind, port, args_of_node, tmp_path, nproc=1, timeout=300):
    """Both nodes' commands under `kind`: torchrun, accelerate or accord (its own --nnodes)."""
    if kind == "accord":
        where = ["--nnodes", "2", "--master-addr", ADDRESSES[0], "--master-port", str(port)]
        nodes = [
            _start_node(ns, [*args_of_node(rank), f"engine.processes={nproc}", *where, "--node-rank", str(rank)])
            for rank, ns in enumerate(namespaces)
        ]
    else:
        nodes = [
            _start_outer(ns, _launcher(kind, rank, port, nproc, tmp_path), args_of_node(rank))
            for rank, ns in enumerate(namespaces)
        ]
    outputs = [finish(node, timeout=timeout)[0] for node in nodes]
    return [node.returncode for node in nodes], outputs


def _assert_node_local_checkpoint(out0, out1):
    """Each node's folder holds a sealed checkpoint with its own rank's shard and RNG state;
    node 0's alone holds the index, the schedule and the final model."""
    from accord.checkpoint.store import complete_checkpoints

    (first,) = complete_checkpoints(out0 / "checkpoints")[-1:]
    mine = out1 / "checkpoints" / first.name
    assert (mine / "COMPLETE").is_file() and (mine / "rng" / "rank-00001.pt").is_file()
    assert list((mine / "state").glob("__1_*.distcp")) and not (mine / "state" / ".metadata").exists()
    layout = json.loads((first / "layout.json").read_text())
    assert layout["layout"] == "node-local" and [f["dir"] for f in layout["folders"]] == [str(out0), str(out1)]
    assert json.loads((mine / "layout.json").read_text())["files"] == {"rng/rank-00001.pt": 1, "state/__1_0.distcp": 1}
    assert (out0 / "final").is_dir() and not (out1 / "final").exists()


# Slow (default-suite budget): the default tier keeps two nodes under accord's own launcher
# (test_two_nodes_match_one_node_with_two_processes) and the per-node folders' unit tests.
@pytest.mark.parametrize(
    "kind", [pytest.param("torchrun", marks=pytest.mark.slow), pytest.param("accelerate", marks=pytest.mark.slow)]
)
def test_outer_launcher_two_nodes_with_a_folder_each_match_one_node(namespaces, single, tmp_path, kind):
    """The guides' multi-node commands, each node writing its own output.dir and no
    GLOO_SOCKET_IFNAME: gloo finds the veth towards the master, checkpoints are sealed in
    both folders, and the weights equal one node's with 2 processes."""
    recipe, reference = single
    outs = [tmp_path / f"out{rank}" for rank in (0, 1)]
    codes, outputs = _run_two_nodes(
        namespaces,
        kind,
        29621,
        lambda rank: [
            "train",
            str(recipe),
            "engine.processes=1",
            "checkpoint.every_steps=5",
            f"output.dir={outs[rank]}",
        ],
        tmp_path,
    )
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert "each node writes its own output.dir (2 folders)" in outputs[0]
    _assert_node_local_checkpoint(*outs)
    diff = max_param_diff(final_params(reference), final_params(outs[0]))
    print(f"two nodes ({kind}, a folder per node) vs one node: max |Δparam| = {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["torchrun", "accelerate"])
@pytest.mark.parametrize("folders", ["node-local", "shared"])
def test_two_nodes_stopped_by_sigterm_resume_to_the_one_node_result(namespaces, single, tmp_path, kind, folders):
    """SIGTERM to both nodes' launchers mid-run: each node seals the checkpoint of the step
    it was on in its folder (or the shared one); resuming with --resume on both nodes ends
    with one node's weights."""
    import signal

    from accord.checkpoint.store import complete_checkpoints, read_state

    recipe, reference = single
    outs = [tmp_path / "out0", tmp_path / ("out1" if folders == "node-local" else "out0")]

    def args(rank, *more):
        return [
            "train",
            str(recipe),
            "engine.processes=1",
            "checkpoint.every_steps=2",
            f"output.dir={outs[rank]}",
            *more,
        ]

    # The checkpoint of step 2 is held open for 5 s on every rank: the signal comes mid-run however fast the machine is.
    pause = {"ACCORD_FAULTS": "checkpoint_pause_at_step=2,checkpoint_pause_s=5"}
    nodes = [
        _start_outer(ns, _launcher(kind, rank, 29631, 1, tmp_path), args(rank), pause)
        for rank, ns in enumerate(namespaces)
    ]
    wait_for(
        lambda: (outs[0] / "checkpoints" / ".tmp-step-000002").is_dir() or any(n.poll() is not None for n in nodes),
        timeout=240,
    )
    for node in nodes:
        os.kill(node.pid, signal.SIGTERM)  # a scheduler's preemption reaches every node
    outputs = [finish(node, timeout=240)[0] for node in nodes]
    assert "stop requested (SIGTERM)" in outputs[0], outputs[0][-3000:]
    stopped_at = read_state(complete_checkpoints(outs[0] / "checkpoints")[-1]).step
    assert 2 < stopped_at < 10 and (outs[1] / "checkpoints" / f"step-{stopped_at:06d}" / "COMPLETE").is_file()
    if folders == "node-local":
        # node 0 alone cannot resume: it lacks node 1's shard, and says which and where it is
        alone = run_accord("train", recipe, f"output.dir={outs[0]}", "--resume", timeout=240)
        assert alone.returncode == 1 and "Traceback" not in alone.stderr
        assert f"rank 1 wrote it into {outs[1]}/checkpoints/step-{stopped_at:06d} on node 1" in alone.stderr, (
            alone.stderr[-3000:]
        )

    codes, outputs = _run_two_nodes(namespaces, kind, 29632, lambda rank: args(rank, "--resume"), tmp_path)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert f"at step {stopped_at} " in outputs[0]
    assert max_param_diff(final_params(reference), final_params(outs[0])) <= 1e-5


REFUSALS = {
    # every rank sees it (node 1 printed nothing before: only global rank 0 printed errors)
    "batch": (2, ["batch.global_batch_size=6"], "batch.global_batch_size=6 cannot be split over 4 processes"),
    # only rank 0 sees it (node 1 died in the process-group set-up with a network traceback)
    "output.dir": (1, [], "already holds a run (metrics.jsonl); pass --resume"),
}


@pytest.mark.slow  # ~7 s each; the default tier has test_launchers' store hand-over of a refusal
@pytest.mark.parametrize("kind", ["torchrun", "accord"])
@pytest.mark.parametrize("case", ["batch", "output.dir"])
def test_a_refusal_is_printed_on_every_node(namespaces, tmp_path, tiny_recipe, case, kind):
    """A run refused on rank 0 on 2 nodes (torchrun, or accord's own launcher): both nodes'
    logs say why in accord's one line, not only the launcher's ChildFailedError."""
    nproc, overrides, reason = REFUSALS[case]
    if case == "output.dir":  # node 0's folder holds an earlier run; node 1's is new
        (tmp_path / "o0").mkdir()
        (tmp_path / "o0" / "metrics.jsonl").write_text("{}\n")
    codes, outputs = _run_two_nodes(
        namespaces,
        kind,
        29641,
        lambda rank: ["train", str(tiny_recipe), *overrides, f"output.dir={tmp_path / f'o{rank}'}"],
        tmp_path,
        nproc=nproc,
        timeout=150,
    )
    for code, output in zip(codes, outputs):
        assert code != 0
        lines = [line for line in output.splitlines() if line.startswith("accord: error:")]
        assert len(lines) == 1 and reason in lines[0], output[-3000:]
        assert "Traceback" not in output.split("accord: error:")[0]


@pytest.mark.slow  # ~10 s each: two nodes, one refusing before they meet
@pytest.mark.parametrize("kind", ["accord", "torchrun", "accelerate"])
def test_a_refusal_only_node_one_sees_is_printed_by_node_zero(namespaces, tmp_path, kind):
    """Node 1's data file is missing (node 0 has its own): node 1 refuses, and node 0 says
    so naming node 1, its host and the cause, well before torch's 10-minute group timeout,
    under accord's own --nnodes launcher and under the guides' launchers."""
    import copy
    import time

    recipes = []
    for rank in (0, 1):
        recipe = copy.deepcopy(TINY_RECIPE)
        data = tmp_path / f"train{rank}.jsonl"
        if rank == 0:
            rows = (json.dumps({"prompt": f"{i}+1=", "completion": f"{i + 1}"}) for i in range(1024))
            data.write_text("\n".join(rows) + "\n")
        recipe["data"] = {"train": [{"path": str(data), "format": "jsonl"}], "max_length": 32}
        recipes.append(write_recipe(tmp_path / f"recipe{rank}.yaml", recipe))

    def args(rank):
        return ["train", str(recipes[rank]), f"output.dir={tmp_path / f'o{rank}'}"]

    started = time.monotonic()
    codes, outputs = _run_two_nodes(namespaces, kind, 29645, args, tmp_path, timeout=150)
    assert time.monotonic() - started < 90, outputs[0][-3000:]
    assert codes[0] != 0 and codes[1] != 0
    lines = [line for line in outputs[0].splitlines() if line.startswith("accord: error:")]
    assert len(lines) == 1 and "node 1 (" in lines[0] and "train1.jsonl' not found" in lines[0], outputs[0][-3000:]
    assert "Traceback" not in outputs[0].split("accord: error:")[0]
    assert not (tmp_path / "o0" / "metrics.jsonl").exists()  # node 0 trained nothing


@pytest.mark.slow  # ~2 min on 2 loaded cores: the probe, then the 2-step runs
def test_doctor_across_two_nodes_compares_them_and_passes(namespaces, tmp_path, tiny_recipe):
    """`accord doctor` on both nodes: each node's view (versions, data, disk, the veth
    towards the master), the all-reduce between the two nodes and the 2-step equivalence."""
    nodes = [
        _start_node(
            ns,
            [
                "doctor",
                str(tiny_recipe),
                "engine.processes=1",
                f"output.dir={tmp_path / f'd{rank}'}",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--master-addr",
                ADDRESSES[0],
                "--master-port",
                "29651",
            ],
        )
        for rank, ns in enumerate(namespaces)
    ]
    outputs = [finish(node, timeout=400)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    table = outputs[0].splitlines()
    assert any(
        line.startswith("ok")
        and "network" in line
        and "towards the master 10.123.0.1; the nodes met" in line
        and "node 1" in line
        for line in table
    )
    assert any(line.startswith("ok") and "all-reduce bandwidth" in line and "nodes 0 and 1" in line for line in table)
    assert any(line.startswith("ok") and "2 processes on 2 nodes vs 1 process" in line for line in table)
