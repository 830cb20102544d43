"""Keep torch's thread count across numba's parallel kernels.

numba's `omp` threading layer (GNU OpenMP, where numba picks it) and torch's CPU build
share one OpenMP runtime. When numba starts that layer (once per process, at its first
parallel kernel) it sets the runtime's thread count to its own (`omp_set_num_threads`, every
core) in the thread that started it, and torch's later operations in that thread use it,
whatever `torch.set_num_threads` said: a process set to 1 torch thread (`kvsim quality`,
the transport's warm-up thread) would run torch on every core after its first encode.
`kept()` puts the caller's count back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def kept() -> Iterator[int]:
    """Run the body (numba kernels) and restore this thread's torch thread count after it;
    yields that count."""
    threads = torch.get_num_threads()
    try:
        yield threads
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
