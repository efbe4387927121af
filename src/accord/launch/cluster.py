"""Which nodes take part and how they meet: from flags, from the environment, or from
SLURM's job environment (the network interface that reaches the master node is
accord.distributed.network's).

Only the launcher on each node uses this (one accord process per node starts that
node's workers); worker ranks are the launcher's business (dist.py reads them).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass

# interface_towards and is_loopback are read from here too (the launcher, doctor).
from accord.distributed.network import ClusterError, interface_towards, is_local_address, is_loopback  # noqa: F401

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Topology:
    nnodes: int = 1
    node_rank: int | None = 0  # None: assigned by the c10d rendezvous
    master_addr: str | None = None
    master_port: int = DEFAULT_PORT
    rdzv_endpoint: str | None = None  # HOST:PORT for c10d rendezvous instead of a fixed master
    run_id: str | None = None  # the same on every node
    source: str = "local"  # local | flags | environment | slurm

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def hosts_rank_zero(self) -> bool:
        """Will global rank 0 (the one that writes outputs) run on this node?"""
        if self.node_rank is not None:
            return self.node_rank == 0
        return is_local_address(str(self.rdzv_endpoint).rsplit(":", 1)[0])


def resolve_topology(
    nnodes: int | None = None,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    rdzv_endpoint: str | None = None,
    env: dict[str, str] | None = None,
) -> Topology:
    """Flags win over the environment (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT), which
    wins over a SLURM job (srun with one task per node)."""
    env = dict(os.environ) if env is None else env
    if nnodes is not None or rdzv_endpoint is not None:
        return _checked(
            _from_values(
                nnodes if nnodes is not None else 1, node_rank, master_addr, master_port, rdzv_endpoint, "flags"
            )
        )
    if env.get("NNODES") and _env_int(env, "NNODES") > 1:
        return _checked(
            _from_values(
                _env_int(env, "NNODES"),
                _env_int(env, "NODE_RANK") if env.get("NODE_RANK") else None,
                env.get("MASTER_ADDR"),
                _env_int(env, "MASTER_PORT") if env.get("MASTER_PORT") else None,
                None,
                "environment",
            )
        )
    if "SLURM_JOB_ID" in env and "SLURM_NNODES" in env and "SLURM_PROCID" in env:
        return _from_slurm(env)
    return Topology()


def _from_values(nnodes, node_rank, master_addr, master_port, rdzv_endpoint, source) -> Topology:
    port = master_port or DEFAULT_PORT
    run_id = hashlib.sha256(f"{master_addr}:{port}:{rdzv_endpoint}".encode()).hexdigest()[:12]
    return Topology(nnodes, node_rank, master_addr, port, rdzv_endpoint, f"accord-{run_id}", source)


def _checked(topology: Topology) -> Topology:
    if topology.nnodes < 1:
        raise ClusterError(f"--nnodes must be at least 1, got {topology.nnodes}")
    if not topology.multi_node:
        return Topology()
    if topology.rdzv_endpoint is not None:
        if ":" not in topology.rdzv_endpoint:
            raise ClusterError(f"--rdzv-endpoint {topology.rdzv_endpoint!r}: expected HOST:PORT")
        return topology
    if topology.node_rank is None or topology.master_addr is None:
        raise ClusterError(
            f"{topology.nnodes} nodes need --node-rank and --master-addr on every node "
            f"(or --rdzv-endpoint HOST:PORT), or NODE_RANK and MASTER_ADDR in the environment"
        )
    if not 0 <= topology.node_rank < topology.nnodes:
        raise ClusterError(f"--node-rank {topology.node_rank} is outside 0..{topology.nnodes - 1}")
    return topology


def _env_int(env: dict[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ClusterError(
            f"environment variable {name}={env[name]!r} is not a whole number; fix or unset it"
        ) from None


def _from_slurm(env: dict[str, str]) -> Topology:
    nnodes = _env_int(env, "SLURM_NNODES")
    tasks = _env_int(env, "SLURM_NTASKS") if env.get("SLURM_NTASKS") else nnodes
    if tasks != nnodes:
        raise ClusterError(
            f"this SLURM step runs {tasks} tasks on {nnodes} nodes; accord starts the workers of a node itself, "
            f"so run one task per node: srun --ntasks-per-node=1 (accord slurm writes such a script)"
        )
    if nnodes == 1:
        return Topology(source="slurm")
    hosts = slurm_hostnames(env["SLURM_JOB_NODELIST"] if "SLURM_JOB_NODELIST" in env else env["SLURM_NODELIST"])
    port = _env_int(env, "MASTER_PORT") if env.get("MASTER_PORT") else 20000 + _env_int(env, "SLURM_JOB_ID") % 20000
    return Topology(
        nnodes, _env_int(env, "SLURM_NODEID"), hosts[0], port, None, f"accord-slurm-{env['SLURM_JOB_ID']}", "slurm"
    )


def slurm_hostnames(nodelist: str) -> list[str]:
    """Expand a SLURM node list ("gpu[01-03,07],login1") with scontrol, or by hand when
    scontrol is not on this machine."""
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()
    hosts: list[str] = []
    for part in _split_top_level(nodelist):
        if "[" not in part:
            hosts.append(part)
            continue
        prefix, ranges = part.split("[", 1)
        for item in ranges.rstrip("]").split(","):
            lo, _, hi = item.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{n:0{len(lo)}d}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return parts + [current] if current else parts


def tensor_parallel_nodes(tensor_parallel: int, per_node: int, nodes: int) -> str | None:
    """Why a tensor-parallel group would span nodes (None: each stays inside one). Its all-reduces
    run twice per layer, forward and backward: over the network they would dominate the step."""
    if tensor_parallel == 1 or nodes == 1:
        return None
    if per_node % tensor_parallel:
        return (
            f"engine.tensor_parallel={tensor_parallel} would span nodes: it must divide the {per_node} processes per "
            f"node (a TP group all-reduces twice per layer and belongs inside one node); use a divisor of "
            f"{per_node}, and engine.strategy=fsdp over the nodes"
        )
    return None
