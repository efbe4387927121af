"""Which nodes take part and how they meet: from flags, from the environment, or from
SLURM's job environment; and the network interface that reaches the master node.

Only the launcher on each node uses this (one accord process per node starts that
node's workers); worker ranks are the launcher's business (dist.py reads them).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import struct
import subprocess
from dataclasses import dataclass

from accord.errors import UserInputError

DEFAULT_PORT = 29500


class ClusterError(UserInputError):
    """Inconsistent multi-node settings; the message says which and how to fix them."""


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


def interface_towards(host: str) -> tuple[str | None, str | None]:
    """(interface name, local address) this machine uses to reach `host`, so gloo binds to
    the network the other nodes can reach (else it picks the hostname's address, often
    127.0.0.1, and the other node's connections are refused)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # no packet is sent: this only selects the route
            local = probe.getsockname()[0]
    except OSError:
        return None, None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == local:
            return name, local
    return None, local


def _ipv4_of(interface: str) -> str | None:
    import fcntl

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", interface[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def is_local_address(host: str) -> bool:
    """Does `host` name this machine (so its launcher hosts the c10d rendezvous store)?"""
    try:
        target = socket.gethostbyname(host)
    except OSError:
        return False
    if target.startswith("127."):
        return True
    return any(_ipv4_of(name) == target for _, name in socket.if_nameindex())


def is_loopback(host: str) -> bool:
    """Does `host` resolve to a loopback address (localhost, or a host name that /etc/hosts
    maps to 127.0.1.1 as many distributions do)? Other machines cannot reach it."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    import ipaddress

    return any(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)
