"""Incast at a decode instance: its ingress link (optional, `link.decode_ingress_gbps`).

Every flow to a decode instance crosses two fluid servers: its prefill instance's egress
link (kvsim.sim.link, as without an ingress) and the decode instance's ingress link, which
all flows to that instance share (same scheduling classes as the egress). The flow is
submitted to both with the same release times; a message has arrived once both have
carried it: arrival_j = max(egress last byte_j, ingress last byte_j) + latency (the
propagation latency is counted once, on the egress).

Why two independent servers and not a chain (ingress fed by the egress's output) or a joint
max-min allocation: the link reports a message's completion only at its next rate change
(it costs events per rate change, not per message), so an ingress fed by those reports
would see releases in the past; a joint allocation would replace the link's exact per-link
engine by a network solver. The independent model is exact when one of the two servers is
the bottleneck of every flow it carries — incast (P prefill links of R into an ingress of
R: each flow gets R/P at the ingress and is never held back by its egress), or a single
flow — and conservative otherwise: a flow held back by its egress still takes its full
share of the ingress, which then serves the others more slowly than a work-conserving
receiver would.
"""

from __future__ import annotations

import numpy as np

from kvsim.sim.link import Flow
from kvsim.sim.nodes import Receiver


class CarriedFlow:
    """The flow as the receiver sees it after both links: release times (s) of the
    egress flow, completion times (s) the later of the two links' (duck-types the
    `Flow` fields a Receiver reads, kvsim.sim.nodes.Carried)."""

    def __init__(self, egress: Flow, ingress: Flow) -> None:
        self.release = egress.release  # [m] s
        self.complete_t = np.maximum(egress.complete_t, ingress.complete_t)  # [m] s
        self.cum_l = egress.cum_l  # bytes through message j (counted once, on the egress)


class IngressJoin:
    """Joins one flow's two crossings (egress, ingress) for its `Receiver`: a message has
    arrived once both links have carried it, at the later of its two completions + the
    egress latency. Messages are handed on as soon as both links have reported them
    (each link reports its messages in order, at its rate changes and flushes), so a
    reader that flushes both links sees every message that has arrived by now + latency
    (kvsim.sim.nodes.NodeDeserializer); the flow is done when both crossings are."""

    def __init__(self, rx: Receiver) -> None:
        self.rx = rx
        self.egress: Flow | None = None  # set by Scenario._send from each link's submit
        self.ingress: Flow | None = None
        self.reported = 0  # messages 0..reported-1 handed to the receiver

    def delivered(self, _flow: Flow, _j0: int, _j1: int, _arrival_t: np.ndarray) -> None:
        """Either link reported messages: hand on those both have carried now."""
        egress, ingress = self.egress, self.ingress
        if egress is None or ingress is None:
            return
        j0, j1 = self.reported, min(egress.head, ingress.head)
        if j1 <= j0:
            return
        self.reported = j1
        arrival_t = np.maximum(egress.complete_t[j0:j1], ingress.complete_t[j0:j1]) + \
            egress.link.latency_s  # [j1 - j0] s
        self.rx.delivered(egress, j0, j1, arrival_t)

    def crossing_done(self, _flow: Flow) -> None:
        """One link sent the flow's last message; once both have, the flow is done. Both
        links are flushed first: the request's Deserializer evaluates the flow now from
        every message of its other streams that has arrived by now + latency, and a
        message's report waits for the later of its two links (flushing reallocates
        nothing; the link calling this is already advanced to now)."""
        egress, ingress = self.egress, self.ingress
        if egress is None or ingress is None or not (egress.done and ingress.done):
            return
        egress.link.flush()
        ingress.link.flush()  # (every message was handed on: both links report it before
        self.rx.done(CarriedFlow(egress, ingress))  # they finish, the later one with both)
