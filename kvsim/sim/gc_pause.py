"""Python's cyclic garbage collector paused over a simulation run.

A run allocates millions of small objects (simpy events, flows, records, timelines) and
keeps the records until its end. With the collector on, every full collection rescans all
of them, so the time it takes per request grows with the size of the run. Pausing it only
postpones the freeing of reference cycles (their memory is bounded by the run's own
allocations) to the first full collection after the run; it changes no result.

At the end, what the run left is moved into the oldest generation without a pass over it
(`gc.freeze()` then `gc.unfreeze()`, which puts the frozen objects back into the oldest
generation). Otherwise the first allocation after the collector is back triggers a
young-generation collection over every object the run left, and a second one follows when
they are promoted: on `kvsim bench sim`'s 100,000-request case that first pass alone took
0.46 s (733,000 objects, cache-cold) against 0.016 s for 10,000 requests, a cost that grew
faster than the run. Those objects are long-lived by construction (the run's records), so
the young-generation passes would only have promoted them. The price: the run's own
reference cycles (about 300 objects, ~60 KB, whatever the run's size: its environment and
closures) wait for the next full collection instead of the next young one. So the move is
made only after a run that left many objects (`MOVE_AT_OBJECTS` net tracked allocations,
`gc.get_count()[0]`, a pass of a few ms and more), not after the small runs of a sweep; and
never when the caller has frozen objects of its own (`gc.get_freeze_count()`), whose freeze
it would undo.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

MOVE_AT_OBJECTS = 10_000  # young objects left from which the survivors move (see above)


@contextmanager
def gc_paused() -> Iterator[None]:
    """The collector is off inside the block and back to its former state after it; the
    objects alive at its end are in the oldest generation (see the module docstring)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_count()[0] >= MOVE_AT_OBJECTS and gc.get_freeze_count() == 0:
            gc.freeze()  # every tracked object into the permanent generation (no pass) ...
            gc.unfreeze()  # ... and from there into the oldest generation
        if was_enabled:
            gc.enable()
