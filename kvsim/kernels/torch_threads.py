"""Keep torch's thread count across numba's parallel kernels.

numba's `omp` threading layer (the one it picks on the CPU machines here: GNU OpenMP) and
torch's CPU build share one OpenMP runtime, and numba sets that runtime's thread count for
the calling thread (`omp_set_num_threads`) on every parallel launch. After a codec's kernel
ran in a thread, torch's later operations in that thread use numba's count (every core),
whatever `torch.set_num_threads` said: on this 2-core host a receiver configured with
`transport.threads: 1` decoded on 2 threads after dequantizing on demand (`torch
.get_num_threads()` 1 -> 2, the decode loop's CPU time 1.93x its wall time), as did every
step timed in a process after an encode. `kept()` puts the caller's count back.
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
