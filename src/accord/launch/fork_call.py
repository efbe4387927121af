"""Run a function in a forked child and take its result back, so what the function
imports and allocates leaves with the child. The launcher checks a recipe this way before
it starts its workers: those checks import transformers and datasets (much of a process's memory), which
the launcher itself never needs again while it watches the workers for hours."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from typing import Any

from accord.errors import RunStopped


def call_in_fork(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in a forked child: its return value, or its exception re-raised
    here. Runs in this process where fork does not exist. Only for a process that has
    started no threads of its own (fork copies the calling thread only)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return fn(*args, **kwargs)
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, fn, args, kwargs), name="accord-checks")
    child.start()
    send.close()  # the child holds the only writer: its exit ends the read below
    try:
        payload = receive.recv_bytes()
    except EOFError:
        payload = None
    finally:
        receive.close()
        child.join()
    if payload is None:
        raise RunStopped(
            f"the checks before start died ({_describe(child.exitcode)}); run again, or report it with the recipe"
        )
    return unpack_outcome(payload)


def _child(send, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    code = 0
    try:
        send.send_bytes(packed_outcome(fn, *args, where="the forked child", **kwargs))
    except BaseException:  # noqa: BLE001 - nothing sent: the parent reports the exit code
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


def _describe(exitcode: int | None) -> str:
    # multiprocessing gives a child killed by a signal a negative exit code.
    return f"signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exit code {exitcode}"
