"""glibc settings under which ZeroMQ's large received messages reuse warm memory.

ZeroMQ allocates every received message with ``malloc``, on its I/O thread; the receiver copies
it out and frees it. With glibc's defaults a freed block of a MiB or more goes back to the kernel
(an ``munmap``, or a heap trimmed with ``madvise``), so the next message lands in fresh pages
and pays a page fault per 4 KiB, which slows a stream of 1 MiB frames (see docs/benchmarks.md).
`keep_freed_memory` raises those thresholds for this process: blocks up to 32 MiB come
from malloc's heaps and stay there once freed, so the next message reuses them. The cost is
memory kept by the process: at most what was in flight at once (chunks in flight x chunk size
per peer link), which stays mapped for reuse.

Process-wide and called once, at start: the daemon (`kvsidecar.daemon.server`) and the raw
baseline of ``kvsidecar bench peer``, so that the benchmark compares like with like.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("kvsidecar.wire")

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size come from malloc's heaps (glibc accepts at most 32 MiB here)."""
TRIM_THRESHOLD = 1 << 30
"""Free memory at the top of a heap kept rather than given back to the kernel."""
TOP_PAD = 64 << 20
"""Extra memory taken whenever a heap grows, so that growing is rare."""

_state = {"done": False}


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where glibc is absent.

    Idempotent. Settings from the environment (``MALLOC_MMAP_THRESHOLD_`` and the like) are
    overridden: call it only where large ZeroMQ messages matter.
    """
    if _state["done"]:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all(
        mallopt(param, value)
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (_M_TOP_PAD, TOP_PAD),
        )
    )
    if not ok:
        log.info("mallopt refused a setting: large ZeroMQ messages use fresh pages")
    _state["done"] = ok
    return ok
