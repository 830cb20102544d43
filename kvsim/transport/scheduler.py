"""Link scheduler: which released chunk the link sends next.

Policies (the simulator's `link.scheduling` names, same meaning):
- anchors_first: priority class = stream index; every request's stream-0 (anchor) chunks go
  before any residual chunk; within a class, release order.
- fifo: by request (arrival order), then stream, then release order.
- weighted: anchors ahead without starving residuals. Stream s has weight
  residual_weight^s; while several streams have chunks queued, each gets link bytes in
  proportion to its weight (self-clocked fair queueing: a chunk's tag is max(virtual time,
  its stream's last tag) + bytes / weight, assigned when it is queued; the smallest tag
  goes next; the virtual time is the tag last sent). residual_weight 0.25: the anchors get
  80% of the link while a residual waits, the residual the rest, either all of it alone.
- aging: by arrival time + stream x residual_age_s, then request, stream, release order:
  a residual goes ahead of the anchors of requests that arrived more than residual_age_s
  after its own (0: fifo; large: anchors_first).

Encoders `put` chunks as they finish them (bounded by `max_queued_bytes`: an encoder that
runs ahead of the link blocks, so memory stays bounded for any context length); the link
loop `peek`s the best chunk and `pop`s it when it may send. Thread-safe.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

SCHEDULINGS = ("anchors_first", "fifo", "weighted", "aging")


@dataclass(order=True)
class QueuedChunk:
    priority: tuple
    request_id: int = field(compare=False)
    stream: int = field(compare=False)
    layer: int = field(compare=False)
    page: int = field(compare=False)
    seq: int = field(compare=False)
    payload: Any = field(compare=False)  # 1-D uint8 buffer (numpy array / bytes)
    size_bytes: int = field(compare=False)  # what the link pays for: header + payload
    released_t: float = field(compare=False, default=0.0)
    payload_crc: int | None = field(compare=False, default=None)  # CRC32C of the payload


class ChunkScheduler:
    def __init__(self, policy: str = "anchors_first", max_queued_bytes: int = 256 << 20,
                 residual_weight: float = 0.25, residual_age_s: float = 1.0) -> None:
        if policy not in SCHEDULINGS:
            raise ValueError(f"link.scheduling must be one of {SCHEDULINGS}, got {policy!r}")
        if not 0.0 < residual_weight <= 1.0:
            raise ValueError(f"link.residual_weight must be in (0, 1], got {residual_weight!r}")
        if not residual_age_s >= 0.0:
            raise ValueError(f"link.residual_age_s must be >= 0, got {residual_age_s!r}")
        self.policy = policy
        self.residual_weight = float(residual_weight)
        self.residual_age_s = float(residual_age_s)
        self._virtual_t = 0.0  # weighted: tag of the chunk sent last (bytes / weight)
        self._last_tag: dict[int, float] = {}  # weighted: last tag given per stream
        self.max_queued_bytes = int(max_queued_bytes)
        self._heap: list[QueuedChunk] = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self.queued_bytes = 0
        self.closed = False
        # queued chunks per (request, stream): a chunk released onto an empty flow starts a
        # backlog (the Figure-2 breakdown's serialize / communication split needs the time)
        self._flow_count: dict[tuple[int, int], int] = {}
        self._blocked = 0  # producers waiting for room (pop wakes them only then)

    def priority(self, arrival_seq: int, stream: int, arrival_offset_s: float = 0.0) -> tuple:
        """The heap key of a chunk (weighted: its stream, then release order; `put` turns it
        into the fair-queueing tag, which needs the virtual time when it is queued).
        arrival_offset_s: the request's arrival after the run's start (aging)."""
        if self.policy in ("anchors_first", "weighted"):
            return (stream, next(self._order))
        if self.policy == "aging":
            return (arrival_offset_s + stream * self.residual_age_s, arrival_seq, stream,
                    next(self._order))
        return (arrival_seq, stream, next(self._order))

    def _fair_tag(self, item: QueuedChunk) -> tuple:
        """weighted: (tag, order); tag = max(virtual time, the stream's last tag) + bytes /
        weight (called under the lock)."""
        start = max(self._virtual_t, self._last_tag.get(item.stream, 0.0))
        tag = start + item.size_bytes / self.residual_weight ** item.stream
        self._last_tag[item.stream] = tag
        return (tag, next(self._order))

    def put(self, item: QueuedChunk, timeout_s: float) -> bool:
        """Queue a released chunk; blocks while the queue is full. Returns whether the flow
        (request, stream) was empty (a new backlog starts). TimeoutError after timeout_s."""
        with self._cv:
            self._blocked += 1
            try:
                ok = self._cv.wait_for(
                    lambda: self.closed or self.queued_bytes == 0 or
                    self.queued_bytes + item.size_bytes <= self.max_queued_bytes,
                    timeout=timeout_s)
            finally:
                self._blocked -= 1
            if self.closed:
                raise RuntimeError("link scheduler closed")
            if not ok:
                raise TimeoutError(f"link queue full ({self.queued_bytes} bytes) for "
                                   f"{timeout_s} s: the link is not draining")
            if self.policy == "weighted":
                item.priority = self._fair_tag(item)
            heapq.heappush(self._heap, item)
            self.queued_bytes += item.size_bytes
            key = (item.request_id, item.stream)
            self._flow_count[key] = self._flow_count.get(key, 0) + 1
            self._cv.notify_all()
            return self._flow_count[key] == 1

    def peek(self) -> QueuedChunk | None:
        with self._cv:
            return self._heap[0] if self._heap else None

    def pop(self) -> QueuedChunk:
        with self._cv:
            item = heapq.heappop(self._heap)
            if self.policy == "weighted":
                self._virtual_t = item.priority[0]
            self.queued_bytes -= item.size_bytes
            key = (item.request_id, item.stream)
            self._flow_count[key] -= 1
            if not self._flow_count[key]:
                del self._flow_count[key]
            if self._blocked:
                self._cv.notify_all()
            return item

    def __len__(self) -> int:
        """Chunks queued (a gauge's reading: no lock, a list's length is atomic)."""
        return len(self._heap)

    def drop_request(self, request_id: int) -> int:
        """Remove every queued chunk of a request (aborted); returns how many."""
        with self._cv:
            keep = [c for c in self._heap if c.request_id != request_id]
            dropped = len(self._heap) - len(keep)
            self._heap = keep
            heapq.heapify(self._heap)
            self.queued_bytes = sum(c.size_bytes for c in keep)
            for key in [k for k in self._flow_count if k[0] == request_id]:
                del self._flow_count[key]
            self._cv.notify_all()
            return dropped

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()
