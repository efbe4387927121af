"""C library calls through ctypes: glibc's mallopt (launch.host_memory) and Linux's madvise
(data.mapped_pages). Both are optional levers: where the C library lacks the call (not
glibc, not Linux), the functions say so and accord runs without the lever.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

WRITTEN_FOR = "glibc 2.x (mallopt), Linux (madvise)"

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MADV_DONTNEED = 4  # Linux's mman.h


def mallopt(param: int, value: int) -> bool:
    """glibc's mallopt(param, value); False where the C library has none (nothing changed)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        call = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    call.argtypes, call.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return call(param, value) == 1


def madvise_dontneed() -> Callable[[int, int], bool] | None:
    """A function (start, length) -> bool that drops this process's resident pages of the
    mapping [start, start + length) (Linux's madvise MADV_DONTNEED); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def release(start: int, length: int) -> bool:
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_DONTNEED) == 0

    return release
