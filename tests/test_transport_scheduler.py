"""The transport's chunk scheduler: each policy's send order, by construction."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.transport.scheduler import ChunkScheduler, QueuedChunk


def _chunk(sched: ChunkScheduler, request: int, stream: int, size: int = 100,
           arrival_s: float = 0.0) -> QueuedChunk:
    return QueuedChunk(sched.priority(request, stream, arrival_s), request, stream, 0, 0, 0,
                       np.zeros(1, np.uint8), size)


def _drain(sched: ChunkScheduler) -> list[tuple[int, int]]:
    out = []
    while sched.peek() is not None:
        c = sched.pop()
        out.append((c.request_id, c.stream))
    return out


def test_weighted_shares_bytes_by_stream_weight_and_never_starves():
    """40 anchor and 40 residual chunks of equal size queued together, weight 0.25: the
    residual gets one chunk in five while both wait (80/20), then the rest alone."""
    sched = ChunkScheduler("weighted", residual_weight=0.25)
    for _ in range(40):
        sched.put(_chunk(sched, 0, 1), 1.0)
    for _ in range(40):
        sched.put(_chunk(sched, 1, 0), 1.0)
    order = _drain(sched)
    first = order[:50]
    assert sum(s == 1 for _, s in first) == 10  # 20% of the first 50 chunks
    assert [s for _, s in order[50:]] == [1] * 30  # the residual alone takes it all
    # anchors_first sends every anchor first; the residual waits for all 40
    sched = ChunkScheduler("anchors_first")
    for _ in range(40):
        sched.put(_chunk(sched, 0, 1), 1.0)
    for _ in range(40):
        sched.put(_chunk(sched, 1, 0), 1.0)
    assert [s for _, s in _drain(sched)] == [0] * 40 + [1] * 40


def test_weighted_late_anchor_gets_no_credit_for_idle_time():
    """A stream that was idle starts from the virtual time: after 10 residual chunks sent
    alone, a new anchor still shares 80/20 instead of taking the link for 10 chunks' worth
    of unused credit plus its share."""
    sched = ChunkScheduler("weighted", residual_weight=0.25)
    for _ in range(30):
        sched.put(_chunk(sched, 0, 1), 1.0)
    sent = [sched.pop().stream for _ in range(10)]
    assert sent == [1] * 10
    for _ in range(20):
        sched.put(_chunk(sched, 1, 0), 1.0)
    nxt = [sched.pop().stream for _ in range(10)]
    assert nxt.count(1) == 2 and nxt.count(0) == 8


def test_aging_puts_old_residuals_before_new_anchors():
    sched = ChunkScheduler("aging", residual_age_s=1.0)
    sched.put(_chunk(sched, 0, 1, arrival_s=0.0), 1.0)  # request 0's residual: key 1.0
    sched.put(_chunk(sched, 1, 0, arrival_s=0.5), 1.0)  # request 1's anchor: 0.5
    sched.put(_chunk(sched, 2, 0, arrival_s=1.5), 1.0)  # request 2's anchor: 1.5
    sched.put(_chunk(sched, 1, 1, arrival_s=0.5), 1.0)  # request 1's residual: 1.5
    # keys 0.5, 1.0, then a tie at 1.5 broken by arrival order (request 1 before 2)
    assert _drain(sched) == [(1, 0), (0, 1), (1, 1), (2, 0)]


def test_bad_parameters_refused():
    with pytest.raises(ValueError, match="scheduling"):
        ChunkScheduler("priority")
    with pytest.raises(ValueError, match="residual_weight"):
        ChunkScheduler("weighted", residual_weight=0.0)
    with pytest.raises(ValueError, match="residual_age_s"):
        ChunkScheduler("aging", residual_age_s=-1.0)
