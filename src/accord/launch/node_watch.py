"""The hang watchdog where an outer launcher started the workers (torchrun, accelerate launch,
deepspeed, Ray Train): each node's local rank 0 starts a small watcher process that runs
accord.launch.watchdog's Watchdog over the node's ranks, as accord's own launcher does in its
process (srun runs accord's launcher, one per node, which watches its workers itself).

A process, not a thread in local rank 0: a stopped or frozen rank runs none of its threads
(see accord.launch.watchdog). The node's ranks find the watcher's folder without talking to
each other (their heartbeat starts before the process group exists): it is named by what they
share -- the launcher's job (launcher_run_id), the process that started them all (torchrun's
or accelerate's agent, deepspeed's launch.py, Ray's raylet), the worker group's restart and
the user.

The watcher lives as long as local rank 0's end of a pipe, its stdin: local rank 0 closes it
once it has left the process group (however the run ended), and the operating system closes
it when that process dies (killed by the watcher after a hang, or by the launcher); the
watcher then stops watching, removes its folder and exits. It ignores the stop signals meant
for the workers and runs in a session of its own, so a launcher signalling its workers'
process groups cannot end it half-way through a dump.

    python -m accord.launch.node_watch TIMEOUT_S NPROC RESTART OUT_DIR FOLDER
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from accord.observe import heartbeat

if TYPE_CHECKING:
    from accord.distributed.rank_env import DistInfo

CLOSE_WAIT_S = 30.0  # the watcher leaves within a poll of its pipe closing; only a stuck one is killed
# What the workers are told to stop with (the watcher must outlive their shutdown): SIGHUP and
# SIGINT come from a terminal, SIGTERM and SIGUSR1 from a scheduler.
_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


class NodeWatch:
    """One worker's part in its node's watcher: the environment that points its heartbeat and
    stack dumps at the watcher's folder, and on local rank 0 the watcher process itself."""

    def __init__(self, folder: Path, added_env: list[str], process: subprocess.Popen | None) -> None:
        self.folder, self.added_env, self.process = folder, added_env, process

    def close(self) -> None:
        """After the process group is left: the watcher (local rank 0's) ends; the environment
        is as before."""
        if self.process is not None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=CLOSE_WAIT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
        for name in self.added_env:
            os.environ.pop(name, None)
        self.added_env = []


def watch_node(
    timeout_s: float | None, info: DistInfo, restart: int, out_dir: str | Path, nccl: bool
) -> NodeWatch | None:
    """Before heartbeat.start, in every worker an outer launcher started: the node's watcher
    (started by local rank 0) and its folder for this worker's progress and stacks. None when
    the watchdog is off, for a single process (no peer to hang on), or under accord's launcher
    (whose watchdog set the folder already)."""
    if timeout_s is None or info.world_size == 1 or heartbeat.DUMP_DIR_ENV in os.environ:
        return None
    folder = node_folder(restart)
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.stat().st_uid != os.getuid():  # a name in a shared /tmp that someone else took
        print(f"accord: warning: hang watchdog off: {folder} belongs to another user", file=sys.stderr, flush=True)
        return None
    before = set(os.environ)
    os.environ[heartbeat.DUMP_DIR_ENV] = str(folder)
    if nccl:
        heartbeat.enable_flight_recorder(folder, pipe=True)
    added = sorted(set(os.environ) - before)
    process = None
    if info.leads_node:
        command = [sys.executable, "-m", __name__, f"{timeout_s:g}", str(info.local_world_size), str(restart)]
        command += [str(Path(out_dir).resolve()), str(folder)]
        process = subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True)
    return NodeWatch(folder, added, process)


def node_folder(restart: int) -> Path:
    """The folder every local rank of this worker group names alike (see the module's docstring)."""
    from accord.distributed.group import launcher_run_id

    key = f"{launcher_run_id()}|{os.getppid()}|{restart}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"accord-watch-{os.getuid()}-{digest}"


def main(argv: list[str]) -> int:
    from accord.launch.watchdog import Watchdog

    timeout_s, nproc, restart, out_dir, folder = argv
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    group = int(restart)
    dog = Watchdog(float(timeout_s), int(nproc), group, Path(out_dir), Path(folder), restart=group)
    dog.start()
    try:
        sys.stdin.buffer.read()  # until local rank 0 closes its end or dies
    finally:
        dog.close()
        shutil.rmtree(folder, ignore_errors=True)
    if dog.verdicts:
        print(
            "accord: error: the run hung and this node's workers were stopped; the launcher that started them "
            "sees them fail (and restarts them, if it has restarts left); --resume continues from the latest "
            "checkpoint, if one was written",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
