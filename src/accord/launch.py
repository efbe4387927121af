"""Start the workers: on every local device through torch's elastic agent, or not at all
when an outer launcher (torchrun, accelerate launch, ...) already started this process."""

from __future__ import annotations

import os
import uuid
from typing import Any

from accord import dist
from accord.recipe import EngineConfig, Recipe


class WorkerFailed(RuntimeError):
    """A worker process exited with an error (its traceback was printed by the worker)."""


def local_world_size(cfg: EngineConfig) -> int:
    """Processes to start on this machine: one per GPU used, else engine.processes on CPU."""
    from accord.engine.device import wants_cuda

    if wants_cuda(cfg):
        import torch

        return len(cfg.devices) if cfg.devices is not None else torch.cuda.device_count()
    return cfg.processes


def planned_world_size(cfg: EngineConfig) -> int:
    """The world size the run will have, known before anything starts."""
    if dist.outer_launcher() is not None:
        return dist.env_info().world_size
    return local_world_size(cfg)


def run(recipe: Recipe) -> dict[str, float]:
    """Train `recipe` here (outer launcher, or one process) or on freshly started local workers."""
    from accord.worker import train_worker

    data = recipe.model_dump(mode="json")
    if dist.outer_launcher() is not None:
        return train_worker(data)
    nproc = local_world_size(recipe.engine)
    _set_worker_environment(recipe.engine, nproc)
    if nproc == 1:
        return train_worker(data)
    return _elastic_launch(train_worker, data, nproc)


def _set_worker_environment(cfg: EngineConfig, nproc: int) -> None:
    """Environment the workers inherit: visible GPUs, and CPU threads split between processes."""
    from accord.engine.device import wants_cuda

    if wants_cuda(cfg):
        if cfg.devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, cfg.devices))
    if "OMP_NUM_THREADS" not in os.environ:
        # Each process would otherwise start one thread per core: with 2 processes on
        # 2 cores that is 4 busy threads fighting for 2 cores.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // nproc))


def _elastic_launch(entrypoint, data: dict[str, Any], nproc: int) -> dict[str, float]:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"accord-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        # Port 0: the agent's store takes a free port itself, so there is no race with
        # other programs for a port picked in advance.
        rdzv_endpoint="127.0.0.1:0",
        rdzv_configs={"is_host": True},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr="127.0.0.1",
    )
    try:
        results = elastic_launch(config, entrypoint)(data)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        raise WorkerFailed(f"worker rank {rank} failed (exit code {failure.exitcode}); its error is printed above") from None
    return results[0]
