"""The C allocator of a worker process whose tensors come and go in large sizes (a long sequence's activations).

glibc serves a block of at least its mmap threshold with a mapping of its own, returned to the system when freed;
smaller blocks come from the heap, where a freed block between live ones stays in the process. The threshold
starts at 128 KiB but rises to the size of every mapped block freed (up to 32 MiB), so after the first layer a
capture's tensors (a few MiB to tens of MiB) all come from the heap, interleaved with the tensors a backward
keeps: measured on SmolLM2 at 4,096 positions, the KL-sensitivity pass held 1.48 GiB of RSS with the adaptive
threshold and 0.70 GiB with a fixed 1 MiB one, in the same time (bench/fold_memory.py).
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter; setting it also turns the adaptive threshold off
LARGE_BLOCK = 1 << 20


def release_large_frees(threshold: int = LARGE_BLOCK) -> bool:
    """Serve blocks of `threshold` bytes or more from their own mappings, returned to the system when freed, for
    the rest of this process. False where the C library has no mallopt (not glibc): nothing changes."""
    if threshold < 1:
        raise ValueError(f"mmap threshold must be >= 1 byte, got {threshold}")
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(threshold)))
    except (OSError, AttributeError):
        return False
