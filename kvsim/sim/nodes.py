"""Prefill and decode instances (simpy actors' state) and the receive side: per-flow
arrival bookkeeping and the request's deserializer on its decode instance.

Deserialization model (stated assumptions): a request's streams are deserialized by one
server on its decode instance in priority order (anchor first; `deserializer=shared`, the
default) or by one server per stream (`deserializer=per_stream`); with these two,
concurrent requests on the same decode instance deserialize independently (the instance
overlaps them as it overlaps its batched decode steps). `deserializer=node`: one server
per decode instance for every message of every request on it, first come first served
by arrival (NodeDeserializer; no priority between streams). `deserializer=on_demand`: no work
on arrival (a flow is ready at its last byte); the request's decoder dequantizes what it
needs when it starts on it (kvsim.sim.run: the anchor, then the full cache after drafting),
as kvsim's transport receiver does. Drafting on the anchor does not slow the
residual's dequantization (nor the reverse): what drafting costs on a partial cache is
`speculative.draft_overhead_s` per drafted token. On one host that runs both ends of a
transfer (kvsim emulate), the on-arrival worker runs slower while the request's own encoder
shares its cores and while its bytes are taken in (a link profile's `worker_pace`: WorkPace).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Protocol

import numpy as np
import simpy

from kvsim.scenario.policy import FlowPlan, serial_pipeline
from kvsim.scenario.prefix_cache import PrefixCache
from kvsim.scenario.timing_model import TimingModel
from kvsim.sim.batch import DecodeBatch
from kvsim.sim.link import Flow, Link
from kvsim.sim.prefill_batch import ChunkedPrefill
from kvsim.sim.timer import Timer, call_later

_NONE = np.empty(0)  # [0] s: no arrival reported yet (read-only use)


class PrefillNode:
    """One prefill instance: runs one prefill at a time, first come first served, and owns
    one serial encoder whose chunks leave on `link`. A FIFO server with known service times
    needs no queue of events: a request that arrives now starts its prefill at
    max(now, free_t) and ends it prefill_s later (kvsim.sim.run)."""

    def __init__(self, index: int, link: Link) -> None:
        self.name = f"prefill{index}"
        self.free_t = -math.inf  # the prefill of the last request routed here ends (s)
        self.encoder_free_t = 0.0
        self.link = link
        # chunked prefill batching (workload.prefill_chunk_tokens > 0) replaces free_t
        self.chunked: ChunkedPrefill | None = None
        # requests waiting for the instance: (start s, start()) in start order, one timer
        # (for the head) at a time, so that a long queue does not fill the event heap
        self.waiting: deque[tuple[float, Callable[[], None]]] = deque()

    def start_at(self, t: float, start: Callable[[], None]) -> None:
        """Call start() at time t (s, after the starts already waiting: FIFO)."""
        self.waiting.append((t, start))
        if len(self.waiting) == 1:
            env = self.link.env
            call_later(env, t - env.now, self._started)

    def _started(self, _timer: Timer) -> None:
        _, start = self.waiting.popleft()
        start()
        if self.waiting:
            env = self.link.env
            call_later(env, self.waiting[0][0] - env.now, self._started)


class DecodeNode:
    """One decode instance: up to `max_batch` sequences decode concurrently, and only while
    their bf16 KV caches fit beside the weights (`admission`: a request takes a slot, then
    its cache's bytes, and gives both back when it finishes). Admitted requests decode
    together in `batch`, a continuous batch (kvsim.sim.batch: every join and leave re-times
    the step)."""

    def __init__(self, env: simpy.Environment, index: int, max_batch: int,
                 kv_memory_bytes: float, timing: TimingModel) -> None:
        self.name, self.index = f"decode{index}", index
        self.kv_memory_bytes = float(kv_memory_bytes)
        self.admission = DecodeAdmission(max_batch, self.kv_memory_bytes)
        self.batch = DecodeBatch(env, timing)
        self.deserializer: NodeDeserializer | None = None  # deserializer=node only
        self.prefix: PrefixCache | None = None  # prefix_cache.enabled only

    def keep_prefix(self, prefix: PrefixCache) -> None:
        """Hold prefix blocks in this instance's KV memory (its bytes are admission's)."""
        self.prefix = prefix
        self.admission.prefix = prefix


class DecodeAdmission:
    """Admission to one decode instance, first come first served in two stages: a slot of
    the batch (`max_batch`), then the request's KV bytes out of `kv_memory_bytes` (memory
    beside the weights). A request holding a slot whose cache does not fit waits, and the
    ones behind it wait too. Callbacks, not simpy events: admission changes only when a
    request asks (`request`) or leaves (`release`), and the admitted one starts then.

    With a prefix cache (`prefix`) in the same memory, its idle blocks give way to the first
    waiting request when that makes it fit (and only then). Its pinned blocks belong to
    requests running or waiting here: when the first waiting request cannot fit and none is
    running (so no release would ever come), the first later one that fits goes ahead,
    since only its finish can unpin the blocks the first one waits for."""

    def __init__(self, max_batch: int, kv_memory_bytes: float) -> None:
        if max_batch < 1:
            raise ValueError(f"decode max_batch must be >= 1, got {max_batch}")
        self.free_slots = int(max_batch)
        self.free_bytes = float(kv_memory_bytes)
        # waiting for a slot: (KV bytes, admitted callback)
        self._slot_queue: deque[tuple[float, Callable[[float], None]]] = deque()
        # holding a slot, waiting for memory: (KV bytes, slot time s, admitted callback)
        self._memory_queue: deque[tuple[float, float, Callable[[float], None]]] = deque()
        self.prefix: PrefixCache | None = None
        self.running = 0  # admitted and not released

    def request(self, kv_bytes: float, now: float, admitted: Callable[[float], None]) -> None:
        """Queue a request for `kv_bytes` of cache; admitted(t_slot) is called (now or at a
        later release) once it holds a slot and its bytes; t_slot: when it got the slot."""
        self._slot_queue.append((kv_bytes, admitted))
        self._grant(now)

    def release(self, kv_bytes: float, now: float, slot: bool = True) -> None:
        """A request finished now: its slot and its bytes return; admit who fits. (slot
        False: only bytes return, freed by a prefix cache's eviction.)"""
        self.free_bytes += kv_bytes
        self.free_slots += slot
        self.running -= slot
        self._grant(now)

    def _grant(self, now: float) -> None:
        while self.free_slots and self._slot_queue:
            kv_bytes, admitted = self._slot_queue.popleft()
            self.free_slots -= 1
            self._memory_queue.append((kv_bytes, now, admitted))
        queue = self._memory_queue
        while queue:
            need = queue[0][0]
            if need > self.free_bytes:
                prefix = self.prefix
                if prefix is None:
                    break
                if self.free_bytes + prefix.idle_bytes >= need:
                    self.free_bytes += prefix.evict(need - self.free_bytes)
                elif self.running == 0:  # stalled behind blocks pinned by waiting requests
                    self._admit_fitting(now)
                    break
                else:
                    break
            kv_bytes, t_slot, admitted = queue.popleft()
            self.free_bytes -= kv_bytes
            self.running += 1
            admitted(t_slot)

    def _admit_fitting(self, now: float) -> None:
        """Admit the first waiting request (after the head) that fits, idle blocks evicted
        for it if need be (prefix reuse only: see the class)."""
        prefix = self.prefix
        for i, (kv_bytes, t_slot, admitted) in enumerate(self._memory_queue):
            if i and self.free_bytes + prefix.idle_bytes >= kv_bytes:  # type: ignore[union-attr]
                if kv_bytes > self.free_bytes:
                    self.free_bytes += prefix.evict(kv_bytes - self.free_bytes)  # type: ignore
                del self._memory_queue[i]
                self.free_bytes -= kv_bytes
                self.running += 1
                admitted(t_slot)
                return
        # none fits now: a request that joins the queue later may (Scenario.run names the
        # stall if none ever does)


class Carried(Protocol):
    """What a receiver reads of a flow once carried: a link's `Flow`, or the join of an
    egress and an ingress crossing (kvsim.sim.ingress.CarriedFlow)."""

    release: np.ndarray  # [m] s, messages released by the encoder
    complete_t: np.ndarray  # [m] s, last byte carried
    cum_l: list[float]  # [m] bytes through message j


class Receiver:
    """Receives one flow on the decode node: collects its messages' arrival times (s) and,
    once the flow's last message has left the link, hands it to the request's
    `Deserializer`, which fires `ready` when the last message is deserialized."""

    # slots: one per stream of each request in flight, read at every delivery, and a run's
    # cost per event grows with what it keeps in flight (the sizes:
    # docs/development/simulator-speed.md)
    __slots__ = ("env", "plan", "group", "is_ready", "_waiting", "_arrivals", "arrival_t",
                 "received_bytes", "last_arrival_t", "ready_t", "first_arrival_t",
                 "backlog_start_t", "is_done", "node_finish_t", "carriers")

    def __init__(self, env: simpy.Environment, plan: FlowPlan, group: Deserializer) -> None:
        self.env, self.plan, self.group = env, plan, group
        self.is_ready = False  # its ready time has come (see fire)
        self._waiting: list[Callable[[], None]] = []  # called once, when it is ready
        self._arrivals: list[np.ndarray] = []
        self.arrival_t = np.empty(0)  # [m] s, set when the flow is done
        self.received_bytes = 0.0
        self.last_arrival_t = math.nan
        self.ready_t = math.nan
        self.first_arrival_t = math.nan
        self.backlog_start_t = math.nan  # release of the message opening the last backlog
        self.is_done = False
        self.node_finish_t = -math.inf  # deserializer=node: its last message processed
        # the link flows that carry it (the egress; with an ingress, the egress then the
        # ingress), set by the scenario when it submits them (kvsim.sim.worker_load reads them)
        self.carriers: list[Flow] = []

    def release(self) -> None:
        """The request is finished: drop the links to its deserializer and its link flows
        (reference cycles: freed by reference counting, not by the cyclic collector)."""
        self.group = None  # type: ignore[assignment]
        self.carriers = []

    def known_arrivals(self) -> np.ndarray:
        """[j] arrival times (s) reported so far, in order."""
        if self.is_done:
            return self.arrival_t
        if len(self._arrivals) == 1:
            return self._arrivals[0]
        return np.concatenate(self._arrivals) if self._arrivals else _NONE

    def delivered(self, flow: Carried, j0: int, j1: int, arrival_t: np.ndarray) -> None:
        # arrivals come in order; deserialization is evaluated when the flow (and every
        # higher-priority flow of the request) is done, which keeps per-event cost low
        self._arrivals.append(arrival_t)
        node = self.group.node
        if node is not None and self.group.pipelined:
            node.offer(self, arrival_t, self.plan.deserialize_s[j0:j1])
        self.received_bytes += flow.cum_l[j1 - 1] - (flow.cum_l[j0 - 1] if j0 else 0.0)

    def done(self, flow: Carried) -> None:
        arrivals = self._arrivals  # [m] s, every message of the flow, as reported
        self.arrival_t = arrivals[0] if len(arrivals) == 1 else np.concatenate(arrivals)
        self.first_arrival_t, self.last_arrival_t = (float(self.arrival_t[0]),
                                                    float(self.arrival_t[-1]))
        self.backlog_start_t = backlog_start(flow.release, flow.complete_t)
        self.is_done = True
        self.group.flow_done()

    def fire(self, ready_t: float) -> None:
        """The flow will be deserialized at ready_t (s): one event then."""
        self.ready_t = ready_t
        call_later(self.env, max(0.0, ready_t - self.env.now), self._ready)

    def _ready(self, _timer: Timer) -> None:
        self.is_ready = True
        waiting, self._waiting = self._waiting, []
        for callback in waiting:
            callback()

    def when_ready(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the flow is ready: now if it is, else at its ready time."""
        if self.is_ready:
            callback()
        else:
            self._waiting.append(callback)


def when_all_ready(receivers: list[Receiver], callback: Callable[[], None]) -> None:
    """Call `callback` once every receiver is ready (now, if they all are)."""
    pending = [rx for rx in receivers if not rx.is_ready]
    if not pending:
        callback()
        return
    if len(pending) == 1:  # (a split-stream request waits for its anchor alone)
        pending[0]._waiting.append(callback)
        return
    left = [len(pending)]

    def one_ready() -> None:
        left[0] -= 1
        if left[0] == 0:
            callback()

    for rx in pending:
        rx._waiting.append(one_ready)


def backlog_start(release_t: np.ndarray, complete_t: np.ndarray) -> float:
    """Start of a flow's final backlog period: the release time (s) of the last message
    released after its predecessor had left (the flow sat empty, waiting for the encoder),
    or of the first message. From then on the flow always had bytes queued, so its last
    byte's lateness after that instant is the link's (own bytes, or others' ahead of it)
    and before it the encoder's: the Figure-2 breakdown splits serialize / communication
    there. release_t, complete_t: [m] s."""
    if len(release_t) < 2:
        return float(release_t[0])
    starved = release_t[1:] > complete_t[:-1]  # [m-1] message j+1 found the flow empty
    last = starved[::-1]  # [m-1] from the last message back
    i = int(last.argmax())  # the last starved message, or 0 when none is (one pass)
    if not last[i]:
        return float(release_t[0])
    return float(release_t[len(starved) - i])


class WorkPace:
    """How long an on-arrival worker's jobs take as time passes, on a host that runs both
    ends of a transfer (kvsim emulate; a link profile's `worker_pace`, fitted by
    kvsim.calibrate.worker_pace): every job `alone` x its work (the codec timing's layer
    job), and over each span (start s, end s, extra) 1 + extra times that (the extras of
    overlapping spans add: the request's encoder beside it, its bytes being taken in).

    Jobs are served on a work clock that runs 1/(1 + extra) as fast over the spans: a
    non-preemptive server whose speed varies with time finishes its jobs where the same
    server at full speed would on that clock (the work done is the clock's advance), mapped
    back (the clock is piecewise linear: np.interp both ways)."""

    __slots__ = ("alone", "edges_t", "_work_t")

    def __init__(self, alone: float, spans: list[tuple[float, float, float]]) -> None:
        if not alone > 0 or any(not (x >= 0 and math.isfinite(a) and math.isfinite(b)
                                     and b >= a) for a, b, x in spans):
            raise ValueError(f"a worker's pace needs alone > 0 and spans (start <= end, "
                             f"extra >= 0), got {alone} and {spans}")
        self.alone = float(alone)
        spans = [(a, b, x) for a, b, x in spans if b > a and x > 0]
        edges = np.unique(np.array([t for a, b, _x in spans for t in (a, b)], dtype=float))
        self.edges_t = edges  # [k] s, increasing (k = 0: no span)
        if len(edges) < 2:
            self._work_t = edges
            return
        mid = (edges[:-1] + edges[1:]) / 2  # [k-1] s
        ratio = 1.0 + sum(x * ((a <= mid) & (mid < b)) for a, b, x in spans)  # [k-1]
        self._work_t = edges[0] + np.concatenate([[0.0], np.cumsum(np.diff(edges) / ratio)])

    def to_work(self, t: np.ndarray) -> np.ndarray:
        """[m] s of real time -> the work clock (s): slope 1 outside the spans."""
        e, w = self.edges_t, self._work_t
        if len(e) < 2:
            return t
        return np.interp(t, e, w) + np.minimum(t - e[0], 0.0) + np.maximum(t - e[-1], 0.0)

    def from_work(self, v: np.ndarray) -> np.ndarray:
        """[m] s of the work clock -> real time (s): the inverse of to_work."""
        e, w = self.edges_t, self._work_t
        if len(e) < 2:
            return v
        return np.interp(v, w, e) + np.minimum(v - w[0], 0.0) + np.maximum(v - w[-1], 0.0)


def worker_server(arrival_t: list[np.ndarray], work_s: list[np.ndarray],
                  pace: WorkPace | None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """priority_server's jobs (work_s: the codec timing's) at `pace` (None: as their work
    says): ([m_c] start times, [m_c] finish times) per class (s)."""
    if pace is None:
        finish = priority_server(arrival_t, work_s)
        return [f - w for f, w in zip(finish, work_s, strict=True)], finish
    work = [w * pace.alone for w in work_s]
    on_clock = priority_server([pace.to_work(a) for a in arrival_t], work)
    return ([pace.from_work(f - w) for f, w in zip(on_clock, work, strict=True)],
            [pace.from_work(f) for f in on_clock])


def priority_server(arrival_t: list[np.ndarray], work_s: list[np.ndarray]) -> list[np.ndarray]:
    """Finish times of jobs on one non-preemptive server, classes in priority order.

    arrival_t[c], work_s[c]: [m_c] s of class c's jobs (arrivals non-decreasing; FIFO
    within a class). Whenever the server frees it starts the waiting job of the best class
    (smallest c); idle, it takes the next job to arrive (ties: the best class). Returns
    [m_c] finish times per class."""
    classes = len(arrival_t)
    if classes > 1:
        fast = _uncontended(arrival_t, work_s)
        if fast is not None:
            return fast
    arr = [a.tolist() for a in arrival_t]
    work = [w.tolist() for w in work_s]
    fin = [[0.0] * len(a) for a in arr]
    head = [0] * classes
    n = [len(a) for a in arr]
    free = -math.inf
    left = sum(n)
    if classes == 1:  # one class: the serial pipeline (closed form)
        return [serial_pipeline(arrival_t[0], work_s[0])] if n[0] else [np.empty(0)]
    inf = math.inf
    while left:
        # next[c]: arrival of class c's next job (inf: none left); plain loops, not min()
        # over generators: this loop runs once per run of jobs, the simulator's hot spot
        nxt = [arr[c][head[c]] if head[c] < n[c] else inf for c in range(classes)]
        # the earliest time any job can start, then the best class waiting by then
        soonest = inf
        for x in nxt:
            if x < soonest:
                soonest = x
        start = soonest if soonest > free else free
        limit = inf  # a better class's next arrival ends the run
        for c in range(classes):
            if nxt[c] <= start:
                break
            if nxt[c] < limit:
                limit = nxt[c]
        # serve class c back to back while no better class has a job waiting
        a, w, f = arr[c], work[c], fin[c]
        i = head[c]
        t = start
        while True:
            t += w[i]
            f[i] = t
            i += 1
            left -= 1
            if i >= n[c] or a[i] > t or limit <= t:
                break
        head[c] = i
        free = t
    return [np.asarray(f) for f in fin]


def _uncontended(arrival_t: list[np.ndarray], work_s: list[np.ndarray],
                 ) -> list[np.ndarray] | None:
    """priority_server's answer when no job ever waits: taken in arrival order, every job
    ends by the next one's arrival, so each starts on arrival and ends at arrival + work
    (the float the job-by-job loop computes too; priorities never come into play). None
    when some job would wait: then the loop decides who goes first."""
    finish = [a + w for a, w in zip(arrival_t, work_s, strict=True)]  # [m_c] s per class
    # classes with jobs, by first arrival: when each one's jobs all arrive before the next
    # one's first (strict priority on the link sends a request's streams one after the
    # other), arrival order is the classes' concatenation: no job waits when none does
    # within a class and each class's last job ends by the next class's first arrival
    busy = [c for c in range(len(arrival_t)) if len(arrival_t[c])]
    if len(busy) > 1:
        busy.sort(key=lambda c: arrival_t[c][0])
        if not all(arrival_t[busy[i]][-1] <= arrival_t[busy[i + 1]][0]
                   for i in range(len(busy) - 1)):  # interleaved: sort every job
            arrival = np.concatenate(arrival_t)  # [j] s, every class's jobs
            order = np.argsort(arrival, kind="stable")
            a, f = arrival[order], np.concatenate(finish)[order]  # [j] s, in arrival order
            return None if _waits(a, f) else finish
        for i in range(len(busy) - 1):
            if finish[busy[i]][-1] > arrival_t[busy[i + 1]][0]:
                return None
    for c in busy:
        if _waits(arrival_t[c], finish[c]):
            return None
    return finish


def _waits(arrival_t: np.ndarray, finish_t: np.ndarray) -> bool:
    """Some job of [m] jobs in arrival order (s) arrives before its predecessor finishes.
    (count_nonzero: a fraction of ndarray.any's cost on a few dozen jobs; per flow.)"""
    return len(arrival_t) > 1 and np.count_nonzero(finish_t[:-1] > arrival_t[1:]) > 0


class NodeDeserializer:
    """One deserialization server per decode instance (`deserializer=node`): every message
    of every request on the instance, first come first served by arrival time.

    Exact without an event per message: messages are buffered as the links report them and
    served when some flow to the instance is done. Then every link is flushed (the egress
    links and, with link.decode_ingress_gbps, the instance's ingress: kvsim.sim.ingress
    hands a message on once both have carried it), so every message that arrives by now +
    latency is known (one not yet reported leaves a link after now); FIFO by arrival, none
    of them can be overtaken by a later report, so the buffered batch is served in arrival
    order after the server's previous work (serial_pipeline from free_t), and a done flow's
    last message has its finish time."""

    def __init__(self, links: list[Link]) -> None:
        self.links = links  # every link that carries flows to this instance
        self.free_t = -math.inf  # the server finishes its work so far (s)
        self._arrival: list[np.ndarray] = []  # buffered jobs: arrival (s) ...
        self._work: list[np.ndarray] = []  # ... work (s) ...
        self._owner: list[Receiver] = []  # ... and whose (one entry per array)

    def offer(self, rx: Receiver, arrival_t: np.ndarray, work_s: np.ndarray) -> None:
        self._arrival.append(np.asarray(arrival_t, dtype=np.float64))
        self._work.append(np.asarray(work_s, dtype=np.float64))
        self._owner.append(rx)

    def serve(self) -> None:
        """Serve every message reported so far; owners learn their last finish time."""
        for link in self.links:
            link.flush()
        if not self._arrival:
            return
        arrival = np.concatenate(self._arrival)  # [j] s
        work = np.concatenate(self._work)  # [j] s
        owner = np.repeat(np.arange(len(self._owner)), [len(a) for a in self._arrival])
        order = np.argsort(arrival, kind="stable")  # ties: in report order
        finish = serial_pipeline(arrival[order], work[order], self.free_t)  # [j] s
        self.free_t = float(finish[-1])
        last = np.full(len(self._owner), -math.inf)
        np.maximum.at(last, owner[order], finish)
        for rx, f in zip(self._owner, last.tolist(), strict=True):
            if f > rx.node_finish_t:
                rx.node_finish_t = f
        self._arrival, self._work, self._owner = [], [], []


class Deserializer:
    """Deserialization of one request's flows on its decode instance.

    shared (default), on_arrival: one server for the request's streams, messages in
    priority order (stream 0, the anchor, first; FIFO within a stream; a message in progress
    is not preempted; on_arrival: a layer's work on its last message, see build_plan;
    `pace`: how long that server's jobs take over time, worker_server). Flow s's finish
    times depend only on messages of streams <= s and on lower streams' messages that
    started before, which have all been reported by the time flows 0..s have left the
    link, so flow s is evaluated then, exactly.
    per_stream: every stream has its own server (streams deserialize in parallel).
    Monolithic transfer (not pipelined): everything is deserialized after the last arrival.
    """

    __slots__ = ("pipelined", "mode", "node", "pace", "receivers", "_fired")  # one per request

    def __init__(self, env: simpy.Environment, plans: list[FlowPlan], pipelined: bool,
                 mode: str = "shared", node: NodeDeserializer | None = None,
                 pace: WorkPace | None = None) -> None:
        if mode not in ("shared", "per_stream", "node", "on_demand", "on_arrival"):
            raise ValueError(f"deserializer must be 'shared', 'per_stream', 'node', "
                             f"'on_demand' or 'on_arrival', got {mode!r}")
        if (mode == "node") != (node is not None):
            raise ValueError("deserializer=node needs the decode instance's NodeDeserializer")
        self.pipelined, self.mode, self.node = pipelined, mode, node
        self.pace = pace  # the server's pace where its work is not what it takes (on_arrival)
        self.receivers = [Receiver(env, fp, self) for fp in plans]
        self._fired = 0  # flows 0.._fired-1 have their ready time

    def flow_done(self) -> None:
        rx = self.receivers
        if self.node is not None:
            if not self.pipelined:  # one job: the whole request after its last arrival
                if not all(r.is_done for r in rx):
                    return
                work = sum(float(r.plan.deserialize_s.sum()) for r in rx)
                self.node.offer(rx[0], np.array([max(r.last_arrival_t for r in rx)]),
                                np.array([work]))
            self.node.serve()
            for r in rx:
                if r.is_done and math.isnan(r.ready_t):
                    r.fire(rx[0].node_finish_t if not self.pipelined else r.node_finish_t)
            return
        if self.mode == "on_demand":  # dequantized by the decoder (kvsim.sim.run)
            for r in rx:
                if r.is_done and math.isnan(r.ready_t):
                    r.fire(r.last_arrival_t)
            return
        if not self.pipelined:
            if all(r.is_done for r in rx):
                last = max(r.last_arrival_t for r in rx)
                work = sum(float(r.plan.deserialize_s.sum()) for r in rx)
                for r in rx:
                    r.fire(last + work)
                self._fired = len(rx)
            return
        if self.mode == "per_stream":
            for r in rx:
                if r.is_done and math.isnan(r.ready_t):
                    r.fire(float(serial_pipeline(r.arrival_t, r.plan.deserialize_s)[-1]))
            return
        while self._fired < len(rx) and rx[self._fired].is_done:
            s = self._fired
            arrivals = [r.known_arrivals() for r in rx]
            works = [r.plan.deserialize_s[: len(a)] for r, a in zip(rx, arrivals, strict=True)]
            fin = priority_server(arrivals, works) if self.pace is None else \
                worker_server(arrivals, works, self.pace)[1]
            rx[s].fire(float(fin[s][-1]))
            self._fired += 1
