"""The emulator's continuous batch (kvsim.transport.decode_batch): members step together, a
step lasts the batch formula of its members, joins wait for the next step, slots bound the
batch, and a batched timing loop's token times are the hand-computed ones."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from timing_models import llama8b_h100_timing

from kvsim.scenario.acceptance import geometric
from kvsim.transport.decode_batch import DecodeInstances, StepBatch, StepWork
from kvsim.transport.decode_loop import TimingDecodeLoop

# clock slack (s) for thread wake-ups and sleep overshoot on a loaded shared 2-core host; the
# steps below are 0.1 s or more, so one step too many or too few always fails
TOL_S = 0.04
WAIT_S = 20.0  # bound on every wait in these tests


class LinearTiming:
    """A timing model whose batched step is 0.05 s per member + 0.02 s per new token, and a
    lone verification pass (measured) 0.3 s."""

    verify_measured = True

    def batch_pass_s(self, new_tokens, flops, kv_read_bytes, sequences, context_tokens_sum,
                     verifying):
        if sequences == verifying == 1:
            return 0.3
        return 0.05 * sequences + 0.02 * new_tokens


ONE = StepWork(1, 0.0, 0.0, 100)


def _thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_members_share_steps_and_join_between_them():
    batch = StepBatch(LinearTiming(), max_batch=4, wait_timeout_s=WAIT_S)
    a_t, b_t = [], []
    joined = threading.Event()

    def a():
        t0 = time.time()
        batch.step("a", ONE, 1.0)
        a_t.append(time.time() - t0)
        joined.wait(WAIT_S)  # b is in the batch before a posts its second step
        while "b" not in batch._computing:
            time.sleep(0.001)
        for _ in range(3):
            batch.step("a", ONE, 1.0)
            a_t.append(time.time() - t0)
        batch.pause("a")

    def b():
        joined.set()
        for _ in range(3):
            batch.step("b", ONE, 1.0)
            b_t.append(time.time())
        batch.pause("b")

    ta = _thread(a)
    time.sleep(0.02)  # a's first step runs alone (0.07 s)
    tb = _thread(b)
    ta.join(WAIT_S)
    tb.join(WAIT_S)
    # a alone: 0.05 + 0.02; then a and b: 0.1 + 0.04 per step
    expected = [0.07, 0.21, 0.35, 0.49]
    assert np.all(np.asarray(a_t) >= np.asarray(expected) - 1e-3), a_t
    assert np.all(np.asarray(a_t) - np.asarray(expected) <= TOL_S), a_t
    assert batch.steps == 4 and batch.widest == 2
    assert b_t[-1] == pytest.approx(b_t[0] + 0.28, abs=TOL_S)


def test_a_lone_verification_takes_the_measured_pass_and_scale_multiplies():
    batch = StepBatch(LinearTiming(), max_batch=2, wait_timeout_s=WAIT_S)
    t0 = time.time()
    batch.step("v", StepWork(5, 0.0, 0.0, 100, verifying=True), 0.5)
    assert time.time() - t0 == pytest.approx(0.15, abs=TOL_S)
    t0 = time.time()
    batch.step("v", StepWork(1, 0.0, 0.0, 100, overhead_s=0.1), 0.5)  # (0.07 + 0.1) x 0.5
    assert time.time() - t0 == pytest.approx(0.085, abs=TOL_S)
    with pytest.raises(ValueError, match="one time scale"):
        batch.step("w", ONE, 1.0)
    batch.pause("v")


def test_slots_are_first_come_first_served_and_bounded_in_time():
    batch = StepBatch(LinearTiming(), max_batch=1, wait_timeout_s=0.2)
    batch.take_slot()
    with pytest.raises(TimeoutError, match="max_batch 1"):
        batch.take_slot()
    order = []

    def waiter(name):
        batch.wait_timeout_s = WAIT_S
        batch.take_slot()
        order.append(name)
        batch.give_slot()

    t1 = _thread(lambda: waiter("first"))
    time.sleep(0.05)
    t2 = _thread(lambda: waiter("second"))
    time.sleep(0.05)
    assert order == []
    batch.give_slot()
    t1.join(WAIT_S)
    t2.join(WAIT_S)
    assert order == ["first", "second"]
    with pytest.raises(RuntimeError, match="no one held"):
        batch.give_slot()


def test_a_member_that_neither_steps_nor_pauses_is_dropped_and_said():
    said = []
    batch = StepBatch(LinearTiming(), max_batch=2, wait_timeout_s=WAIT_S, stall_s=0.3,
                      log=said.append)
    batch.step("gone", ONE, 1.0)  # steps once, then is never heard of again
    t0 = time.time()
    batch.step("other", ONE, 1.0)  # waits for "gone" until the stall guard drops it
    assert 0.3 <= time.time() - t0 < 0.3 + 0.5 + 0.1 + TOL_S
    assert said and "'gone' neither stepped nor paused" in said[0]
    batch.pause("other")


def test_a_failing_timing_model_fails_every_member():
    class Broken(LinearTiming):
        def batch_pass_s(self, *args):
            raise ValueError("no curve here")

    batch = StepBatch(Broken(), max_batch=2, wait_timeout_s=WAIT_S)
    with pytest.raises(RuntimeError, match="no curve here"):
        batch.step("a", ONE, 1.0)


def test_instances_take_the_least_assigned_first_of_equals():
    hosts = DecodeInstances(lambda: StepBatch(LinearTiming(), 4), 3)
    got = [hosts.assign() for _ in range(4)]
    idx = [hosts.batches.index(b) for b in got]
    assert idx == [0, 1, 2, 0]
    hosts.done(got[1])
    assert hosts.batches.index(hosts.assign()) == 1
    hosts.done(got[2])
    with pytest.raises(RuntimeError, match="twice"):
        hosts.done(hosts.batches[2])
    with pytest.raises(ValueError, match="decode_nodes"):
        DecodeInstances(lambda: StepBatch(LinearTiming(), 4), 0)


def test_round_robin_instances_go_by_assignment_order_whatever_the_load():
    hosts = DecodeInstances(lambda: StepBatch(LinearTiming(), 4), 3, routing="round_robin")
    got = [hosts.assign() for _ in range(2)]
    hosts.done(got[0])
    assert [hosts.batches.index(hosts.assign()) for _ in range(3)] == [2, 0, 1]
    with pytest.raises(ValueError, match="round_robin"):
        DecodeInstances(lambda: StepBatch(LinearTiming(), 4), 2, routing="kv_aware")


# ---- batched timing loops -------------------------------------------------------------------

class ReadyView:
    """A one-stream cache view complete from the start (a plain request)."""

    num_streams = 1

    def wait_streams(self, n, timeout_s):
        return True

    def streams_ready(self):
        return 1

    def kv(self, n):
        return torch.zeros(1)


def test_batched_timing_loops_match_the_hand_computed_steps():
    """A decodes 8 tokens; B joins while A's third step runs and decodes 4. A's steps 1-3
    are one-member steps (s1), then A and B share two-member steps (s2) until B leaves,
    then A is alone again: every token time is a sum of those step lengths."""
    timing, context = llama8b_h100_timing(), 4096
    s1_model = timing.tpot_s(context, 1)
    scale = 0.1 / s1_model  # a one-member step is 0.1 clock s
    s1 = 0.1
    flops, kv = timing.member_work(1, context)
    s2 = timing.batch_pass_s(2, 2 * flops, 2 * kv, 2, 2 * context, 0) * scale
    assert s2 > s1  # a second member costs something
    batch = StepBatch(timing, max_batch=4, wait_timeout_s=WAIT_S)
    done = []

    def loop():
        return TimingDecodeLoop(timing, context, geometric(0.9), np.random.default_rng(0),
                                time_scale=scale, dequantize=False, batch=batch,
                                on_done=lambda: done.append(1))

    results = {}
    t0 = time.time()
    ta = _thread(lambda: results.setdefault("a", loop().run(ReadyView(), False, 8, 0, WAIT_S)))
    time.sleep(2.5 * s1)
    tb = _thread(lambda: results.setdefault("b", loop().run(ReadyView(), False, 4, 0, WAIT_S)))
    ta.join(WAIT_S)
    tb.join(WAIT_S)
    a, b = results["a"], results["b"]
    steps_a = [s1, s1, s1, s2, s2, s2, s2, s1]
    expected_a = a.full_t + np.cumsum(steps_a)
    lag = np.asarray(a.committed_t) - expected_a
    assert lag.min() >= -TOL_S and lag.max() <= TOL_S, lag
    expected_b = expected_a[2] + s2 * np.arange(1, 5)
    lag = np.asarray(b.committed_t) - expected_b
    assert lag.min() >= -TOL_S and lag.max() <= TOL_S, lag
    # reported steps are as they ran, from B's first post (mid-step: half a step of waiting
    # for the boundary, as the simulator's join counts it) to its last token
    assert b.tpot_s == pytest.approx(s2 + 0.5 * s1 / 4, abs=TOL_S / 4)
    assert batch.steps == 8 and batch.widest == 2 and len(done) == 2
    assert a.full_t - t0 < TOL_S


def test_a_cancelled_batched_loop_leaves_the_batch_and_its_slot():
    timing, context = llama8b_h100_timing(), 4096
    scale = 0.05 / timing.tpot_s(context, 1)
    batch = StepBatch(timing, max_batch=1, wait_timeout_s=WAIT_S)

    class Cancelled(ReadyView):
        def __init__(self):
            self.steps = 0

        def cancelled(self):
            return "peer gone" if batch.steps >= 2 else ""

    loop = TimingDecodeLoop(timing, context, geometric(0.9), np.random.default_rng(0),
                            time_scale=scale, dequantize=False, batch=batch)
    with pytest.raises(Exception, match="peer gone"):
        loop.run(Cancelled(), False, 50, 0, WAIT_S)
    assert batch._holders == 0 and not batch._computing
    batch.take_slot()  # the slot is free again
    batch.give_slot()


def test_a_failed_step_fails_its_members_and_the_next_step_runs():
    calls = []

    class OnceBroken(LinearTiming):
        def batch_pass_s(self, *args):
            calls.append(1)
            if len(calls) == 1:
                raise ValueError("no curve here")
            return super().batch_pass_s(*args)

    batch = StepBatch(OnceBroken(), max_batch=2, wait_timeout_s=WAIT_S)
    with pytest.raises(RuntimeError, match="no curve here"):
        batch.step("a", ONE, 1.0)
    t0 = time.time()
    batch.step("a", ONE, 1.0)  # a new stepping thread, a step of its own
    assert time.time() - t0 == pytest.approx(0.07, abs=TOL_S)
    batch.pause("a")


def test_late_wake_ups_do_not_add_up_and_a_paused_member_starts_fresh():
    late_s = 0.02

    def oversleep(s):
        time.sleep(s + late_s)  # a busy host: every sleep ends late

    batch = StepBatch(LinearTiming(), max_batch=2, sleep=oversleep, wait_timeout_s=WAIT_S)
    t0 = time.time()
    for _ in range(6):
        batch.step("a", ONE, 1.0)  # 0.07 s steps, back to back
    # planned from each other's ends: one lateness, not six
    assert time.time() - t0 == pytest.approx(6 * 0.07 + late_s, abs=TOL_S)
    batch.pause("a")  # e.g. dequantizing its full cache
    time.sleep(0.1)
    t1 = time.time()
    batch.step("a", ONE, 1.0)  # back from the load: a step of its own length from now
    assert time.time() - t1 == pytest.approx(0.07 + late_s, abs=TOL_S)
    batch.pause("a")


def test_an_overhead_that_ends_mid_step_re_times_the_step_in_progress():
    # 0.07 s step; the member's overhead is 0.2 s while its worker works (the first 0.05 s):
    # 0.05 / 0.27 of the step is done by then, the rest runs at 0.07 s per step
    batch = StepBatch(LinearTiming(), max_batch=2, wait_timeout_s=WAIT_S)
    t0 = time.time()
    busy_until = t0 + 0.05
    work = StepWork(1, 0.0, 0.0, 100, overhead_now=lambda: 0.2 if time.time() < busy_until
                    else 0.0)
    batch.step("d", work, 1.0)
    expected = 0.05 + (1 - 0.05 / 0.27) * 0.07
    assert time.time() - t0 == pytest.approx(expected, abs=TOL_S / 2)
    batch.pause("d")


def test_a_dropped_request_leaves_a_long_step_and_the_slot_queue_at_once():
    batch = StepBatch(LinearTiming(), max_batch=1, wait_timeout_s=WAIT_S)
    why = []
    cancelled = lambda: why[0] if why else ""  # noqa: E731
    threading.Timer(0.2, lambda: why.append("peer gone")).start()
    t0 = time.time()
    # a 7 s step (x 100): the member is out when its request is dropped, not at the end
    assert batch.step("a", ONE, 100.0, cancelled) is False
    assert time.time() - t0 < 0.2 + 0.1 + TOL_S + 0.05
    assert not batch._computing
    # the step it was alone in ends too (a good request behind it is not held for 7 s)
    deadline = time.time() + 0.5
    while batch._finished < batch._started and time.time() < deadline:
        time.sleep(0.01)
    assert batch._finished == batch._started == 1
    batch.take_slot()
    why.clear()
    threading.Timer(0.2, lambda: why.append("peer gone")).start()
    assert batch.take_slot(cancelled) is False  # queued behind the held slot, then dropped
    batch.give_slot()


def test_a_loop_that_waited_for_its_slot_steps_from_when_it_had_it():
    """One slot, two requests ready at once: the second waits for the first's end, then
    steps a step apart from when it held the slot (planned from when it was ready, its
    first steps would bunch up at once to catch up with the wait)."""
    timing, context = llama8b_h100_timing(), 4096
    step_s = 0.08
    scale = step_s / timing.tpot_s(context, 1)
    slot = StepBatch(timing, max_batch=1, wait_timeout_s=WAIT_S)
    results = {}

    def run(i: int) -> None:
        loop = TimingDecodeLoop(timing, context, geometric(0.9), np.random.default_rng(i),
                                time_scale=scale, dequantize=False, slots=slot)
        results[i] = loop.run(ReadyView(), False, 4, 0, WAIT_S)

    for t in [_thread(lambda i=i: run(i)) for i in range(2)]:
        t.join(WAIT_S)
    first, second = sorted(results.values(), key=lambda r: r.committed_t[-1])
    assert second.committed_t[0] >= first.committed_t[-1] + step_s - TOL_S
    assert np.diff(second.committed_t) == pytest.approx([step_s] * 3, abs=TOL_S)
