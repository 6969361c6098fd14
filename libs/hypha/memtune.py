"""glibc malloc tuning for processes that move large payloads (every node; see docs/performance.md).

By default glibc serves each allocation above 128 KiB-32 MiB (its dynamic mmap
threshold) with a fresh ``mmap`` and gives freed heap tops back to the kernel
above 128 KiB, so every 1 MiB chunk, joined payload or safetensors buffer is
memory the kernel must fault in page by page. On the machines we measured, that
page faulting and zeroing, not the copying, was most of the cost of the data
path: a 1 MiB copy took 2 ms with the defaults and 0.05-0.15 ms with the heap
kept (benchmarks/transfer.py, slices.py, aggregate.py). Keeping allocations up to
32 MiB in the heap and up to 128 MiB of freed memory mapped lets the process
reuse the pages it has already touched; the price is that much idle memory kept.

An operator's own ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` always
wins: nothing is changed when either is set. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

#: mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Allocations up to this come from the heap (glibc's maximum for the threshold on 64-bit).
MMAP_THRESHOLD_BYTES = 32 << 20
#: Freed memory kept mapped for reuse before the heap is trimmed.
TRIM_THRESHOLD_BYTES = 128 << 20

_tuned: bool | None = None


def tune_malloc() -> bool:
    """Apply the thresholds once per process; True when glibc took them (idempotent)."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): nothing to tune
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _tuned = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    log.debug("malloc tuned for large payloads: %s", _tuned)
    return _tuned
