"""Python's cyclic garbage collector paused over a simulation run.

A run allocates millions of small objects (simpy events, flows, records, timelines) and
keeps the records until its end. With the collector on, every full collection rescans all
of them, so the time it takes per request grows with the size of the run. Pausing it only
postpones the freeing of reference cycles (their memory is bounded by the run's own
allocations) to the first collection after the run; it changes no result.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """The collector is off inside the block and back to its former state after it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
