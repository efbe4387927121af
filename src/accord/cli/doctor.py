"""`accord doctor RECIPE`: check a machine or a cluster before a long run, as a table with a
verdict per line.

Run it like `accord train` (on every node with the same --nnodes / --node-rank /
--master-addr flags, or under SLURM). Each node first looks at itself (library versions,
the recipe's checks and data, GPUs, free disk, the interface towards the master); then
this node's processes join the others' (the same launch as training) to compare every
node's view, time an all-reduce between each pair of nodes, and finally train the recipe
2 steps on all processes and on 1 process (node 0) to check that they agree to 1e-5.
Exit 0 when no line failed, 1 otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from accord.distributed import group as dist
from accord.distributed.network import interface_towards, is_loopback
from accord.errors import AccordError
from accord.launch.cluster import Topology, tensor_parallel_nodes
from accord.recipe.schema import EngineConfig, Recipe

OK, WARN, FAIL = "ok", "warn", "FAIL"
SELF_TEST_STEPS = 2
TOLERANCE = 1e-5
BANDWIDTH_BYTES = 16 * 2**20  # the all-reduced tensor
BANDWIDTH_REPEATS = 3


@dataclass(frozen=True)
class Line:
    check: str
    where: str
    result: str
    verdict: str


# ------------------------------------------------------------------ this node


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in ("accord", "torch", "transformers", "deepspeed"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def node_view(recipe: Recipe, topology: Topology, world_size: int) -> dict:
    """What this node sees, before meeting the others."""
    from accord.engine.device import wants_cuda
    from accord.launch.preflight import preflight

    problems = preflight(recipe, world_size, writer=False)  # the recipe's own checks and its data, here
    needed = _checkpoint_bytes(recipe)
    free = shutil.disk_usage(_existing(Path(recipe.output.dir))).free
    master = topology.rdzv_endpoint.rsplit(":", 1)[0] if topology.rdzv_endpoint else topology.master_addr
    interface, address = interface_towards(master) if master else ("lo", "127.0.0.1")
    return {
        "versions": versions(),
        "problems": problems,
        "cuda": {
            "wanted": wants_cuda(recipe.engine),
            "count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        },
        "disk": {"free": free, "needed": needed, "dir": str(Path(recipe.output.dir).absolute())},
        "network": {
            "master": master,
            "interface": interface,
            "address": address,
            "loopback": bool(master) and topology.multi_node and is_loopback(master),
        },
    }


def _checkpoint_bytes(recipe: Recipe) -> int:
    """keep_last + 1 checkpoints (what may be on disk at once), as the run's own disk warning
    estimates them (every parameter trained: an upper bound under LoRA); the model counted on
    the meta device."""
    from accord.checkpoint.disk_space import checkpoint_bytes
    from accord.planner.estimate import meta_model

    params = sum(p.numel() for p in meta_model(recipe).parameters())
    return (recipe.checkpoint.keep_last + 1) * checkpoint_bytes(params, params)


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


# ------------------------------------------------------------------ all nodes together (the probe workers)


def probe(view_path: str, result_path: str) -> int:
    """One worker of the probe: join the group, gather every node's view, time all-reduces
    between each pair of nodes; each node's local rank 0 writes the whole picture."""
    from accord.engine.device import select_device

    info = dist.env_info()
    view = json.loads(Path(view_path).read_text())
    engine = EngineConfig.model_validate(view.pop("engine"))
    device = select_device(engine, info.local_rank)
    dist.init(device)
    try:
        views = dist.all_gather_objects(
            view | {"node": info.node, "host": os.uname().nodename} if info.leads_node else None
        )
        nodes = info.world_size // info.local_world_size
        # each pair of nodes' local ranks 0; on one node all its processes (none for one process)
        pairs = [(a, b) for a in range(nodes) for b in range(a + 1, nodes)] or ([(0, 0)] if info.world_size > 1 else [])
        figures = {}
        for a, b in pairs:
            ranks = (
                sorted({a * info.local_world_size, b * info.local_world_size})
                if nodes > 1
                else list(range(info.world_size))
            )
            group = torch.distributed.new_group(ranks) if info.world_size > 1 else None
            if info.rank in ranks:
                figures[f"{a}-{b}"] = _all_reduce_gbps(device, group)
        measured = dist.all_gather_objects(figures)
        merged: dict[str, float] = {}
        for entry in measured:
            merged |= {k: v for k, v in (entry or {}).items() if k not in merged}
        if info.leads_node:
            Path(result_path).write_text(
                json.dumps(
                    {
                        "views": [v for v in views if v],
                        "bandwidth": merged,
                        "world": info.world_size,
                        "local_world": info.local_world_size,
                    }
                )
            )
    finally:
        dist.shutdown()
    return 0


def _all_reduce_gbps(device, group) -> float:
    """Algorithm bandwidth of an all-reduce of BANDWIDTH_BYTES (bytes / seconds), best of a few."""
    tensor = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for i in range(BANDWIDTH_REPEATS + 1):  # the first one sets up the connections
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(tensor, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - start)
    return BANDWIDTH_BYTES / best / 1e9


# ------------------------------------------------------------------ the verdicts


def lines_from(picture: dict, recipe: Recipe) -> list[Line]:
    views = sorted(picture["views"], key=lambda v: v["node"])
    out: list[Line] = []
    first = views[0]["versions"]
    differing = [
        f"node {v['node']}: {k} {v['versions'][k]} (node 0: {first[k]})"
        for v in views[1:]
        for k in first
        if v["versions"][k] != first[k]
    ]
    summary = ", ".join(f"{k} {first[k]}" for k in ("accord", "torch", "transformers", "deepspeed"))
    out.append(
        Line(
            "versions",
            "all nodes" if len(views) > 1 else "this node",
            "; ".join(differing) or summary,
            FAIL if differing else OK,
        )
    )
    for v in views:
        where = f"node {v['node']} ({v['host']})"
        out.append(
            Line(
                "recipe, model and data",
                where,
                "; ".join(v["problems"]) or "found and readable",
                FAIL if v["problems"] else OK,
            )
        )
        cuda = v["cuda"]
        visible = f", CUDA_VISIBLE_DEVICES={cuda['visible']}" if cuda["visible"] is not None else ""
        if cuda["wanted"]:
            out.append(Line("GPUs", where, f"{cuda['count']} visible{visible}", OK if cuda["count"] else FAIL))
        else:
            out.append(Line("GPUs", where, f"{cuda['count']} visible{visible}; this recipe runs on the CPU", OK))
        disk = v["disk"]
        enough = disk["free"] >= disk["needed"]
        out.append(
            Line(
                "disk for checkpoints",
                where,
                f"{disk['free'] / 2**30:.1f} GiB free under {disk['dir']}, "
                f"{recipe.checkpoint.keep_last + 1} checkpoints need ~{disk['needed'] / 2**30:.2f} GiB",
                OK if enough else WARN,
            )
        )
        net = v["network"]
        if net["master"] is None:
            out.append(Line("network", where, "one node: processes meet on 127.0.0.1", OK))
        elif net["loopback"] or net["interface"] is None:
            out.append(
                Line(
                    "network",
                    where,
                    f"no interface reaches the master {net['master']} from here (it is a loopback "
                    "address or unroutable); give node 0's network address",
                    FAIL,
                )
            )
        else:
            out.append(
                Line(
                    "network",
                    where,
                    f"{net['interface']} ({net['address']}) towards the master {net['master']}; the nodes met",
                    OK,
                )
            )
    tp = recipe.engine.tensor_parallel
    if tp > 1:
        out.append(tensor_parallel_line(tp, picture["local_world"], picture["world"]))
    ep = recipe.engine.expert_parallel
    if ep > 1:
        out.append(expert_parallel_line(ep, picture["local_world"], picture["world"]))
    for pair, gbps in sorted(picture["bandwidth"].items()):
        a, b = pair.split("-")
        where = f"nodes {a} and {b}" if a != b else f"{picture['world']} local processes"
        out.append(
            Line(
                "all-reduce bandwidth",
                where,
                f"{gbps:.2f} GB/s ({BANDWIDTH_BYTES // 2**20} MiB, best of {BANDWIDTH_REPEATS})",
                OK,
            )
        )
    return out


def self_test(recipe: Recipe, topology: Topology, folder: Path) -> Line | None:
    """The recipe for SELF_TEST_STEPS steps on every process of the job, then (node 0) on one
    process: the final weights must agree to TOLERANCE. None on the other nodes."""
    from accord import api

    steps = [f"train.max_steps={SELF_TEST_STEPS}", "resume=never", "output.overwrite=false"]
    flags = (
        dict(
            nnodes=topology.nnodes,
            node_rank=topology.node_rank,
            master_addr=topology.master_addr,
            master_port=topology.master_port,
            rdzv_endpoint=topology.rdzv_endpoint,
        )
        if topology.multi_node
        else dict(nnodes=1)
    )
    everyone = api.train(recipe, steps + [f"output.dir={folder / 'all'}"], **flags)
    if not topology.hosts_rank_zero:
        return None
    from accord.engine.device import wants_cuda

    single = dict(devices=[0]) if wants_cuda(recipe.engine) else dict(processes=1)
    one = api.train(recipe, steps + one_process(recipe) + [f"output.dir={folder / 'one'}"], nnodes=1, **single)
    diff = max_difference(everyone.final, one.final)
    world = everyone_world(topology, recipe)
    where = f"{world} processes{f' on {topology.nnodes} nodes' if topology.multi_node else ''} vs 1 process"
    return Line(
        f"{SELF_TEST_STEPS}-step equivalence",
        where,
        f"max |Δparam| = {diff:.1e} (≤ {TOLERANCE:g})",
        OK if diff <= TOLERANCE else FAIL,
    )


@contextlib.contextmanager
def _output_to(log: Path) -> Iterator[None]:
    """This process's stdout and stderr, and its children's (workers inherit the descriptors), go to `log`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(log, "ab") as sink:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def tensor_parallel_line(tp: int, local_world: int, world: int) -> Line:
    """Whether each engine.tensor_parallel group stays inside a node (its all-reduces run twice
    per layer: over the network they would dominate the step)."""
    nodes = world // max(local_world, 1)
    problem = tensor_parallel_nodes(tp, local_world, nodes)
    if problem is None and world % tp:
        problem = f"engine.tensor_parallel={tp} does not divide the {world} processes"
    where = "all nodes" if nodes > 1 else "this node"
    detail = problem or f"groups of {tp} consecutive ranks, each inside one node ({local_world} processes per node)"
    return Line("tensor-parallel groups", where, detail, FAIL if problem else OK)


def one_process(recipe: Recipe) -> list[str]:
    """Overrides that let the self-test's 1-process run train the recipe: the layouts that split
    the model over a group of ranks set to 1 (the model itself is the same)."""
    return [f"engine.{key}=1" for key in ("tensor_parallel", "expert_parallel") if getattr(recipe.engine, key) > 1]


def expert_parallel_line(ep: int, local_world: int, world: int) -> Line:
    """Whether each engine.expert_parallel group stays inside a node: its all-to-alls (two per MoE
    layer forward, two backward) run over the network otherwise, which works but slows every step."""
    nodes = world // max(local_world, 1)
    where = "all nodes" if nodes > 1 else "this node"
    if world % ep:
        return Line(
            "expert-parallel groups", where, f"engine.expert_parallel={ep} does not divide the {world} processes", FAIL
        )
    if nodes > 1 and local_world % ep:
        detail = (
            f"groups of {ep} consecutive ranks span nodes ({local_world} processes per node): each MoE layer's "
            f"all-to-all crosses the network; a divisor of {local_world} keeps them inside a node"
        )
        return Line("expert-parallel groups", where, detail, WARN)
    holders = world // ep
    holding = f"{holders} ranks hold each expert" if holders > 1 else "1 rank holds each expert"
    detail = f"groups of {ep} consecutive ranks, each inside one node; {holding}"
    return Line("expert-parallel groups", where, detail, OK)


def everyone_world(topology: Topology, recipe: Recipe) -> int:
    from accord.launch.agent import planned_world_size

    return planned_world_size(recipe.engine, topology)


def max_difference(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict:
        out = {}
        for file in sorted(folder.glob("*.safetensors")):
            out |= load_file(file)
        return out

    left, right = tensors(a), tensors(b)
    if left.keys() != right.keys():
        return float("inf")
    return max((left[k].float() - right[k].float()).abs().max().item() for k in left)


def format_table(lines: list[Line]) -> str:
    header = Line("check", "where", "result", "verdict")
    widths = [max(len(getattr(x, f)) for x in [header, *lines]) for f in ("check", "where", "verdict")]
    rows = []
    for x in [header, *lines]:
        rows.append(f"{x.verdict:<{widths[2]}}  {x.check:<{widths[0]}}  {x.where:<{widths[1]}}  {x.result}")
    return "\n".join(rows)


# ------------------------------------------------------------------ the command


def run(recipe: Recipe, topology: Topology, with_self_test: bool = True) -> int:
    from accord.launch.agent import planned_world_size, run_module

    world = planned_world_size(recipe.engine, topology)
    view = node_view(recipe, topology, world) | {"engine": recipe.engine.model_dump(mode="json")}
    with tempfile.TemporaryDirectory(prefix="accord-doctor-") as tmp:
        folder = Path(tmp)
        (folder / "view.json").write_text(json.dumps(view))
        net = view["network"]
        try:
            if topology.multi_node and (net["loopback"] or net["interface"] is None):
                # the nodes could not meet: say so now instead of waiting for the rendezvous to time out
                raise AccordError(
                    f"no interface reaches the master {net['master']} from here (a loopback address or "
                    f"unroutable); give node 0's network address"
                )
            run_module(
                "accord.cli.doctor", [str(folder / "view.json"), str(folder / "picture.json")], recipe.engine, topology
            )
            lines = lines_from(json.loads((folder / "picture.json").read_text()), recipe)
        except AccordError as e:
            lines = [Line("meeting the other processes", "this node", str(e).splitlines()[0], FAIL)]
        if with_self_test and not any(line.verdict == FAIL for line in lines):
            log = folder / "self-test.log"
            try:
                with _output_to(log):
                    line = self_test(recipe, topology, folder)
            except AccordError as e:
                line = Line(f"{SELF_TEST_STEPS}-step equivalence", "all processes vs 1", str(e).splitlines()[0], FAIL)
            if line is not None and line.verdict == FAIL:
                # Its two runs' logs are shown only when it failed: they say why.
                sys.stderr.write(log.read_text(errors="replace"))
            if line is not None:
                lines.append(line)
    print(format_table(lines), flush=True)
    return 1 if any(line.verdict == FAIL for line in lines) else 0


if __name__ == "__main__":  # a probe worker, started by run_module
    dist.exit_after_shutdown(probe(sys.argv[1], sys.argv[2]))
