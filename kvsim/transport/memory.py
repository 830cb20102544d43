"""A node process keeps the memory it frees, as a serving engine keeps its KV-cache pool.

A serving engine allocates its KV cache once at start-up; a request never waits for the
operating system to hand it fresh pages. A Python process using glibc's allocator does: a
block of 128 KiB or more is mmap-ed and returned to the system when freed, and the top of
a heap is trimmed, so every request's cache (and every decode step's growing copy of it)
page-faults its memory again: with SmolLM2-135M and a 2048-token cache, that adds
60-120 ms to the first decode step after a transfer (the fault counts: CHANGELOG.md,
2026-11-23, "Earlier").

`retain_freed_memory()` makes the allocator behave like a pool: one arena for every thread
(the decode thread of a new request reuses what the last one freed), blocks up to 32 MiB
from the heap instead of mmap, and no trimming below 2 GiB of free memory, so the
process's memory grows to its peak once (the warm-up reaches it:
`kvsim.transport.session.warm_up`) and is reused after. Other C libraries (musl, macOS)
are left as they are and the call says so on stderr.

Also needed: a request's memory must be freed when it ends (`Assembly.close`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_MAX_BYTES = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int: a free heap top above 2 GiB is trimmed


def retain_freed_memory(who: str) -> bool:
    """Set glibc's allocator to keep freed memory (see the module docstring). Call early,
    before the process's threads start. Returns whether it applied; when not, says why on
    stderr as `kvsim <who>`."""
    why = _mallopt_refusal()
    if why:
        print(f"kvsim {who}: freed memory goes back to the system ({why}): requests "
              "page-fault their caches afresh", file=sys.stderr)
    return not why


def _mallopt_refusal() -> str:
    """Apply the settings; "" when applied, else why not."""
    name = ctypes.util.find_library("c")
    if not name:
        return "no C library found"
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return f"{name} has no mallopt (not glibc)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX_BYTES),
                (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    refused = [param for param, value in settings if mallopt(param, value) != 1]
    return f"mallopt refused parameters {refused}" if refused else ""


__all__ = ["retain_freed_memory"]
