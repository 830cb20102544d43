"""Prefill side: encode each request's KV layer by layer and send its chunks over one link.

    producer thread per request:  arrival -> its prefill instance's turn (PrefillInstances)
        -> prefill (real, timed; or modelled) -> HELLO ->
        encode layer l (codec) -> scheduler.put(chunks)       [bounded queue: backpressure]
    link loop (the thread that owns the ZeroMQ DEALER socket):
        highest-priority released chunk -> credit window -> rate limiter -> send (zero-copy)
        <- ACCEPT / REFUSE / ACK / NACK / DONE / ABORT / HEARTBEAT

Encoding layer l+1 overlaps sending layer l. The credit window (bytes sent and not yet
processed by the receiver) bounds what sits in socket buffers, so the priority order holds on
the wire and a dead receiver is noticed: no message from it for `timeout_s` while work is
outstanding fails every open request with what was acknowledged.
"""

from __future__ import annotations

import math
import os
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from kvsim.core.device import synchronize
from kvsim.kernels import wire
from kvsim.kernels.codec import Codec
from kvsim.kernels.encoded import preamble_meta
from kvsim.scenario.policy import PIPELINED, WITH_PREFILL
from kvsim.transport import auth
from kvsim.transport import protocol as P
from kvsim.transport.prefill_instances import PrefillInstances
from kvsim.transport.scheduler import ChunkScheduler, QueuedChunk
from kvsim.transport.source import KVSource

# a lazily generated (synthetic) cache up to this size is generated during its modelled
# prefill and held whole; a larger one is generated layer by layer as it is encoded
PREPARE_BUDGET_BYTES = 1 << 30


class PeerLost(RuntimeError):
    pass


@dataclass
class OutgoingRequest:
    request_id: int
    arrival_seq: int  # order of arrival (fifo scheduling)
    arrival_offset_s: float  # when the request arrives, after the run starts
    codec: Codec
    codec_label: str
    policy: str  # monolithic | layerwise | split_stream | split_stream_layerwise
    make_source: Callable[[], KVSource]  # runs the prefill (called at arrival)
    hello: dict = field(default_factory=dict)  # extra HELLO fields (model, workload, ...)


@dataclass
class SendResult:
    request_id: int
    codec: str
    status: str = "pending"  # done | refused | peer_lost | aborted | error
    error: str = ""
    row: dict | None = None  # the receiver's report row (DONE)
    chunks: list[int] = field(default_factory=list)  # chunks per stream
    acked: list[int] = field(default_factory=list)  # acknowledged (contiguous) per stream
    sent_bytes: int = 0
    resent_chunks: int = 0
    skipped_chunks: int = 0  # already held by the receiver (resume)
    prefix_tokens: int = 0  # leading tokens the receiver held (prefix reuse): not encoded
    times: dict = field(default_factory=dict)  # Unix s: arrival, prefill, hello, encode end
    events: list[tuple[str, float, float]] = field(default_factory=list)  # encode spans
    sends: list[tuple[int, int, int, float]] = field(default_factory=list)  # (s, l, p, t)


class _Req:
    """Link-loop state of one request (touched by its producer under `lock`)."""

    def __init__(self, out: OutgoingRequest) -> None:
        self.out = out
        self.result = SendResult(out.request_id, out.codec_label)
        self.accepted = threading.Event()
        self.finished = threading.Event()
        self.held: dict[int, set[int]] = {}
        self.plan: list[list[tuple[int, int]]] = []  # per stream: (layer, page) of seq i
        self.table: Any = None  # the codec's SizeTable for this request's shape
        self.tokens = 0  # its cache's tokens
        self.window_bytes = 0
        self.unacked: dict[tuple[int, int], QueuedChunk] = {}
        self.sent_bytes = 0
        self.processed_bytes = 0
        self.queued_chunks = 0
        self.released_all = False
        self.fin_sent = False
        self.fin: dict = {}
        self.backlog_start_t: dict[int, float] = {}


class Sender:
    def __init__(self, address: str, limiter: Any, scheduling: str = "anchors_first",
                 timeout_s: float = 30.0, heartbeat_s: float = 0.5,
                 max_queued_bytes: int = 256 << 20, identity: bytes | None = None,
                 log: Callable[[str], None] | None = None,
                 max_in_flight_bytes: int = 64 << 20, residual_weight: float = 0.25,
                 residual_age_s: float = 1.0, keys: str = "", insecure: bool = False,
                 metrics: Any = None, prefill: PrefillInstances | None = None,
                 kernel_threads: int = 0, behind_in_flight_bytes: int | None = None) -> None:
        """max_in_flight_bytes caps the receiver's credit window: bytes in a shaper's queue
        (`tc`) are beyond the scheduler's reach, so over one keep it near the link's rate x
        a few ms or the priority order is lost on the wire (kvsim.transport.session).
        behind_in_flight_bytes (None: the same cap): the cap for a chunk of a later stream
        (a residual) while its request's encoder still releases chunks. The link loop sends
        it when no earlier stream's chunk is released yet, as the simulator's link does,
        but on a shaped link it then sits in the shaper's FIFO queue ahead of the anchor
        chunks released after it: a small cap keeps that wait short, where the full cap
        (at least 1 MiB, 84 ms at 0.1 Gbps) let the anchor wait tens of ms.
        prefill: the prefill instances requests queue for (default: one). kernel_threads:
        the threads each request's parallel codec kernels use (numba's count is per
        launching thread; 0: numba's pool size), e.g. the CPUs a pinned sender has."""
        if timeout_s <= 0 or heartbeat_s <= 0:
            raise ValueError("timeout_s and heartbeat_s must be > 0")
        self.address, self.limiter, self.timeout_s = address, limiter, float(timeout_s)
        self.max_in_flight_bytes = int(max_in_flight_bytes)
        self.behind_in_flight_bytes = self.max_in_flight_bytes \
            if behind_in_flight_bytes is None else int(behind_in_flight_bytes)
        self.heartbeat_s = float(heartbeat_s)
        self.scheduler = ChunkScheduler(scheduling, max_queued_bytes, residual_weight,
                                        residual_age_s)
        # the routing id requests belong to on the receiver (with the CURVE key, if any):
        # 128 random bits; a resumed run passes its earlier run's
        self.identity = identity or uuid.uuid4().bytes
        self.keys, self.insecure = keys, insecure
        self.metrics = metrics  # a TransportMetrics (kvsim.transport.metrics) or None
        self.log = log or (lambda msg: print(f"kvsim send: {msg}", file=sys.stderr))
        self._outbox: queue.SimpleQueue[list[Any]] = queue.SimpleQueue()
        # producers wake the link loop's poll when they queue a message or release a chunk
        # (else it would sleep out its poll timeout, up to 50 ms, before sending it)
        self._wake_r = self._wake_w = -1  # a pipe while run() runs
        self._reqs: dict[int, _Req] = {}
        self._lock = threading.Lock()
        self.prefill = prefill or PrefillInstances(1)
        if isinstance(kernel_threads, bool) or int(kernel_threads) < 0:
            raise ValueError(f"kernel_threads must be >= 0, got {kernel_threads!r}")
        self.kernel_threads = int(kernel_threads)
        self.protocol_errors = 0

    # ---- public ----------------------------------------------------------------------
    def run(self, requests: list[OutgoingRequest]) -> list[SendResult]:
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"request ids must be unique, got {ids}")
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self.identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # the credit window bounds what is queued, not the HWM
        sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
        try:
            auth.secure_client(sock, self.keys, self.insecure, self.address, self.log)
        except BaseException:
            sock.close(0)
            ctx.term()
            raise
        sock.connect(self.address)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.t0 = time.time()
        for out in requests:
            self._reqs[out.request_id] = _Req(out)
        threads = [threading.Thread(target=self._producer, args=(self._reqs[i],), daemon=True,
                                    name=f"kvsim-encode-{i}") for i in ids]
        for t in threads:
            t.start()
        try:
            self._link_loop(sock)
        except zmq.Again:  # a send blocked timeout_s: no connection takes our messages
            self._lose_peer(f"could not send to {self.address} for {self.timeout_s} s (nothing "
                            "accepts the connection: the address, or a CURVE key the "
                            "receiver does not allow)")
        finally:
            self.scheduler.close()
            for req in self._reqs.values():
                req.accepted.set()
                req.finished.set()
            sock.close(0)
            ctx.term()
        for t in threads:
            t.join(timeout=self.timeout_s)
        wake = (self._wake_r, self._wake_w)
        self._wake_r = self._wake_w = -1  # a producer still alive now writes nowhere
        for fd in wake:
            os.close(fd)
        return [self._reqs[i].result for i in ids]

    # ---- producer (one per request) --------------------------------------------------
    def _producer(self, req: _Req) -> None:
        out, res = req.out, req.result
        try:
            if self.kernel_threads:  # this thread's parallel kernels (encode) on that many
                import numba

                numba.set_num_threads(min(self.kernel_threads, numba.config.NUMBA_NUM_THREADS))
            delay = self.t0 + out.arrival_offset_s - time.time()
            if delay > 0:
                time.sleep(delay)
            res.times["arrival_t"] = time.time()
            with self.prefill.turn():  # routed now, its prefill when its instance frees
                res.times["prefill_start_t"] = time.time()
                source = out.make_source()  # a live prefill runs (and is timed) here
                if source.prefill_measured:  # its KV is in hand now: prefill ends here
                    res.times["prefill_end_t"] = time.time()
                    res.times["prefill_start_t"] = res.times["prefill_end_t"] - source.prefill_s
                    if source.reused:  # booked, not waited: the request arrived that early
                        res.times["arrival_t"] = min(res.times["arrival_t"],
                                                     res.times["prefill_start_t"])
                else:
                    if out.policy not in WITH_PREFILL:  # modelled: the layers exist after it;
                        # synthetic KV is generated meanwhile (not counted as encoding)
                        source.prepare(PREPARE_BUDGET_BYTES)
                        left = res.times["prefill_start_t"] + source.prefill_s - time.time()
                        if left > 0:
                            time.sleep(left)
                    res.times["prefill_end_t"] = res.times["prefill_start_t"] + source.prefill_s
            self._hello(req, source)
            if not req.accepted.wait(self.timeout_s) or req.finished.is_set():
                if not req.finished.is_set():
                    self._fail(req, "peer_lost", f"no ACCEPT within {self.timeout_s} s")
                return
            self._encode(req, source)
        except Exception as exc:  # a producer never dies silently: the request fails
            self._fail(req, "error", f"{type(exc).__name__}: {exc}")

    def _hello(self, req: _Req, source: KVSource) -> None:
        out, codec = req.out, req.out.codec
        # the handshake's origin: prefill end, or its start for a modelled prefill the
        # transfer runs with (kvsim.transport.record.handshake_s)
        req.result.times["hello_start_t"] = time.time()
        table = codec.size_table(source.shape)
        meta = preamble_meta(codec.name, codec.params_dict(), source.shape,
                             codec.page_tokens(source.shape), codec.stream_names())
        req.plan = P.stream_order(table.chunk_bytes)
        req.table, req.tokens = table, source.shape.tokens
        req.result.chunks = [len(p) for p in req.plan]
        doc = {"wire_version": wire.WIRE_VERSION, "preamble": meta, "policy": out.policy,
               "codec_label": out.codec_label, "first_token": source.first_token,
               "kv_source": source.describe, "prefill_measured": source.prefill_measured,
               **req.result.times, **out.hello}
        req.result.times["hello_t"] = time.time()
        self._outbox.put(P.json_message(P.MsgType.HELLO, out.request_id, doc))
        self._wake()

    def _encode(self, req: _Req, source: KVSource) -> None:
        out, codec, shape = req.out, req.out.codec, source.shape
        res = req.result
        seq_of = [{lp: i for i, lp in enumerate(p)} for p in req.plan]
        layers = shape.layers
        prefill_start = res.times["prefill_start_t"]
        held = req.held
        pending: list[QueuedChunk] = []
        res.times["encode_start_t"] = time.time()  # ACCEPTed: the encoder starts

        def release(chunks: list[QueuedChunk]) -> None:
            for item in chunks:
                item.released_t = time.time()
                res.times.setdefault("first_release_t", item.released_t)
                with self._lock:
                    req.queued_chunks += 1
                if self.scheduler.put(item, self.timeout_s):
                    req.backlog_start_t[item.stream] = item.released_t
                if self.scheduler.peek() is item:  # the link loop only waits on its head:
                    self._wake()  # a chunk queued behind it changes nothing there

        # a reused prefix (whole pages, of a codec whose pages encode alone): the tokens
        # after it are encoded alone, their pages numbered from its end
        skip_tokens = res.prefix_tokens
        page_offset = skip_tokens // req.table.page_tokens

        def queued(enc_streams: list, layer_offset: int, page_offset: int = 0
                   ) -> list[QueuedChunk]:
            items = []
            for chunks in enc_streams:
                for c in chunks:
                    layer, page = c.layer + layer_offset, c.page + page_offset
                    seq = seq_of[c.stream][(layer, page)]
                    size = P.CONTROL_BYTES + P.CHUNK_HEADER_BYTES + c.payload.nbytes
                    expected = int(req.table.chunk_bytes[c.stream, layer, page]) - \
                        wire.CHUNK_HEADER_BYTES
                    if codec.exact_sizes and c.payload.nbytes != expected:
                        raise RuntimeError(f"{codec.name}: chunk ({c.stream}, {layer}, {page}) "
                                           f"has {c.payload.nbytes} bytes, its size table "
                                           f"{expected}")
                    if seq in held.get(c.stream, ()):
                        res.skipped_chunks += 1
                        continue
                    prio = self.scheduler.priority(out.arrival_seq, c.stream,
                                                   out.arrival_offset_s)
                    payload = np.ascontiguousarray(c.payload)
                    items.append(QueuedChunk(prio, out.request_id, c.stream, layer, page, seq,
                                             payload, size,
                                             payload_crc=P.payload_crc(payload)))
            return items

        if not getattr(codec, "layer_independent", True):
            kv = source.full()
            synchronize(source.device)  # the span below is the encode's work alone
            t0 = time.time()
            enc = codec.encode(kv)
            res.events.append(("encode", t0, time.time()))
            release(queued(enc.streams, 0))
        else:
            for layer in range(layers):
                if out.policy in WITH_PREFILL and not source.prefill_measured:
                    # modelled prefill produces layer l at (l + 1) / layers of its duration
                    wait = prefill_start + source.prefill_s * (layer + 1) / layers - time.time()
                    if wait > 0:
                        time.sleep(wait)
                # the layer on its device (a lazily made source makes it now: not encoding)
                kv = source.layer(layer)
                if skip_tokens:
                    kv = kv[:, :, :, skip_tokens:, :].contiguous()
                synchronize(source.device)  # the span below is the encode's work alone
                t0 = time.time()
                enc = codec.encode(kv)
                items = queued(enc.streams, layer, page_offset)
                res.events.append((f"encode layer {layer}", t0, time.time()))
                if out.policy in PIPELINED:
                    release(items)
                else:
                    pending.extend(items)
                if req.finished.is_set():
                    return
            release(pending)  # monolithic: the whole cache leaves after its last layer
        res.times["encode_end_t"] = time.time()
        # the encoder's own time (encode + checksum, summed over layers; not the waits for
        # the scheduler's queue or a modelled prefill): calibration's encode rate as the
        # sender runs it, beside its link loop and the receiver
        encode_work_s = sum(t1 - t0 for name, t0, t1 in res.events if name.startswith("encode"))
        with self._lock:
            req.fin.update({
                "encode_end_t": res.times["encode_end_t"], "encode_work_s": encode_work_s,
                "backlog_start_t": {str(k): v for k, v in req.backlog_start_t.items()},
                "skipped_chunks": res.skipped_chunks,
                # the handshake (kvsim.transport.record.handshake_s)
                "hello_start_t": res.times["hello_start_t"],
                "encode_start_t": res.times["encode_start_t"]})
            if "first_release_t" in res.times:  # none: every chunk was held (resume)
                req.fin["first_release_t"] = res.times["first_release_t"]
            req.released_all = True

    # ---- the link loop (owns the socket) ---------------------------------------------
    def _link_loop(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        last_rx = last_tx = last_gauges = time.monotonic()
        # the head message waited for credit: it can go from when credit came (the link
        # idled meanwhile), not from its release (the limiter would catch that up)
        credit_waited = False
        while not all(r.finished.is_set() for r in self._reqs.values()):
            now = time.monotonic()
            while not self._outbox.empty():
                sock.send_multipart(self._outbox.get())
                last_tx = last_rx = now  # the receiver has timeout_s from now to answer
            while sock.get(zmq.EVENTS) & zmq.POLLIN:
                self._handle(sock.recv_multipart(copy=False))
                last_rx = time.monotonic()
            wait_s = 0.05
            item = self.scheduler.peek()
            if item is not None:
                in_flight = self._in_flight()
                if in_flight + item.size_bytes <= self._window(item) or in_flight == 0:
                    owner = self._reqs.get(item.request_id)
                    if owner is not None and "first_send_t" not in owner.fin:
                        # the link has this request's bytes from now on: goodput counts
                        with self._lock:  # from here, not from the first paid send
                            owner.fin.setdefault("first_send_t", time.time())
                    ready_t = max(item.released_t, time.time()) if credit_waited \
                        else item.released_t
                    credit_waited = False
                    delay = self.limiter.delay_s(item.size_bytes, ready_t)
                    if delay <= 0:
                        self._send_chunk(sock, self.scheduler.pop())
                        last_tx = time.monotonic()
                        continue
                    wait_s = min(wait_s, delay)
                else:
                    credit_waited = True
                    wait_s = min(wait_s, 0.005)  # waiting for credit: ACKs wake the poll
            self._send_fins(sock)
            now = time.monotonic()
            if self.metrics is not None and now - last_gauges > 0.05:  # gauges at <= 20 Hz
                self.metrics.set_queue(len(self.scheduler), self.scheduler.queued_bytes)
                self.metrics.set_credit(self._in_flight(), self._window())
                last_gauges = now
            if now - last_tx > self.heartbeat_s:
                sock.send_multipart(P.heartbeat())
                last_tx = now
            if not self._waiting_on_peer():
                last_rx = now  # silence only counts while an answer is owed
            elif now - last_rx > self.timeout_s:
                self._lose_peer(f"no message from the receiver for {self.timeout_s} s")
                return
            woken = poller.poll(math.ceil(max(0.0, wait_s) * 1000))  # ms; never a busy spin
            if any(what == self._wake_r for what, _ in woken):
                self._drain_wake()

    def _wake(self) -> None:
        """Wake the link loop (a producer queued something for it)."""
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):  # full (a wake is pending anyway) or closed
            pass

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _window(self, item: QueuedChunk | None = None) -> int:
        """Bytes that may be in flight before `item` goes: the credit granted, capped;
        a later stream's chunk while its request is still being encoded gets the smaller
        cap (behind_in_flight_bytes)."""
        cap = self.max_in_flight_bytes
        if item is not None and item.stream > 0:
            owner = self._reqs.get(item.request_id)
            if owner is not None and not owner.released_all:
                cap = min(cap, self.behind_in_flight_bytes)
        return min(cap, self._granted())

    def _granted(self) -> int:
        with self._lock:
            return min((r.window_bytes for r in self._reqs.values()
                        if r.accepted.is_set() and r.window_bytes),
                       default=self.max_in_flight_bytes) if self._reqs else 0

    def _in_flight(self) -> int:
        with self._lock:
            return sum(r.sent_bytes - r.processed_bytes for r in self._reqs.values()
                       if not r.finished.is_set())

    def _waiting_on_peer(self) -> bool:
        """Outstanding work the receiver must answer: an un-ACCEPTed HELLO, unacknowledged
        bytes, or a request whose DONE has not come."""
        return any("hello_t" in r.result.times and not r.finished.is_set()
                   for r in self._reqs.values())

    def _send_chunk(self, sock: zmq.Socket, item: QueuedChunk) -> None:
        req = self._reqs.get(item.request_id)
        if req is None or req.finished.is_set():
            return
        self.limiter.consume(item.size_bytes)
        frames = P.chunk_frames(item.request_id, item.stream, item.layer, item.page, item.seq,
                                item.payload, item.payload_crc)
        t = time.time()
        sock.send_multipart(frames, copy=False)
        with self._lock:
            req.sent_bytes += item.size_bytes
            req.unacked[(item.stream, item.seq)] = item
            req.queued_chunks -= 1
        req.result.sent_bytes += item.size_bytes
        req.result.sends.append((item.stream, item.layer, item.page, t))
        if self.metrics is not None:
            self.metrics.chunk("sent", item.stream, item.size_bytes)

    def _send_fins(self, sock: zmq.Socket) -> None:
        for req in self._reqs.values():
            if req.fin_sent:
                continue
            with self._lock:
                ready = req.released_all and not req.fin_sent and req.queued_chunks == 0
            if ready and not req.finished.is_set():
                sock.send_multipart(P.json_message(P.MsgType.FIN, req.out.request_id, req.fin))
                req.fin_sent = True

    def _handle(self, frames: list[Any]) -> None:
        try:
            msg = P.parse(frames)
        except P.ProtocolError as exc:
            self.protocol_errors += 1
            self.log(f"refused a message from the receiver: {exc}")
            return
        if msg.type == P.MsgType.HEARTBEAT:
            return
        req = self._reqs.get(msg.request_id)
        if req is None or req.finished.is_set():
            return
        if msg.type == P.MsgType.ACCEPT:
            self._accepted(req, msg.body)
        elif msg.type == P.MsgType.REFUSE:
            self._fail(req, "refused", str(msg.body.get("reason", "no reason given"))[
                :P.MAX_REASON_CHARS])
        elif msg.type == P.MsgType.ABORT:
            self._fail(req, "aborted", str(msg.body.get("reason", "no reason given"))[
                :P.MAX_REASON_CHARS])
        elif msg.type == P.MsgType.ACK:
            processed, contiguous = msg.body
            with self._lock:
                req.processed_bytes = max(req.processed_bytes, min(processed, req.sent_bytes))
                if len(contiguous) == len(req.result.chunks):
                    req.result.acked = list(contiguous)
                    for key in [k for k in req.unacked if k[1] < contiguous[k[0]]]:
                        del req.unacked[key]
        elif msg.type == P.MsgType.NACK:
            if self.metrics is not None:
                self.metrics.nack("received")
            for stream, seq in msg.body:
                with self._lock:
                    item = req.unacked.pop((stream, seq), None)
                    if item is not None:
                        req.queued_chunks += 1
                        req.sent_bytes -= item.size_bytes  # back in the queue, not in flight
                if item is None:  # already acknowledged, or never sent: not ours to resend
                    self.protocol_errors += 1
                    continue
                req.result.resent_chunks += 1
                if self.metrics is not None:
                    self.metrics.resend()
                item.priority = (-1, *item.priority)  # a resend jumps the queue
                self.scheduler.put(item, self.timeout_s)
        elif msg.type == P.MsgType.DONE:
            req.result.row = msg.body
            req.result.acked = list(req.result.chunks)
            self._finish(req, "done")

    def _accepted(self, req: _Req, body: dict) -> None:
        """An ACCEPT: the credit window and, for a resumed request, the chunks the receiver
        holds. Believed only within this request's own size table: a stream it has, seq
        ranges inside that stream, at most one range per chunk."""
        try:
            window = P.field_int(body, "window_bytes", 1, 1 << 40)
            held = body.get("held") or {}
            if not isinstance(held, dict) or len(held) > len(req.plan):
                raise P.ProtocolError("held must be an object with one entry per stream")
            parsed: dict[int, set[int]] = {}
            for key, ranges in held.items():
                stream = int(key)
                if not 0 <= stream < len(req.plan):
                    raise P.ProtocolError(f"held names stream {stream:.20}, the codec has "
                                          f"{len(req.plan)}")
                n = len(req.plan[stream])
                if not isinstance(ranges, list) or len(ranges) > n:
                    raise P.ProtocolError(f"held stream {stream}: more ranges than its {n} "
                                          "chunks")
                seqs: set[int] = set()
                for a, b in ranges:
                    if not (isinstance(a, int) and isinstance(b, int) and 0 <= a < b <= n):
                        raise P.ProtocolError(f"held stream {stream}: a range outside its "
                                              f"{n} chunks")
                    seqs.update(range(a, b))
                parsed[stream] = seqs
            prefix = body.get("prefix_tokens", 0)
            pt = req.table.page_tokens
            if isinstance(prefix, bool) or not isinstance(prefix, int) or \
                    not 0 <= prefix < req.tokens or prefix % pt or \
                    (prefix and not req.out.codec.pages_encode_alone()):
                raise P.ProtocolError(f"prefix_tokens must be whole {pt}-token pages before "
                                      f"the last of {req.tokens} tokens, of a codec whose "
                                      "pages encode alone")
        except (P.ProtocolError, TypeError, ValueError) as exc:
            self._fail(req, "error", f"malformed ACCEPT: {str(exc)[:P.MAX_REASON_CHARS]}")
            return
        with self._lock:
            req.window_bytes, req.held = window, parsed
            req.result.prefix_tokens = prefix
        if prefix:
            self.log(f"request {P.id_hex(req.out.request_id)}: the receiver holds its first "
                     f"{prefix} tokens; encoding and sending the rest")
        elif parsed:
            self.log(f"request {P.id_hex(req.out.request_id)}: the receiver holds "
                     f"{sum(map(len, parsed.values()))} chunk(s); sending the rest")
        req.accepted.set()

    def _fail(self, req: _Req, status: str, error: str) -> None:
        if req.finished.is_set():
            return
        req.result.error = error
        self.scheduler.drop_request(req.out.request_id)
        self._finish(req, status)
        self.log(f"request {P.id_hex(req.out.request_id)} ({req.out.codec_label}): {status}: "
                 f"{error}")

    def _finish(self, req: _Req, status: str) -> None:
        req.result.status = status
        req.result.times["finished_t"] = time.time()
        req.finished.set()
        req.accepted.set()
        if self.metrics is not None:
            self.metrics.request_ended(status)
            if req.result.row is not None:
                self.metrics.observe_row(req.result.row)

    def _lose_peer(self, why: str) -> None:
        for req in self._reqs.values():
            if not req.finished.is_set():
                acked = req.result.acked = req.result.acked or [0] * len(req.result.chunks)
                self._fail(req, "peer_lost", f"{why}; acknowledged chunks per stream "
                           f"{acked} of {req.result.chunks}")

