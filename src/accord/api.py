"""accord from Python: `accord.train` and `accord.plan` do what `accord train` and `accord plan`
do, and raise an AccordError (UserInputError, RunStopped, ...) where the command prints
`accord: error: ...` lines.

    import accord
    result = accord.train("recipes/quickstart.yaml", {"train.max_steps": 50}, overwrite=True)
    result.status, result.final      # "completed", Path("runs/quickstart/final")
    accord.plan(recipe_dict, gpus=8, gpu_memory="80GB").advice

A recipe is a YAML file's path, the parsed YAML (a dict) or a Recipe; overrides are dotted
keys, as a mapping ({"batch.micro_batch_size": 4}) or as the command line writes them
(["batch.micro_batch_size=4"]), and take precedence over the recipe.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accord.errors import UserInputError
from accord.recipe.schema import Recipe, apply_override, load_recipe, validate_recipe

if TYPE_CHECKING:
    from accord.planner.estimate import StrategyPlan

RecipeLike = str | os.PathLike | Mapping[str, Any] | Recipe
Overrides = Mapping[str, Any] | Sequence[str] | str | None


@dataclass(frozen=True)
class TrainResult:
    """How a training run ended."""

    # completed | preempted (stopped on request, checkpointed) | stopped (could not go on; the reason is on stderr)
    # | refused (bad input the workers found before writing anything, e.g. no checkpoint verifies; the reason is
    # on stderr)
    status: str
    output_dir: Path
    message: str = ""  # preempted: where the run can continue from

    @property
    def final(self) -> Path | None:
        """The exported model (a save_pretrained folder) of a completed run."""
        return self.output_dir / "final" if self.status == "completed" else None


@dataclass(frozen=True)
class PlanResult:
    """Per-GPU memory of each strategy (bytes, the largest rank's share) and what fits."""

    rows: list[StrategyPlan]
    world_size: int
    gpu_memory_gib: float | None
    advice: str
    device: str = "GPU"  # what a rank runs on: "GPU", or "CPU process" (planned for this machine's RAM)
    nodes: int = 1
    memory_source: str = (
        ""  # where gpu_memory_gib came from, e.g. "--gpu-memory", "2 × NVIDIA H200", "31.3 GiB RAM / 2"
    )

    @property
    def per_node(self) -> int:
        return self.world_size // self.nodes

    def as_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "device": self.device,
            "memory_source": self.memory_source,
            "gpu_memory_gib": self.gpu_memory_gib,
            "strategies": [row.as_dict() for row in self.rows],
            "advice": self.advice,
        }


def train(
    recipe: RecipeLike,
    /,
    overrides: Overrides = None,
    *,
    overwrite: bool = False,
    resume: bool = False,
    processes: int | None = None,
    devices: Sequence[int] | None = None,
    launcher: str | None = None,
    nnodes: int | None = None,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    rdzv_endpoint: str | None = None,
) -> TrainResult:
    """Train a recipe as `accord train` does: on engine.processes CPU workers or every
    visible GPU, started here (or as the worker an outer launcher such as torchrun started).

    overwrite: replace an earlier run in output.dir (output.overwrite=true).
    resume: continue from the latest complete checkpoint in output.dir (resume=auto); unlike
    resume=auto in a recipe, refused (UserInputError) when there is none to continue from.
    processes: CPU worker processes (engine.processes); devices: GPU indices (engine.devices).
    launcher: who starts the workers (engine.launcher): "accord", or "ray" for Ray Train workers
    on the Ray cluster at engine.ray.address / RAY_ADDRESS, else on a local Ray (docs/ray.md).
    nnodes, node_rank, master_addr, master_port, rdzv_endpoint: several nodes, as the
    command's flags of the same names (default: the environment's NNODES & co., or SLURM's).

    Every check runs before any worker trains or anything is written (on the CPU of one
    machine in the first worker, which imports what they need to train anyway) and raises
    a UserInputError naming what to fix. A worker that crashes raises WorkerFailed (a
    RunStopped); a stop signal to the launcher raises Interrupted once its workers have
    stopped. A run stopped on request after a checkpoint returns status "preempted", its
    message saying how to continue.
    """
    from accord.observe.progress import announce

    announce("checking recipe…")
    lines = override_lines(overrides)
    if overwrite:
        lines.append("output.overwrite=true")
    if resume:
        lines.append("resume=auto")
    if processes is not None:
        lines.append(f"engine.processes={processes}")
    if devices is not None:
        lines.append(f"engine.devices={json.dumps(list(devices))}")
    if launcher is not None:
        lines.append(f"engine.launcher={json.dumps(launcher)}")
    validated = load(recipe, lines)  # the one validation of the user's recipe in this process
    # The launcher imports torch (seconds): only once the recipe is read, so a mistake in it is named first.
    from accord.launch.start import Where, start

    where = Where(nnodes, node_rank, master_addr, master_port, rdzv_endpoint)
    ended = start(validated, where, resume_requested=resume)
    return TrainResult(ended.status, Path(validated.output.dir), ended.message)


def plan(
    recipe: RecipeLike,
    /,
    overrides: Overrides = None,
    *,
    gpus: int | None = None,
    nodes: int = 1,
    gpu_memory: float | str | None = None,
) -> PlanResult:
    """What each strategy holds per GPU for `recipe` on nodes × gpus GPUs, from the model
    built on the meta device (nothing is loaded), and the cheapest strategy that fits; each
    row's `phases` gives the peak per rank of build, train, checkpoint, export and resume.

    gpus: GPUs per node (default: this machine's; on a machine without GPUs, the recipe's
    engine.processes CPU processes, each with an equal share of the RAM as its memory).
    gpu_memory: memory per GPU in GiB, or a size such as "80GB" or "24GiB" (default: the
    smallest visible GPU's, or RAM / processes on the CPU).
    """
    from accord.planner.estimate import plan as plan_strategies
    from accord.planner.estimate import recommend

    recipe = load(recipe, overrides)
    device, source = "GPU", "--gpu-memory"
    local = _local_gpus()
    if gpus is None:
        if local:
            gpus = len(local)
        else:
            device, gpus = "CPU process", recipe.engine.processes
    if gpus < 1 or nodes < 1:
        raise UserInputError(f"gpus and nodes must be at least 1, got gpus={gpus}, nodes={nodes}")
    if gpu_memory is not None:
        memory: float | None = _memory_gib(gpu_memory)
    elif device == "GPU" and local:
        memory = min(m for _, m in local)
        source = f"{len(local)} × {local[0][0]} here"
    elif device == "GPU":
        memory, source = None, ""
    else:
        ram = _ram_gib()
        memory, source = ram / gpus, f"{ram:.1f} GiB RAM / {gpus} processes"
    rows, world = plan_strategies(recipe, gpus, nodes, cpu=device != "GPU")
    advice = (
        recommend(rows, recipe, world, memory, device)
        if memory
        else "give the memory per GPU (--gpu-memory) to see what fits"
    )
    return PlanResult(rows, world, memory, advice, device, nodes, source)


def load(recipe: RecipeLike, overrides: Overrides = None) -> Recipe:
    """A validated Recipe from a path, parsed YAML or a Recipe, with the overrides applied;
    a RecipeError names each bad key (with a did-you-mean) or value."""
    lines = override_lines(overrides)
    if isinstance(recipe, (str, os.PathLike)):
        return load_recipe(recipe, lines)
    if isinstance(recipe, Recipe):
        if not lines:
            return recipe
        # Only what was set: the rest stays "left open" for accelerate's settings to fill.
        raw = recipe.model_dump(mode="json", exclude_unset=True)
    elif isinstance(recipe, Mapping):
        raw = copy.deepcopy(dict(recipe))
    else:
        raise UserInputError(f"a recipe is a YAML file's path, a dict or a Recipe, got {type(recipe).__name__}")
    for line in lines:
        apply_override(raw, line)
    return validate_recipe(raw)


def override_lines(overrides: Overrides) -> list[str]:
    """Overrides as the command line writes them (`key.sub=value`, the value read as YAML)."""
    if overrides is None:
        return []
    if isinstance(overrides, str):
        return [overrides]
    if isinstance(overrides, Mapping):
        # JSON is YAML: each value reads back as the same number, string, list or mapping.
        return [f"{key}={json.dumps(value, default=str)}" for key, value in overrides.items()]
    return list(overrides)


def _memory_gib(value: float | str) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(GB|GiB|G|MB|MiB)?\s*", value, flags=re.IGNORECASE)
    if not match:
        raise UserInputError(f"--gpu-memory {value!r}: expected a size such as 80GB or 24GiB")
    number, unit = float(match.group(1)), (match.group(2) or "GB").lower()
    return number * {"gb": 1e9, "g": 1e9, "gib": 2**30, "mb": 1e6, "mib": 2**20}[unit] / 2**30


def _local_gpus() -> list[tuple[str, float]]:
    """(name, GiB) of each GPU visible here."""
    import torch

    if not torch.cuda.is_available():
        return []
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return [(p.name, p.total_memory / 2**30) for p in props]


def _ram_gib() -> float:
    """This machine's memory (its cgroup limit when lower)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total / 2**30
