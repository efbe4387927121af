"""Run a function in a forked child and take its result back, so what the function
imports and allocates leaves with the child. The launcher checks a recipe this way before
it starts its workers: those checks import transformers and datasets (~170 MB), which the
launcher itself never needs again while it watches the workers for hours."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

from accord.errors import RunStopped


def call_in_fork(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in a forked child: its return value, or its exception re-raised
    here. Runs in this process where fork does not exist. Only for a process that has
    started no threads of its own (fork copies the calling thread only)."""
    return start_in_fork(fn, *args, **kwargs).result()


class Forked:
    """A call running in a forked child; `result()` waits for it (from any thread)."""

    def __init__(self, pid: int, read_end: int) -> None:
        self._pid, self._read_end, self._reaped = pid, read_end, False

    def result(self) -> Any:
        with os.fdopen(self._read_end, "rb") as pipe:
            payload = pipe.read()
        _, status = os.waitpid(self._pid, 0)
        self._reaped = True
        if not payload:
            raise RunStopped(
                f"the checks before start died ({_describe(status)}); run again, or report it with the recipe"
            )
        return unpack_outcome(payload)

    def cancel(self) -> None:
        """Stop the child (its result() then raises RunStopped)."""
        if not self._reaped:
            try:
                os.kill(self._pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class _Done:
    """The same interface where there is no fork: the call already ran here."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        try:
            self._outcome = ("returned", fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - re-raised by result(), as the child's would be
            self._outcome = ("raised", e)

    def result(self) -> Any:
        outcome, value = self._outcome
        if outcome == "raised":
            raise value
        return value

    def cancel(self) -> None:
        pass


def start_in_fork(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Forked | _Done:
    """Start fn(*args, **kwargs) in a forked child and return at once; the same conditions
    as call_in_fork (fork before this process starts any thread)."""
    if not hasattr(os, "fork"):
        return _Done(fn, args, kwargs)
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _child(write_end, fn, args, kwargs)  # never returns
    os.close(write_end)
    return Forked(pid, read_end)


def _child(write_end: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    code = 0
    try:
        payload = packed_outcome(fn, *args, where="the forked child", **kwargs)
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(payload)
    except BaseException:  # noqa: BLE001
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no atexit handlers or finalizers of the parent's objects in the child


def packed_outcome(fn: Callable[..., Any], *args: Any, where: str, **kwargs: Any) -> bytes:
    """fn(*args, **kwargs)'s return value or exception as bytes for another process of the same
    user (unpack_outcome there): a forked child's pipe, or a worker's report to its launcher."""
    try:
        return pickle.dumps(("returned", fn(*args, **kwargs)))
    except BaseException as e:  # noqa: BLE001 - every outcome goes back to the caller
        if hasattr(e, "add_note"):  # where it happened, for an unexpected error's traceback
            e.add_note(f"raised in {where}, at:\n" + "".join(traceback.format_tb(e.__traceback__)).rstrip())
        try:
            return pickle.dumps(("raised", e))
        except Exception:  # an exception that does not pickle: keep its message
            return pickle.dumps(("raised", RuntimeError(f"{type(e).__name__}: {e}")))


def unpack_outcome(payload: bytes) -> Any:
    """The value packed_outcome packed, or its exception raised here."""
    outcome, value = pickle.loads(payload)
    if outcome == "raised":
        raise value
    return value


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"
