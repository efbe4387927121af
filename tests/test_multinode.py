"""Two nodes made of two network namespaces joined by a veth pair (needs root and iproute2):
one accord per node, one process each, gloo — the same result as one node with 2 processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from conftest import accord_env, final_params, finish, max_param_diff, start_process

pytestmark = pytest.mark.distributed
ADDRESSES = ("10.123.0.1", "10.123.0.2")


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture(scope="module")
def namespaces():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("two-node test needs root and iproute2 (ip netns)")
    tag = uuid.uuid4().hex[:5]
    names = [f"acc{tag}n{i}" for i in (0, 1)]
    links = [f"acc{tag}v{i}" for i in (0, 1)]
    try:
        for name in names:
            _sh("ip", "netns", "add", name)
        _sh("ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for name, link, addr in zip(names, links, ADDRESSES):
            _sh("ip", "link", "set", link, "netns", name)
            _sh("ip", "netns", "exec", name, "ip", "addr", "add", f"{addr}/24", "dev", link)
            _sh("ip", "netns", "exec", name, "ip", "link", "set", link, "up")
            _sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {e.stderr.decode().strip()}")
    yield names
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


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
    out = tmp_path / "two-nodes"
    common = ["train", str(recipe), "engine.processes=1", f"output.dir={out}", "--nnodes", "2"]
    nodes = []
    for rank, namespace in enumerate(namespaces):
        if meeting == "static":
            where = ["--node-rank", str(rank), "--master-addr", ADDRESSES[0], "--master-port", "29611"]
        else:
            where = ["--rdzv-endpoint", f"{ADDRESSES[0]}:29612"]
        nodes.append(_start_node(namespace, common + where))
    outputs = [finish(node, timeout=300)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-3000:]
    assert "batch 2 processes × 8 sequences × 2 accumulation steps" in outputs[0] + outputs[1]
    diff = max_param_diff(final_params(reference), final_params(out))
    print(f"two nodes ({meeting}) vs one node: max |Δparam| = {diff:.2e}")
    assert diff <= 1e-5
