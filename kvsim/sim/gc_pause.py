"""Python's cyclic garbage collector paused over a simulation run.

A run allocates millions of small objects (simpy events, flows, records, timelines) and
keeps the records until its end. With the collector on, every full collection rescans all
of them, so the time it takes per request grows with the size of the run. Pausing it only
postpones the freeing of reference cycles (their memory is bounded by the run's own
allocations) to a collection after the run; it changes no result (kvsim has no finalizers
or weak references whose timing a result could see).

At the end of a large run, what it left is moved into the oldest generation without a pass
over it (`gc.freeze()` then `gc.unfreeze()`, which puts the frozen objects back into the
oldest generation). Otherwise the first young collection after the collector is back
passes over every object the run left (cache-cold), and a second pass follows when they
are promoted: a cost that grows faster than the run (figures: docs,
development/simulator-speed.md). Those objects are long-lived by construction (the run's
records), so the young passes would only have promoted them.

The price, and where the move is not made:
- the run's own reference cycles (its environment and closures: a few objects per run,
  whatever its size) wait for the next full collection instead of the next young one. So
  the move is made only after a run that left many objects (`MOVE_AT_OBJECTS` net tracked
  allocations, `gc.get_count()[0]`: a young pass of a few ms and more), not after a sweep's
  small runs;
- objects a caller froze (`gc.freeze()`) are back in the oldest generation after a large
  run: the interpreter's own frozen objects cannot be told from a caller's (CPython 3.12
  parks immortal objects there at every full collection, and parks them again at the next
  one). kvsim freezes objects only while its emulator's sender sends
  (kvsim.core.gc_freeze), and unfreezes them before a simulation can run;
- on a free-threaded build (no generations; freeze and unfreeze each walk the whole heap)
  there is nothing to gain, and the collector is only paused.
"""

from __future__ import annotations

import gc
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager

MOVE_AT_OBJECTS = 10_000  # young objects left from which the survivors move (see above)
_GENERATIONAL = not sysconfig.get_config_var("Py_GIL_DISABLED")


@contextmanager
def gc_paused() -> Iterator[None]:
    """The collector is off inside the block and back to its former state after it; after
    a large block, the objects alive at its end are in the oldest generation (see the
    module docstring)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _GENERATIONAL and gc.get_count()[0] >= MOVE_AT_OBJECTS:
            gc.freeze()  # every tracked object into the permanent generation (no pass) ...
            gc.unfreeze()  # ... and from there into the oldest generation
        if was_enabled:
            gc.enable()
