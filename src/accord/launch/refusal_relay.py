"""Every node says why a multi-node run was refused, also when only rank 0 could see why.

Under torchrun or accelerate launch on several nodes each worker checks the run itself; a
problem that only rank 0 sees (its output.dir holds a run, ...) ends rank 0 with accord's
line, and the other nodes' workers would die in the process-group set-up with a network
traceback once node 0's launcher is gone. So rank 0 puts its message into the launcher's
store (the elastic agent's TCPStore at MASTER_ADDR:MASTER_PORT) and waits a moment for the
other nodes to read it; each other node's local rank 0 watches for it from the start of
the run until the process group is up, prints the same line and ends its node's workers.
"""

from __future__ import annotations

import os
import sys
import threading
from datetime import timedelta

from accord.distributed import rank_env

KEY, SEEN = "accord/refusal", "accord/refusal/seen"
WAIT_FOR_NODES_S = 15.0  # how long rank 0 waits for the other nodes to read its refusal
POLL_S = 0.5

_watch: threading.Event | None = None
_said = threading.Lock()  # held by whichever prints this process's refusal first


def claim() -> bool:
    """Whether this thread is the first to print why this process stops (the watcher and a
    refusal of this node's own could otherwise both print it)."""
    return _said.acquire(blocking=False)


def forget_claim() -> None:
    """For tests that run the command's main() in their own process, one refusal after
    another: each call may print its refusal again."""
    if _said.locked():
        _said.release()


def _agent_store_nodes() -> int:
    """Nodes in this job when an elastic agent's store is there to share messages (else 0)."""
    info = rank_env.env_info()
    if (
        rank_env.outer_launcher() is None
        or not info.multi_node
        or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    ):
        return 0
    return info.world_size // info.local_world_size


def _store(timeout_s: float):
    from torch.distributed import TCPStore

    return TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=timeout_s)
    )


def publish(message: str) -> None:
    """Rank 0 refusing the run: leave `message` for the other nodes and give them a moment
    to print it (best effort: a store that cannot be reached changes nothing)."""
    import time

    nodes = _agent_store_nodes()
    if nodes < 2 or not rank_env.leads():
        return
    try:
        store = _store(5.0)
        store.set(KEY, message)
        deadline = time.monotonic() + WAIT_FOR_NODES_S
        while store.add(SEEN, 0) < nodes - 1 and time.monotonic() < deadline:
            time.sleep(POLL_S / 2)
    except Exception:  # noqa: BLE001 - the message was printed here already; the rest is courtesy
        pass


def watch() -> None:
    """On another node's local rank 0: print rank 0's refusal and end this worker, until
    stop_watching() (the process group is up: later failures are agreed collectively)."""
    global _watch
    info = rank_env.env_info()
    if _watch is not None or _agent_store_nodes() < 2 or info.node == 0 or not info.leads_node:
        return
    _watch = threading.Event()
    threading.Thread(target=_watching, args=(_watch,), name="accord-refusal-watch", daemon=True).start()


def _watching(stop: threading.Event) -> None:
    try:
        store = _store(30.0)
        while not stop.wait(POLL_S):
            if store.check([KEY]) and claim():
                message = store.get(KEY).decode()
                for line in message.splitlines():
                    print(f"accord: error: {line}", file=sys.stderr, flush=True)
                store.add(SEEN, 1)
                os._exit(2)
    except Exception:  # noqa: BLE001 - node 0 gone before saying why: the launcher reports it
        return


def stop_watching() -> None:
    if _watch is not None:
        _watch.set()
