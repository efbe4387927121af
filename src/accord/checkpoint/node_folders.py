"""Where a multi-node run's ranks write: one output folder shared by every node (network
storage), or one folder per node (each node's own disk, `output.dir` local to it).

Which of the two is found when the run starts, collectively: each node's local rank 0 drops
a marker file into its output.dir and every node looks for the others' markers; nodes that
see each other's markers share a folder. Every folder has one leader, the local rank 0 of
its lowest node (global rank 0 for the folder of node 0), which prepares the folder and
seals its checkpoints (COMPLETE, rename, `latest`, prune) once every rank's files are
written. Each rank writes its shards and RNG state into its own node's folder; rank 0's
folder alone holds what only rank 0 writes (the DCP index, schedule.pt) and the final
model. A checkpoint of a multi-node run records the layout in `layout.json`: which ranks
wrote into which folder on which node, and which rank wrote each of this folder's files.

Resuming with node-local folders, the nodes first send each other the files of the
checkpoint they lack (over the process group), so every rank can read the whole index and
the shards it needs; a file that no node of the resumed run holds is named, with the rank
and folder that wrote it.
"""

from __future__ import annotations

import json
import re
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from accord.atomic import replacing
from accord.distributed import group as dist
from accord.engine.state import missing_file_problem, state_problems
from accord.errors import CheckpointError

SHARED, NODE_LOCAL = "shared", "node-local"
LAYOUT_FILE = "layout.json"
MARKER = ".accord-node-{token}-{node}"
# Files each folder writes for itself when sealing: never copied from another node.
OWN_FILES = ("COMPLETE", LAYOUT_FILE, "state.json", "recipe.yaml", "MANIFEST.json")
CHUNK_BYTES = 64 * 2**20  # a file travels between nodes in pieces of this size


@dataclass(frozen=True)
class Layout:
    kind: str = SHARED
    leader: bool = True  # this process prepares and seals its folder
    folder: int = 0  # index of this process's folder in `folders`
    folders: list[dict] = field(default_factory=list)  # per folder: dir, host, nodes, ranks, leader rank

    @property
    def multi_node(self) -> bool:
        return bool(self.folders)


_current: Layout | None = None


def current(info: dist.DistInfo | None = None) -> Layout:
    """The layout found by detect(); before it (or in a single-node run) global rank 0
    alone writes the shared folder."""
    if _current is not None:
        return _current
    info = info or dist.env_info()
    return Layout(leader=info.is_main)


def writes_folder(info: dist.DistInfo) -> bool:
    """Whether this process prepares and seals its output folder's checkpoints."""
    return current(info).leader


def writes_into_my_folder(rank: int, info: dist.DistInfo) -> bool:
    """Whether `rank` writes its checkpoint files into this process's output folder."""
    layout = current(info)
    return not layout.multi_node or rank in layout.folders[layout.folder]["ranks"]


def detect(out_dir: Path, info: dist.DistInfo) -> Layout:
    """Collective (multi-node runs only): which nodes share an output folder. Called once
    rank 0 has created its output.dir; every node's local rank 0 creates its own."""
    global _current
    if not info.multi_node:
        _current = Layout(leader=info.is_main)
        return _current
    token = dist.broadcast_object(uuid.uuid4().hex[:12] if info.is_main else None)
    node_leader = info.leads_node
    marker = out_dir / MARKER.format(token=token, node=info.node)
    if node_leader:
        out_dir.mkdir(parents=True, exist_ok=True)
        marker.touch()
    dist.barrier()
    seen = (
        sorted(int(p.name.rsplit("-", 1)[1]) for p in out_dir.glob(MARKER.format(token=token, node="*")))
        if node_leader
        else []
    )
    me = {
        "rank": info.rank,
        "node": info.node,
        "host": socket.gethostname(),
        "dir": str(out_dir.absolute()),
        "seen": seen,
    }
    everyone = dist.all_gather_objects(me)
    dist.barrier()
    if node_leader:
        marker.unlink(missing_ok=True)
    # A folder is named by the lowest node that sees it; all of a node's ranks use their node's.
    folder_of_node = {p["node"]: min(p["seen"]) for p in everyone if p["seen"]}
    folders: dict[int, dict] = {}
    for p in everyone:
        first = folder_of_node[p["node"]]
        entry = folders.setdefault(
            first, {"dir": p["dir"], "host": p["host"], "nodes": [], "ranks": [], "leader": p["rank"]}
        )
        entry["ranks"].append(p["rank"])
        if p["node"] not in entry["nodes"]:
            entry["nodes"].append(p["node"])
        entry["leader"] = min(entry["leader"], p["rank"])
    ordered = [folders[k] for k in sorted(folders)]
    mine = next(i for i, f in enumerate(ordered) if info.rank in f["ranks"])
    kind = SHARED if len(ordered) == 1 else NODE_LOCAL
    _current = Layout(kind, ordered[mine]["leader"] == info.rank, mine, ordered)
    return _current


def describe(layout: Layout) -> str | None:
    """The line a multi-node run prints about its output folders (None on one node)."""
    if not layout.multi_node:
        return None
    if layout.kind == SHARED:
        return f"output.dir {layout.folders[0]['dir']} is shared by all {len(layout.folders[0]['nodes'])} nodes"
    return (
        f"each node writes its own output.dir ({len(layout.folders)} folders): checkpoints hold every node's part "
        "in that node's folder, the final model and metrics are written on node 0 only "
        f"({layout.folders[0]['dir']})"
    )


# ------------------------------------------------------------------ writing


def record(tmp: Path) -> None:
    """Before sealing (the folder's leader): layout.json naming which rank wrote which file
    of this folder, and the folders of the other nodes. Nothing on one node."""
    layout = current()
    if not layout.multi_node:
        return
    files = {rel: writer_of(rel) for rel in _inventory(tmp) if rel not in OWN_FILES}
    data = {"layout": layout.kind, "folder": layout.folder, "folders": layout.folders, "files": files}
    (tmp / LAYOUT_FILE).write_text(json.dumps(data, indent=1))


def writer_of(relative: str) -> int:
    """The rank that writes a checkpoint file: DCP names each rank's shards __R_k.distcp,
    accord its RNG states rng/rank-R.pt; the rest (index, schedule) is rank 0's."""
    match = re.search(r"(?:__(\d+)_\d+\.distcp|rank-(\d+)\.pt)$", relative)
    return int(next(g for g in match.groups() if g is not None)) if match else 0


def _inventory(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ resuming


def read_layout(checkpoint: Path) -> dict | None:
    path = checkpoint / LAYOUT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def checked_when_nodes_meet(checkpoint: Path) -> bool:
    """A node-local checkpoint: each folder lacks the other nodes' files until the nodes
    meet, so its state is checked then (complete_from_peers), not before the run starts."""
    layout = read_layout(checkpoint)
    return layout is not None and layout["layout"] == NODE_LOCAL


def agreed_source(source: Path | None, out_dir: Path, info: dist.DistInfo) -> Path | None:
    """Collective in a node-local run: rank 0's choice of checkpoint, as the same step in
    each node's folder (else a node could start fresh while the others resume)."""
    layout = current(info)
    if layout.kind != NODE_LOCAL:
        return source
    name = dist.broadcast_object(source.name if source is not None else None)
    if name is None:
        return None
    mine = out_dir / "checkpoints" / name if source is None or source.name != name else source
    missing = dist.all_gather_objects(None if (mine / "COMPLETE").is_file() else f"{mine} (node {info.node})")
    absent = sorted({m for m in missing if m is not None})
    if absent:
        raise CheckpointError(
            f"resume: rank 0 resumes from {name}, but {', '.join(absent)} is not a complete checkpoint; "
            f"each node resumes from its own output.dir: copy that node's checkpoint there, or resume=PATH an older one"
        )
    return mine


def complete_from_peers(folder: Path, info: dist.DistInfo) -> list[str]:
    """Collective: in a node-local run, each folder's leader receives the files of the
    checkpoint it lacks from a folder that holds them; then every leader checks that its
    folder holds all the checkpoint needs. Returns the problems (one line each, the same
    on every rank): files no node of this run holds, named with the rank that wrote them."""
    layout = current(info)
    (recorded,) = dist.any_rank(checked_when_nodes_meet(folder))  # also when resuming on fewer nodes
    if layout.kind != NODE_LOCAL and not recorded:
        return []
    if layout.kind == NODE_LOCAL:
        _exchange(folder, info, layout)
    problems: list[str] = []
    if layout.leader:
        problems = state_problems(folder, missing=lambda path: _missing_here(path, folder))
    found = dist.all_gather_objects(problems)
    return sorted({line for lines in found for line in lines})


def _exchange(folder: Path, info: dist.DistInfo, layout: Layout) -> None:
    """Every leader lists its folder; each file one folder lacks comes from the lowest rank
    holding it, in CHUNK_BYTES pieces broadcast to all ranks (written by those that lack it)."""
    have = _inventory(folder) if layout.leader else None
    listed = dist.all_gather_objects(have)
    holders: dict[str, tuple[int, int]] = {}  # file -> (rank holding it, size)
    for rank, files in enumerate(listed):
        for rel, size in (files or {}).items():
            if rel not in OWN_FILES and rel not in holders:
                holders[rel] = (rank, size)
    for rel, (src, size) in sorted(holders.items()):
        wanted = [
            r
            for r, files in enumerate(listed)
            if files is not None and rel not in files and not _other_rng(rel, r, layout)
        ]
        if not wanted:
            continue
        receiving = info.rank in wanted
        target = folder / rel
        if receiving:
            target.parent.mkdir(parents=True, exist_ok=True)
        with (
            open(folder / rel, "rb") if info.rank == src else _null() as source,
            replacing(target, durable=True) if receiving else _null() as sink,
        ):
            for _ in range(max(1, -(-size // CHUNK_BYTES))):
                piece = dist.broadcast_object(source.read(CHUNK_BYTES) if info.rank == src else None, src=src)
                if receiving:
                    sink.write(piece)


def _other_rng(rel: str, rank: int, layout: Layout) -> bool:
    """Another folder's RNG state: only its own ranks read it."""
    if not rel.startswith("rng/"):
        return False
    folder_ranks = next(f["ranks"] for f in layout.folders if rank in f["ranks"])
    return writer_of(rel) not in folder_ranks


def _missing_here(path: Path, folder: Path) -> str:
    """A file of checkpoint `folder` missing here, with the rank and folder that wrote it when
    the checkpoint's layout says another node's folder holds it."""
    layout = read_layout(folder)
    rank = writer_of(path.relative_to(folder).as_posix())
    owner = next((f for f in layout["folders"] if rank in f["ranks"]), None) if layout is not None else None
    if owner is None:
        return missing_file_problem(path)
    return (
        f"{path} is missing here: rank {rank} wrote it into {owner['dir']}/checkpoints/{folder.name} "
        f"on node {owner['nodes'][0]} (host {owner['host']}); resume with that node taking part, or copy its files "
        f"into {folder}"
    )


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
