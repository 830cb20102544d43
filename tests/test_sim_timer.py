"""kvsim.sim.timer.call_later on the installed simpy: fires when and in the order a simpy
Timeout scheduled at the same moment would, under env.run, run(until=...) and step."""

from __future__ import annotations

import math

import pytest
import simpy

from kvsim.sim.run import CountingEnvironment
from kvsim.sim.timer import Timer, call_later


def test_fires_at_its_time_with_itself_as_the_event():
    env = simpy.Environment()
    seen: list[tuple[float, object]] = []
    timer = call_later(env, 2.5, lambda ev: seen.append((env.now, ev)))
    assert isinstance(timer, Timer)
    env.run()
    assert seen == [(2.5, timer)]
    assert timer.callbacks is None  # processed, as simpy marks its events


def test_same_order_as_simpy_timeouts_scheduled_alongside():
    """Timers and Timeouts interleaved, some at equal times: the firing order is time,
    then scheduling order, for both kinds alike."""
    env = simpy.Environment()
    order: list[str] = []
    delays = [1.0, 0.5, 1.0, 0.0, 0.5, 1.0, 0.0]
    for i, delay in enumerate(delays):
        if i % 2:
            env.timeout(delay).callbacks.append(lambda _ev, i=i: order.append(f"timeout{i}"))
        else:
            call_later(env, delay, lambda _ev, i=i: order.append(f"timer{i}"))
    env.run()
    expected = [name for _d, _i, name in sorted(
        (d, i, f"timeout{i}" if i % 2 else f"timer{i}") for i, d in enumerate(delays))]
    assert order == expected


def test_scheduled_from_a_callback_and_counted():
    env = CountingEnvironment()
    times: list[float] = []

    def tick(_timer: Timer) -> None:
        times.append(env.now)
        if len(times) < 4:
            call_later(env, 0.25, tick)

    call_later(env, 0.0, tick)
    env.run()
    assert times == [0.0, 0.25, 0.5, 0.75]
    assert env.scheduled == 4  # the environment's event counter counts timers


def test_run_until_an_event_stops_with_timers_pending():
    env = simpy.Environment()
    done = env.event()
    fired: list[float] = []
    call_later(env, 1.0, lambda _t: done.succeed("ok"))
    call_later(env, 2.0, lambda _t: fired.append(env.now))
    assert env.run(until=done) == "ok"
    assert env.now == 1.0 and fired == []
    env.run()  # the pending timer still fires afterwards
    assert fired == [2.0]


@pytest.mark.parametrize("delay", [-1e-9, -1.0, math.nan])
def test_bad_delay_refused(delay):
    env = simpy.Environment()
    with pytest.raises(ValueError, match="timer delay must be >= 0 s"):
        call_later(env, delay, lambda _t: None)
    assert env.peek() == math.inf  # nothing was scheduled
