"""Fluid link: analytic cases hold exactly (to float precision)."""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from kvsim.sim.link import Link

REL = 1e-12


def _run(link_kw, flows):
    """flows: list of (sizes, release, priority). Returns (links, flow objects, env)."""
    env = simpy.Environment()
    link = Link(env, **link_kw)
    log = []

    def submitter(sizes, release, prio, at):
        if at > 0:
            yield env.timeout(at)
        f = link.submit(np.asarray(sizes, float), np.asarray(release, float), prio,
                        on_delivered=lambda fl, j0, j1, arr: log.extend(arr.tolist()))
        out.append(f)

    out = []
    for sizes, release, prio in flows:
        env.process(submitter(sizes, release, prio, 0.0))
    env.run()
    return link, out, env, log


def test_one_flow_completes_at_latency_plus_bytes_over_rate():
    size_bytes, gbps, latency_s = 3_000_000.0, 25.0, 0.0023
    link, (f,), env, _ = _run(dict(bandwidth_gbps=gbps, latency_s=latency_s),
                              [([size_bytes], [0.0], 0)])
    assert f.arrival_t()[-1] == pytest.approx(latency_s + 8 * size_bytes / (gbps * 1e9), rel=REL)
    assert link.total_sent_bytes == size_bytes


def test_messages_back_to_back_and_per_message_overhead():
    sizes, gbps = [1000.0, 2000.0, 500.0], 8.0  # 1e9 B/s
    link, (f,), _, _ = _run(dict(bandwidth_gbps=gbps, message_overhead_bytes=100),
                            [(sizes, [0, 0, 0], 0)])
    expected = np.cumsum(np.array(sizes) + 100) / 1e9
    np.testing.assert_allclose(f.complete_t, expected, rtol=REL)


def test_strict_priority_between_classes():
    # 8 Gbps = 1e9 B/s. Low-priority A (1 GB) from t=0; high-priority B (0.5 GB) at t=0.2
    link, (a, b), _, _ = _run(dict(bandwidth_gbps=8.0),
                              [([1e9], [0.0], 1), ([0.5e9], [0.2], 0)])
    assert b.complete_t[-1] == pytest.approx(0.7, rel=REL)  # B alone from 0.2
    assert a.complete_t[-1] == pytest.approx(1.5, rel=REL)  # A paused 0.2..0.7


def test_equal_flows_share_fairly():
    link, (a, b), _, _ = _run(dict(bandwidth_gbps=8.0), [([1e9], [0.0], 0), ([1e9], [0.0], 0)])
    assert a.complete_t[-1] == pytest.approx(2.0, rel=REL)
    assert b.complete_t[-1] == pytest.approx(2.0, rel=REL)


def test_unequal_flows_same_class_then_alone():
    # 0.25 GB and 1 GB share 1e9 B/s: small done at 0.5 s, big has 0.75 GB left alone
    link, (a, b), _, _ = _run(dict(bandwidth_gbps=8.0),
                              [([0.25e9], [0.0], 0), ([1e9], [0.0], 0)])
    assert a.complete_t[-1] == pytest.approx(0.5, rel=REL)
    assert b.complete_t[-1] == pytest.approx(1.25, rel=REL)


def test_bandwidth_trace():
    # 8 Gbps (1e9 B/s) until 0.5 s, then 4 Gbps (0.5e9 B/s) until 1.5 s, then 16 Gbps
    # 1 GB: 0.5 GB by 0.5 s, 0.5 GB more by 1.5 s -> done at 1.5 s exactly; 2 GB: +1 GB at
    # 2e9 B/s -> 2.0 s
    link, (f,), _, _ = _run(dict(bandwidth_gbps=8.0, trace=[[0.5, 4.0], [1.5, 16.0]]),
                            [([1e9, 1e9], [0.0, 0.0], 0)])
    np.testing.assert_allclose(f.complete_t, [1.5, 2.0], rtol=REL)
    assert link.capacity_bytes(0.0, 2.0) == pytest.approx(0.5e9 + 0.5e9 + 1e9, rel=REL)
    assert link.utilisation(2.0) == pytest.approx(1.0, rel=1e-9)


def test_trace_from_first_byte_and_busy_utilisation():
    """The same trace, first message released at 2 s: with origin first_byte the steps land
    at 2.5 and 3.5 s (as if the transfer started at 0); with origin run the trace is over
    before the first byte: the link warns and runs at the last rate."""
    trace = [[0.5, 4.0], [1.5, 16.0]]
    link, (f,), env, _ = _run(dict(bandwidth_gbps=8.0, trace=trace, trace_origin="first_byte"),
                              [([1e9, 1e9], [2.0, 2.0], 0)])
    np.testing.assert_allclose(f.complete_t, [3.5, 4.0], rtol=REL)
    assert link.first_byte_t == 2.0
    assert link.busy_utilisation() == pytest.approx(1.0, rel=1e-9)
    assert link.utilisation(8.0) == pytest.approx(2e9 / link.capacity_bytes(0.0, 8.0), rel=1e-9)
    with pytest.warns(UserWarning, match="trace ends at 1.5 s, before its first byte"):
        link, (f,), _, _ = _run(dict(bandwidth_gbps=8.0, trace=trace),
                                [([1e9, 1e9], [2.0, 2.0], 0)])
    np.testing.assert_allclose(f.complete_t, [2.5, 3.0], rtol=REL)  # 16 Gbps = 2e9 B/s
    # a link that idles between two bursts is busy half of [first byte, last byte]
    link, _, _, _ = _run(dict(bandwidth_gbps=8.0), [([1e9], [0.0], 0), ([1e9], [2.0], 0)])
    assert link.busy_utilisation() == pytest.approx(2e9 / 3e9, rel=1e-9)
    with pytest.raises(ValueError, match="trace_origin"):
        _run(dict(bandwidth_gbps=8.0, trace_origin="arrival"), [])


def test_released_messages_idle_gaps_and_priority_takeover():
    # anchor messages released every 1 s (1e8 B each, 0.1 s on the wire at 1e9 B/s);
    # residual 1e9 B from t=0 uses the gaps: it gets 0.9 s per second -> done at 1.1 s
    anchor_rel = [0.0, 1.0, 2.0]
    link, (anc, res), _, _ = _run(dict(bandwidth_gbps=8.0),
                                  [([1e8] * 3, anchor_rel, 0), ([1e9], [0.0], 1)])
    np.testing.assert_allclose(anc.complete_t, [0.1, 1.1, 2.1], rtol=REL)
    assert res.complete_t[-1] == pytest.approx(1.1 + 0.1, rel=REL)


def test_head_release_follows_the_head_message():
    """The link reads a flow's next release from one scalar (Flow.head_release_t), kept
    equal to release[head] as messages leave, on both of _advance's paths (one message at
    its drain instant, several between two events), and inf once the last has left."""
    seen = []

    def check(flow, j0, j1, _arrival_t):
        # reported messages j0..j1-1 have left: the head is j1 now
        assert flow.head == j1
        expect = float(flow.release[j1]) if j1 < flow.n else float("inf")
        seen.append((flow.name, j1, flow.head_release_t == expect))

    env = simpy.Environment()
    link = Link(env, bandwidth_gbps=8.0)  # 1e9 B/s
    # encoder-bound flow: 1e6 B (1 ms) released every 10 ms -> drains after every message
    slow = link.submit(np.full(4, 1e6), np.arange(4) * 0.01, 0, check, name="slow")
    # backlogged flow: 20 messages (1 ms each) released every 0.5 ms behind it, sent in
    # the slow flow's gaps: several complete per event, the slow flow's releases cut in
    bulk = link.submit(np.full(20, 1e6), np.arange(20) * 0.0005, 1, check, name="bulk")
    assert slow.head_release_t == 0.0 and slow.last_release_t == 0.03
    env.run()
    assert {name for name, _, _ in seen} == {"slow", "bulk"}
    assert all(ok for _, _, ok in seen), seen
    bulk_heads = [j for name, j, _ in seen if name == "bulk"]
    assert bulk_heads[-1] == 20 and any(1 < j < 20 for j in bulk_heads)  # mid-flow reports
    assert slow.head_release_t == bulk.head_release_t == float("inf")
    assert not slow.backlogged(env.now) and not bulk.backlogged(env.now)


def test_bytes_conserved_time_monotone_randomised():
    rng = np.random.default_rng(3)
    flows = []
    for _ in range(6):
        n = int(rng.integers(1, 40))
        sizes = rng.uniform(1e3, 1e6, n)
        release = np.sort(rng.uniform(0, 0.01, n))
        flows.append((sizes, release, int(rng.integers(0, 3))))
    link, objs, env, log = _run(dict(bandwidth_gbps=10.0, latency_s=1e-4), flows)
    total = sum(float(np.sum(s)) for s, _, _ in flows)
    assert link.total_sent_bytes == pytest.approx(total, rel=1e-12)
    for f, (sizes, release, _) in zip(objs, flows, strict=True):
        assert np.all(np.diff(f.complete_t) >= 0)  # FIFO within a flow
        assert np.all(f.complete_t >= release - 1e-15)  # nothing leaves before release
        # a message needs at least size / capacity on the wire after its release
        assert np.all(f.complete_t - release >= sizes / (10e9 / 8) * (1 - 1e-9))
    assert max(log) <= env.now + 1e-4 + 1e-12  # no delivery after the run's last event
    # the link never sends faster than its capacity
    assert total <= link.capacity_bytes(0.0, max(f.complete_t[-1] for f in objs)) * (1 + 1e-9)


def test_bad_input_is_refused():
    env = simpy.Environment()
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        Link(env, 0.0)
    link = Link(env, 10.0)
    with pytest.raises(ValueError, match="non-decreasing"):
        link.submit(np.array([1.0, 1.0]), np.array([1.0, 0.5]))
    with pytest.raises(ValueError, match="> 0 bytes"):
        link.submit(np.array([0.0]), np.array([0.0]))
    with pytest.raises(ValueError, match="non-decreasing"):
        Link(env, 10.0, trace=[[1.0, 5.0], [0.5, 5.0]])


@pytest.mark.parametrize("weighted", [False, True])
def test_flows_submitted_while_holding_finish_as_if_submitted_one_by_one(weighted):
    """Link.holding defers the reallocation to the block's end: same completion times."""
    rng = np.random.default_rng(3)
    plans = [(rng.uniform(1e5, 1e6, 6), np.sort(rng.uniform(0, 0.002, 6)), (int(s),))
             for s in rng.integers(0, 2, 5)]

    def complete_t(hold: bool) -> list[list[float]]:
        env = simpy.Environment()
        link = Link(env, 10.0, latency_s=1e-4,
                    class_weight=(lambda key: 0.25 ** key[0]) if weighted else None)
        flows = []

        def request(i):
            yield env.timeout(0.0005 * i)  # two requests at each instant
            group = plans[2 * i: 2 * i + 2]
            if hold:
                with link.holding():
                    for sizes, rel, prio in group:
                        flows.append(link.submit(sizes, rel + env.now, prio))
            else:
                for sizes, rel, prio in group:
                    flows.append(link.submit(sizes, rel + env.now, prio))

        for i in range(3):
            env.process(request(i))
        env.run()
        return [f.complete_t.tolist() for f in flows]

    assert complete_t(True) == complete_t(False)


def test_prepared_messages_are_reused_by_identity_and_bounded():
    """Link.messages prepares a sizes array once (framing added, running totals) and hands
    the same object back for the same array; fresh arrays per flow do not grow it
    without bound."""
    env = simpy.Environment()
    link = Link(env, 8.0, message_overhead_bytes=10.0)
    sizes = np.array([100.0, 50.0])
    first = link.messages(sizes)
    assert link.messages(sizes) is first
    assert first.cum_l == [110.0, 170.0]
    assert link.messages(np.array([100.0, 50.0])) is not first  # equal, but another array
    for _ in range(5000):
        link.messages(np.array([1.0]))
    assert len(link._messages) <= 4096
    with pytest.raises(ValueError, match="> 0 bytes"):
        Link(env, 8.0).messages(np.array([1.0, 0.0]))


def test_links_of_one_framing_share_prepared_messages():
    """With shared_messages, links of the same message overhead prepare an array once
    between them; a link with other framing keeps its own (its totals differ); the
    times a flow gets are those of an unshared link."""
    env = simpy.Environment()
    shared: dict = {}
    a = Link(env, 8.0, message_overhead_bytes=10.0, shared_messages=shared)
    b = Link(env, 8.0, message_overhead_bytes=10.0, shared_messages=shared)
    c = Link(env, 8.0, message_overhead_bytes=20.0, shared_messages=shared)
    sizes = np.array([100.0, 50.0])
    assert a.messages(sizes) is b.messages(sizes)
    assert c.messages(sizes) is not a.messages(sizes)
    assert c.messages(sizes).cum_l == [120.0, 190.0]
    assert sorted(shared) == [10.0, 20.0]

    def arrivals(link_kw):
        _, (flow,), _, _ = _run(link_kw, [(sizes, [0.0, 0.5], 0)])
        return flow.arrival_t().tolist()
    alone = arrivals({"bandwidth_gbps": 8e-9 * 100.0, "message_overhead_bytes": 10.0})
    with_shared = arrivals({"bandwidth_gbps": 8e-9 * 100.0, "message_overhead_bytes": 10.0,
                            "shared_messages": shared})
    assert with_shared == alone == pytest.approx([1.1, 1.7], rel=REL)
