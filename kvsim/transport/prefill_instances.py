"""The prefill host's prefill instances (`workload.prefill_nodes`), run as the simulator runs them.

A request is routed when it arrives (`workload.routing`): least_loaded, to the instance
with the fewest requests routed to it and not yet through their prefill (the first of
equals); round_robin, by arrival order. It then waits there for the requests routed before
it: an instance prefills one request at a time, first come first served, as the
simulator's prefill instance does (kvsim.sim.run: a FIFO server, routed at arrival).
kv_aware routing reads prefix caches the transport's prefill host does not keep; the
transport's config refuses it with more than one instance (kvsim.transport.config).

A plain lock is not a queue (which waiting thread takes it next is up to the scheduler),
so each instance keeps its waiting requests in arrival order and a request's turn comes
when it is the first of them.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from kvsim.transport.routing import check_routing, route_index


class PrefillInstances:
    """See the module docstring. Thread-safe; one per sender run."""

    def __init__(self, nodes: int, routing: str = "least_loaded",
                 wait_timeout_s: float = 3600.0) -> None:
        if isinstance(nodes, bool) or int(nodes) != nodes or nodes < 1:
            raise ValueError(f"a prefill host needs prefill_nodes >= 1, got {nodes!r}")
        if not wait_timeout_s > 0:
            raise ValueError(f"wait_timeout_s must be > 0, got {wait_timeout_s}")
        self.routing = check_routing(routing, "prefills")
        self.wait_timeout_s = float(wait_timeout_s)
        # [i]: the requests routed to instance i and not through their prefill, the one
        # prefilling first (each an object of its own, compared by identity)
        self.queues: list[deque[object]] = [deque() for _ in range(int(nodes))]
        self._routed = 0
        self._cond = threading.Condition()

    def route(self) -> tuple[int, object]:
        """Route a request arriving now: its instance and its place in that queue."""
        with self._cond:
            i = route_index([len(q) for q in self.queues], self.routing, self._routed)
            self._routed += 1
            ticket = object()
            self.queues[i].append(ticket)
            return i, ticket

    @contextmanager
    def turn(self) -> Iterator[int]:
        """Route a request arriving now, wait for its turn on its instance (at most
        wait_timeout_s: TimeoutError) and hold the instance while the block runs (its
        prefill); yields the instance's index."""
        i, ticket = self.route()
        queue = self.queues[i]
        try:
            with self._cond:
                if not self._cond.wait_for(lambda: queue[0] is ticket, self.wait_timeout_s):
                    raise TimeoutError(
                        f"prefill instance {i} did not free within {self.wait_timeout_s:g} s "
                        f"({queue.index(ticket)} request(s) ahead of this one)")
            yield i
        finally:
            with self._cond:
                queue.remove(ticket)
                self._cond.notify_all()


__all__ = ["PrefillInstances"]
