"""How busy a request's on-arrival worker will be while its decoder drafts, or while it is received.

With `deserializer=on_arrival` (the transport receiver's default) one worker per request
dequantizes each layer once its last message is in, the anchor's layers first. A decoder
that drafts on the anchor runs beside that worker's work on the later streams, and on a
small host its steps slow down while the worker is busy, not while it waits for the next
layer (measured by `kvsim calibrate` as hardware `draft_step.busy_ratio`: at 1 Gbps the
worker dequantizes the whole residual back to back, at 0.1 Gbps it mostly waits for it).

When drafting starts, the share of the time until the worker's last job ends that it is
busy is projected from what the simulator knows then: arrivals known so far, and the
rest as each link would carry its current flows (kvsim.sim.link_projection: a dry run of
the link's schedule, priorities, weights and capacity trace included), served as the
request's Deserializer serves them (kvsim.sim.nodes.worker_server: in priority order, at the
worker's pace). A drafting member's
overhead is the mean over that share (kvsim.scenario.speculative.busy_share_overhead_s),
until its full cache is ready (kvsim.sim.batch: `overhead_until_full`). The projection is
exact while no other flow joins the request's links before its last message; a flow that
joins later is not foreseen, and
the share runs to the worker's last job even when the draft cap stops drafting earlier.
Taking the later streams' bytes in costs the receiver too (its sockets and copies, and over a
`tc`-shaped link the kernel's shaping): with the link's measured cost per byte
(draft_step.ingest_s_per_byte, kvsim.calibrate.draft_ingest) the receiver is also busy
that cost x their arrival rate (at most 1) while they arrive and the worker waits, so the
slowdown grows with the arrival rate.

With workload.worker_slows_decode the same projection, over every stream, is made when the
request's first message reaches its decode instance: the share of its reception the worker
(or the receiver taking bytes in) is busy, during which the instance's whole batch steps
slower (kvsim.sim.batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvsim.sim.link_projection import project_link
from kvsim.sim.nodes import worker_server

if TYPE_CHECKING:
    from kvsim.sim.link import Flow, Link
    from kvsim.sim.nodes import Receiver


def busy_fraction(now: float, finish_t: np.ndarray, work_s: np.ndarray) -> float:
    """Share of [now, last finish] during which jobs of one server run: finish_t, work_s
    [m] s (a job runs over [finish - work, finish]). 0 when every job is over by now."""
    if len(finish_t) == 0:
        return 0.0
    end = float(finish_t.max())
    if end <= now:
        return 0.0
    busy = np.maximum(finish_t, now) - np.maximum(finish_t - work_s, now)  # [m] s after now
    return float(busy.sum()) / (end - now)


def projected_arrival_t(rx: Receiver,
                        projections: dict[Link, dict[Flow, np.ndarray]]) -> np.ndarray:
    """[m] s: the arrivals of rx's flow, reported ones as they are, the rest projected from
    each link it crosses (a message arrives once every link carried it, + the first link's
    latency, as kvsim.sim.ingress joins them). projections: the links' dry runs covering
    rx's unfinished flows (project_carriers)."""
    if rx.is_done:
        return rx.arrival_t
    carriers = rx.carriers
    if not carriers:
        raise RuntimeError(f"flow {rx.plan.name}: no link flow carries it (set by the scenario)")
    complete = None
    for flow in carriers:
        # a crossing whose every message is sent has final times
        times = flow.complete_t if flow.done else projections[flow.link][flow]
        complete = times.copy() if complete is None else np.maximum(complete, times)
    assert complete is not None
    return complete + carriers[0].link.latency_s


def project_carriers(receivers: list[Receiver]) -> dict[Link, dict[Flow, np.ndarray]]:
    """One dry run per link that carries an unfinished flow of `receivers`, up to their
    last message (a done flow's times are final: no dry run for it)."""
    wanted: dict[Link, list[Flow]] = {}
    for rx in receivers:
        for flow in rx.carriers:
            if not flow.done:
                wanted.setdefault(flow.link, []).append(flow)
    return {link: project_link(link, flows) for link, flows in wanted.items()}


def receiver_busy_fraction(receivers: list[Receiver], now: float,
                           ingest_s_per_byte: float = 0.0, first_stream: int = 1) -> float:
    """Projected share of [now, the end of the worker's last job on streams >= first_stream]
    the request's receiver is busy, as kvsim.calibrate.draft_ingest replays it: fully busy
    while its worker runs a job of those streams (every stream's jobs served in priority
    order, the anchor's first, from their known and projected arrivals), and otherwise,
    while those streams arrive (from the last message of the streams before them, or from
    the first message, to their last), busy min(1, ingest_s_per_byte x their mean arrival
    rate) (s/B: the link's measured cost of taking bytes in). first_stream=1: the later
    streams, beside drafts on the anchor; 0: the whole reception
    (workload.worker_slows_decode)."""
    if len(receivers) <= first_stream:
        return 0.0
    projections = project_carriers(receivers)
    arrivals = [projected_arrival_t(rx, projections) for rx in receivers]
    works = [rx.plan.deserialize_s for rx in receivers]
    start, finish = worker_server(arrivals, works, receivers[0].group.pace)  # [m_c] s
    jobs_end = np.concatenate(finish[first_stream:])
    jobs_s = jobs_end - np.concatenate(start[first_stream:])  # as they run (at the worker's pace)
    share = busy_fraction(now, jobs_end, jobs_s)
    if ingest_s_per_byte <= 0.0:
        return share
    end = float(jobs_end.max())  # the worker's last job ends after the last arrival
    # from the last message of the streams before (none reported or projected: now), or
    # from the first message of all
    a0 = max((float(a.max()) for a in arrivals[:first_stream] if len(a)), default=now) \
        if first_stream else min(float(a.min()) for a in arrivals if len(a))
    a1 = max(float(a.max()) for a in arrivals[first_stream:])
    lo, hi = max(now, a0), min(end, a1)
    if hi <= lo:
        return share
    later_bytes = sum(float(rx.plan.sizes_bytes.sum()) for rx in receivers[first_stream:])
    u = min(1.0, ingest_s_per_byte * later_bytes / (a1 - a0))
    # the worker's job time inside [lo, hi] is busy already
    jobs_in = float(np.maximum(np.minimum(jobs_end, hi) - np.maximum(jobs_end - jobs_s, lo),
                               0.0).sum())
    return min(1.0, share + u * max(0.0, hi - lo - jobs_in) / (end - now))
