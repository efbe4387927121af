"""The hang watchdog, in accord's launcher: it notices when no local rank made progress for
engine.hang_timeout_s, names the stuck rank(s), dumps every rank's stacks into
output.dir/hang-<time>/ and stops the workers (the elastic agent then restarts them under
engine.max_restarts, or the run ends with exit 1).

Why in the launcher and not a thread in each rank: a SIGSTOPped or frozen process runs none of
its threads, and a rank blocked in a collective cannot tell whether it or a peer is the stuck
one. The launcher reads every local rank's progress file (accord.observe.heartbeat), which stays
readable whatever state the rank is in, and can signal the processes.

Progress is any rank entering a phase or ticking inside one: while rank 0 writes a checkpoint
or evaluates, the others wait in a collective and report nothing, and that is not a hang.
Each node's launcher watches its own ranks: a rank stuck on another node shows here as all
local ranks waiting in the same phase, and that node's launcher names it. Where an outer
launcher (torchrun, accelerate launch, deepspeed, Ray) started the workers, a watcher process
that each node's local rank 0 starts runs the same Watchdog (accord.launch.node_watch).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from accord.errors import RunStopped
from accord.observe import heartbeat
from accord.output.procstat import STOPPED, process_stat

POLL_S = 0.25
LAUNCHER_PAUSE_S = 5.0  # a poll this late means the launcher itself was not running
DUMP_WAIT_S = 5.0  # for each rank's faulthandler output (and NCCL's trace) to be written


class HangDetected(RunStopped):
    """The watchdog stopped a run that made no progress (and no restart was left)."""


@dataclass
class StallClock:
    """How long the local ranks have gone without progress, on the launcher's clock."""

    nproc: int
    timeout_s: float
    records: dict[int, dict] = field(default_factory=dict)  # per rank: its last progress record
    changed_at: dict[int, float] = field(default_factory=dict)
    stopped_since: dict[int, float] = field(default_factory=dict)  # ranks whose process is stopped
    seen_at: float | None = None

    def update(self, records: dict[int, dict], stopped: set[int], now: float) -> None:
        if self.seen_at is not None and now - self.seen_at > LAUNCHER_PAUSE_S:
            # The launcher itself did not run (SLURM suspends a whole job with SIGSTOP, then
            # continues it): that time is nobody's stall.
            gap = now - self.seen_at
            self.changed_at = {rank: t + gap for rank, t in self.changed_at.items()}
            self.stopped_since = {rank: t + gap for rank, t in self.stopped_since.items()}
        self.seen_at = now
        for rank, record in records.items():
            if self.records.get(rank) != record:
                self.records[rank], self.changed_at[rank] = record, now
        self.stopped_since = {rank: self.stopped_since.get(rank, now) for rank in stopped}

    def stalled_for(self, now: float) -> float:
        """Seconds without progress. A stopped process counts from the moment it was seen stopped,
        in any phase. Otherwise only the training loop is watched, from the moment every rank entered
        it (loading can be long and silent) until one left it (export and shutdown are not watched);
        there progress is any rank entering a phase or ticking inside one."""
        stopped = max((now - t for t in self.stopped_since.values()), default=0.0)
        records = self.records.values()
        in_loop = len(self.records) == self.nproc and all(r["seq"] > 0 and r["op"] != heartbeat.DONE for r in records)
        return max(stopped, now - max(self.changed_at.values()) if in_loop else 0.0)

    def stalled(self, now: float) -> bool:
        return self.stalled_for(now) >= self.timeout_s


def diagnose(records: list[dict], stopped: set[int]) -> tuple[list[dict], str]:
    """The ranks to blame among `records` and why: the stopped processes (pids in `stopped`);
    else the ranks behind the others in the phase sequence every rank goes through; else all
    of them, waiting in the same phase."""
    culprits = [r for r in records if r["pid"] in stopped]
    if culprits:
        return culprits, "stopped by a signal (SIGSTOP)"
    lowest = min(r["seq"] for r in records)
    if any(r["seq"] != lowest for r in records):
        return [r for r in records if r["seq"] == lowest], "behind the other ranks"
    return (
        records,
        "all waiting in the same phase (a collective that does not complete: the network, or a rank on another node)",
    )


def describe(culprits: list[dict], why: str, records: list[dict], stalled_s: float, folder: Path) -> str:
    """The one line that names the stuck rank(s)."""
    named = ", ".join(f"rank {r['rank']} (host {r['host']}, pid {r['pid']})" for r in culprits)
    where = "; ".join(f'rank {r["rank"]} in "{r["op"]}" of step {r["step"]}' for r in records)
    return f"hang: no rank progressed for {stalled_s:.0f} s; stuck: {named}, {why}; {where}; stacks in {folder}/"


class Watchdog(threading.Thread):
    def __init__(
        self, timeout_s: float, nproc: int, max_restarts: int, out_dir: Path, dump_dir: Path, restart: int = 0
    ):
        super().__init__(name="accord-watchdog", daemon=True)
        self.timeout_s, self.nproc, self.max_restarts = timeout_s, nproc, max_restarts
        self.out_dir, self.dump_dir = out_dir, dump_dir
        # The worker group being watched (TORCHELASTIC_RESTART_COUNT), up to max_restarts.
        self.restart = restart
        self.clock = StallClock(nproc, timeout_s)
        self.verdicts: dict[int, str] = {}  # per worker group: the line printed when it hung
        self._closing = threading.Event()

    def run(self) -> None:
        while not self._closing.wait(POLL_S):
            try:
                self._poll()
            except Exception as e:  # a watchdog that crashes must not take the run with it
                print(f"accord: warning: hang watchdog stopped: {e}", file=sys.stderr, flush=True)
                return

    def _poll(self) -> None:
        newer = self._newest_group()
        if newer != self.restart:
            self.restart, self.clock = newer, StallClock(self.nproc, self.timeout_s)
        if self.restart in self.verdicts:
            return  # this group was stopped; wait for the next one
        records = self._records(self.restart)
        stopped = {rank for rank, r in records.items() if process_stat(r["pid"])[0] in STOPPED}
        now = time.monotonic()
        self.clock.update(records, stopped, now)
        if self.clock.stalled(now):
            self._fire(self.clock.stalled_for(now), stopped)

    def _newest_group(self) -> int:
        for restart in range(self.max_restarts, self.restart, -1):
            if heartbeat.progress_files(self.dump_dir, restart):
                return restart
        return self.restart

    def _records(self, restart: int) -> dict[int, dict]:
        records = (heartbeat.read_progress(path) for path in heartbeat.progress_files(self.dump_dir, restart))
        return {r["rank"]: r for r in records if r is not None}

    def _fire(self, stalled_s: float, stopped_ranks: set[int]) -> None:
        records = sorted(self.clock.records.values(), key=lambda r: r["rank"])
        stopped = {r["pid"] for r in records if r["rank"] in stopped_ranks}
        culprits, why = diagnose(records, stopped)
        folder = self.out_dir / f"hang-{time.strftime('%Y%m%d-%H%M%S')}"
        line = describe(culprits, why, records, stalled_s, folder)
        self.verdicts[self.restart] = line
        # On a line of its own: rank 0's progress bar may be mid-line on the same terminal.
        print(f"\naccord: {line}", file=sys.stderr, flush=True)
        summary = {
            "kind": "hang",
            "step": max(r["step"] for r in records),
            "time": time.time(),
            "stalled_s": round(stalled_s, 1),
            "stuck": [r["rank"] for r in culprits],
            "why": why,
            "folder": str(folder),
            "ranks": [{**r, "state": "stopped" if r["pid"] in stopped else "waiting"} for r in records],
        }
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._dump(records, stopped, folder)
            (folder / "hang.json").write_text(json.dumps(summary, indent=1) + "\n")
            _append_line(self.out_dir / "metrics.jsonl", json.dumps(summary))
        finally:  # whatever could not be written: the agent sees the group fail (a restart, or the end)
            for record in records:
                _signal(record["pid"], signal.SIGKILL)

    def _dump(self, records: list[dict], stopped: set[int], folder: Path) -> None:
        """Every rank's Python stacks (faulthandler, on DUMP_SIGNAL) and on NCCL the flight
        recorder's trace. The running ranks dump first and are then stopped themselves; a
        stopped rank is then continued, and dumps where it was the moment it runs, but cannot
        get past its next collective with its peers stopped: the run does not move on."""
        stacks = {r["rank"]: heartbeat.stacks_file(self.dump_dir, self.restart, r["rank"]) for r in records}
        running = [r for r in records if r["pid"] not in stopped]
        frozen = [r for r in records if r["pid"] in stopped]
        self._ask_dump(running)
        _wait_written([stacks[r["rank"]] for r in running])
        for record in running:
            _signal(record["pid"], signal.SIGSTOP)
        self._ask_dump(frozen)
        for record in frozen:
            _signal(record["pid"], signal.SIGCONT)  # it takes the pending dump signal as it resumes
        _wait_written([stacks[r["rank"]] for r in frozen])
        for rank, source in stacks.items():
            text = source.read_text() if source.is_file() else ""
            (folder / f"stacks-rank-{rank:05d}.txt").write_text(
                text or f"rank {rank} wrote no stacks within {DUMP_WAIT_S:g} s\n"
            )
        for trace in self.dump_dir.glob("nccl-trace-rank-*"):
            shutil.copy(trace, folder / trace.name)

    def _ask_dump(self, records: list[dict]) -> None:
        for record in records:
            _signal(record["pid"], heartbeat.DUMP_SIGNAL)
            _poke_pipe(self.dump_dir / f"nccl-pipe-rank-{record['rank']}.pipe")

    def close(self) -> None:
        self._closing.set()
        self.join()


@contextmanager
def watch_for_hangs(
    timeout_s: float | None, nproc: int, max_restarts: int, out_dir: str | Path, nccl: bool
) -> Iterator[Watchdog | None]:
    """A watchdog over the local workers started inside the block (None when turned off); they
    find its folder (progress files, stack dumps) through the environment."""
    if timeout_s is None:
        yield None
        return
    dump_dir = Path(tempfile.mkdtemp(prefix="accord-watchdog-"))
    before = dict(os.environ)
    os.environ[heartbeat.DUMP_DIR_ENV] = str(dump_dir)
    if nccl:
        heartbeat.enable_flight_recorder(dump_dir, pipe=True)
    dog = Watchdog(timeout_s, nproc, max_restarts, Path(out_dir), dump_dir)
    dog.start()
    try:
        yield dog
    finally:
        dog.close()
        for name in set(os.environ) - set(before):
            del os.environ[name]
        shutil.rmtree(dump_dir, ignore_errors=True)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _poke_pipe(path: Path) -> None:
    """NCCL's flight recorder dumps when its rank's pipe is written to (TORCH_NCCL_DEBUG_INFO_PIPE_FILE)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no pipe (gloo), or nobody reading it
        return
    try:
        os.write(fd, b"1\n")
    finally:
        os.close(fd)


def _wait_written(files: list[Path]) -> None:
    """Until every file has content that stopped growing, or DUMP_WAIT_S."""
    deadline, sizes = time.monotonic() + DUMP_WAIT_S, None
    while time.monotonic() < deadline:
        now = [f.stat().st_size if f.is_file() else 0 for f in files]
        if all(now) and now == sizes:
            return
        sizes = now
        time.sleep(0.2)


def _append_line(path: Path, line: str) -> None:
    """One write with O_APPEND: rank 0 appends to the same file."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
