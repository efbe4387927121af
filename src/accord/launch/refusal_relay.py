"""Every node says why a multi-node run was refused, also when only one node could see why.

On several nodes each node checks the run itself; a problem that only one node sees (rank 0's
output.dir holds a run, node 1's data file is missing, ...) ends that node with accord's line,
and the other nodes would wait in the rendezvous or the process-group set-up until torch's
timeout (10 minutes or more), or die with a network traceback. So the refusing node leaves
its message in the store where the nodes meet, and waits a moment for the others to read it;
every node watches that store from the start of the run, prints the line naming the node and
its host, and ends its part of the run.

Where the nodes meet: under torchrun or accelerate launch, the elastic agent's TCPStore at
MASTER_ADDR:MASTER_PORT (each node's local rank 0 worker publishes and watches); under accord's
own `--nnodes` launcher, the rendezvous store at --master-addr/--master-port or the
--rdzv-endpoint (each node's launcher publishes and watches; a refusing node that would host
the store hosts it for that moment, since its agent never starts).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from accord.distributed import rank_env

if TYPE_CHECKING:
    from accord.launch.cluster import Topology

# COUNT numbers the refusals; KEY/<n> holds the n-th; SEEN counts the nodes that know of one.
KEY, COUNT, SEEN = "accord/refusal", "accord/refusal/count", "accord/refusal/seen"
WAIT_FOR_NODES_S = 15.0  # how long a refusing node waits for the other nodes to read its refusal
CONNECT_S = 60.0  # how long a node looks for the store (the host node may start later)
POLL_S = 0.5
_ME = f"{socket.gethostname()}:{os.getpid()}"  # whose refusal an entry is (never acted on by its writer)


@dataclass(frozen=True)
class Meeting:
    """The store the nodes meet at, and this node's place in the run."""

    addr: str
    port: int
    nodes: int
    node: int | None  # None: numbered by the c10d rendezvous, which has not happened yet
    hosts_store: bool  # this node's agent hosts the store (so a refusal here must host it)

    def connect(self, timeout_s: float, host: bool = False):
        from torch.distributed import TCPStore

        return TCPStore(
            self.addr, self.port, is_master=host, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )


_meeting: Meeting | None = None
_launched = False  # accord's launcher started its agent: what fails from here is not a refusal
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


def meet(topology: Topology) -> None:
    """Under accord's own launcher on several nodes: where this node's launcher relays refusals."""
    global _meeting
    if rank_env.outer_launcher() is not None or not topology.multi_node:
        return
    if topology.rdzv_endpoint is not None:
        from accord.distributed.network import is_local_address

        addr, port = topology.rdzv_endpoint.rsplit(":", 1)
        _meeting = Meeting(addr, int(port), topology.nnodes, topology.node_rank, is_local_address(addr))
    else:
        addr = str(topology.master_addr)
        _meeting = Meeting(addr, topology.master_port, topology.nnodes, topology.node_rank, topology.node_rank == 0)


def launching() -> None:
    """accord's launcher starts its workers now: from here a failure is the workers' (said by them
    once the nodes met), not a refusal to relay. The watch goes on: another node may still refuse
    before it joins, and then this node's workers cannot have started."""
    global _launched
    _launched = True


def _current() -> Meeting | None:
    """Accord's launcher's meeting, else (on a node's local rank 0 under a multi-node outer
    launcher) the elastic agent's store, else None: nothing to relay."""
    if _meeting is not None:
        return _meeting
    info = rank_env.env_info()
    if (
        rank_env.outer_launcher() is None
        or not info.multi_node
        or not info.leads_node
        or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    ):
        return None
    nodes = info.world_size // info.local_world_size
    return Meeting(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), nodes, info.node, hosts_store=False)


def publish(message: str) -> None:
    """This node refusing the run: leave `message` for the other nodes and give them a moment
    to print it (best effort: a store that cannot be reached changes nothing)."""
    meeting = _current()
    if meeting is None or (meeting is _meeting and _launched):
        return
    try:
        store = (_host_store(meeting) if meeting.hosts_store else None) or meeting.connect(CONNECT_S)
        entry = {"from": _ME, "node": meeting.node, "host": socket.gethostname(), "message": message}
        key = f"{KEY}/{store.add(COUNT, 1)}"
        store.set(key, json.dumps(entry))
        store.add(SEEN, 1)
        deadline = time.monotonic() + WAIT_FOR_NODES_S
        while store.add(SEEN, 0) < meeting.nodes and time.monotonic() < deadline:
            time.sleep(POLL_S / 2)
        store.set(f"{key}/done", "")  # the readers may go now (one of them may take the store with it)
    except Exception:  # noqa: BLE001 - the message was printed here already; the rest is courtesy
        pass


def _host_store(meeting: Meeting):
    """The store this node's agent would have hosted, or None when the port is taken (it is up)."""
    try:
        return meeting.connect(WAIT_FOR_NODES_S, host=True)
    except Exception:  # noqa: BLE001 - another process serves the port: connect to it instead
        return None


def watch(then: Callable[[], None] | None = None) -> None:
    """Print another node's refusal and end this process (after `then`, e.g. releasing the
    output folder), until stop_watching(): once the process group is up, later failures are
    agreed collectively."""
    global _watch
    meeting = _current()
    if _watch is not None or meeting is None:
        return
    _watch = threading.Event()
    threading.Thread(target=_watching, args=(_watch, meeting, then), name="accord-refusal-watch", daemon=True).start()


def _watching(stop: threading.Event, meeting: Meeting, then: Callable[[], None] | None) -> None:
    try:
        store = meeting.connect(CONNECT_S)
        while not stop.wait(POLL_S):
            for index in range(1, store.add(COUNT, 0) + 1):
                key = f"{KEY}/{index}"
                if not store.check([key]):
                    continue  # counted, not written yet
                entry = json.loads(store.get(key))
                if entry["from"] != _ME and claim():
                    _say(entry)
                    store.add(SEEN, 1)
                    _wait_quietly(store, f"{key}/done")
                    if then is not None:
                        then()
                    os._exit(2)
    except Exception:  # noqa: BLE001 - the refusing node gone before saying why: the launcher reports it
        return


def _wait_quietly(store, key: str) -> None:
    """Until the refusing node stopped asking the store (this node's exit may take the store
    with it, and a request cut off mid-way is a network error printed on that node)."""
    try:
        store.wait([key], timedelta(seconds=WAIT_FOR_NODES_S + 5))
    except Exception:  # noqa: BLE001 - the refusing node is gone: nothing left to wait for
        pass


def _say(entry: dict) -> None:
    who = f"node {entry['node']} ({entry['host']})" if entry["node"] is not None else f"the node on {entry['host']}"
    for line in entry["message"].splitlines():
        print(f"accord: error: {who} refused the run: {line}", file=sys.stderr, flush=True)


def stop_watching() -> None:
    if _watch is not None:
        _watch.set()
