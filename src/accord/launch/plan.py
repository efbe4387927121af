"""The launch plan: what a run's start decides before any check runs or any worker starts,
decided once (launch/planning.py) and then only read. Where accord starts the workers it is
handed to them as data (`to_json` / `from_json`: a file in the run's private folder, or Ray's
train_loop_config); where an outer launcher (torchrun, accelerate launch, srun, deepspeed)
started this process as one worker of many, each worker plans for itself, from the same
recipe and environment. Imports no torch: a worker reads it while its gate watcher runs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from enum import Enum
from pathlib import Path

from accord.distributed.batch_plan import BatchPlan
from accord.launch.cluster import Topology
from accord.recipe.schema import Recipe


@dataclass(frozen=True)
class Where:
    """Which nodes the run spans (the `accord train` flags of the same names; None: the
    environment's NNODES & co., or SLURM's)."""

    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None


class ChecksRun(Enum):
    """Where the checks before start (launch/preflight.py) run."""

    # In a child forked from the launcher, which then starts the workers or Ray: the libraries
    # the checks load leave with the child instead of staying in a launcher that watches the
    # workers for the whole job (Ray's workers may be on other machines; over several nodes the
    # other nodes' workers would be past their gate before this node's checks failed).
    FORKED_CHILD = "forked child"
    # In the node's first worker, once it has imported what training needs anyway; the other
    # workers wait at their gate (one CPU machine: a second importer only slows the workers).
    FIRST_WORKER = "first worker"
    # In this process: it is the worker (outer launcher, one process), or it has GPUs (a forked
    # child must not touch a CUDA runtime its parent initialised).
    HERE = "here"


@dataclass(frozen=True)
class OutputHolder:
    """Who holds output.dir: `locks`, this process takes its node's lock (accord's launcher, or
    under an outer launcher each node's local rank 0); `writes`, this process is (or starts)
    global rank 0, which writes the run's files."""

    locks: bool
    writes: bool


@dataclass(frozen=True)
class LaunchPlan:
    """One run's start, decided. `recipe` is the resolved recipe: the launcher's settings merged
    in, engine.processes as launched, hub names pinned to commits (what recipe.yaml records)."""

    recipe: Recipe
    topology: Topology
    world_size: int
    batch: BatchPlan
    run_id: str
    holder: OutputHolder
    checks: ChecksRun
    trains_here: bool  # this process is the worker (else it starts the workers, or Ray does)
    launcher: str  # accord | ray | the outer launcher that started this process
    hub_handoff: str | None = None  # where the node's leader leaves the hub commits (outer launchers)
    # resume: a transformers.Trainer checkpoint-N, brought in on this node as an accord
    # checkpoint (recipe.resume names it); the node's leader removes it when the run ends.
    brought_in: str | None = None

    @property
    def out_dir(self) -> Path:
        return Path(self.recipe.output.dir)

    def with_recipe(self, recipe: Recipe) -> LaunchPlan:
        return replace(self, recipe=recipe)

    def to_json(self) -> str:
        fields = asdict(replace(self, recipe=None))  # type: ignore[arg-type]
        fields["recipe"] = self.recipe.model_dump(mode="json")
        fields["checks"] = self.checks.value
        return json.dumps(fields)

    @classmethod
    def from_json(cls, text: str) -> LaunchPlan:
        """The plan a launcher wrote, its recipe validated once in the reading process."""
        fields = json.loads(text)
        return cls(
            recipe=Recipe.model_validate(fields["recipe"]),
            topology=Topology(**fields["topology"]),
            world_size=fields["world_size"],
            batch=BatchPlan(**fields["batch"]),
            run_id=fields["run_id"],
            holder=OutputHolder(**fields["holder"]),
            checks=ChecksRun(fields["checks"]),
            trains_here=fields["trains_here"],
            launcher=fields["launcher"],
            hub_handoff=fields["hub_handoff"],
            brought_in=fields.get("brought_in"),
        )


def read_plan(path: str | Path) -> LaunchPlan:
    return LaunchPlan.from_json(Path(path).read_text(encoding="utf-8"))


def run_checks(plan: LaunchPlan, keep_for_run: bool = False) -> list[str]:
    """The checks before start (launch/preflight.py), one line per problem, wherever the plan
    runs them: imported here, so in a forked child their imports (transformers, datasets, the
    checkpoint format's) stay out of the launcher. Over several nodes each node prepares its
    share of the data (data/nodeshare.py) when its rank is known here. `keep_for_run`: this
    process trains next and its assembly takes what the data check built."""
    from accord.data.nodeshare import NodeShare
    from accord.launch.preflight import preflight

    topology = plan.topology
    share = None
    if topology.multi_node and topology.node_rank is not None:
        share = NodeShare(topology.node_rank, topology.nnodes)
    return preflight(
        plan.recipe,
        plan.batch.processes,
        writer=topology.hosts_rank_zero,
        share=share,
        plan=plan.batch,
        keep_for_run=keep_for_run,
    )
