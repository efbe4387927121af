"""Host memory that a run frees goes back to the OS at once (engine.release_host_memory).

glibc's malloc serves a large block from its heap once a block of that size has been freed
(its mmap threshold rises to the freed size, up to 32 MiB), and a heap gives memory back
only from its top: FSDP and ZeRO-3 gather and free every layer's parameters, gradients and
activations each step, and on a CPU run the freed blocks stay resident between the live
ones. A fixed threshold (what MALLOC_MMAP_THRESHOLD_ sets) serves every block of at least
RELEASED_BLOCK_BYTES from its own mapping, unmapped when freed: a rank's resident memory
follows its live tensors, for the page faults of mapping each block again (about a third more
CPU time on a CPU run; docs/memory-and-plan.md). A GPU's memory is torch's caching allocator's,
not affected.
"""

from __future__ import annotations

from accord.compat.libc import M_MMAP_THRESHOLD, mallopt

RELEASED_BLOCK_BYTES = 1 << 20  # blocks from 1 MiB up: tensors, not the interpreter's small objects


def release_freed_memory() -> bool:
    """From now on, blocks of RELEASED_BLOCK_BYTES or more are returned when freed. False
    where the C library is not glibc (nothing changed)."""
    return mallopt(M_MMAP_THRESHOLD, RELEASED_BLOCK_BYTES)
