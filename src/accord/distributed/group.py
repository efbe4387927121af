"""Process-group state in one place (the launcher's RANK, WORLD_SIZE & co. are read by rank_env)."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from accord.distributed.network import ClusterError, interface_towards, is_loopback
from accord.distributed.rank_env import DistInfo, env_info, outer_launcher  # noqa: F401 (read from here too)
from accord.recipe.schema import PROCESS_GROUP_TIMEOUT_S

_control_group: dist.ProcessGroup | None = None
_left_group = False  # set by shutdown(): this process joined (and left) a process group


def init(device: torch.device, timeout_s: float = PROCESS_GROUP_TIMEOUT_S) -> DistInfo:
    """Join the process group (gloo on CPU, NCCL on GPU); a no-op for a single process."""
    global _control_group
    info = env_info()
    choose_gloo_interface()
    if info.world_size <= 1:
        return info
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    # else joined already: Ray Train creates the group before its workers run (TorchConfig's backend)
    # Small control messages (stop flags, errors) go over gloo on CPU tensors, so
    # asking "did any rank get a signal?" never waits for the GPU stream.
    _control_group = dist.new_group(backend="gloo") if "gloo" not in dist.get_backend() else None
    return info


def choose_gloo_interface() -> None:
    """Under an outer launcher (torchrun, accelerate launch, srun, deepspeed) bind gloo to
    the interface that reaches MASTER_ADDR, as accord's own launcher does for its workers:
    else gloo takes the address of the host name, often 127.0.0.1, and the other nodes'
    connections are refused. GLOO_SOCKET_IFNAME set by the user wins. A multi-node job whose
    MASTER_ADDR is a loopback address cannot meet: one line, before the group is created."""
    info = env_info()
    master = os.environ.get("MASTER_ADDR")
    if outer_launcher() is None or info.world_size <= 1 or not master or "GLOO_SOCKET_IFNAME" in os.environ:
        return
    if is_loopback(master):
        if info.multi_node:
            raise ClusterError(
                f"MASTER_ADDR={master} is a loopback address, which the other nodes of this "
                f"{info.world_size // info.local_world_size}-node job cannot reach; give node 0's network address "
                f"(torchrun --master_addr, accelerate's main_process_ip)"
            )
        return  # every process is on this machine: any interface reaches the others
    interface, _ = interface_towards(master)
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface


_restart_count: int | None = None  # set by a launcher that does not say it in the environment (Ray)


def restart_count() -> int:
    """How many times the launcher has restarted this worker group (torch's elastic agent, or Ray's)."""
    if _restart_count is not None:
        return _restart_count
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def set_restart_count(count: int) -> None:
    global _restart_count
    _restart_count = count


def shutdown(clean: bool = True) -> None:
    """Leave the process group in a fixed order so no rank dies at interpreter exit.

    The barrier makes every rank finish its last collective before any rank tears down
    its communicator; destroying the group explicitly stops gloo's threads while the
    interpreter is still whole, instead of leaving them to static destructors at exit.
    After an error (`clean=False`) a peer may never arrive, so there is no barrier.
    """
    global _control_group, _left_group
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
        _left_group = True
    _control_group = None


def exit_after_shutdown(code: int) -> NoReturn:
    """End a process that ran a process group, skipping interpreter teardown.

    After shutdown() every file accord writes is closed, but torch's C++ objects (a process
    group still referenced by a model, DeviceMesh or DTensor; gloo's threads) would be
    destroyed in static-destructor order at exit, which sometimes aborts the process with
    "terminate called without an active exception" (SIGABRT, exit -6) after a run that
    succeeded. Leaving with os._exit takes that path away.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def in_group() -> bool:
    """Whether this process is in a process group now."""
    return dist.is_initialized()


def left_a_group() -> bool:
    """Whether this process joined and left a process group (see exit_after_shutdown)."""
    return _left_group


def is_main() -> bool:
    """This process is global rank 0 (also before the group exists, from the launcher's environment)."""
    return dist.get_rank() == 0 if dist.is_initialized() else env_info().is_main


def print0(*args, **kwargs) -> None:
    """print on rank 0 only, on stderr (with the progress bar and the evaluations: one
    stream for everything a run says, so `2> log` keeps all of it)."""
    if is_main():
        kwargs.setdefault("file", sys.stderr)
        print(*args, **kwargs, flush=True)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place and returned (identity for one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def any_rank(*flags: bool) -> tuple[bool, ...]:
    """Each flag OR-ed over all ranks, the same answer everywhere (one small collective)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return tuple(flags)
    tensor = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_control_group)
    return tuple(bool(v) for v in tensor.tolist())


def all_gather_objects(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `value` (small and picklable), in rank order, on every rank; over `group`
    (a gloo one), else the control group (just this one for one process)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    group = group or _control_group
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def all_gather_value(value: float, device: torch.device) -> list[float]:
    """Every rank's `value`, in rank order (just this one for one process)."""
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return mine.tolist()
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [t.item() for t in gathered]


def broadcast_object(value: Any, src: int = 0) -> Any:
    """Rank `src`'s (picklable) `value` on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src, group=_control_group)
    return box[0]


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Maximum over ranks, in place and returned (identity for one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def launcher_run_id() -> str | None:
    """An id shared by every process of one job that an outer launcher started (the same
    on every node, different for two jobs running at once: they cannot share a master
    port); None for a single process, which shares nothing."""
    if outer_launcher() is None or env_info().world_size == 1:
        return None
    import hashlib

    parts = "|".join(
        os.environ.get(k, "") for k in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")
    )
    return f"launcher-{hashlib.sha256(parts.encode()).hexdigest()[:12]}"
