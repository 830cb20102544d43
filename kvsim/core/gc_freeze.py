"""The objects a process holds before a timed run, kept out of the cyclic collector's passes
during it.

A process that measures (the emulator's sender, in `kvsim validate` beside a loaded model,
Hydra's configs and earlier scenarios' results) may hold millions of tracked objects. Each
full collection during the run passes over all of them, on one core for tens to hundreds of
ms: on a 2-core host that is a third runnable thread beside the receiver's, which then waits
a scheduler slice (~12 ms) in the middle of a layer's dequantization. `frozen_heap` collects
once, moves every survivor into the permanent generation (`gc.freeze()`), so the run's
collections see its own objects only, and puts them back afterwards (`gc.unfreeze()`: into
the oldest generation, as before).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
