"""A local process's state and start time, from /proc/PID/stat (Linux; empty elsewhere).

The run lock tells a dead or reused pid from its holder by the start time; the hang watchdog
tells a stopped (SIGSTOP) worker by its state letter.
"""

from __future__ import annotations

from pathlib import Path

STOPPED = ("T", "t")  # stopped by a signal; stopped by a tracer


def process_stat(pid: int) -> tuple[str, str]:
    """The state letter and the start time in clock ticks since boot (fields 3 and 22);
    empty strings when the process is gone or /proc is not there."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return "", ""
    return fields[0], fields[19]
