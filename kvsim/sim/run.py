"""Run one scenario (codec x transfer policy x context x bandwidth) and return its report row.

A request's passage (`Passage`) is a chain of callbacks on the simpy clock, not a
generator process: `arrivals` starts each request at its arrival time; it is routed, and
its prefill starts when its prefill instance frees (a FIFO server with known service
times: one timer, no queue of events); its chunks are handed to the link as the encoder
releases them; once the flows its policy needs are deserialized it asks its decode
instance for a slot and its cache's memory (kvsim.sim.nodes.DecodeAdmission) and decodes
(speculatively on the anchor for split-stream). Links are fluid servers (kvsim.sim.link);
the per-token decode timeline is a continuous batch per decode instance
(kvsim.sim.batch: a fluid clock re-timed at every join, leave and phase change), so a
request costs events per flow and per batch change, not per token. Callbacks instead of
generator processes: no process start, resource request and release, or condition event
per wait, so a run schedules about half the events, with the same results
(tests/test_sim_golden.py). The timers behind those callbacks are kvsim.sim.timer's, not
simpy Timeouts: the same order, about half the cost to schedule. The figures are in the
docs (development/simulator-speed.md).
"""

from __future__ import annotations

import copy
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import simpy

from kvsim.scenario.acceptance import load_acceptance
from kvsim.scenario.codec_timing import CodecTiming, load_codec_timing
from kvsim.scenario.config import SimConfig
from kvsim.scenario.link_profile import (
    draft_step_for,
    encoder_pace_for,
    encoder_ratio,
    load_link_profile,
    profiled_link_settings,
    worker_pace_for,
)
from kvsim.scenario.metrics import RequestRecord, aggregate_records, record_columns, request_row
from kvsim.scenario.policy import (
    PIPELINED,
    WITH_PREFILL,
    FlowPlan,
    TransferPlan,
    build_plan,
    release_times,
)
from kvsim.scenario.size_calibration import calibrate_sizes
from kvsim.scenario.speculative import (
    busy_share_overhead_s,
    contention_overhead_s,
    draft_overhead_s,
    receiver_busy_draft_s,
    receiver_draft_s,
)
from kvsim.scenario.timing_model import TimingModel
from kvsim.scenario.trace import TraceLog
from kvsim.scenario.variants import Variant, variants
from kvsim.scenario.workload import Request, requests
from kvsim.sim.batch import Member
from kvsim.sim.gc_pause import gc_paused
from kvsim.sim.ingress import IngressJoin
from kvsim.sim.link import Link
from kvsim.sim.nodes import (
    DecodeNode,
    Deserializer,
    NodeDeserializer,
    PrefillNode,
    Receiver,
    WorkPace,
    when_all_ready,
)
from kvsim.sim.prefill_batch import ChunkedPrefill
from kvsim.sim.prefix_reuse import PrefixReuse, Reuse
from kvsim.sim.request_log import request_rows, write_request_log
from kvsim.sim.spread import spread_of
from kvsim.sim.timer import Timer, call_later
from kvsim.sim.worker_load import receiver_busy_fraction


class CountingEnvironment(simpy.Environment):
    """simpy environment that counts scheduled events (for events/s).

    simpy numbers every scheduled event from its own counter (`_eid`, an itertools.count
    starting at 0), so the count is read off a copy of it rather than by overriding
    `schedule`, which would add a Python call to every event."""

    @property
    def scheduled(self) -> int:
        return next(copy.copy(self._eid))


RECEPTION_WAITING, RECEPTION_ON, RECEPTION_OVER = 0, 1, 2


class Passage:
    """One request's way through the cluster, filled in as it goes (times in s): routed to
    prefill instance `p` and decode instance `d`, prefilled, transferred, deserialized,
    admitted, decoded (kvsim.sim.run.Scenario.request and the callbacks after it)."""

    __slots__ = ("sim", "req", "plan", "p", "d", "t_p0", "t_pe", "receivers", "needed",
                 "encode_end_t", "t_need", "drafting", "load_all_s", "kv_bytes", "t_slot",
                 "t_start", "prefill_s", "member", "reuse", "sent_tokens", "fetch",
                 "reception")

    def __init__(self, sim: Scenario, req: Request, plan: TransferPlan, p: int, d: int) -> None:
        self.sim = sim
        self.req, self.plan, self.p, self.d = req, plan, p, d
        self.t_p0 = self.t_pe = self.encode_end_t = self.t_need = math.nan
        self.t_slot = self.t_start = math.nan
        self.receivers: list[Receiver] = []
        self.needed: list[Receiver] = []
        self.drafting = False  # deserializer=on_demand: drafting decided at the anchor's load
        self.load_all_s = 0.0  # the full cache's load (s) once drafting stops
        self.kv_bytes = 0.0  # its bf16 cache in decode memory
        self.prefill_s = math.nan  # its prefill's length (one prefill at a time)
        self.member: Member | None = None  # in its decode batch, while drafting
        self.reuse: Reuse | None = None  # prefix_cache.enabled: what it reuses
        self.sent_tokens = req.context_tokens  # tokens whose KV crosses the link
        self.fetch: Receiver | None = None  # blocks fetched from the shared store, if any
        # workload.worker_slows_decode: its reception slows its decode instance's batch
        # (RECEPTION_*: not begun, begun, over)
        self.reception = RECEPTION_WAITING

    # The callbacks of its steps: bound methods, not a closure (and its cells) per step and
    # request, which would live from the step's start to its end and be freed cold. (Nothing
    # that outlives the request may hold one: the Passage holds the Scenario.)
    def prefill_waited(self) -> None:
        """It waited for its prefill instance: its prefill starts now."""
        now = self.sim.env.now
        self.sim._prefill(self, now, now, self.prefill_s)

    def needed_in(self) -> None:
        self.sim._needed_in(self)

    def admitted(self, t_slot: float) -> None:
        self.sim._decode(self, t_slot)

    def full_in(self) -> None:
        """Every stream is ready (now): the drafting member has its full cache."""
        member, self.member = self.member, None  # (no ps <-> member cycle left behind)
        if self.reuse is not None:
            self.sim._keep_prefix(self)
        self.sim.decode[self.d].batch.full_ready(member, self.load_all_s)  # type: ignore[arg-type]

    def left(self, member: Member) -> None:
        self.sim._finish(self, member)

    def reception_begins(self, _timer: Timer) -> None:
        self.sim._reception_begins(self)

    def reception_ends(self) -> None:
        """Its cache is dequantized, or it joins to draft (now): its decode instance's
        batch no longer steps beside its worker (workload.worker_slows_decode)."""
        if self.reception == RECEPTION_ON:
            self.sim.decode[self.d].batch.receiving(self.req.seq, None)
        self.reception = RECEPTION_OVER


class Scenario:
    """One simulation: a codec and a policy over a workload on a cluster."""

    def __init__(self, cfg: SimConfig, variant: Variant, context_tokens: int,
                 bandwidth_gbps: float, trace: TraceLog | None = None) -> None:
        cfg.validate()
        self.cfg, self.variant, self.trace = cfg, variant, trace
        self.context_tokens, self.bandwidth_gbps = int(context_tokens), float(bandwidth_gbps)
        self.codec = variant.spec.build()
        # the receiver mode this codec runs in: as the transport's receiver
        # (kvsim.transport.assembly), on arrival falls back to on demand for a codec whose
        # layers do not decode alone (CacheGen)
        self.deserializer = cfg.deserializer
        if self.deserializer == "on_arrival" and not self.codec.layer_independent:
            self.deserializer = "on_demand"
        self.model, self.hw = cfg.model, cfg.hardware
        calibrate_sizes(self.codec, cfg.size_calibration, cfg.model.kv_shape(context_tokens))
        # link.profile: the measured emulated link (its rate, latency and per-message cost,
        # and the receiver's draft step measured on it)
        self.link_profile = load_link_profile(cfg.link.profile) if cfg.link.profile else None
        self.timing = TimingModel(cfg.model, cfg.hardware, draft_step_for(
            self.link_profile, cfg.model.name, cfg.hardware.profile))
        # a transfer's set-up before its encoder starts (s): the link's, + the profile's
        self.handshake_s = cfg.link.handshake_s + (
            self.link_profile.handshake_s if self.link_profile is not None else 0.0)
        # the on-arrival worker's pace on this link (a profile measured on one host)
        self.worker_pace = worker_pace_for(self.link_profile, cfg.model.name,
                                           cfg.hardware.profile) \
            if self.deserializer == "on_arrival" else None
        table = load_codec_timing(cfg.hardware.name, cfg.codec_timing or None)
        self.codec_timing: CodecTiming = table.lookup(variant.spec.label, variant.spec.name)
        encoder_pace = encoder_pace_for(self.link_profile, cfg.model.name, cfg.hardware.profile)
        if encoder_pace and variant.policy in PIPELINED:  # its encoder beside its transfer
            self.codec_timing = replace(self.codec_timing, encode_gb_per_s=(
                self.codec_timing.encode_gb_per_s / encoder_ratio(encoder_pace, bandwidth_gbps)))
        self.acceptance = load_acceptance(variant.acceptance or cfg.speculative.acceptance)
        self.rng = np.random.default_rng(cfg.seed)
        self._plans: dict[int, tuple[TransferPlan, Any]] = {}
        self.records: list[RequestRecord] = []
        self.messages = 0  # link messages (chunks) simulated
        self._arriving: list[Request] = []  # the run's requests, in arrival order (_arrive)
        self._next_arrival = 0  # the first of them not started

    # ---- plans -------------------------------------------------------------------------
    def plan(self, context_tokens: int) -> TransferPlan:
        hit = self._plans.get(context_tokens)
        if hit is None:
            shape = self.model.kv_shape(context_tokens)
            table = self.codec.size_table(shape)
            on_arrival = self.deserializer == "on_arrival"
            plan = build_plan(table, shape, self.variant.policy, self.codec_timing,
                              self.hw.devices, self.cfg.granularity, layer_jobs=on_arrival,
                              anchor_jobs=on_arrival and self.cfg.speculative.cap_tokens > 0)
            hit = self._plans[context_tokens] = (plan, table)
        return hit[0]

    # ---- the run -----------------------------------------------------------------------
    def run_samples(self, samples: int) -> dict:
        """Run `samples` times with seeds seed, seed+1, ... (independent acceptance draws and
        arrivals) and average: the seeds report means over many prompts."""
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples}")
        rows = []
        self.request_log: list[dict] = []
        for i in range(samples):
            self.rng = np.random.default_rng(self.cfg.seed + i)
            rows.append(self.run())
            if self.cfg.requests_path:
                self.request_log += request_rows(self.records, list(self.cfg.metrics.ks), {
                    "codec": self.variant.spec.label, "transfer": self.variant.policy,
                    "scenario_context_tokens": self.context_tokens,
                    "bandwidth_gbps": self.bandwidth_gbps, "sample": i,
                    "seed": self.cfg.seed + i})
        out = mean_rows(rows)
        out["samples"] = samples
        # std and 95% interval of the mean of the headline metrics (None with one sample)
        out["spread"] = spread_of(rows)
        return out

    def run(self) -> dict:
        self.records, self.messages = [], 0
        cfg, w = self.cfg, self.cfg.workload
        reqs = requests(_with_context(w, self.context_tokens), self.rng)
        for ctx in sorted({r.context_tokens for r in reqs}):
            self.timing.check_fits(ctx)
        if w.colocated_prefill:
            self.timing.beside_prefill_ratio(1)  # refused here where it was not measured
        if w.worker_slows_decode:
            self.timing.beside_worker_extra_s()  # refused here where it was not measured
        env = self.env = CountingEnvironment()
        class_weight: Callable[[Any], float] | None = None
        if cfg.link.scheduling == "weighted":  # GPS between streams, weight r^stream
            r = cfg.link.residual_weight
            class_weight = lambda key: r ** key[0]  # noqa: E731
        n_links = 1 if cfg.link.sharing == "shared" else w.prefill_nodes
        egress = profiled_link_settings(
            self.bandwidth_gbps, cfg.link.latency_s, cfg.link.message_overhead_bytes,
            cfg.link.trace, self.link_profile)
        messages: dict = {}  # the links' prepared message sizes, shared (Link.messages)
        self.links = [Link(env, **egress, name=f"link{i}", trace_origin=cfg.link.trace_origin,
                           class_weight=class_weight, shared_messages=messages)
                      for i in range(n_links)]
        self.prefill = [PrefillNode(i, self.links[0 if n_links == 1 else i])
                        for i in range(w.prefill_nodes)]
        # [i] requests routed to prefill node i and not yet through its prefill, counted down
        # lazily (at the next arrival) from a heap of (prefill end s, seq, node)
        self.prefill_queued = [0] * w.prefill_nodes
        self._prefill_ends: list[tuple[float, int, int]] = []
        if w.prefill_chunk_tokens:  # chunked prefill batching on every prefill instance
            for pnode in self.prefill:
                pnode.chunked = ChunkedPrefill(env, self.timing, w.prefill_chunk_tokens)
        kv_memory = self.hw.memory_gb * 1e9 * self.hw.devices - self.model.weight_bytes
        self.decode = [DecodeNode(env, i, w.decode_max_batch, kv_memory, self.timing)
                       for i in range(w.decode_nodes)]
        # [i] requests routed to decode node i and not finished
        self.decode_assigned = [0] * w.decode_nodes
        # optional ingress per decode node (no latency: counted once, on the egress link)
        self.ingress = [Link(env, cfg.link.decode_ingress_gbps, name=f"ingress{i}",
                             message_overhead_bytes=cfg.link.message_overhead_bytes,
                             class_weight=class_weight, shared_messages=messages)
                        for i in range(w.decode_nodes)] if cfg.link.decode_ingress_gbps else []
        if self.deserializer == "node":  # one FIFO deserializer per decode instance, which
            for i, node in enumerate(self.decode):  # flushes every link its flows cross
                node.deserializer = NodeDeserializer(
                    self.links + ([self.ingress[i]] if self.ingress else []))
        self.prefix: PrefixReuse | None = None
        if cfg.prefix_cache.enabled:  # kvsim.sim.prefix_reuse
            self.prefix = PrefixReuse(
                cfg.prefix_cache, w.routing, w.routing_load_slack,
                float(self.model.kv_bytes_bf16(cfg.prefix_cache.block_tokens)), kv_memory,
                self.decode, w.prefill_nodes)
            self.prefix.check(reqs)
            pc = cfg.prefix_cache
            self.store_link = Link(env, pc.store_gbps, pc.store_latency_s, name="store") \
                if self.prefix.store is not None else None
        self._routed = 0  # requests routed (workload.routing=round_robin)
        self.finished = 0
        self.all_done = env.event()
        self.n_requests = len(reqs)
        started = time.perf_counter()
        with gc_paused():  # kvsim.sim.gc_pause: the collector's cost grows with the run
            self.arrivals(reqs)
            try:
                env.run(until=self.all_done)
            except RuntimeError as exc:
                if "No scheduled events left" not in str(exc):
                    raise
                raise ValueError(self._stalled()) from None
            wall_s = time.perf_counter() - started
            return self.row(wall_s)

    def _stalled(self) -> str:
        """What a run that stopped with requests unfinished waits for."""
        waiting = [(node.name, len(node.admission._memory_queue), node.admission.free_bytes,
                    node.prefix.held_bytes - node.prefix.idle_bytes if node.prefix else 0.0)
                   for node in self.decode if node.admission._memory_queue]
        where = "; ".join(f"{name}: {n} waiting, {free / 1e9:.3f} GB free, {pinned / 1e9:.3f} "
                          "GB of prefix blocks pinned" for name, n, free, pinned in waiting)
        return (f"the run stalled with {self.n_requests - self.finished} of {self.n_requests} "
                f"requests unfinished: no decode admission can ever fit ({where or 'none'}); "
                "give the decode instances more memory (hardware.memory_gb, hardware.devices)")

    def arrivals(self, reqs: list[Request]) -> None:
        """Start each request at its arrival time: one timer per distinct arrival time."""
        self._arriving, self._next_arrival = reqs, 0
        self._arrive()

    def _arrive(self, _timer: Timer | None = None) -> None:
        """Start the requests that arrive by now; time the next arrival. (A method, not a
        closure: a closure that re-arms itself is a reference cycle, which would hold the
        run's requests until the cyclic collector runs.)"""
        env, reqs = self.env, self._arriving
        now, i, n = env.now, self._next_arrival, len(reqs)
        while i < n and reqs[i].arrival_t <= now:
            self.request(reqs[i])
            i += 1
        self._next_arrival = i
        if i < n:
            call_later(env, reqs[i].arrival_t - now, self._arrive)
        else:
            self._arriving = []

    def request(self, req: Request) -> None:
        """The request arrives now: route it, queue it for prefill. Its passage continues
        in callbacks (kvsim.sim.run.Passage), each run when what it waits for is done."""
        env = self.env
        now = env.now
        # requests whose prefill ended by now no longer count as queued on their instance
        ends, queued, assigned = self._prefill_ends, self.prefill_queued, self.decode_assigned
        prefix = self.prefix
        while ends and ends[0][0] <= now:
            _, seq, p = heapq.heappop(ends)
            queued[p] -= 1
            if prefix is not None:
                prefix.prefill_ended(seq)
        routing = self.cfg.workload.routing
        if routing == "round_robin":
            p, d = self._routed % len(queued), self._routed % len(assigned)
        else:  # the least loaded instances (the first of equals), by builtin min
            p, d = queued.index(min(queued)), assigned.index(min(assigned))
        self._routed += 1
        reuse, cached_tokens = None, 0
        if prefix is not None:  # kv_aware routing, and what the request reuses
            p, d, reuse = prefix.route(req, queued, assigned, p, d)
            cached_tokens = reuse.prefill_hit * prefix.block_tokens
        pnode = self.prefill[p]
        queued[p] += 1
        assigned[d] += 1
        # (with reuse, the plan of what crosses the link is made at the transfer's set-up)
        ps = Passage(self, req, self.plan(req.context_tokens), p, d)
        if reuse is not None:
            ps.reuse = reuse
            prefix.prefill_started(req, p, reuse)  # type: ignore[union-attr]
        if pnode.chunked is not None:  # chunked prefill batching (kvsim.sim.prefill_batch)
            job = pnode.chunked.submit(req.seq, req.context_tokens, cached_tokens)
            # the step with its last chunk starts when last_step succeeds
            job.last_step.callbacks.append(
                lambda _ev: self._prefill(ps, job.first_step_t, env.now, job.last_step_s))
            return
        # one prefill at a time, first come first served: it starts when the one before ends
        prefill_s = self.timing.prefill_step_s(
            [(req.context_tokens - cached_tokens, cached_tokens)]) if cached_tokens else \
            self.timing.prefill_s(req.context_tokens)
        t_p0 = pnode.free_t if pnode.free_t > now else now
        pnode.free_t = t_p0 + prefill_s
        if t_p0 > now:
            ps.prefill_s = prefill_s
            pnode.start_at(t_p0, ps.prefill_waited)
        else:
            self._prefill(ps, now, now, prefill_s)

    def _prefill(self, ps: Passage, t_p0: float, layers_start_t: float,
                 layers_s: float) -> None:
        """The prefill (or the step with its last chunk) starts now: the encoder releases
        the chunks to the link as their layers complete; decoding waits for the flows the
        policy needs."""
        ps.t_p0 = t_p0
        ps.t_pe = layers_start_t + layers_s
        heapq.heappush(self._prefill_ends, (ps.t_pe, ps.req.seq, ps.p))
        if self.cfg.workload.colocated_prefill:  # whole prompts: it runs from now to t_pe
            self._colocated_prefill(ps.t_pe - self.env.now)
        if ps.reuse is not None:
            if self.variant.policy not in WITH_PREFILL:  # set up once the prefill ends
                self.prefill[ps.p].link.expect(self.env.now)
                if self.ingress:
                    self.ingress[ps.d].expect(self.env.now)
                call_later(self.env, ps.t_pe - self.env.now,
                           lambda _timer: self._reused_send(ps, layers_start_t, layers_s))
            else:
                self._reused_send(ps, layers_start_t, layers_s)
            return
        self._release(ps, layers_start_t, layers_s)

    def _colocated_prefill(self, prefill_s: float) -> None:
        """A prefill runs for prefill_s from now on the decode instances' host
        (workload.colocated_prefill): their steps meanwhile cost the profile's ratio."""
        for node in self.decode:
            node.batch.prefills_running(+1)

        def ended(_timer: Timer) -> None:
            for node in self.decode:
                node.batch.prefills_running(-1)
        call_later(self.env, prefill_s, ended)

    def _reused_send(self, ps: Passage, layers_start_t: float, layers_s: float) -> None:
        """Prefix reuse: the transfer is set up now (kvsim.sim.prefix_reuse): its decode
        instance looks the prompt up, and only the KV it lacks crosses the link."""
        prefix, req = self.prefix, ps.req
        prefix.look_up(req, ps.d, ps.reuse)  # type: ignore[union-attr, arg-type]
        full_bytes = ps.plan.total_bytes
        ps.sent_tokens = prefix.sent_tokens(req, ps.reuse)  # type: ignore[union-attr, arg-type]
        ps.plan = self.plan(ps.sent_tokens)
        if ps.reuse.fetched:  # type: ignore[union-attr]
            ps.fetch = self._fetch(req, ps.reuse.fetched)  # type: ignore[union-attr]
        prefix.wire_bytes(full_bytes, ps.plan.total_bytes)  # type: ignore[union-attr]
        self._release(ps, layers_start_t, layers_s)

    def _release(self, ps: Passage, layers_start_t: float, layers_s: float) -> None:
        """The request's flows to the link as their layers complete; decoding waits for the
        flows the policy needs."""
        ps.receivers, ps.encode_end_t = self._send(
            ps.req, ps.plan, self.prefill[ps.p], self.decode[ps.d], layers_start_t, layers_s,
            ps.t_p0)
        ps.needed = ps.receivers[:1] if ps.plan.speculative else ps.receivers
        # (a codec whose layers do not decode alone is dequantized on demand: no worker)
        if self.cfg.workload.worker_slows_decode and self.deserializer == "on_arrival":
            self._reception(ps)
        if ps.fetch is not None:  # decoding needs the prefix fetched from the store too
            ps.needed = [*ps.needed, ps.fetch]
        when_all_ready(ps.needed, ps.needed_in)

    def _reception(self, ps: Passage) -> None:
        """workload.worker_slows_decode: the request's reception on its decode instance
        begins when its first message arrives (its release + the link's latency; the
        message's own crossing left out) and ends when every stream is dequantized, or
        when it joins its batch to draft with an overhead that stands for its worker (the
        draft step measured beside a busy worker: receiver_busy_draft_s)."""
        first = min(float(rx.carriers[0].release[0]) for rx in ps.receivers)
        latency_s = ps.receivers[0].carriers[0].link.latency_s
        call_later(self.env, max(0.0, first + latency_s - self.env.now), ps.reception_begins)
        when_all_ready(ps.receivers, ps.reception_ends)

    def _reception_begins(self, ps: Passage) -> None:
        if ps.reception != RECEPTION_WAITING:
            return
        ps.reception = RECEPTION_ON
        self.decode[ps.d].batch.receiving(ps.req.seq, receiver_busy_fraction(
            ps.receivers, self.env.now, self.timing.draft_ingest_s_per_byte(), first_stream=0))

    def _needed_in(self, ps: Passage) -> None:
        """The flows decoding needs are deserialized (now)."""
        ps.t_need = self.env.now
        if self.deserializer == "on_demand":  # the decoder dequantizes what it starts on
            self._load_on_demand(ps)
        elif self.deserializer == "on_arrival":  # the decoder builds its cache from layers
            self._build_on_arrival(ps)
        else:
            self._admit(ps)

    def _build_on_arrival(self, ps: Passage) -> None:
        """deserializer=on_arrival, once the needed streams are dequantized (now): the decoder
        builds its cache from them (cache_build) and its first step on it costs the fresh
        cache's extra; a split-stream request whose residual was dequantized while its anchor
        cache was built builds the full cache too. The full cache's build s once drafting
        stops is ps.load_all_s (its verification pass is measured on a fresh cache: no
        extra)."""
        env, ctx = self.env, ps.req.context_tokens
        build_s = self.timing.cache_build_s(ps.sent_tokens)  # (a reused prefix is in place)
        all_in_before = all(rx.is_ready for rx in ps.receivers)
        ps.load_all_s = build_s

        def built(_timer: Timer) -> None:
            if ps.plan.speculative and not all_in_before and \
                    all(rx.is_ready for rx in ps.receivers):
                # the anchor's cache was built for nothing
                call_later(env, build_s, lambda _timer: self._admit(ps))
            else:
                self._admit(ps)

        call_later(env, build_s + self.timing.first_step_extra_s(ctx), built)

    def _load_on_demand(self, ps: Passage) -> None:
        """deserializer=on_demand, once the needed streams are in (now): as the transport's
        decoder, dequantize the anchor and draft if the rest is still missing then, else
        wait for every stream and dequantize the full cache. Each load is the codec's
        dequantization of the whole cache (stream 0 alone, or every stream) plus the first
        step's extra cost on a fresh cache (measured profiles). Sets ps.t_need (decoding may
        start), ps.drafting and ps.load_all_s (the full cache's load s once drafting
        stops)."""
        env, receivers = self.env, ps.receivers
        bf16 = float(self.model.kv_bytes_bf16(ps.sent_tokens))  # the bytes it was sent
        devices = self.hw.devices
        extra_s = self.timing.first_step_extra_s(ps.req.context_tokens)
        load_all_s = self.codec_timing.decode_s(bf16, devices)  # verification's pass, a
        # fresh cache's first, is measured as such: no extra there

        def all_in() -> bool:
            return all(rx.ready_t <= env.now for rx in receivers)

        def full_loaded(_timer: Timer) -> None:
            ps.t_need, ps.drafting, ps.load_all_s = env.now, False, 0.0
            self._admit(ps)

        def load_full() -> None:
            call_later(env, load_all_s + extra_s, full_loaded)

        def anchor_loaded(_timer: Timer) -> None:
            if all_in():
                when_all_ready(receivers, load_full)
            else:
                ps.t_need, ps.drafting, ps.load_all_s = env.now, True, load_all_s
                self._admit(ps)

        if ps.plan.speculative and not all_in():
            call_later(env, self.codec_timing.anchor_decode_s(bf16, devices) + extra_s,
                       anchor_loaded)
        else:
            when_all_ready(receivers, load_full)

    def _admit(self, ps: Passage) -> None:
        """Queue for the decode instance: a slot, then the cache's bytes (DecodeAdmission)."""
        req, dnode = ps.req, self.decode[ps.d]
        tokens = req.output_tokens
        # the request's cache in decode memory (bf16, its context and the tokens it decodes)
        ps.kv_bytes = float(self.model.kv_bytes_bf16(req.context_tokens + tokens))
        if ps.reuse is not None:  # its reused blocks are in memory already
            ps.kv_bytes -= ps.reuse.decode_hit * self.prefix.block_bytes  # type: ignore
        if ps.kv_bytes > dnode.kv_memory_bytes:
            raise ValueError(
                f"request {req.seq}: its bf16 KV cache ({req.context_tokens} + {tokens} tokens, "
                f"{ps.kv_bytes / 1e9:.1f} GB) never fits the decode instance's "
                f"{dnode.kv_memory_bytes / 1e9:.1f} GB left beside the weights; raise "
                "hardware.devices or shorten the context / output")
        dnode.admission.request(ps.kv_bytes, self.env.now, ps.admitted)

    def _decode(self, ps: Passage, t_slot: float) -> None:
        """Admitted now (slot since t_slot): join the decode batch, speculatively on the
        anchor while some stream is still missing."""
        cfg, req, dnode, receivers = self.cfg, ps.req, self.decode[ps.d], ps.receivers
        ps.t_start, ps.t_slot = self.env.now, t_slot
        spec = cfg.speculative
        plan = ps.plan
        # speculative only while some stream is still missing when decoding starts
        drafting = ps.drafting if self.deserializer == "on_demand" else \
            plan.speculative and not all(rx.is_ready for rx in receivers)
        overhead_s = draft_overhead_s(spec.draft_overhead_s, self.codec_timing,
                                      self.model.kv_bytes_bf16(ps.sent_tokens),
                                      plan.stream_bytes[0], plan.total_bytes, self.hw.devices,
                                      receiver_draft_s(self.deserializer, self.timing,
                                                       req.context_tokens))
        # on arrival, with the draft step measured beside a busy worker: that overhead for
        # the worker's projected share of busy time, until the full cache is ready
        busy_s = receiver_busy_draft_s(self.deserializer, spec.draft_overhead_s, self.timing,
                                       req.context_tokens) if drafting else None
        if busy_s is not None:
            overhead_s = busy_share_overhead_s(
                busy_s, self.timing.tpot_s(req.context_tokens),
                receiver_busy_fraction(receivers, self.env.now,
                                       self.timing.draft_ingest_s_per_byte()))
        # shared / per_stream: the deserializer dequantizes the later streams on this
        # instance while the request drafts; with dequant_contention > 0 the drafts lose
        # that share of its work (its projected busy share of the window, until full ready)
        contended = drafting and busy_s is None and spec.dequant_contention > 0 and \
            self.deserializer in ("shared", "per_stream")
        if contended:
            # (the whole draft step, its own overhead included, is what makes no progress)
            overhead_s += contention_overhead_s(
                self.timing.tpot_s(req.context_tokens) + overhead_s,
                receiver_busy_fraction(receivers, self.env.now), spec.dequant_contention)
        member = dnode.batch.join(
            req.seq, req.context_tokens, req.output_tokens, spec.cap_tokens, overhead_s,
            self._sample_accepted if drafting else None,
            on_leave=ps.left, overhead_until_full=busy_s is not None or contended)
        if drafting:
            ps.member = member
            if cfg.workload.worker_slows_decode and busy_s is not None:
                ps.reception_ends()  # its draft overhead stands for its worker from now
            when_all_ready(receivers, ps.full_in)
        elif ps.reuse is not None:
            self._keep_prefix(ps)

    def _keep_prefix(self, ps: Passage) -> None:
        """Admitted with every stream in (now): its blocks may serve later requests."""
        self.prefix.keep(ps.req, ps.d, ps.reuse, self.env.now)  # type: ignore[union-attr]

    def _sample_accepted(self, proposed: int) -> int:
        """Drafts accepted of `proposed` (the acceptance model, on this sample's rng)."""
        return self.acceptance.sample_accepted(proposed, self.rng)

    def _finish(self, ps: Passage, member: Member) -> None:
        """The request's last token is out (now): free its place, record it."""
        req, receivers, plan = ps.req, ps.receivers, ps.plan
        pnode, dnode = self.prefill[ps.p], self.decode[ps.d]
        timeline = member.timeline
        reuse = ps.reuse
        if reuse is None:
            dnode.admission.release(ps.kv_bytes, self.env.now)
        else:  # the blocks it kept for reuse stay, idle, in the instance's memory
            self.prefix.release(req, ps.d, reuse)  # type: ignore[union-attr]
            dnode.admission.release(
                ps.kv_bytes - len(reuse.kept) * self.prefix.block_bytes,  # type: ignore
                self.env.now)
        self.decode_assigned[ps.d] -= 1
        needed = ps.needed
        last_needed = max(needed, key=lambda rx: rx.last_arrival_t)
        rec = RequestRecord(
            req.seq, req.context_tokens, req.arrival_t, ps.t_p0, ps.t_pe, ps.encode_end_t,
            last_needed.last_arrival_t, last_needed.backlog_start_t, ps.t_need,
            max(rx.last_arrival_t for rx in receivers),
            timeline.full_t if self.deserializer == "on_demand" else
            max(rx.ready_t for rx in receivers),
            ps.t_start, timeline, plan.stream_bytes, sum(rx.received_bytes for rx in receivers),
            plan.policy == "monolithic",
            {"memory_wait_s": ps.t_start - ps.t_slot, "decode_kv_bytes": ps.kv_bytes}
            if reuse is None else
            {"memory_wait_s": ps.t_start - ps.t_slot, "decode_kv_bytes": ps.kv_bytes,
             "sent_tokens": ps.sent_tokens,
             "prefix_hit_tokens": reuse.decode_hit * self.cfg.prefix_cache.block_tokens,
             "prefill_hit_tokens": reuse.prefill_hit * self.cfg.prefix_cache.block_tokens,
             "store_hit_tokens": reuse.fetched * self.cfg.prefix_cache.block_tokens})
        # bytes conserved: what arrived = the codec's wire bytes + per-message framing
        framing = pnode.link.message_overhead_bytes * sum(len(f.sizes_bytes) for f in plan.flows)
        if abs(rec.received_bytes - plan.total_bytes - framing) > 1e-9 * plan.total_bytes:
            raise RuntimeError(f"request {req.seq}: received {rec.received_bytes} bytes, "
                               f"sent {plan.total_bytes} + {framing} framing")
        self.records.append(rec)
        if self.trace is not None:
            self._trace(rec, pnode, dnode, receivers)
        for rx in receivers:
            rx.release()
        if ps.fetch is not None:
            ps.fetch.release()
        self.finished += 1
        if self.finished == self.n_requests:
            self.all_done.succeed()

    def _fetch(self, req: Request, blocks: int) -> Receiver:
        """The request's decode instance fetches `blocks` prefix blocks from the shared store
        (bf16, one message each, all available now) over the store's link."""
        n = int(blocks)
        fp = FlowPlan(0, "store", np.full(n, self.prefix.block_bytes),  # type: ignore
                      np.zeros(n, dtype=np.int64), np.zeros(n))
        rx = Deserializer(self.env, [fp], True, "per_stream").receivers[0]
        rx.carriers = [self.store_link.submit(  # type: ignore[union-attr]
            fp.sizes_bytes, np.full(n, self.env.now), (0,), rx.delivered, rx.done,
            name=f"r{req.seq}.store", tag=req.seq)]
        return rx

    def _worker_pace(self, plan: TransferPlan, release_t: np.ndarray, links: list[Link]
                     ) -> WorkPace:
        """The request's on-arrival worker's pace (link profile `worker_pace`): its jobs
        take `alone` x their codec timing, and more while its own encoder runs (its work
        counted back from its last chunk: back to back after the prefill; spread over the
        prefill where the transfer runs with it, an approximation there) and while its bytes
        arrive: from its first message's release + latency to the later of its last
        release + latency and its bytes (with their framing) at the slowest of `links`' rate
        then (its egress, and the decode instance's ingress where there is one). Its share
        of a busy link, a bandwidth trace's later steps and other requests' encoders and
        bytes are not foreseen."""
        p = self.worker_pace
        assert p is not None
        encode_end = float(release_t[-1])
        latency_s = links[0].latency_s
        first = float(release_t[0]) + latency_s
        messages = sum(len(fp.sizes_bytes) for fp in plan.flows)
        crossing_s = max((plan.total_bytes + messages * link.message_overhead_bytes)
                         / link.capacity_at(first) for link in links)
        last = max(encode_end + latency_s, first + crossing_s)
        return WorkPace(float(p["alone"]), [
            (encode_end - float(plan.encode_cum_s[-1]), encode_end, float(p["encoder"])),
            (first, last, float(p["ingest"]))])

    def _send(self, req: Request, plan: TransferPlan, pnode: PrefillNode, dnode: DecodeNode,
              layers_start_t: float, layers_s: float, prefill_start_t: float
              ) -> tuple[list[Receiver], float]:
        """Hand the request's flows to the link(s) as the encoder releases its chunks: layer
        l's KV is complete at layers_start_t + (l + 1) / layers x layers_s (the prefill, or
        the step carrying its last chunk). Returns the receivers on the decode instance and
        the time (s) its last chunk is encoded."""
        cfg = self.cfg
        # the decode side admits the request before its encoder starts: from prefill end,
        # or from the prefill's start (its first chunk's, chunked) where the transfer runs
        # with it. The first chunk's hand-off to the link, part of the handshake, is hidden
        # behind that prefill too here, where the real sender pays it after the release
        hello_t = prefill_start_t if plan.pipelined_with_prefill else layers_start_t + layers_s
        rel = release_times(plan, layers_start_t, layers_s, self.model.layers,
                            max(pnode.encoder_free_t, hello_t + self.handshake_s))
        pnode.encoder_free_t = float(rel[-1])
        pace = self._worker_pace(plan, rel, [pnode.link, *(
            [self.ingress[dnode.index]] if self.ingress else [])]) if self.worker_pace else None
        # on_arrival: the receiver's worker dequantizes layers as they land, whatever the policy
        deser = Deserializer(self.env, plan.flows,
                             plan.pipelined or self.deserializer == "on_arrival",
                             self.deserializer, dnode.deserializer, pace)
        receivers = deser.receivers
        if self.ingress:  # both links carry every message (kvsim.sim.ingress)
            for fp, rx in zip(plan.flows, receivers, strict=True):
                prio = link_priority(cfg.link, req.seq, req.arrival_t, fp.stream)
                name = f"r{req.seq}.{fp.name}"
                join = IngressJoin(rx)
                egress = join.egress = pnode.link.submit(
                    fp.sizes_bytes, rel[fp.chunk], prio, join.delivered, join.crossing_done,
                    name=name, tag=req.seq)
                ingress = join.ingress = self.ingress[dnode.index].submit(
                    fp.sizes_bytes, rel[fp.chunk], prio, join.delivered, join.crossing_done,
                    name=name, tag=req.seq)
                rx.carriers = [egress, ingress]
                self.messages += len(fp.sizes_bytes)
            return receivers, float(rel[-1])
        with pnode.link.holding():  # the request's flows enter the link with one reallocation
            for fp, rx in zip(plan.flows, receivers, strict=True):
                prio = link_priority(cfg.link, req.seq, req.arrival_t, fp.stream)
                rx.carriers = [pnode.link.submit(fp.sizes_bytes, rel[fp.chunk], prio,
                                                 rx.delivered, rx.done,
                                                 name=f"r{req.seq}.{fp.name}", tag=req.seq)]
                self.messages += len(fp.sizes_bytes)
        return receivers, float(rel[-1])

    def _trace(self, rec: RequestRecord, pnode: PrefillNode, dnode: DecodeNode,
               receivers: list[Receiver]) -> None:
        tr, tid = self.trace, f"{self.variant.spec.label}/{self.variant.policy}/r{rec.seq}"
        tr.span("prefill", pnode.name, tid, rec.prefill_start_t, rec.prefill_end_t)
        tr.span("encode", pnode.name, tid, rec.prefill_start_t, rec.encode_end_t)
        for rx in receivers:
            tr.span(f"transfer {rx.plan.name}", pnode.link.name, tid, rec.prefill_start_t,
                    rx.last_arrival_t, bytes=float(rx.plan.sizes_bytes.sum()))
            tr.span(f"deserialize {rx.plan.name}", dnode.name, tid, rx.first_arrival_t,
                    rx.ready_t)
        for kind, t0, t1 in rec.timeline.segments:
            tr.span(kind, dnode.name, tid, t0, t1)

    # ---- report ------------------------------------------------------------------------
    def row(self, wall_s: float) -> dict:
        cfg, recs = self.cfg, sorted(self.records, key=lambda r: r.seq)
        plan = self.plan(recs[0].context_tokens)
        end_t = self.env.now
        ks = list(cfg.metrics.ks)
        row: dict[str, Any] = {
            "model": self.model.name, "hardware": self.hw.name,
            "codec": self.variant.spec.label, "codec_name": self.variant.spec.name,
            "codec_params": dict(self.variant.spec.params),
            "transfer": self.variant.policy, "streams": len(plan.stream_names),
            # the receiver mode that ran (the emulator's rows: the same key)
            "dequantize": self.deserializer,
            "context_tokens": self.context_tokens, "bandwidth_gbps": self.bandwidth_gbps,
            "workload": cfg.workload.kind, "requests": len(recs),
            "stream_bytes": dict(zip(plan.stream_names, plan.stream_bytes, strict=True)),
            "total_bytes": plan.total_bytes,
            "bits_per_element": 8.0 * plan.total_bytes /
            self.model.kv_shape(recs[0].context_tokens).numel,
            "codec_timing_source": self.codec_timing.source,
            "size_estimate": self.codec.size_note() or "exact",
            "acceptance": self.acceptance.name,
            "link_profile": cfg.link.profile,
            "handshake_s": self.handshake_s,  # the link's + its profile's
            "link_utilisation": float(np.mean([lk.utilisation(end_t) for lk in self.links])),
            # busy fraction over [first byte, last byte] of each link that carried bytes
            "link_busy_utilisation": float(np.nanmean(
                [lk.busy_utilisation() for lk in self.links]
                if any(not math.isnan(lk.first_byte_t) for lk in self.links) else [0.0])),
            # decode ingress links (link.decode_ingress_gbps), busy over their own bytes
            "ingress_busy_utilisation": float(np.nanmean(
                [lk.busy_utilisation() for lk in self.ingress if not math.isnan(lk.first_byte_t)]))
            if any(not math.isnan(lk.first_byte_t) for lk in self.ingress) else math.nan,
            "sim_end_s": end_t, "wall_s": wall_s, "events": self.env.scheduled,
            "messages": self.messages,
            "events_per_s": self.env.scheduled / wall_s if wall_s > 0 else math.nan,
        }
        if cfg.workload.colocated_prefill:  # the decode steps beside prefills, as measured
            row["colocated_prefill"] = True
        if cfg.workload.worker_slows_decode:  # ... and beside the on-arrival workers
            row["worker_slows_decode"] = True
        if self.prefix is not None:  # prefix reuse: hit rates, bytes not sent
            row.update(self.prefix.row())
            row["routing"] = cfg.workload.routing
            if self.store_link is not None:
                row["prefix_store_link_utilisation"] = self.store_link.utilisation(end_t)
        if len(recs) == 1:
            row.update(request_row(recs[0], ks, cfg.metrics.breakdown_k))
            return row
        # multi-request rows: means over requests (bytes too: contexts differ), percentiles;
        # the records read once, as columns (metrics.record_columns)
        cols = record_columns(recs)
        col = cols.scalars
        context = col["context_tokens"].astype(np.int64)
        row["context_tokens_mean"] = float(np.mean(context))
        row["stream_bytes"] = {name: float(np.mean(cols.stream_bytes[:, i]))
                               for i, name in enumerate(plan.stream_names)}
        row["total_bytes"] = float(np.mean(col["total_bytes"]))
        if self.prefix is not None:  # bits per element of the KV sent (the prefix delta)
            context = np.array([r.extra["sent_tokens"] for r in recs], dtype=np.int64)
        contexts, which = np.unique(context, return_inverse=True)  # [c] distinct, [n] index
        numel = np.array([float(self.model.kv_shape(int(ctx)).numel) for ctx in contexts])[which]
        row["bits_per_element"] = float(np.mean(8.0 * col["total_bytes"] / numel))
        row.update(aggregate_records(recs, ks, cfg.metrics.breakdown_k, cols))
        row["breakdown_k"] = cfg.metrics.breakdown_k
        span = float(col["last_token_t"].max() - col["arrival_t"].min())
        row["throughput_rps"] = len(recs) / span if span > 0 else math.nan
        row["output_tokens_per_s"] = int(col["tokens"].sum()) / span if span > 0 else math.nan
        return row


def mean_rows(rows: list[dict]) -> dict:
    """Average numeric fields (and dicts of numbers) of rows of the same scenario."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, bool) or key in ("requests", "streams", "context_tokens",
                                              "breakdown_k", "messages", "prefix_block_tokens"):
            continue
        if isinstance(value, (int, float)):
            out[key] = float(np.mean([r[key] for r in rows]))
        elif isinstance(value, dict) and all(isinstance(v, (int, float)) for v in value.values()):
            out[key] = {k: float(np.mean([r[key][k] for r in rows])) for k in value}
    return out


def link_priority(link: Any, seq: int, arrival_t: float, stream: int) -> tuple:
    """The link's class key of a request's stream (smaller first; see LinkConfig.scheduling):
    anchors_first / weighted: the stream; fifo: the request, then the stream; aging: the
    arrival time + stream x residual_age_s (a residual goes ahead of the anchors of requests
    that arrived more than residual_age_s after its own)."""
    if link.scheduling in ("anchors_first", "weighted"):
        return (stream,)
    if link.scheduling == "aging":
        return (arrival_t + stream * link.residual_age_s, seq, stream)
    return (seq, stream)


def _with_context(w, context_tokens: int):
    from dataclasses import replace

    return replace(w, context_tokens=int(context_tokens))


def run_all(cfg: SimConfig, progress: bool = False) -> tuple[list[dict], TraceLog | None]:
    """Every (codec, transfer) of the config; one row each. Grids over contexts, bandwidths
    or any other key are Hydra multiruns (`kvsim sim -m`, `kvsim sweep`): one config each."""
    cfg.validate()
    trace = TraceLog() if cfg.trace_path else None
    jobs = [(v, cfg.workload.context_tokens, cfg.link.bandwidth_gbps) for v in variants(cfg)]
    rows, request_log = [], []
    if progress and len(jobs) > 1:
        from tqdm import tqdm

        jobs_iter = tqdm(jobs, desc="sim", unit="run", leave=False)
    else:
        jobs_iter = jobs
    for v, c, b in jobs_iter:
        scenario = Scenario(cfg, v, c, b, trace)
        rows.append(scenario.run_samples(cfg.samples))
        request_log += scenario.request_log
    if cfg.requests_path:
        write_request_log(request_log, cfg.requests_path)
    if trace is not None:
        trace.write(cfg.trace_path)
    return rows, trace
