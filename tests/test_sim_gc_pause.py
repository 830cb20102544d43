"""kvsim.sim.gc_pause: the collector is off inside a run and the run's survivors end in
the oldest generation without a collection pass; cycles are still collected later."""

from __future__ import annotations

import gc
import weakref

from kvsim.sim.gc_pause import MOVE_AT_OBJECTS, gc_paused


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _in_generation(obj: object, generation: int) -> bool:
    return any(o is obj for o in gc.get_objects(generation=generation))


def test_survivors_move_to_the_oldest_generation_and_cycles_are_still_collected() -> None:
    was_enabled = gc.isenabled()
    gc.enable()
    try:
        with gc_paused():
            assert not gc.isenabled()
            # survivors (containers: tracked), as many as a large run leaves
            kept = [[i] for i in range(2 * MOVE_AT_OBJECTS)]
            a, b = _Node(), _Node()
            a.other, b.other = b, a  # a reference cycle left behind by the "run"
            gone = weakref.ref(a)
            del a, b
        assert gc.isenabled()
        assert gc.get_freeze_count() == 0
        # no young-generation pass was needed to promote them: already the oldest
        assert _in_generation(kept[0], 2) and not _in_generation(kept[0], 0)
        assert gone() is not None  # the cycle waits for a full collection ...
        gc.collect()
        assert gone() is None  # ... and is freed by it: nothing leaks
    finally:
        if not was_enabled:
            gc.disable()


def test_after_a_small_run_objects_stay_young_and_cycles_go_with_a_young_collection() -> None:
    was_enabled = gc.isenabled()
    gc.enable()
    try:
        gc.collect()
        with gc_paused():
            kept = [[i] for i in range(100)]
            a, b = _Node(), _Node()
            a.other, b.other = b, a
            gone = weakref.ref(a)
            del a, b
        assert _in_generation(kept[0], 0) and not _in_generation(kept[0], 2)
        gc.collect(0)  # the next young collection (no full one) frees the cycle
        assert gone() is None
    finally:
        if not was_enabled:
            gc.disable()


def test_a_callers_freeze_is_left_alone_and_a_disabled_collector_stays_off() -> None:
    was_enabled = gc.isenabled()
    gc.disable()
    frozen = [object()]
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        assert count > 0
        with gc_paused():
            young = [[1]]
        assert not gc.isenabled()  # restored to the caller's state
        assert gc.get_freeze_count() == count  # the caller's freeze is not undone
        assert not _in_generation(young[0], 2)  # no move while something is frozen
    finally:
        gc.unfreeze()
        del frozen
        if was_enabled:
            gc.enable()
