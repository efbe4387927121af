"""Start the workers: on every local device through torch's elastic agent, or not at all
when an outer launcher (torchrun, accelerate launch, ...) already started this process."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
import uuid
from typing import TYPE_CHECKING, Any, Protocol

import torch

from accord.distributed import group as dist
from accord.errors import AccordError, RunStopped, UserInputError
from accord.launch import ending
from accord.launch.cluster import Topology, interface_towards, is_local_address
from accord.recipe.schema import EngineConfig
from accord.stopping import EXIT_CODES, PREEMPTED_EXIT_CODE

if TYPE_CHECKING:
    from accord.launch.plan import LaunchPlan

# The default where no topology is given: this node alone (Topology is frozen, so one instance serves all).
LOCAL_TOPOLOGY = Topology()


class PendingChecks(Protocol):
    """The checks still running (in local rank 0's worker: accord.launch.worker_start.WorkerChecks):
    `result()` waits for their problems, one line each (none: the run may start), or
    re-raises what they raised."""

    def result(self) -> list[str]: ...

    def cancel(self) -> None: ...


class WorkerFailed(RunStopped):
    """A worker process crashed (its traceback was printed by the worker)."""


class Interrupted(AccordError):
    """The launcher was told to stop (SIGTERM / SIGUSR1 / SIGINT) and stopped its workers;
    the exit code asks a job script to requeue the run."""

    exit_code = PREEMPTED_EXIT_CODE


def local_world_size(cfg: EngineConfig) -> int:
    """Processes to start on this machine: one per GPU used, else engine.processes on CPU."""
    from accord.engine.device import wants_cuda

    if wants_cuda(cfg):
        return len(cfg.devices) if cfg.devices is not None else torch.cuda.device_count()
    return cfg.processes


def planned_world_size(cfg: EngineConfig, topology: Topology = LOCAL_TOPOLOGY) -> int:
    """The world size the run will have, known before anything starts."""
    if dist.outer_launcher() is not None:
        return dist.env_info().world_size
    return topology.nnodes * local_world_size(cfg)


def starts_workers(cfg: EngineConfig, topology: Topology = LOCAL_TOPOLOGY) -> bool:
    """Whether this process launches worker processes (else it is the worker itself)."""
    if dist.outer_launcher() is not None:
        return False
    return local_world_size(cfg) > 1 or topology.multi_node


def run(plan: LaunchPlan, checks: PendingChecks | None = None) -> str:
    """Train the plan's recipe here (outer launcher, or one process) or on freshly started local
    workers (joining the other nodes' when multi-node); returns how the run ended:
    completed | preempted | stopped.

    `checks`: the recipe's checks, still running; the workers start now and train only if
    they pass (else the checks' problems are raised as a UserInputError). Only where this
    process starts the workers, which are handed the plan."""
    recipe, topology = plan.recipe, plan.topology
    nproc = local_world_size(recipe.engine)
    if plan.launcher == "accord":
        _set_worker_environment(recipe.engine, nproc, topology)
    if plan.trains_here:
        from accord.launch.worker import train_worker  # this process is the (only) worker

        try:
            status = train_worker(recipe, plan.batch).status
        except BaseException:
            if dist.left_a_group():  # failed after its process group: it ends as a worker does
                ending.trained()
            raise
        ending.trained()  # ended as a worker process does (train_worker: files closed, threads joined)
        return status
    if topology.hosts_rank_zero:
        from accord.observe.progress import announce

        announce(
            f"starting {nproc} worker{'s' if nproc != 1 else ''}…"
            + (f" (this node's of {topology.nnodes})" if topology.multi_node else "")
        )
    return _launch_watched(plan, nproc, checks)


def _launch_watched(plan: LaunchPlan, nproc: int, checks: PendingChecks | None) -> str:
    """The workers under the hang watchdog (accord.launch.watchdog): a hang that used up the restarts
    ends the run with its own message rather than "worker rank N failed"."""
    from accord.engine.device import wants_cuda
    from accord.launch.watchdog import HangDetected, watch_for_hangs

    cfg = plan.recipe.engine
    with watch_for_hangs(
        cfg.hang_timeout_s, nproc, cfg.max_restarts, plan.recipe.output.dir, nccl=wants_cuda(cfg)
    ) as watchdog:
        try:
            return _elastic_launch(plan.to_json(), nproc, cfg.max_restarts, plan.topology, checks)
        except WorkerFailed:
            if watchdog is None or watchdog.restart not in watchdog.verdicts:
                raise
            restarts = (
                f"no restart left of engine.max_restarts={cfg.max_restarts}"
                if cfg.max_restarts
                else "engine.max_restarts=0"
            )
            raise HangDetected(
                f"the run hung and its workers were stopped ({restarts}); "
                "--resume continues from the latest checkpoint, if one was written"
            ) from None


def _set_worker_environment(cfg: EngineConfig, nproc: int, topology: Topology) -> None:
    """Environment the workers inherit: visible GPUs, CPU threads split between processes,
    and for several nodes the network interface gloo must use."""
    from accord.engine.device import wants_cuda

    if topology.multi_node and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface, _ = interface_towards(_meeting_host(topology))
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface

    if wants_cuda(cfg):
        if cfg.devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, cfg.devices))
    # Each restart of the worker group gets a fresh store: sharing the agent's store
    # across restarts lets a new worker read a dead worker's address and hang in
    # gloo's connectFullMesh (seen often with torch 2.13).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if "OMP_NUM_THREADS" not in os.environ:
        # Each process would otherwise start one thread per core: with 2 processes on
        # 2 cores that is 4 busy threads fighting for 2 cores.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // nproc))


def _meeting_host(topology: Topology) -> str:
    return topology.rdzv_endpoint.rsplit(":", 1)[0] if topology.rdzv_endpoint else str(topology.master_addr)


def _rendezvous(topology: Topology) -> dict[str, Any]:
    """LaunchConfig settings for how the nodes' agents meet."""
    if not topology.multi_node:
        # Port 0: the agent's store takes a free port itself, so there is no race with
        # other programs for a port picked in advance.
        return dict(
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            rdzv_configs={"is_host": True},
            local_addr="127.0.0.1",
            run_id=f"accord-{uuid.uuid4().hex[:8]}",
        )
    _, local_addr = interface_towards(_meeting_host(topology))
    if topology.rdzv_endpoint is not None:
        host = topology.rdzv_endpoint.rsplit(":", 1)[0]
        # The node whose address is the endpoint hosts the store (else the c10d agent hangs).
        configs = {"is_host": is_local_address(host)}
        return dict(
            rdzv_backend="c10d",
            rdzv_endpoint=topology.rdzv_endpoint,
            rdzv_configs=configs,
            local_addr=local_addr,
            run_id=topology.run_id,
        )
    return dict(
        rdzv_backend="static",
        rdzv_endpoint=f"{topology.master_addr}:{topology.master_port}",
        rdzv_configs={"rank": topology.node_rank},
        local_addr=local_addr,
        run_id=topology.run_id,
    )


def _elastic_launch(
    plan_json: str, nproc: int, max_restarts: int, topology: Topology, checks: PendingChecks | None
) -> str:
    """Workers are separate `python -m accord.launch.worker_start` programs (not functions run
    through multiprocessing): a worker that finished after a stop signal can then simply
    exit, where a function worker would wait for the agent to collect its return value."""
    from torch.distributed.launcher.api import LaunchConfig

    _quiet_agent()
    from accord.launch.worker_start import GO, WorkerChecks, open_gate

    with tempfile.TemporaryDirectory(prefix="accord-run-") as folder:
        config = LaunchConfig(
            min_nodes=topology.nnodes,
            max_nodes=topology.nnodes,
            nproc_per_node=nproc,
            max_restarts=max_restarts,
            monitor_interval=0.1,
            start_method="spawn",
            **_rendezvous(topology),
            # The agent forwards these to the workers, which finish their step, checkpoint
            # and exit; SIGUSR1 is what SLURM sends before the time limit.
            signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
            logs_specs=_agent_logs(folder),
        )
        plan_path, gate = os.path.join(folder, "plan.json"), os.path.join(folder, "gate")
        with open(plan_path, "w", encoding="utf-8") as f:
            f.write(plan_json)
        if checks is None:
            open_gate(gate, GO)
            return _run_agent(config, [gate, plan_path])
        worker_args = [gate, plan_path]
        if isinstance(checks, WorkerChecks):  # the workers check: local rank 0 reports here
            checks.report = os.path.join(folder, "checks")
            worker_args.append(checks.report)
        verdict = _Verdict(checks, gate)
        try:
            status = _run_agent(config, worker_args)
        except BaseException:
            # Workers that never got the go (a signal, a crash at import): the checks'
            # reason first if they have one, else the agent's; checks still running are stopped.
            verdict.raise_if_failed(cancel=True)
            raise
        verdict.raise_if_failed()
        return status


class _Verdict:
    """Opens the workers' gate once the checks are done: `go` when they found nothing,
    else `abort` (the workers leave quietly and the checks' reason is raised here)."""

    def __init__(self, checks: PendingChecks, gate: str) -> None:
        self._checks, self._failure = checks, None
        self._thread = threading.Thread(target=self._wait, args=(checks, gate), name="accord-checks", daemon=True)
        self._thread.start()

    def _wait(self, checks: PendingChecks, gate: str) -> None:
        from accord.launch.worker_start import ABORT, GO, open_gate

        try:
            problems = checks.result()
            if problems:
                self._failure = UserInputError("\n".join(problems))
        except BaseException as e:  # noqa: BLE001 - whatever stopped the checks stops the run
            self._failure = e
        open_gate(gate, ABORT if self._failure is not None else GO)

    def raise_if_failed(self, cancel: bool = False) -> None:
        if cancel and self._thread.is_alive():
            self._checks.cancel()
            self._thread.join()
            return
        self._thread.join()
        if self._failure is not None:
            raise self._failure


def _run_agent(config, worker_args: list[str]) -> str:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    ending.trained()  # once the agent returns or raises, its workers have ended
    try:
        elastic_launch(config, sys.executable)("-m", "accord.launch.worker_start", *worker_args)
    except ChildFailedError as e:
        # The first failure is the cause; the agent then stops the other workers.
        rank, failure = e.get_first_failure()
        for status in ("preempted", "stopped", "refused"):
            if failure.exitcode == EXIT_CODES[status]:
                return status
        raise WorkerFailed(
            f"worker rank {rank} failed (exit code {failure.exitcode}); its error is printed above"
        ) from None
    except SignalException as e:
        raise Interrupted(f"stopped by {e.sigval.name}") from None
    return "completed"


def run_module(module: str, args: list[str], cfg: EngineConfig, topology: Topology = LOCAL_TOPOLOGY) -> None:
    """`python -m MODULE ARGS` as this node's workers, meeting the other nodes' as training's
    workers do (accord doctor's probe); WorkerFailed when one fails."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    nproc = local_world_size(cfg)
    _set_worker_environment(cfg, nproc, topology)
    _quiet_agent()
    with tempfile.TemporaryDirectory(prefix="accord-run-") as folder:
        config = LaunchConfig(
            min_nodes=topology.nnodes,
            max_nodes=topology.nnodes,
            nproc_per_node=nproc,
            max_restarts=0,
            monitor_interval=0.1,
            start_method="spawn",
            logs_specs=_agent_logs(folder),
            **_rendezvous(topology),
        )
        try:
            elastic_launch(config, sys.executable)("-m", module, *args)
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            raise WorkerFailed(
                f"{module} rank {rank} failed (exit code {failure.exitcode}); its error is printed above"
            ) from None


def _agent_logs(folder: str):
    """The agent's per-worker files (error files, redirected output) inside the run's private
    folder, removed with it: by default torch makes a /tmp/torchelastic_* folder per launch and
    leaves it behind (thousands after a few days of runs)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    return DefaultLogsSpecs(log_dir=os.path.join(folder, "agent"))


def _quiet_agent() -> None:
    """The agent's log lines (closing workers, exit codes) repeat what accord and the
    workers print themselves; a worker's crash traceback comes from the worker."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)


# How long workers get to finish a step and write a checkpoint after a stop signal
# before the agent kills them.
SHUTDOWN_TIMEOUT_S = 120
