"""A network link as an exact fluid server (simpy-driven).

Flows are FIFO queues of messages (one request's stream on this link). Each message has a
release time (when its encoder hands it over) and a size in bytes. The link's capacity
C(t) (a constant, or a piecewise-constant bandwidth trace) is divided among the
*backlogged* flows: strict priority between classes (smaller `priority` key first), or,
given `class_weight`, shares in proportion to the backlogged classes' weights (GPS); equal
shares within a class. Rates are recomputed only when the set of
backlogged flows or the capacity changes: a flow becomes backlogged (a message released
into an empty queue) or drains, a flow finishes, the trace steps. Between two such
instants every rate is constant, so each message's completion time is computed exactly
(t0 + remaining bytes / rate) without an event per message, let alone per packet.

A message is delivered `latency_s` after its last byte leaves (propagation); each message
carries `message_overhead_bytes` of framing on the wire in addition to its payload.

Trace times count from the simulation's start (`trace_origin="run"`), or from the instant
the link first carries a byte (`"first_byte"`: a recorded trace replayed against the
transfer, wherever prefill puts it). A run-origin trace that ends before the first byte
does nothing but set the rate; the link warns when that happens.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import simpy

from kvsim.core.checks import check_number, check_trace
from kvsim.sim.timer import Timer, call_later

_MESSAGES_CACHED = 4096  # prepared size arrays a link keeps (Link.messages)
_REL_EPS = 1e-12  # relative slack when deciding that a message's last byte has left
TRACE_ORIGINS = ("run", "first_byte")


class Flow:
    """One FIFO of messages on a link. Times in s, sizes in bytes (wire bytes incl. overhead)."""

    __slots__ = ("link", "priority", "name", "sizes", "cum", "release", "n", "head", "served",
                 "rate", "complete_t", "on_delivered", "on_done", "done", "idle_t", "tag",
                 "first_byte_t", "idle_j", "cum_l", "head_release_t", "last_release_t")

    def __init__(self, link: Link, priority: Any, messages: Messages, release: np.ndarray,
                 on_delivered: Callable[[Flow, int, int, np.ndarray], None] | None,
                 on_done: Callable[[Flow], None] | None, name: str, tag: Any) -> None:
        self.link, self.priority, self.name, self.tag = link, priority, name, tag
        self.sizes = messages.sizes  # [n] float64 bytes
        self.cum = messages.cum  # [n] bytes through message j
        self.release = release  # [n] s, non-decreasing
        self.n = messages.n
        self.cum_l = messages.cum_l  # the same as Python floats: cheap scalar access
        # release (s) of message `head` (inf once every message is sent; kept by
        # sent_through) and of the last: the scalars the link reads at every reallocation.
        # Two scalars, not a float object per message of every flow in flight: a run's cost
        # per event grows with what it keeps in flight
        self.head_release_t = release.item(0)
        self.last_release_t = release.item(-1)
        self.head = 0  # messages fully sent
        self.served = 0.0  # bytes sent so far
        self.rate = 0.0  # bytes/s now
        self.complete_t = messages.unsent.copy()  # [n] s, last byte left the sender (nan)
        self.on_delivered, self.on_done = on_delivered, on_done
        self.done = False
        self.idle_j = -1  # last message sent before the flow drains at the current rate
        self.idle_t = math.inf  # when, at the current rate, this flow drains or must be revisited
        self.first_byte_t = math.nan

    @property
    def total_bytes(self) -> float:
        return float(self.cum[-1]) if self.n else 0.0

    def backlogged(self, t: float) -> bool:
        """Released bytes not yet sent at time t."""
        return self.head_release_t <= t

    def sent_through(self, k: int) -> bool:
        """Messages 0..k-1 have left: k is the head now. True when that was the last."""
        self.head = k
        if k == self.n:
            self.head_release_t = math.inf
            return True
        self.head_release_t = self.release.item(k)
        return False

    def arrival_t(self) -> np.ndarray:
        return self.complete_t + self.link.latency_s


class Messages:
    """A flow's messages as a link carries them: wire bytes (payload + the link's framing)
    [n], their running total [n] (array, and list for scalar access). Read-only, shared by
    every flow of the same sizes on the link (Link.messages)."""

    __slots__ = ("sizes", "cum", "cum_l", "n", "unsent")

    def __init__(self, sizes: np.ndarray) -> None:
        self.sizes = sizes  # [n] bytes
        self.cum = sizes.cumsum()  # [n] bytes through message j
        self.cum_l: list[float] = self.cum.tolist()
        self.n = len(sizes)
        self.unsent = np.full(self.n, np.nan)  # [n] completion times before any is sent


class Link:
    def __init__(self, env: simpy.Environment, bandwidth_gbps: float, latency_s: float = 0.0,
                 message_overhead_bytes: float = 0.0,
                 trace: Sequence[Sequence[float]] | None = None, name: str = "link",
                 trace_origin: str = "run",
                 class_weight: Callable[[Any], float] | None = None,
                 shared_messages: dict[float, dict[int, tuple[np.ndarray, Messages]]] | None
                 = None) -> None:
        check_number(f"{name}: bandwidth_gbps", bandwidth_gbps)
        if trace_origin not in TRACE_ORIGINS:
            raise ValueError(f"{name}: trace_origin must be one of {TRACE_ORIGINS}, got "
                             f"{trace_origin!r}")
        self.trace_origin = trace_origin
        self.has_trace = bool(trace)
        # None: strict priority between classes; else weight of a class (priority key) > 0
        self.class_weight = class_weight
        check_number(f"{name}: latency_s", latency_s, strict=False)
        check_number(f"{name}: message_overhead_bytes", message_overhead_bytes, strict=False)
        check_trace(f"{name}: trace", trace or [])  # finite, t_s >= 0 non-decreasing, gbps > 0
        self.env, self.name = env, name
        self.latency_s = float(latency_s)
        self.message_overhead_bytes = float(message_overhead_bytes)
        # capacity steps: times [k] s and bytes/s [k], piecewise constant from each time on;
        # of several entries at the same time the last one holds
        steps = [(0.0, float(bandwidth_gbps))]
        for point in trace or []:
            t, gbps = float(point[0]), float(point[1])
            if t == steps[-1][0]:
                steps[-1] = (t, gbps)
            else:
                steps.append((t, gbps))
        self.step_t = [s[0] for s in steps]
        self.step_rate = [s[1] * 1e9 / 8.0 for s in steps]  # bytes/s
        self._step = 0
        self.flows: list[Flow] = []  # unfinished flows
        self.last_t = env.now
        self._timer: Timer | None = None
        self._timer_t = math.inf
        self._finished_bytes = 0.0
        self._finished_pending = False  # a flow sent its last message since the last reschedule
        self._holding = False  # inside holding(): submits wait for its one reallocation
        self.submitted_bytes = 0.0
        # id(payload sizes array) -> (the array, its Messages): see messages(); with
        # shared_messages (message overhead -> such a dict), one dict for every link of the
        # same framing: a run's links carry the same plans' arrays, and a Messages per
        # array and link would be a cost per request that grows with the number of links
        self._messages: dict[int, tuple[np.ndarray, Messages]] = (
            {} if shared_messages is None else
            shared_messages.setdefault(self.message_overhead_bytes, {}))
        self.events = 0  # rate recomputations (for events/s accounting)
        self.first_byte_t = math.nan  # the link first carried a byte
        self.first_t = math.nan
        self.last_done_t = 0.0

    # ---- capacity ----------------------------------------------------------------------
    def capacity_at(self, t: float) -> float:
        """bytes/s at time t."""
        k = 0
        while k + 1 < len(self.step_t) and self.step_t[k + 1] <= t:
            k += 1
        return self.step_rate[k]

    def capacity_bytes(self, t0: float, t1: float) -> float:
        """Integral of the capacity over [t0, t1] in bytes."""
        total = 0.0
        for k, start in enumerate(self.step_t):
            end = self.step_t[k + 1] if k + 1 < len(self.step_t) else math.inf
            lo, hi = max(t0, start), min(t1, end)
            if hi > lo:
                total += (hi - lo) * self.step_rate[k]
        return total

    # ---- submitting ------------------------------------------------------------------
    def submit(self, sizes_bytes: np.ndarray, release_t: np.ndarray, priority: Any = 0,
               on_delivered: Callable[[Flow, int, int, np.ndarray], None] | None = None,
               on_done: Callable[[Flow], None] | None = None, name: str = "flow",
               tag: Any = None) -> Flow:
        """Queue messages (payload sizes in bytes, release times in s, both [n]) as one flow.

        on_delivered(flow, j0, j1, arrival_t[j1-j0]) is called, in order, as messages
        j0..j1-1 finish (arrival = last byte left + latency); on_done(flow) once, when the
        last message has left (its arrival time is flow.arrival_t()[-1])."""
        now = self.env.now
        messages = self.messages(sizes_bytes)
        release = np.asarray(release_t, dtype=np.float64)
        if release.shape != messages.sizes.shape:
            raise ValueError(f"{self.name}: sizes and release times must be equal-length, "
                             f"non-empty 1-D arrays, got {messages.sizes.shape} and "
                             f"{release.shape}")
        # checked on Python floats: once per flow, and a sorted list is one linear pass
        # (a third of numpy's slice-compare-reduce on a request's few dozen messages)
        release_l = release.tolist()
        if release_l != sorted(release_l):
            raise ValueError(f"{self.name}: release times must be non-decreasing")
        if release_l[0] < now:
            if release_l[0] < now - 1e-12 * max(1.0, abs(now)):
                raise ValueError(f"{self.name}: release time {release_l[0]} is before now "
                                 f"({now})")
            # (non-decreasing: only a head within rounding of now)
            release = np.maximum(release, now)
        self._advance(now)
        flow = Flow(self, priority, messages, release, on_delivered, on_done, name, tag)
        self.flows.append(flow)
        self.submitted_bytes += flow.total_bytes
        if math.isnan(self.first_t):
            self.first_t = now
        if not self._holding:
            self._reschedule()
        return flow

    def expect(self, now: float) -> None:
        """A flow set up later will be submitted (prefix reuse defers a monolithic transfer's
        plan to its prefill's end): `utilisation` counts from now, as a submit now would."""
        if math.isnan(self.first_t):
            self.first_t = now

    def messages(self, sizes_bytes: np.ndarray) -> Messages:
        """The link's Messages for payload sizes [n] (bytes), checked (1-D, non-empty, > 0)
        and prepared once per array: a simulation submits the same plan's sizes array for
        every request of a context, so it is looked up by identity (the cache holds the
        array, so its id is not reused while the entry lives)."""
        hit = self._messages.get(id(sizes_bytes))
        if hit is not None and hit[0] is sizes_bytes:
            return hit[1]
        sizes = np.asarray(sizes_bytes, dtype=np.float64) + self.message_overhead_bytes
        if sizes.ndim != 1 or len(sizes) == 0:
            raise ValueError(f"{self.name}: message sizes must be a non-empty 1-D array, "
                             f"got shape {sizes.shape}")
        if sizes.min() <= 0:
            raise ValueError(f"{self.name}: message sizes must be > 0 bytes")
        messages = Messages(sizes)
        if isinstance(sizes_bytes, np.ndarray):  # lists are built per call: not cached
            if len(self._messages) >= _MESSAGES_CACHED:  # a caller with fresh arrays per
                self._messages.clear()  # flow gains nothing; bound what it holds
            self._messages[id(sizes_bytes)] = (sizes_bytes, messages)
        return messages

    def holding(self) -> Holding:
        """`with link.holding():` submit several flows at one instant with one reallocation,
        when the block ends, instead of one per flow (a request's streams enter its link
        together). The outcome is the same: the rates, drain points and timer after the
        last of several reallocations at one instant depend only on the flows there are,
        and nothing between the submits reads the link."""
        return Holding(self)

    def flush(self) -> None:
        """Report (on_delivered) every message whose last byte has left by now. Messages
        complete between rate changes without an event, so their reports wait for the next
        one; a reader that needs every arrival so far (a decode instance's FIFO
        deserializer) flushes first. Rates are unchanged: nothing drains between events."""
        self._advance(self.env.now)

    # ---- the fluid engine --------------------------------------------------------------
    def _advance(self, t: float) -> None:
        """Send bytes at the current rates over [last_t, t]; record message completions."""
        t0 = self.last_t
        if t <= t0:
            return
        for flow in self.flows:
            r = flow.rate
            if r <= 0.0:
                continue
            s0, cum = flow.served, flow.cum
            drained = t >= flow.idle_t - 1e-12 * max(1.0, flow.idle_t)
            j0 = flow.head
            if drained:  # this is the flow's idle instant: it sent exactly through idle_j
                k, s1 = flow.idle_j + 1, flow.cum_l[flow.idle_j]
                if k == j0 + 1:  # one message: scalar path (the common per-chunk case)
                    d = t0 + (s1 - s0) / r
                    d = t if d > t else d
                    flow.complete_t[j0] = d
                    flow.served = s1
                    if flow.sent_through(k):
                        self._finished_pending = True
                    if flow.on_delivered is not None:
                        flow.on_delivered(flow, j0, k, np.array((d + self.latency_s,)))
                    continue
            else:
                s1 = s0 + r * (t - t0)
                # messages whose last byte left by t (all released: no idling between events)
                k = min(int(cum.searchsorted(s1 * (1 + _REL_EPS), side="right")), flow.n)
            if k > j0:
                # t0 + (cum - s0) / r, exact (constant rate since t0), in one array
                done_t = cum[j0:k] - s0
                done_t /= r
                done_t += t0
                np.minimum(done_t, t, out=done_t)
                flow.complete_t[j0:k] = done_t
                if flow.sent_through(k):
                    self._finished_pending = True
                if flow.on_delivered is not None:
                    done_t += self.latency_s  # now the arrival times (the receiver keeps them)
                    flow.on_delivered(flow, j0, k, done_t)
            flow.served = min(s1, flow.cum_l[-1])
        self.last_t = t

    def _idle_index(self, flow: Flow) -> int:
        """Index of the message after which the flow drains at its current rate (the first j
        >= head whose successor is released after j completes, or the last message)."""
        r, t, s0 = flow.rate, self.last_t, flow.served
        j0, n = flow.head, flow.n
        if j0 >= n - 1 or flow.last_release_t <= t:
            # every message is released by now, so each one's successor is waiting when it
            # completes (after now): the flow drains after its last message
            return n - 1
        # fast path (encoder slower than the link): the flow drains after its head message
        if flow.release.item(j0 + 1) > (t + (flow.cum_l[j0] - s0) / r) * (1 + _REL_EPS):
            return j0
        width = 64
        while True:
            j1 = min(n - 1, j0 + width)
            if j1 <= j0:
                return n - 1
            done = t + (flow.cum[j0:j1] - s0) / r  # completion of messages j0..j1-1
            gap = flow.release[j0 + 1 : j1 + 1] > done * (1 + _REL_EPS)
            hit = int(gap.argmax())  # the first gap, or 0 when there is none
            if gap[hit]:
                return j0 + hit
            if j1 >= n - 1:
                return n - 1
            j0, width = j1, width * 8

    def _reschedule(self) -> None:
        """Finish drained flows, reallocate rates, arm the timer for the next change."""
        now = self.env.now
        self.events += 1
        if self._finished_pending:
            self._finished_pending = False
            finished = [f for f in self.flows if f.head >= f.n]
            self.flows = [f for f in self.flows if f.head < f.n]
            for f in finished:
                f.done, f.rate = True, 0.0
                self._finished_bytes += f.total_bytes
                self.last_done_t = max(self.last_done_t, float(f.complete_t[-1]))
            for f in finished:
                if f.on_done is not None:
                    f.on_done(f)
                # a finished flow reports nothing more: dropping its callbacks breaks the
                # flow <-> receiver reference cycle, so that a finished request is freed by
                # reference counting rather than by the cyclic collector at the run's end
                f.on_delivered = f.on_done = None
        # backlogged flows per class: strict priority gives the capacity to the best
        # (smallest key) class; weighted classes share it in proportion to their weights
        # (generalized processor sharing); flows of a class share its part equally
        best, count = None, 0
        counts: dict[Any, int] = {}
        weighted = self.class_weight is not None
        for f in self.flows:
            if f.head_release_t <= now:  # (inf once every message is sent)
                p = f.priority
                if weighted:
                    counts[p] = counts.get(p, 0) + 1
                    count += 1
                elif best is None or p < best:
                    best, count = p, 1
                elif p == best:
                    count += 1
        if count and math.isnan(self.first_byte_t):
            self._first_byte(now)
        # capacity step bookkeeping
        while self._step + 1 < len(self.step_t) and self.step_t[self._step + 1] <= now:
            self._step += 1
        capacity = self.step_rate[self._step]
        shares: dict[Any, float] = {}
        best_share = capacity / count if count else 0.0  # strict: each best-class flow's rate
        if count and weighted:
            weights = {key: self.class_weight(key) for key in counts}
            total = sum(weights.values())
            shares = {key: capacity * weights[key] / total / counts[key] for key in counts}
        next_t = math.inf
        for f in self.flows:
            if weighted:
                share = shares.get(f.priority, 0.0)
            else:
                share = best_share if count and f.priority == best else 0.0
            if share > 0.0 and f.head_release_t <= now:
                if f.rate != share or f.idle_j < f.head:
                    # rate changed: find where the flow drains at the new rate (an unchanged
                    # rate keeps the drain point computed earlier: releases are fixed)
                    if f.rate == 0.0 and math.isnan(f.first_byte_t):
                        f.first_byte_t = now
                    f.rate = share
                    j = self._idle_index(f)
                    f.idle_j = j
                    f.idle_t = now + (f.cum_l[j] - f.served) / share
                if f.idle_t < next_t:
                    next_t = f.idle_t
            else:
                f.rate = 0.0
                f.idle_t = math.inf
                rel = f.head_release_t
                if rel > now and rel < next_t:
                    next_t = rel
        if self.flows and self._step + 1 < len(self.step_t):
            next_t = min(next_t, self.step_t[self._step + 1])
        self._arm(next_t)

    def _first_byte(self, now: float) -> None:
        """The link starts carrying bytes: anchor a first_byte trace here (nothing was sent
        before, so no capacity was used yet), or warn that a run trace is already over."""
        self.first_byte_t = now
        if not self.has_trace:
            return
        if self.trace_origin == "first_byte":
            self.step_t = [0.0] + [now + t for t in self.step_t[1:]]
            self._step = 0
        elif self.step_t[-1] <= now:
            warnings.warn(
                f"{self.name}: its bandwidth trace ends at {self.step_t[-1]:g} s, before its "
                f"first byte at {now:.3f} s: the transfer runs at the trace's last rate only "
                "(link.trace_origin=first_byte replays the trace from the first byte)",
                stacklevel=2)

    def _arm(self, t: float) -> None:
        if t == self._timer_t and self._timer is not None:
            return
        if math.isinf(t):
            self._timer, self._timer_t = None, math.inf
            return
        delay = max(0.0, t - self.env.now)
        self._timer, self._timer_t = call_later(self.env, delay, self._on_timer), t

    def _on_timer(self, event: Timer) -> None:
        if event is not self._timer:
            return  # superseded by a later reschedule
        self._timer, self._timer_t = None, math.inf
        self._advance(self.env.now)
        self._reschedule()

    # ---- accounting ------------------------------------------------------------------
    def utilisation(self, t_end: float) -> float:
        """Bytes sent / bytes the link could have sent over [first submit, t_end]."""
        if math.isnan(self.first_t) or t_end <= self.first_t:
            return 0.0
        return self.total_sent_bytes / self.capacity_bytes(self.first_t, t_end)

    def busy_utilisation(self) -> float:
        """Bytes sent / bytes the link could have sent over [first byte, last byte left]:
        how full the link ran while it had work (1.0 for a saturated link), as opposed to
        `utilisation` over the whole run."""
        if math.isnan(self.first_byte_t) or self.last_done_t <= self.first_byte_t:
            return math.nan
        return self.total_sent_bytes / self.capacity_bytes(self.first_byte_t, self.last_done_t)

    @property
    def total_sent_bytes(self) -> float:
        return self._finished_bytes + sum(f.served for f in self.flows)


class Holding:
    """Link.holding's context: submits inside it skip their reallocation; one follows at
    its end. (A plain class, not contextlib's generator: it is entered once per request.)"""

    __slots__ = ("link",)

    def __init__(self, link: Link) -> None:
        self.link = link

    def __enter__(self) -> None:
        self.link._holding = True

    def __exit__(self, *exc: object) -> None:
        self.link._holding = False
        self.link._reschedule()
