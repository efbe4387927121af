"""One run per output folder: an exclusive lock file in output.dir.

The lock file holds the holder's host, pid, start time and run id. Every node of one run
shares the run id, so the nodes of a run writing into a shared folder join the lock
instead of refusing each other; a different run is refused with one line naming the holder.

Created with O_CREAT|O_EXCL, so two starters cannot both create it; the holder writes
its line right after, and a reader that finds the file still empty or half-written reads
it again a moment later. A lock whose holder is dead is stale:
- on the same host, its pid is gone (or now belongs to a process started later);
- on another host the pid cannot be checked, so the holder refreshes the file's mtime
  every HEARTBEAT_S seconds and a lock not refreshed for STALE_AFTER_S is stale (this
  compares the file system's mtime with this host's clock: clocks must agree to well
  within STALE_AFTER_S).
A stale lock is removed only while holding flock on it and only if it still holds the
same bytes, so of two starters that both find it stale exactly one creates the new lock
and the other then finds that live lock and is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from accord.errors import UserInputError
from accord.output.procstat import process_stat

LOCK_FILE = ".accord.lock"
HEARTBEAT_S = 30.0
# Ten missed heartbeats: a holder on another host is presumed dead after this long.
STALE_AFTER_S = 300.0


class OutputLocked(UserInputError):
    """output.dir is in use by another run."""


@dataclass(frozen=True)
class LockInfo:
    host: str
    pid: int
    started: float  # time.time() when the holder took the lock
    run_id: str
    pid_start: str  # the holder's start time in /proc (guards against a reused pid); "" when unknown

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"host {self.host}, pid {self.pid}, started {when}"


class RunLock:
    """A held (owner) or joined lock; `release` removes it if this process created it."""

    def __init__(self, path: Path, info: LockInfo, owner: bool):
        self.path, self.info, self.owner = path, info, owner
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if owner:
            self._beat = threading.Thread(target=self._heartbeat, name="accord-lock-heartbeat", daemon=True)
            self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        if self.owner and _read(self.path) == self.info:  # never remove a lock another run took over
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self.owner = False

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_problem(out_dir: Path, run_id: str) -> str | None:
    """The line that refuses this run if a live lock of another run holds out_dir now (a
    check before any work; `acquire` decides for good)."""
    holder = _read(out_dir / LOCK_FILE)
    if holder is None or holder.run_id == run_id or stale_reason(holder, out_dir / LOCK_FILE):
        return None
    return _refusal(out_dir, holder)


def acquire(out_dir: Path, run_id: str) -> RunLock:
    """Take (or, for a node of the same run, join) the lock on out_dir, creating the folder;
    raises OutputLocked naming the holder when another live run has it."""
    from accord.observe.progress import announce

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_FILE
    mine = LockInfo(socket.gethostname(), os.getpid(), time.time(), run_id, _process_start(os.getpid()))
    for _ in range(20):
        if _create(path, mine):
            return RunLock(path, mine, owner=True)
        raw, holder = _written(path)
        if raw is None:
            continue  # removed meanwhile: try again
        if holder is None:
            raise OutputLocked(f"output.dir: {path} is not a lock accord can read; if no run uses {out_dir}, delete it")
        reason = stale_reason(holder, path)
        if reason is None:
            if holder.run_id == run_id:
                return RunLock(path, mine, owner=False)  # another node of this run
            raise OutputLocked(_refusal(out_dir, holder))
        if _remove_if_unchanged(path, raw):
            announce(f"taking over the lock of a run that is gone ({holder.describe()}: {reason})")
    raise OutputLocked(
        f"output.dir: could not take the lock {path} (it keeps changing); is another run starting there?"
    )


def stale_reason(holder: LockInfo, path: Path) -> str | None:
    """Why the holder is presumed dead, or None while it may be alive."""
    if holder.host == socket.gethostname():
        try:
            os.kill(holder.pid, 0)
        except ProcessLookupError:
            return f"process {holder.pid} no longer exists"
        except PermissionError:
            pass  # alive, another user's
        state, started = process_stat(holder.pid)
        if state == "Z":
            return f"process {holder.pid} has exited"  # killed, its parent has not collected it yet
        if holder.pid_start and started and started != holder.pid_start:
            return f"pid {holder.pid} now belongs to another process"
        return None
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return "the lock was removed"
    return f"no heartbeat for {age:.0f} s" if age > STALE_AFTER_S else None


def new_run_id() -> str:
    return f"accord-{uuid.uuid4().hex[:12]}"


def _refusal(out_dir: Path, holder: LockInfo) -> str:
    return (
        f"output.dir: {out_dir} is in use by another run ({holder.describe()}); wait for it to finish, "
        f"or choose another output.dir=..."
    )


def _create(path: Path, info: LockInfo) -> bool:
    """Create the lock holding `info`; False if a lock exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(asdict(info)) + "\n")
    return True


def _written(path: Path, wait_s: float = 2.0) -> tuple[bytes | None, LockInfo | None]:
    """The lock's bytes and holder, waiting up to `wait_s` for a lock just created to get its
    line (holder None: a file that stays unreadable; bytes None: no lock any more)."""
    deadline = time.monotonic() + wait_s
    while True:
        raw = _read_bytes(path)
        holder = _parse(raw)
        if raw is None or holder is not None or time.monotonic() > deadline:
            return raw, holder
        time.sleep(0.05)


def _remove_if_unchanged(path: Path, raw: bytes) -> bool:
    """Remove the lock if it still holds `raw`. Starters that found the same stale lock
    serialise here on flock of that file: the first removes it; the others then read the
    new lock (or none) and leave it alone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        with contextlib.suppress(OSError):  # a file system without flock: the content check still holds
            fcntl.flock(fd, fcntl.LOCK_EX)
        if _read_bytes(path) != raw:
            return False
        path.unlink()
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)  # releases the flock


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # no lock, or output.dir is a file (preflight says so)
        return None


def _parse(raw: bytes | None) -> LockInfo | None:
    if raw is None:
        return None
    try:
        return LockInfo(**json.loads(raw))
    except (ValueError, TypeError):
        return None


def _read(path: Path) -> LockInfo | None:
    return _parse(_read_bytes(path))


def _process_start(pid: int) -> str:
    return process_stat(pid)[1]
