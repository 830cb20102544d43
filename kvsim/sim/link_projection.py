"""Where a link's messages would complete if no new flow joined it: a dry run of its fluid
schedule from its last update, for a reader that must look ahead (kvsim.sim.worker_load:
how busy a request's on-arrival worker will be while its decoder drafts).

The dry run allocates rates as `Link._reschedule` does (strict priority between classes,
or the class weights' shares; equal shares within a class) among the flows backlogged at
each instant, follows the capacity trace, and steps from one instant to the next at which
the allocation can change: a head message completes, a waiting message is released, the
capacity steps. With no flow submitted later it equals what the link will do (to rounding);
a flow submitted later makes it an estimate.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Collection

    from kvsim.sim.link import Flow, Link

_REL_EPS = 1e-12  # relative slack: a release or completion within rounding of now is now


def project_link(link: Link, wanted: Collection[Flow] | None = None) -> dict[Flow, np.ndarray]:
    """{flow: [n] s when each of its messages' last byte leaves}, for every unfinished flow
    on `link`: the sent messages' recorded times, the rest projected (see module doc).
    wanted: stop once these flows' last messages are projected (the other flows' later
    messages are then left nan; theirs cannot change what comes before)."""
    flows = list(link.flows)
    out = {f: f.complete_t.copy() for f in flows}
    heads = [f.head for f in flows]
    served = [f.served for f in flows]  # bytes of each flow sent by t
    pending = set(flows if wanted is None else wanted) & set(flows)
    t = link.last_t
    step_t = list(link.step_t)
    # a trace replayed from the first byte starts where the link first carries one
    shift_at_first_byte = link.has_trace and link.trace_origin == "first_byte" and \
        math.isnan(link.first_byte_t)
    k = link._step  # the capacity step in force at t
    weighted = link.class_weight is not None
    active = [i for i, f in enumerate(flows) if heads[i] < f.n]
    while pending and active:
        while k + 1 < len(step_t) and step_t[k + 1] <= t:
            k += 1
        slack = _REL_EPS * max(1.0, abs(t))
        head_release = {i: flows[i].release.item(heads[i]) for i in active}  # s
        backlogged = [i for i in active if head_release[i] <= t + slack]
        next_release = min((r for r in head_release.values() if r > t + slack),
                           default=math.inf)
        if not backlogged:
            t = next_release
            continue
        if shift_at_first_byte:
            step_t = [0.0] + [t + x for x in step_t[1:]]
            k, shift_at_first_byte = 0, False
            continue
        rates = _rates(link, [flows[i] for i in backlogged], link.step_rate[k], weighted)
        # each sent flow's head completes at done_t (if nothing changes before)
        done_t = {i: t + (flows[i].cum_l[heads[i]] - served[i]) / rate
                  for i, rate in zip(backlogged, rates, strict=True) if rate > 0.0}
        t_next = min(next_release, step_t[k + 1] if k + 1 < len(step_t) else math.inf,
                     *done_t.values())
        for i, rate in zip(backlogged, rates, strict=True):
            if rate <= 0.0:
                continue
            f, j = flows[i], heads[i]
            # decided on times, as the link decides a drain: the head that set t_next (and
            # any within rounding of it) completes; bytes alone would miss it by an ulp of t
            if done_t[i] <= t_next * (1 + _REL_EPS):
                out[f][j] = min(done_t[i], t_next)
                heads[i], served[i] = j + 1, f.cum_l[j]
                if j + 1 == f.n:
                    pending.discard(f)
            else:
                served[i] += rate * (t_next - t)
        t = t_next
        active = [i for i in active if heads[i] < flows[i].n]
    return out


def _rates(link: Link, backlogged: list[Flow], capacity: float, weighted: bool) -> list[float]:
    """bytes/s of each backlogged flow, as Link._reschedule allocates them."""
    if weighted:
        counts: dict = {}
        for f in backlogged:
            counts[f.priority] = counts.get(f.priority, 0) + 1
        assert link.class_weight is not None
        weights = {key: link.class_weight(key) for key in counts}
        total = sum(weights.values())
        return [capacity * weights[f.priority] / total / counts[f.priority] for f in backlogged]
    best = min(f.priority for f in backlogged)
    count = sum(1 for f in backlogged if f.priority == best)
    return [capacity / count if f.priority == best else 0.0 for f in backlogged]
