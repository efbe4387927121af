"""The launcher's rank layout, read from the environment: the only module that reads RANK,
WORLD_SIZE & co. It imports no torch, so a refusal before any worker starts prints at once.

Who leads, one notion per scope (nothing else compares ranks with 0):
- the job: global rank 0 -- `DistInfo.is_main` for a layout in hand, `accord.distributed.group.is_main()`
  for this process in its process group, and `leads()` where the asker may be a launcher that has no
  rank yet (the console's messages);
- a node: its local rank 0 -- `DistInfo.leads_node` (prepares the node's data, takes its lock, prints
  its node's errors);
- an output folder: `accord.checkpoint.node_folders.writes_folder` (global rank 0, or with a folder per
  node each of those nodes' leaders).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# Environment variables that an outer launcher sets for each worker, and who sets them.
_LAUNCHER_MARKERS = (
    ("ACCELERATE_DYNAMO_BACKEND", "accelerate launch"),
    ("ACCELERATE_MIXED_PRECISION", "accelerate launch"),
    ("TORCHELASTIC_RUN_ID", "torchrun"),
)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Global rank 0: the job's leader."""
        return self.rank == 0

    @property
    def leads_node(self) -> bool:
        """Local rank 0: the leader of this process's node."""
        return self.local_rank == 0

    @property
    def node(self) -> int:
        """This process's node: launchers number ranks node by node (torchrun, accord)."""
        return self.rank // max(self.local_world_size, 1)

    @property
    def multi_node(self) -> bool:
        return self.world_size > self.local_world_size


def outer_launcher() -> str | None:
    """Name of the launcher that started this process as one worker of many, if any.
    `accelerate launch` with a single-process config sets no RANK: still its worker."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return "accelerate launch" if "ACCELERATE_MIXED_PRECISION" in os.environ else None
    for var, name in _LAUNCHER_MARKERS:
        if var in os.environ:
            return name
    return "an outer launcher"


def env_info() -> DistInfo:
    """Rank layout from the launcher's environment (a single process when there is none)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return DistInfo(
        rank=int(os.environ.get("RANK", 0)),
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        local_world_size=local_world,
    )


def leads() -> bool:
    """This process is (or, as a launcher, will start) global rank 0: a launcher has no RANK
    yet, and its node's rank says whether rank 0 will be one of its workers."""
    if "RANK" in os.environ:
        return os.environ["RANK"] == "0"
    return os.environ.get("NODE_RANK", os.environ.get("SLURM_NODEID", "0")) == "0"
