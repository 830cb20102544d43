"""The prefill host's instances (kvsim.transport.prefill_instances): routed at arrival as the
simulator routes, each prefilling one request at a time in arrival order, every wait bounded."""

from __future__ import annotations

import threading
import time

import pytest

from kvsim.transport.prefill_instances import PrefillInstances

WAIT_S = 10.0  # bound on every wait in these tests


def _until(cond) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_one_instance_serves_its_requests_in_arrival_order():
    hosts = PrefillInstances(1)
    order: list[str] = []
    release = threading.Event()

    def request(name: str, hold: bool) -> None:
        with hosts.turn():
            order.append(name)
            if hold:
                release.wait(WAIT_S)

    threads = []
    for i, name in enumerate("abcde"):
        t = threading.Thread(target=request, args=(name, name == "a"), daemon=True)
        t.start()
        threads.append(t)
        _until(lambda n=i + 1: len(hosts.queues[0]) == n)  # it has arrived, in this order
    assert order == ["a"]  # the rest wait behind the one prefilling
    release.set()
    for t in threads:
        t.join(WAIT_S)
    assert order == list("abcde") and not hosts.queues[0]


def test_least_loaded_routes_to_the_first_of_the_shortest_queues():
    hosts = PrefillInstances(3)
    tickets = [hosts.route() for _ in range(4)]
    assert [i for i, _ in tickets] == [0, 1, 2, 0]
    hosts.queues[1].remove(tickets[1][1])  # instance 1's request is through its prefill
    assert hosts.route()[0] == 1


def test_round_robin_routes_by_arrival_order_whatever_the_load():
    hosts = PrefillInstances(3, "round_robin")
    first = hosts.route()
    hosts.queues[0].remove(first[1])
    assert [hosts.route()[0] for _ in range(4)] == [1, 2, 0, 1]


def test_two_instances_prefill_side_by_side():
    hosts = PrefillInstances(2)
    inside = threading.Barrier(2, timeout=WAIT_S)  # both hold an instance at once

    def request() -> None:
        with hosts.turn():
            inside.wait()

    threads = [threading.Thread(target=request, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not inside.broken and all(not q for q in hosts.queues)


def test_a_wait_is_bounded_and_leaves_the_queue():
    hosts = PrefillInstances(1, wait_timeout_s=0.05)
    held = hosts.route()  # someone prefills and never ends
    with pytest.raises(TimeoutError, match="1 request"), hosts.turn():
        pass
    assert list(hosts.queues[0]) == [held[1]]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="prefill_nodes"):
        PrefillInstances(0)
    with pytest.raises(ValueError, match="least_loaded or round_robin"):
        PrefillInstances(2, "kv_aware")
    with pytest.raises(ValueError, match="wait_timeout_s"):
        PrefillInstances(1, wait_timeout_s=0)
