"""engine.release_host_memory: a freed tensor-sized block leaves the process's RSS at once."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Allocates one 8 MiB block between live ones and frees it: glibc keeps it in its heap (it
# raised its mmap threshold when the first such block was freed, and the live small block
# after it pins the heap's top), unless the threshold is fixed. Prints the RSS it kept (MiB).
_SCRIPT = """
import ctypes, ctypes.util, sys
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
if sys.argv[1] == "release":
    from accord.launch.host_memory import release_freed_memory
    assert release_freed_memory()
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
size = 8 << 20
first = libc.malloc(size); libc.memset(first, 1, size); libc.free(first)
before = rss()
block = libc.malloc(size); libc.memset(block, 1, size)
pin = libc.malloc(4096); libc.memset(pin, 1, 4096)
libc.free(block)
print((rss() - before) / 2**20)
"""


def _kept_mib(mode: str) -> float:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.subprocess
def test_release_host_memory_returns_a_freed_block_that_glibc_would_keep():
    assert _kept_mib("default") >= 7.0  # the behaviour the setting is for
    assert _kept_mib("release") < 1.0


def test_release_host_memory_is_off_by_default_and_a_bad_value_is_one_recipe_line():
    from accord.recipe.schema import RecipeError, validate_recipe
    from conftest import TINY_RECIPE

    assert validate_recipe(TINY_RECIPE).engine.release_host_memory is False
    with pytest.raises(RecipeError, match="engine.release_host_memory") as e:
        validate_recipe(TINY_RECIPE | {"engine": TINY_RECIPE["engine"] | {"release_host_memory": "sometimes"}})
    assert len(str(e.value).splitlines()) == 1
