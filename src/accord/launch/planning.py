"""Plan a run's start (the LaunchPlan of launch/plan.py), in the order the mistakes are named
in: the nodes, Ray's refusals, the network interface, another node's refusal, an output folder
another run holds, the launcher's own settings (accelerate, a DeepSpeed file), the batch split,
tensor parallelism across nodes, then the hub names pinned to commits. Run by accord's launcher
once for its workers, or by each worker an outer launcher started."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import yaml

from accord.distributed import group as dist
from accord.distributed import rank_env
from accord.distributed.batch_plan import BatchPlan
from accord.engine.device import wants_cuda
from accord.errors import UserInputError
from accord.launch import ray_train
from accord.launch import refusal_relay as refusals
from accord.launch.accelerate_config import (
    accelerate_settings,
    accelerate_warnings,
    deepspeed_file_settings,
    reconcile,
)
from accord.launch.agent import planned_world_size, starts_workers
from accord.launch.cluster import Topology, resolve_topology, tensor_parallel_nodes
from accord.launch.plan import ChecksRun, LaunchPlan, OutputHolder, Where
from accord.output.lock import OutputLocked, lock_problem, new_run_id
from accord.recipe.hub import pin
from accord.recipe.schema import EngineConfig, OutputConfig, Recipe


def plan_launch(recipe: Recipe, where: Where) -> LaunchPlan:
    """The plan for `recipe` (validated) from this process, on the nodes `where` names; raises
    a UserInputError (or OutputLocked) naming the first thing that stops the run."""
    topology = resolve_topology(
        where.nnodes, where.node_rank, where.master_addr, where.master_port, where.rdzv_endpoint
    )
    outer = rank_env.outer_launcher()
    on_ray = recipe.engine.launcher == "ray"
    if on_ray:
        refusal = ray_train.refusal(recipe, outer, topology.multi_node)
        if refusal:
            raise UserInputError(refusal)
    dist.choose_gloo_interface()  # under torchrun & co.: a loopback MASTER_ADDR stops here, before the data step
    refusals.meet(topology)  # over several nodes: a refusal here is relayed to the others, and theirs here
    run_id = topology.run_id or dist.launcher_run_id() or new_run_id()
    # One lock per node: taken by the launcher, or under an outer launcher by each node's local rank 0.
    locks = outer is None or rank_env.env_info().leads_node
    held_elsewhere = lock_problem(Path(recipe.output.dir), run_id) if locks else None
    if held_elsewhere:
        raise OutputLocked(held_elsewhere)
    world_size = ray_train.world_size(recipe) if on_ray else planned_world_size(recipe.engine, topology)
    # The launcher's own settings are input too: merged into the recipe (and validated with it).
    recipe = reconcile(recipe, accelerate_settings(), world_size)  # under `accelerate launch`
    for line in accelerate_warnings():
        dist.print0(f"accord: warning: {line}")  # once, not per rank under accelerate launch
    if recipe.engine.deepspeed_config:
        path = recipe.engine.deepspeed_config
        recipe = reconcile(recipe, deepspeed_file_settings(path), world_size, source=path)
    engine = _processes_as_launched(recipe.engine)
    if engine is not recipe.engine:
        recipe = recipe.model_copy(update={"engine": engine})
    # The likeliest mistake, found in microseconds: refused before any other check or worker.
    batch = BatchPlan.of(recipe.batch, recipe.engine, world_size)
    _refuse_tensor_parallel_across_nodes(recipe.engine.tensor_parallel, world_size, topology)
    # Hub names become commits before any check reads them: once per node (the launcher, or
    # under an outer launcher each node's local rank 0), and recorded in the run's recipe.yaml.
    handoff = Path(tempfile.gettempdir()) / f"accord-hub-{run_id}.json" if outer else None
    recipe = pin(
        recipe,
        _resumed_recipe(recipe.output, recipe.resume),
        handoff,
        leads=locks,
        timeout_s=recipe.data.prepare_timeout_s,
    )
    recipe, brought_in = _trainer_checkpoint(recipe)
    launches = not on_ray and starts_workers(recipe.engine, topology)
    return LaunchPlan(
        recipe=recipe,
        topology=topology,
        world_size=world_size,
        batch=batch,
        run_id=run_id,
        holder=OutputHolder(locks=locks, writes=topology.hosts_rank_zero and dist.is_main()),
        checks=_where_checks_run(on_ray, launches, wants_cuda(recipe.engine), topology.multi_node),
        trains_here=not on_ray and not launches,
        launcher="ray" if on_ray else outer or "accord",
        hub_handoff=str(handoff) if handoff is not None else None,
        brought_in=str(brought_in) if brought_in is not None else None,
    )


def _trainer_checkpoint(recipe: Recipe) -> tuple[Recipe, Path | None]:
    """resume: a transformers.Trainer checkpoint-N folder, brought in as an accord checkpoint on
    this node before any check or worker reads it; the workers resume from that. The copy is
    removed when the run ends (the run's own checkpoints continue it from then on)."""
    if recipe.resume in ("never", "auto"):
        return recipe, None
    # The checkpoint format's imports (torch.distributed.checkpoint): only for a resume from a folder.
    from accord.checkpoint.trainer_folder import bring_in, is_trainer_checkpoint

    if not is_trainer_checkpoint(recipe.resume):
        return recipe, None
    folder = bring_in(Path(recipe.resume), recipe)
    return recipe.model_copy(update={"resume": str(folder)}), folder


def _where_checks_run(on_ray: bool, launches: bool, cuda: bool, multi_node: bool) -> ChecksRun:
    """Ray's driver, or accord's launcher over several CPU nodes: a forked child; accord's
    launcher on one CPU machine: its first worker; with GPUs, or as the worker: here."""
    if on_ray or (launches and not cuda and multi_node):
        return ChecksRun.FORKED_CHILD
    if launches and not cuda:
        return ChecksRun.FIRST_WORKER
    return ChecksRun.HERE


def _refuse_tensor_parallel_across_nodes(tensor_parallel: int, world_size: int, topology: Topology) -> None:
    if rank_env.outer_launcher() is not None:
        info = rank_env.env_info()
        per_node, nodes = info.local_world_size, info.world_size // max(info.local_world_size, 1)
    else:
        per_node, nodes = world_size // topology.nnodes, topology.nnodes
    refusal = tensor_parallel_nodes(tensor_parallel, per_node, nodes)
    if refusal:
        raise UserInputError(refusal)


def _processes_as_launched(engine: EngineConfig) -> EngineConfig:
    """Under an outer launcher the processes per node are the launcher's: a different
    engine.processes in the recipe is said once, and the run's recipe.yaml records what ran."""
    launcher = rank_env.outer_launcher()
    if launcher is None or wants_cuda(engine):
        return engine
    info = rank_env.env_info()
    if engine.processes == info.local_world_size:
        return engine
    if "processes" in engine.model_fields_set and rank_env.leads():
        count = f"{info.local_world_size} process{'es' if info.local_world_size != 1 else ''}"
        print(
            f"accord: warning: engine.processes={engine.processes} is overruled by {launcher}, which started "
            f"{count} per node ({info.world_size} in all); the run's recipe.yaml records {info.local_world_size}",
            file=sys.stderr,
            flush=True,
        )
    return engine.model_copy(update={"processes": info.local_world_size})


def _resumed_recipe(output: OutputConfig, resume: str) -> dict | None:
    """The recipe.yaml of the run this one continues (its hub commits are kept), if any."""
    path = Path(output.dir) / "recipe.yaml"
    if resume == "never" or output.overwrite or not path.is_file():
        return None
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None  # check_resume names a damaged run folder
