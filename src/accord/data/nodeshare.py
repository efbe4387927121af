"""Preparing one cache from several nodes, with no process group: files are the only signal.

Each node tokenises its share of the work units first (unit i belongs to node i mod N),
then every unit still without a chunk file (data/chunks.py). Chunk files are renamed into
place when complete and are the same whoever writes them, so:
- on a cache folder the nodes share (network storage), the nodes split the work, and a node
  that finishes early takes over what is left of a slower node's share (a unit two nodes
  tokenise at once is written twice, identically);
- on node-local caches no node sees another's chunks: each prepares everything, as one
  node does, and ends with the whole cache.
The first node with every chunk seals the cache (joins the chunks into shards, renames the
folder into place) after claiming `seal` in the work folder; the others stop tokenising as
soon as the cache is sealed, and read it. Nothing needs to know which of the two layouts it
is on.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

SEAL = "seal"


@dataclass(frozen=True)
class NodeShare:
    node: int = 0
    nodes: int = 1

    def owns(self, unit_index: int) -> bool:
        return unit_index % self.nodes == self.node


def node_share(env: os._Environ | dict[str, str] = os.environ) -> NodeShare:
    """This node's place among the nodes preparing the data: from a launcher's worker
    environment (RANK / WORLD_SIZE / LOCAL_WORLD_SIZE: torchrun, accord's own), else from
    NNODES / NODE_RANK (accord's multi-node flags' environment) or SLURM; one node otherwise."""
    try:
        if "RANK" in env and "WORLD_SIZE" in env and "LOCAL_WORLD_SIZE" in env:
            local = max(int(env["LOCAL_WORLD_SIZE"]), 1)
            return _share(int(env["RANK"]) // local, int(env["WORLD_SIZE"]) // local)
        if env.get("NNODES") and env.get("NODE_RANK"):
            return _share(int(env["NODE_RANK"]), int(env["NNODES"]))
        if env.get("SLURM_NNODES") and env.get("SLURM_NODEID"):
            return _share(int(env["SLURM_NODEID"]), int(env["SLURM_NNODES"]))
    except ValueError:
        pass  # a malformed variable is the launcher's to report; prepare everything here
    return NodeShare()


def _share(node: int, nodes: int) -> NodeShare:
    return NodeShare(node, nodes) if nodes > 1 and 0 <= node < nodes else NodeShare()


def claim_seal(work: Path) -> bool:
    """Whether this process seals the cache: the first to create `work/seal`. A claim left
    by a killed process of this host is taken over; the work folder gone means another node
    sealed (or failed) already."""
    path = work / SEAL
    me = f"{socket.gethostname()}:{os.getpid()}"
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileNotFoundError:
            return False
        except FileExistsError:
            if not _stale(path):
                return False
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(me)
        return True
    return False


def _stale(path: Path) -> bool:
    try:
        host, _, pid = path.read_text().partition(":")
    except OSError:
        return False
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
