"""A callback at a later time on the simpy clock, cheaper than `env.timeout(...)`.

The simulator's events are almost all timers whose only use is one callback: a link's
next rate change, a decode batch's next target, a prefill start, the next arrival. A
simpy Timeout is a general event (value, failure, condition and process support) and
costs two constructors and a dict per instance; `call_later` puts a two-field object on
the environment's own queue instead, with the same key as a Timeout's (time, NORMAL
priority, the environment's event counter), so it fires in exactly the order a Timeout
scheduled at that moment would, and `Environment.run`/`step` process it unchanged (they
read `callbacks` and `_ok`). That key layout is simpy 4's (`Environment.schedule`);
tests/test_sim_timer.py checks it on the installed simpy.
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heappush
from typing import Any

import simpy
from simpy.events import NORMAL


class Timer:
    """A scheduled callback; `callbacks` is set to None once it has fired (as simpy does
    for every event). Identity is what its callback compares to tell a superseded timer
    (kvsim.sim.link.Link._on_timer)."""

    __slots__ = ("callbacks",)
    _ok = True  # read by Environment.step: a timer never fails
    _value = None

    def __init__(self, callback: Callable[[Any], None]) -> None:
        self.callbacks: list[Callable[[Any], None]] | None = [callback]


def call_later(env: simpy.Environment, delay_s: float,
               callback: Callable[[Any], None]) -> Timer:
    """Call callback(timer) delay_s seconds from now (delay_s >= 0), after every event
    already scheduled for that instant (FIFO at equal times, as env.timeout)."""
    if not delay_s >= 0.0:  # also refuses NaN
        raise ValueError(f"timer delay must be >= 0 s, got {delay_s}")
    timer = Timer(callback)
    heappush(env._queue, (env._now + delay_s, NORMAL, next(env._eid), timer))
    return timer
