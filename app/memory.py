"""Give memory back to the operating system after big requests, and after running out of it.

glibc's malloc raises its mmap threshold as large blocks are freed, up to 32 MiB, after which decoded
images (Pillow allocates them in 16 MiB blocks) come from the heap and stay with the process once freed:
a server that once decoded a batch of big images kept ~2 GB. A fixed threshold keeps every block of
1 MiB or more in its own mapping, unmapped when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger("dmlsearch.app")

_M_MMAP_THRESHOLD = -3  # mallopt parameter numbers from glibc's malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    # musl and other C libraries have neither function: then nothing is tuned (and nothing breaks).
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


def return_freed_blocks() -> None:
    """Serve large allocations from their own mappings, so that freeing one returns it (glibc only)."""
    if _LIBC is not None and not _LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        log.warning("mallopt(M_MMAP_THRESHOLD) failed: freed image memory may stay with the process")


def release_memory() -> None:
    """Collect garbage and hand free heap pages back to the operating system (after a MemoryError)."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
