"""kvsim.sim.gc_pause: the collector is off inside a run and a large run's survivors end in
the oldest generation without a collection pass; cycles are still collected later."""

from __future__ import annotations

import gc
import weakref

import pytest

from kvsim.sim.gc_pause import _GENERATIONAL, MOVE_AT_OBJECTS, gc_paused

pytestmark = pytest.mark.skipif(not _GENERATIONAL,
                                reason="free-threaded build: the collector is only paused")


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _in_generation(obj: object, generation: int) -> bool:
    return any(o is obj for o in gc.get_objects(generation=generation))


@pytest.fixture
def collector_on():
    """The collector on for the test, and back to its former state after it."""
    was_enabled = gc.isenabled()
    gc.enable()
    yield
    if not was_enabled:
        gc.disable()


def _run_leaving(survivors: int) -> tuple[list, weakref.ref]:
    """A "run" under gc_paused that leaves `survivors` tracked containers and one reference
    cycle; (the survivors, a weak reference into the cycle)."""
    with gc_paused():
        assert not gc.isenabled()
        kept = [[i] for i in range(survivors)]
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
    return kept, gone


def test_survivors_move_to_the_oldest_generation_and_cycles_are_still_collected(
        collector_on) -> None:
    kept, gone = _run_leaving(2 * MOVE_AT_OBJECTS)  # as many as a large run leaves
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
    # no young-generation pass was needed to promote them: already the oldest
    assert _in_generation(kept[0], 2) and not _in_generation(kept[0], 0)
    assert gone() is not None  # the cycle waits for a full collection ...
    gc.collect()
    assert gone() is None  # ... and is freed by it: nothing leaks


def test_after_a_small_run_objects_stay_young_and_cycles_go_with_a_young_collection(
        collector_on) -> None:
    gc.collect()
    kept, gone = _run_leaving(100)
    assert _in_generation(kept[0], 0) and not _in_generation(kept[0], 2)
    gc.collect(0)  # the next young collection (no full one) frees the cycle
    assert gone() is None


def test_a_large_run_moves_what_a_caller_froze_back_to_the_oldest_generation() -> None:
    # the interpreter's frozen objects (CPython 3.12: immortals) cannot be told from a
    # caller's: after a large run both are back in the oldest generation
    was_enabled = gc.isenabled()
    gc.disable()
    frozen = [[-1]]
    gc.freeze()
    try:
        assert gc.get_freeze_count() > 0
        young, _ = _run_leaving(2 * MOVE_AT_OBJECTS)
        assert not gc.isenabled()  # restored to the caller's state
        assert gc.get_freeze_count() == 0
        assert _in_generation(frozen[0], 2) and _in_generation(young[0], 2)
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
