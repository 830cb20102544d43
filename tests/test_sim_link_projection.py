"""A link's dry run (kvsim.sim.link_projection) equals what the link then does, when no
flow joins it later: strict priority with staggered releases, class weights shared within
a class, capacity traces (from the run or from the first byte), partly sent flows, late
and fast links."""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from kvsim.sim.link import Link
from kvsim.sim.link_projection import project_link


def _flows(link: Link, rng: np.random.Generator, keys: list, messages: int, t0: float = 0.0):
    """One flow per class key: random sizes (1-100 kB), releases spread over t0 + 0-20 ms
    with gaps (the encoder slower than the link now and then)."""
    flows = []
    for key in keys:
        sizes = rng.uniform(1e3, 1e5, messages)
        release = t0 + np.sort(rng.uniform(0.0, 0.02, messages))
        flows.append(link.submit(sizes, release, priority=key, name=f"{key}"))
    return flows


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("trace, origin", [(None, "run"),
                                           ([[0.004, 0.2], [0.009, 2.0], [0.02, 0.5]], "run"),
                                           ([[0.003, 0.3], [0.012, 3.0]], "first_byte")])
@pytest.mark.parametrize("look_at_s, flush", [(0.0, False), (0.006, True), (0.006, False)])
def test_the_dry_run_equals_the_links_schedule(weighted, trace, origin, look_at_s, flush):
    env = simpy.Environment()
    weight = (lambda key: {0: 4.0, 1: 2.0, 2: 1.0}[key[0]]) if weighted else None
    link = Link(env, 1.0, latency_s=1e-3, message_overhead_bytes=64.0, trace=trace,
                trace_origin=origin, class_weight=weight)
    rng = np.random.default_rng(7)
    # three streams (0 before 1 before 2), two flows sharing class 1; the first flows are
    # released 2 ms in, so a first-byte trace is shifted in the dry run as by the link
    keys = [(0,), (1,), (1,), (2,)]
    flows = _flows(link, rng, keys, 40, t0=0.002)
    if look_at_s > 0:
        env.run(until=look_at_s)
    if flush:
        link.flush()  # else the link's last update is earlier than now
    projected = project_link(link)
    if look_at_s > 0:  # some messages are sent already: their times are kept as recorded
        assert any(f.head > 0 for f in flows)
    env.run()
    for f in flows:
        assert f.done
        np.testing.assert_allclose(projected[f], f.complete_t, rtol=1e-9, atol=1e-12)
    if not weighted:  # strict priority: the lowest class ends after every other
        assert projected[flows[3]][-1] >= max(projected[f][-1] for f in flows[:3])


def test_a_late_fast_link_terminates_and_matches():
    """At t ~ 40 s on 10 Gbps a completion decided on bytes would miss by an ulp of t and
    never come; the dry run decides on times, as the link does."""
    env = simpy.Environment(initial_time=40.0)
    link = Link(env, 10.0)
    rng = np.random.default_rng(3)
    flows = _flows(link, rng, [(0,), (1,)], 200, t0=40.0)
    projected = project_link(link)
    env.run()
    for f in flows:
        np.testing.assert_allclose(projected[f], f.complete_t, rtol=1e-12)


def test_wanted_flows_stop_the_dry_run_at_their_last_message():
    env = simpy.Environment()
    link = Link(env, 8e-9 * 1000.0)  # 1000 bytes/s
    high = link.submit(np.full(2, 100.0), np.zeros(2), priority=(0,))
    low = link.submit(np.full(3, 100.0), np.zeros(3), priority=(1,))
    whole = project_link(link)
    np.testing.assert_allclose(whole[high], [0.1, 0.2], rtol=1e-12)
    np.testing.assert_allclose(whole[low], [0.3, 0.4, 0.5], rtol=1e-12)
    part = project_link(link, [high])
    np.testing.assert_allclose(part[high], whole[high], rtol=0)
    assert np.isnan(part[low]).all()  # not needed: left unprojected


def test_a_stream_behind_another_requests_anchor_is_projected_after_it():
    """Strict priority by stream (anchors first): request A's residual waits while request
    B's anchor is sent. By hand, 1000 bytes/s: A's anchor alone until B's (released at
    0.05 s) shares with it, done at 0.15 s; B's anchor at 0.2 and 0.3 s; A's residual at
    0.4 and 0.5 s. Projected at 0.1 s, each flow alone at the link's capacity (the earlier
    estimate) would have put A's residual at 0.2 and 0.3 s."""
    env = simpy.Environment()
    link = Link(env, 8e-9 * 1000.0)
    a_anchor = link.submit(np.array([100.0]), np.zeros(1), priority=(0,))
    a_residual = link.submit(np.full(2, 100.0), np.zeros(2), priority=(1,))
    b_anchor = link.submit(np.full(2, 100.0), np.full(2, 0.05), priority=(0,))
    env.run(until=0.1)
    link.flush()
    projected = project_link(link, [a_residual])
    np.testing.assert_allclose(projected[a_residual], [0.4, 0.5], rtol=1e-12)
    env.run()
    np.testing.assert_allclose(a_residual.complete_t, [0.4, 0.5], rtol=1e-12)
    np.testing.assert_allclose(b_anchor.complete_t, [0.2, 0.3], rtol=1e-12)
    assert a_anchor.done


def test_a_flow_that_joins_later_is_not_foreseen():
    env = simpy.Environment()
    link = Link(env, 8e-9 * 1000.0)  # 1000 bytes/s
    low = link.submit(np.full(2, 100.0), np.zeros(2), priority=1)
    projected = project_link(link)
    np.testing.assert_allclose(projected[low], [0.1, 0.2], rtol=1e-12)
    env.run(until=0.05)
    link.submit(np.full(1, 100.0), np.array([0.05]), priority=0)  # preempts for 0.1 s
    env.run()
    np.testing.assert_allclose(low.complete_t, [0.2, 0.3], rtol=1e-12)
    assert project_link(link) == {}  # nothing left to send
