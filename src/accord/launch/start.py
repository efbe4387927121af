"""Start a training run from a validated Recipe, in one direction: the topology, the output
folder's lock, the launcher's settings (accelerate, a DeepSpeed file), the batch plan (once),
the checks, then spawn the workers or train here. `accord.train` and `accord train` both come
here; the recipe is not validated again on the way."""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from accord.errors import UserInputError
from accord.output.lock import OutputLocked, acquire, lock_problem, new_run_id
from accord.recipe.hub import pin
from accord.recipe.schema import Recipe

if TYPE_CHECKING:
    from accord.distributed.batch_plan import BatchPlan
    from accord.launch.cluster import Topology


@dataclass(frozen=True)
class Ended:
    """How the run ended: status completed | preempted | stopped | refused, and for preempted
    where the run can continue from."""

    status: str
    message: str = ""


@dataclass(frozen=True)
class Where:
    """Which nodes the run spans (the `accord train` flags of the same names; None: the
    environment's NNODES & co., or SLURM's)."""

    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None


def start(recipe: Recipe, where: Where = Where(), resume_requested: bool = False) -> Ended:
    """Train `recipe` (validated) on this node: every check before any worker trains or
    anything is written, then the workers (or this process as the worker).

    resume_requested: --resume (refused when there is nothing to continue from).
    Raises a UserInputError naming what to fix, WorkerFailed, or Interrupted."""
    out_dir = Path(recipe.output.dir)
    if resume_requested:
        _check_something_to_resume(recipe)
    # Imported once the recipe is read: a mistake in it is named before torch loads (seconds).
    from accord.distributed import group as dist
    from accord.distributed.batch_plan import BatchPlan
    from accord.engine.device import wants_cuda
    from accord.launch.accelerate_config import (
        accelerate_settings,
        accelerate_warnings,
        deepspeed_file_settings,
        reconcile,
    )
    from accord.launch.agent import Interrupted, planned_world_size, run, starts_workers
    from accord.launch.cluster import resolve_topology
    from accord.launch.fork_call import call_in_fork
    from accord.launch.worker_start import WorkerChecks

    topology = resolve_topology(
        where.nnodes, where.node_rank, where.master_addr, where.master_port, where.rdzv_endpoint
    )
    on_ray = recipe.engine.launcher == "ray"
    if on_ray:
        from accord.launch import ray_train

        refusal = ray_train.refusal(recipe, dist.outer_launcher(), topology.multi_node)
        if refusal:
            raise UserInputError(refusal)
    dist.choose_gloo_interface()  # under torchrun & co.: a loopback MASTER_ADDR stops here, before the data step
    from accord.launch import refusal_relay as refusals

    refusals.meet(topology)  # over several nodes: a refusal here is relayed to the others, and theirs here
    run_id = topology.run_id or dist.launcher_run_id() or new_run_id()
    # One lock per node: taken by the launcher, or under an outer launcher by each node's local rank 0.
    locks_here = dist.outer_launcher() is None or dist.env_info().leads_node
    held_elsewhere = lock_problem(out_dir, run_id) if locks_here else None
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
    recipe = _processes_as_launched(recipe)
    # The likeliest mistake, found in microseconds: refused before any other check or worker.
    plan = BatchPlan.for_recipe(recipe, world_size)
    _refuse_tensor_parallel_across_nodes(recipe, world_size, topology)
    # Hub names become commits before any check reads them: once per node (the launcher, or
    # under an outer launcher each node's local rank 0), and recorded in the run's recipe.yaml.
    handoff = Path(tempfile.gettempdir()) / f"accord-hub-{run_id}.json" if dist.outer_launcher() else None
    recipe = pin(recipe, _resumed_recipe(recipe), handoff, leads=locks_here, timeout_s=recipe.data.prepare_timeout_s)
    recipe, brought_in = _trainer_checkpoint(recipe)
    hold = _OutputHold(recipe, run_id, locks_here, writer=topology.hosts_rank_zero and dist.is_main())
    refusals.watch(then=hold.refused_elsewhere)  # another node's refusal ends this node's part too
    ray_session = None
    try:
        checks, problems = None, []
        if on_ray:
            # Ray's workers may be on other machines: the checks run here, in a child (the
            # libraries they load do not stay in the driver, which waits for the whole run),
            # before Ray starts its threads here; then Ray, refused if it cannot hold the workers.
            problems = call_in_fork(_preflight, recipe, plan, topology)
            if not problems:
                ray_session = ray_train.RaySession(recipe)
                problems = hold.enter()
        elif starts_workers(recipe.engine, topology) and not wants_cuda(recipe.engine):
            if not topology.multi_node:
                # The first worker checks, once it has imported transformers and datasets
                # for training anyway (seconds each; on a machine with few cores a second
                # importer only slows the workers down); the others wait at their gate, which
                # opens once the checks passed and the output folder is held.
                checks = WorkerChecks(then=hold.enter)
            else:
                # Not over several nodes: the other nodes' workers would be past their gate
                # when this node's checks fail. In a child: the libraries the checks load do
                # not stay resident in the launcher, which watches the workers for the whole job.
                problems = call_in_fork(_preflight, recipe, plan, topology) or hold.enter()
        else:
            # With GPUs here (a forked child must not touch a CUDA runtime its parent
            # initialised, and the workers see only their own devices), or as the worker.
            # This process trains next unless it starts workers: its run takes what the checks built.
            here = not starts_workers(recipe.engine, topology)
            problems = _preflight(recipe, plan, topology, keep_for_run=here) or hold.enter()
        if problems:
            raise UserInputError("\n".join(problems))
        refusals.launching()
        status = ray_session.run() if ray_session else run(recipe, topology, checks, plan)
        hold.refused = status == "refused"
    except Interrupted as e:
        raise Interrupted(f"{e}; {_resume_hint(out_dir)}") from None
    finally:
        hold.leave()
        if handoff is not None and locks_here:
            handoff.unlink(missing_ok=True)
        if brought_in is not None and locks_here:
            shutil.rmtree(brought_in.parent, ignore_errors=True)
        if ray_session:
            ray_session.close()
    return Ended(status, f"stopped early on request; {_resume_hint(out_dir)}" if status == "preempted" else "")


def _refuse_tensor_parallel_across_nodes(recipe: Recipe, world_size: int, topology: Topology) -> None:
    from accord.distributed import group as dist
    from accord.launch.cluster import tensor_parallel_nodes

    if dist.outer_launcher() is not None:
        info = dist.env_info()
        per_node, nodes = info.local_world_size, info.world_size // max(info.local_world_size, 1)
    else:
        per_node, nodes = world_size // topology.nnodes, topology.nnodes
    refusal = tensor_parallel_nodes(recipe.engine.tensor_parallel, per_node, nodes)
    if refusal:
        raise UserInputError(refusal)


def _processes_as_launched(recipe: Recipe) -> Recipe:
    """Under an outer launcher the processes per node are the launcher's: a different
    engine.processes in the recipe is said once, and the run's recipe.yaml records what ran."""
    from accord.distributed import rank_env
    from accord.engine.device import wants_cuda

    launcher = rank_env.outer_launcher()
    if launcher is None or wants_cuda(recipe.engine):
        return recipe
    info = rank_env.env_info()
    if recipe.engine.processes == info.local_world_size:
        return recipe
    if "processes" in recipe.engine.model_fields_set and rank_env.leads():
        count = f"{info.local_world_size} process{'es' if info.local_world_size != 1 else ''}"
        print(
            f"accord: warning: engine.processes={recipe.engine.processes} is overruled by {launcher}, which started "
            f"{count} per node ({info.world_size} in all); the run's recipe.yaml records {info.local_world_size}",
            file=sys.stderr,
            flush=True,
        )
    engine = recipe.engine.model_copy(update={"processes": info.local_world_size})
    return recipe.model_copy(update={"engine": engine})


def _resumed_recipe(recipe: Recipe) -> dict | None:
    """The recipe.yaml of the run this one continues (its hub commits are kept), if any."""
    import yaml

    path = Path(recipe.output.dir) / "recipe.yaml"
    if recipe.resume == "never" or recipe.output.overwrite or not path.is_file():
        return None
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None  # check_resume names a damaged run folder


def _trainer_checkpoint(recipe: Recipe) -> tuple[Recipe, Path | None]:
    """resume: a transformers.Trainer checkpoint-N folder, brought in as an accord checkpoint on
    this node before any check or worker reads it; the workers resume from that. The copy is
    removed when the run ends (the run's own checkpoints continue it from then on)."""
    from accord.checkpoint.trainer_folder import bring_in, is_trainer_checkpoint

    if recipe.resume in ("never", "auto") or not is_trainer_checkpoint(recipe.resume):
        return recipe, None
    folder = bring_in(Path(recipe.resume), recipe)
    return recipe.model_copy(update={"resume": str(folder)}), folder


def _check_something_to_resume(recipe: Recipe) -> None:
    """--resume asks to continue a run: with nothing to continue, a typo in output.dir would
    otherwise start a fresh (maybe days-long) run. `resume: auto` in a recipe starts fresh."""
    from accord.checkpoint.store import CHECKPOINTS, latest_checkpoint

    out_dir = Path(recipe.output.dir)
    if recipe.resume != "auto" or latest_checkpoint(out_dir) is not None:
        return
    where = (
        f"{out_dir} does not exist" if not out_dir.exists() else f"no complete checkpoint in {out_dir}/{CHECKPOINTS}"
    )
    raise UserInputError(
        f"--resume: nothing to resume ({where}); check output.dir=..., or leave out --resume to start a fresh run"
    )


class _OutputHold:
    """The run's hold on output.dir, taken only once the checks passed (a bad input leaves
    no folder and no lock behind) and before any worker is let through its gate: the lock,
    and for --overwrite the earlier run set aside. The workers delete the set-aside run
    after their first good step; if the run ends before that, `leave` puts it back."""

    def __init__(self, recipe: Recipe, run_id: str, locks_here: bool, writer: bool) -> None:
        self.recipe, self.run_id, self.locks_here, self.writer = recipe, run_id, locks_here, writer
        self.out_dir = Path(recipe.output.dir)
        self.lock = None
        self.set_aside = False
        self.fresh = False  # output.dir held no run when this one took it
        self.refused = False  # the workers refused the run before its first step

    def enter(self) -> list[str]:
        from accord.observe.progress import announce
        from accord.output.folder import check_output_dir, earlier_run, set_aside_earlier_run

        if self.locks_here:
            self.lock = acquire(self.out_dir, self.run_id)
        if not self.writer:
            return []
        # Checked again under the lock: another run may have finished here since the checks.
        problems = check_output_dir(self.recipe, self.run_id)
        if problems:
            return problems
        self.fresh = not earlier_run(self.out_dir)
        if self.recipe.output.overwrite and set_aside_earlier_run(self.out_dir):
            self.set_aside = True
            announce(
                f"--overwrite: the earlier run is set aside in {self.out_dir}/.previous-run "
                "until this run completes a step"
            )
        return []

    def refused_elsewhere(self) -> None:
        self.refused = True
        self.leave()

    def leave(self) -> None:
        from accord.observe.progress import announce
        from accord.output.folder import remove_refused_run, restore_earlier_run

        try:
            if self.refused and self.fresh:
                remove_refused_run(self.out_dir)
            if self.set_aside and restore_earlier_run(self.out_dir):
                announce(
                    f"the run ended before its first good step: the earlier run in {self.out_dir} is back as it was"
                )
        finally:
            if self.lock is not None:
                self.lock.release()


def _resume_hint(out_dir: Path) -> str:
    from accord.checkpoint.resume import resume_hint  # the checkpoint format's imports: only when needed

    return resume_hint(out_dir)


def _preflight(recipe: Recipe, plan: BatchPlan, topology: Topology, keep_for_run: bool = False) -> list[str]:
    """preflight, imported where it runs: in a forked child its imports (transformers,
    datasets, the checkpoint format's) stay out of the launcher. Over several nodes each
    node prepares its share of the data (data/nodeshare.py) when its rank is known here."""
    from accord.data.nodeshare import NodeShare
    from accord.launch.preflight import preflight

    share = None
    if topology.multi_node and topology.node_rank is not None:
        share = NodeShare(topology.node_rank, topology.nnodes)
    return preflight(
        recipe, plan.processes, writer=topology.hosts_rank_zero, share=share, plan=plan, keep_for_run=keep_for_run
    )
