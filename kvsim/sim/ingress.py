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
    """Joins one flow's two crossings (egress, ingress) for its `Receiver`: when both are
    done, hands the receiver every message at its later completion + the egress latency."""

    def __init__(self, rx: Receiver) -> None:
        self.rx = rx
        self.egress: Flow | None = None
        self.ingress: Flow | None = None

    def egress_done(self, flow: Flow) -> None:
        self.egress = flow
        self._both()

    def ingress_done(self, flow: Flow) -> None:
        self.ingress = flow
        self._both()

    def _both(self) -> None:
        if self.egress is None or self.ingress is None:
            return
        carried = CarriedFlow(self.egress, self.ingress)
        arrival_t = carried.complete_t + self.egress.link.latency_s  # [m] s
        self.rx.delivered(carried, 0, len(arrival_t), arrival_t)
        self.rx.done(carried)
