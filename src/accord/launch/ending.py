"""How the `accord` process ends once it trained: the launcher whose workers ended, or a process
that trained as the worker itself (one process, or under torchrun, accelerate launch, srun ...).

Such a process skips the interpreter's teardown: its lock is released, its run's folder removed
and nothing is open but stdout and stderr, while tearing down torch's modules and C++ objects
(a process group referenced by a model, DeviceMesh or DTensor; gloo's threads) costs seconds on
a busy machine and can abort a run that succeeded (see accord.distributed.group.exit_after_shutdown).
The launch marks it where it happens; the command reads the mark. Imports no torch: every command
reads it on its way out.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

_trained = False


def trained() -> None:
    """This process ran training: its workers ended, or it trained as a worker and left its group."""
    global _trained
    _trained = True


def skips_teardown() -> bool:
    """Whether this process ends without the interpreter's teardown (it trained)."""
    return _trained


def exit_now(code: int) -> NoReturn:
    """Leave with `code`, the output flushed, without the interpreter's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
