"""Decode side: a ZeroMQ ROUTER that accepts requests, assembles their chunks, acknowledges
them, and runs each request's decode loop as soon as the streams it needs are in.

    I/O thread (owns the socket):  poll (timeout) -> parse (never trusts a byte) ->
        HELLO: bound every field, build the codec and size table, reserve the request's
               memory -> ACCEPT (+ chunks held) | REFUSE (code + what differs)
        CHUNK: owner, checksum, credit, coordinates, length -> Assembly; a bad checksum ->
               NACK (resend)
        FIN:   the sender's own times (encode end, backlog starts, first send)
        -> one ACK per request touched per poll round (cumulative per stream + credit)
    decode thread per request: Assembly (a CacheView) -> decode loop -> report row -> DONE

Nothing a peer sends can end or stall the server:
- a request belongs to the peer that opened it (its ZeroMQ routing id and, with CURVE, its
  authenticated public key): a message for it from any other peer is refused;
- admission is total: every HELLO field is bounded before anything is built, and anything
  admission raises refuses that request;
- one memory budget (`max_memory_bytes`): a request's held chunks and dequantized caches are
  reserved at admission; beyond it, "busy: memory" (on a CUDA device the caches are
  reserved against the device's budget instead, "busy: device memory"); per-peer and total
  request limits;
- the credit window is enforced on receipt; socket high-water marks and a maximum frame size
  bound what is buffered;
- replies never block: a peer that does not read them has them dropped, and after
  `max_dropped_replies` its requests are ended;
- each request has a deadline, and its decode loop stops between steps once it is ended;
- refusals are counted by a fixed vocabulary (protocol.REFUSAL_CODES), logged at most 3
  times per code, and truncated.

A request whose sender falls silent for `timeout_s` is reported as partial (which streams
and chunks arrived) and freed; until then its sender (same peer) may reconnect with the same
request id, is told what is held, and resumes.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import traceback
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from kvsim.core.layout import KVShape
from kvsim.kernels import wire
from kvsim.kernels.codec import checked_codec
from kvsim.scenario.policy import POLICIES
from kvsim.transport import auth
from kvsim.transport import protocol as P
from kvsim.transport.assembly import Assembly
from kvsim.transport.prefix_store import HeldPrefix, PrefixStore, PrefixUse, prefix_of

MAX_LAYERS = 4096
MAX_TOKENS = 1 << 22  # 4M tokens: a larger claim is refused before any table is built
MAX_CHUNKS = 1 << 20  # chunks of one request (all streams): bounds its size table and state
MAX_FINISHED_IDS = 1 << 16  # ended request ids remembered (a late HELLO for one is refused)
LOGGED_PER_CODE = 3  # refusals logged per code; the rest are counted
RCVHWM_MESSAGES = 64  # per peer: ZeroMQ stops reading a peer's socket beyond this backlog
SNDHWM_MESSAGES = 1000  # per peer: replies queued for a peer that does not read them


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(kw_only=True)
class ReceiverSettings:
    bind: str = "tcp://127.0.0.1:5557"  # e.g. tcp://127.0.0.1:5555 or tcp://*:5555
    model: str = ""  # model the HELLO must name ("" accepts any)
    timeout_s: float = 30.0  # a silent sender's request is dropped after this
    heartbeat_s: float = 0.5
    window_bytes: int = 16 << 20  # credit: bytes a sender may have unprocessed in flight
    max_request_bytes: int = 8 << 30  # refuse a request whose bf16 cache is larger
    max_active_requests: int = 64  # refuse a HELLO beyond this many requests in progress
    max_requests_per_peer: int = 16  # ... or beyond this many from one peer
    # every request's wire bytes and dequantized caches are reserved against this at
    # admission (0: half of this host's physical memory)
    max_memory_bytes: int = 0
    # dequantized fp32 copies of a request's cache the decoder holds at its peak (a real
    # model's cache built from them doubles it); a split-stream request with drafting holds
    # the anchor's and the full one
    cache_copies: int = 1
    request_deadline_s: float = 3600.0  # a request running longer is ended and freed
    max_dropped_replies: int = 64  # replies dropped for a non-reading peer before its end
    max_requests: int = 0  # stop after this many requests ended (0: until stopped)
    idle_exit_s: float = 0.0  # stop when nothing happened for this long (0: never)
    # on_arrival: a worker per request dequantizes each layer once its chunks are in |
    # on_demand: the decoder dequantizes the whole cache when it starts on it
    dequantize: str = "on_arrival"
    keys: str = ""  # CURVE keys directory (kvsim.transport.auth); "": plain TCP
    insecure: bool = False  # a non-loopback bind without keys
    # prefix reuse (kvsim.transport.prefix_store): bytes of reused prompt blocks kept here
    # (bf16 KV), within the memory budget; 0: no store (a HELLO's prefix is sent whole)
    prefix_store_bytes: int = 0
    # where the requests' caches are dequantized to and decoded: "cpu", or a CUDA device
    # ("cuda", "cuda:N"), whose memory then holds them: they are reserved against
    # max_device_memory_bytes, and only the wire bytes against max_memory_bytes
    device: str = "cpu"
    # 0: what the device has free when the receiver starts (its model loaded and warmed up:
    # the driver's free memory and torch's cached blocks), less DEVICE_MEMORY_HEADROOM
    max_device_memory_bytes: int = 0

    def memory_limit_bytes(self) -> int:
        return self.max_memory_bytes or physical_memory_bytes() // 2

    def on_device(self) -> bool:
        """The caches live in a CUDA device's memory, not the host's."""
        return self.device.startswith("cuda")

    def device_memory_limit_bytes(self) -> int:
        """The device memory the requests' caches may take (0: not on a device)."""
        if not self.on_device():
            return 0
        return self.max_device_memory_bytes or device_free_bytes(self.device)


# of a device's free memory, the share its requests' caches may not take: the activations
# of a decode step and the transient copies of a batch's rebuild live there too
DEVICE_MEMORY_HEADROOM = 0.1


def device_free_bytes(device: str) -> int:
    """What a CUDA device has free for this process's caches: the driver's free memory plus
    the blocks torch's allocator keeps cached (its warm-up's, reused by requests), less
    DEVICE_MEMORY_HEADROOM."""
    import torch

    dev = torch.device(device)
    free, _total = torch.cuda.mem_get_info(dev)
    cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    return int((free + cached) * (1 - DEVICE_MEMORY_HEADROOM))


def outcome_of(row: dict) -> str:
    """What a request's row says it ended as, in the metrics' outcomes."""
    status, error = row.get("status"), str(row.get("error") or "")
    if status == "done":
        return "done"
    if status == "partial" or error.startswith("sender silent"):
        return "peer_lost"
    for prefix, outcome in (("deadline", "deadline"), ("sender aborted", "aborted"),
                            ("slow reader", "cancelled"), ("receiver stopped", "cancelled")):
        if error.startswith(prefix):
            return outcome
    return "error"


# (hello, assembly) -> (decode loop with .run(view, ...), description dict); raises to refuse
DecoderFactory = Callable[[dict, Assembly], tuple[Any, dict]]
# (assembly, hello, DecodeResult | None, error) -> report row
RowBuilder = Callable[[Assembly, dict, Any, str], dict]


class Refused(Exception):
    """A HELLO refused with a REFUSAL_CODES code and what differs."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code


@dataclass(frozen=True)
class Peer:
    """Who sent a message: its ZeroMQ routing id and, with CURVE, its authenticated public
    key (z85; "" without CURVE). A request belongs to the Peer that opened it."""

    routing_id: bytes
    key: str

    def owns(self, other: Peer) -> bool:
        """Whether `other` is this peer: the same authenticated key where there is one (its
        connection may be new: a resumed sender), else the same routing id."""
        return self.key == other.key if self.key else self.routing_id == other.routing_id

    @property
    def principal(self) -> str | bytes:
        """What per-peer limits count by: the key where there is one (a peer may open many
        connections), else the connection."""
        return self.key or self.routing_id


class Receiver:
    def __init__(self, settings: ReceiverSettings, make_decoder: DecoderFactory,
                 build_row: RowBuilder, log: Callable[[str], None] | None = None,
                 check_hello: Callable[[dict, KVShape], str] | None = None,
                 metrics: Any = None) -> None:
        self.s = settings
        self.make_decoder, self.build_row = make_decoder, build_row
        self.check_hello = check_hello
        self.metrics = metrics  # a TransportMetrics (kvsim.transport.metrics) or None
        self.log = log or (lambda msg: print(f"kvsim serve: {msg}", file=sys.stderr))
        self.requests: dict[int, Assembly] = {}
        self.owners: dict[int, Peer] = {}
        self.reserved: dict[int, int] = {}  # request -> bytes reserved at admission
        self.memory_limit_bytes = settings.memory_limit_bytes()
        # ... and of the device's memory, where its caches go to a device (0: none)
        self.device_reserved: dict[int, int] = {}
        self.device_memory_limit_bytes = settings.device_memory_limit_bytes()
        self.finished_ids: OrderedDict[int, None] = OrderedDict()
        self.rows: list[dict] = []
        self.refused: Counter[str] = Counter()
        self.dropped_replies: Counter[bytes] = Counter()  # per routing id
        self._done: queue.SimpleQueue[tuple[int, dict]] = queue.SimpleQueue()
        # blocks a request's dequantization produced for the prefix store (the I/O thread
        # keeps them: _keep_given): (request, its use, each block's KV)
        self._given: queue.SimpleQueue[tuple[int, PrefixUse, list]] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.bound = threading.Event()
        self.endpoint = ""
        self._touched: set[int] = set()
        self.prefix_store = PrefixStore(settings.prefix_store_bytes) \
            if settings.prefix_store_bytes > 0 else None

    @property
    def reserved_bytes(self) -> int:
        """Bytes reserved by the requests in progress and held by the prefix store."""
        held = self.prefix_store.held_bytes if self.prefix_store is not None else 0
        return sum(self.reserved.values()) + int(held)

    # ---- main loop -------------------------------------------------------------------
    def serve(self) -> list[dict]:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished peer raises
        sock.setsockopt(zmq.SNDHWM, SNDHWM_MESSAGES)
        sock.setsockopt(zmq.RCVHWM, RCVHWM_MESSAGES)
        # the largest frame a sender may send: a JSON body or a chunk within its credit
        sock.setsockopt(zmq.MAXMSGSIZE, max(P.MAX_JSON_BYTES, self.s.window_bytes) + 4096)
        authenticator = None
        try:
            authenticator = auth.secure_server(ctx, sock, self.s.keys, self.s.insecure,
                                               self.s.bind, self.log)
            sock.bind(self.s.bind)
            self.endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            self.bound.set()
            self._loop(sock)
        finally:
            self.bound.set()
            for asm in list(self.requests.values()):
                asm.fail("receiver stopped")
            sock.close(0)
            if authenticator is not None:
                authenticator.stop()
            ctx.term()
        return self.rows

    def _loop(self, sock: zmq.Socket) -> None:
        last_hb = last_event = time.monotonic()
        while not self.stop.is_set():
            if sock.poll(int(self.s.heartbeat_s * 1000 / 2), zmq.POLLIN):
                budget = 256  # messages per round before ACKs go out
                while budget and sock.get(zmq.EVENTS) & zmq.POLLIN:
                    self._handle(sock, sock.recv_multipart(copy=False))
                    budget -= 1
                last_event = time.monotonic()
            self._send_acks(sock)
            self._keep_given()
            while not self._done.empty():
                self._finish(sock, *self._done.get())
                last_event = time.monotonic()
            now = time.monotonic()
            if now - last_hb >= self.s.heartbeat_s:
                live = {p.routing_id for p in self.owners.values()}
                for routing_id in live:
                    self._send(sock, routing_id, P.heartbeat())
                for routing_id in set(self.dropped_replies) - live:  # bounded by the live
                    del self.dropped_replies[routing_id]
                last_hb = now
            self._drop_silent(now)
            if self.metrics is not None:
                self.metrics.set_active(len(self.requests))
                self.metrics.set_memory(self.reserved_bytes, self.memory_limit_bytes,
                                        sum(self.device_reserved.values()),
                                        self.device_memory_limit_bytes)
            if self.s.max_requests and len(self.rows) >= self.s.max_requests:
                return
            if self.s.idle_exit_s and not self.requests and \
                    now - last_event > self.s.idle_exit_s:
                return

    def _send(self, sock: zmq.Socket, routing_id: bytes, frames: list[Any]) -> bool:
        """Queue a reply without ever blocking: a peer that does not read its replies has
        them dropped (its queue is full), and after max_dropped_replies its requests end."""
        try:
            sock.send_multipart([routing_id, *frames], flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.dropped_replies[routing_id] += 1
            self._count("slow reader", "a peer does not read its replies; dropped one")
            if self.dropped_replies[routing_id] >= self.s.max_dropped_replies:
                for rid, owner in list(self.owners.items()):
                    if owner.routing_id == routing_id and rid in self.requests:
                        self.requests[rid].fail(P.reason(
                            "slow reader", f"{self.dropped_replies[routing_id]} replies "
                            "dropped: the sender does not read them"))
                del self.dropped_replies[routing_id]
        except zmq.ZMQError:  # EHOSTUNREACH: the peer is gone (its requests time out)
            pass
        return False

    # ---- messages ----------------------------------------------------------------------
    def _handle(self, sock: zmq.Socket, frames: list[Any]) -> None:
        if len(frames) < 2:
            self._count("malformed", "no routing id")
            return
        peer = Peer(frames[0].bytes, auth.peer_key(frames[1]))
        body = frames[1:]
        try:
            msg = P.parse(body)
        except P.ChecksumError as exc:
            self._checksum_failed(sock, peer, exc)
            return
        except P.ProtocolError as exc:
            self._count(exc.code, str(exc))
            return
        if msg.type == P.MsgType.HEARTBEAT:
            now = time.monotonic()
            for rid, owner in self.owners.items():
                if owner.routing_id == peer.routing_id and rid in self.requests:
                    self.requests[rid].last_rx_t = now
            return
        if msg.type == P.MsgType.HELLO:
            self._hello(sock, peer, msg.request_id, msg.body)
            return
        asm = self.requests.get(msg.request_id)
        if asm is None:
            self._count("unknown request", msg.type.name)
            return
        if not self.owners[msg.request_id].owns(peer):
            self._count("not owner", msg.type.name)
            return
        asm.last_rx_t = time.monotonic()
        if msg.type == P.MsgType.CHUNK:
            self._chunk(asm, msg.body)
        elif msg.type == P.MsgType.FIN:
            asm.set_fin(msg.body)
        elif msg.type == P.MsgType.ABORT:
            asm.fail(P.reason("sender aborted", str(msg.body.get("reason", ""))))
        else:
            self._count("not a sender message", msg.type.name, asm)

    def _chunk(self, asm: Assembly, frame: P.ChunkFrame) -> None:
        size = P.CONTROL_BYTES + P.CHUNK_HEADER_BYTES + frame.payload.nbytes
        unacked = asm.processed_bytes - asm.acked_bytes
        if unacked and unacked + size > self.s.window_bytes:  # the sender had no credit
            self._count("beyond credit", f"stream {frame.stream} seq {frame.seq}", asm)
            return
        try:
            if asm.add(frame, size) == "duplicate":
                self._count("duplicate chunk", f"stream {frame.stream} seq {frame.seq}", asm,
                            log=False)
            elif self.metrics is not None:
                self.metrics.chunk("received", frame.stream, size)
        except P.ProtocolError as exc:
            self._count("bad chunk", str(exc), asm)
        self._touched.add(asm.request_id)

    def _give(self, rid: int, use: PrefixUse, layer: int, kv_layer: Any) -> None:
        """A layer of a request's cache, dequantized with every stream (its dequantizing
        thread): once every layer is, its blocks wait for the I/O thread (_keep_given)."""
        blocks = use.give_layer(layer, kv_layer)
        if blocks:
            self._given.put((rid, use, blocks))

    def _keep_given(self) -> None:
        """The blocks requests' dequantization produced go to the prefix store, pinned for
        their request (unless it ended meanwhile)."""
        while not self._given.empty():
            rid, use, kv = self._given.get()
            if not use.ended and self.requests.get(rid) is not None:
                use.kept = self.prefix_store.adopt(  # type: ignore[union-attr]
                    use.key, use.block_bytes, use.blocks[use.hit:use.full], kv)

    def _count(self, code: str, detail: str, asm: Assembly | None = None,
               log: bool = True) -> None:
        """Count a refusal by its code (never by anything the peer chose); log the first few
        of each code, truncated."""
        self.refused[code] += 1
        if asm is not None:
            asm.refuse(code)
        if self.metrics is not None:
            self.metrics.refused(code)
        if log and self.refused[code] <= LOGGED_PER_CODE:
            self.log(f"refused: {P.reason(code, detail)}" +
                     (" (further ones only counted)" if self.refused[code] ==
                      LOGGED_PER_CODE else ""))

    def _checksum_failed(self, sock: zmq.Socket, peer: Peer, exc: P.ChecksumError) -> None:
        asm = self.requests.get(exc.request_id)
        if asm is None or not self.owners[exc.request_id].owns(peer):
            self._count("checksum", str(exc))
            return
        self._count("checksum", str(exc), asm)
        if exc.stream >= asm.num_streams or exc.seq >= len(asm.streams[exc.stream].expected):
            return
        if asm.streams[exc.stream].received[exc.seq]:
            return
        # ask for the chunk again (the sender takes its bytes off its in-flight count)
        if self.metrics is not None:
            self.metrics.nack("sent")
        self._send(sock, peer.routing_id, P.nack_message(exc.request_id, [(exc.stream,
                                                                           exc.seq)]))

    def _refuse(self, sock: zmq.Socket, peer: Peer, rid: int, code: str, detail: str) -> None:
        self._count(code, detail)
        self._send(sock, peer.routing_id, P.json_message(P.MsgType.REFUSE, rid, {
            "code": code, "reason": P.reason(code, detail)}))

    def _hello(self, sock: zmq.Socket, peer: Peer, rid: int, hello: dict) -> None:
        if rid in self.finished_ids:
            self._refuse(sock, peer, rid, "finished", "the request already ended here")
            return
        existing = self.requests.get(rid)
        if existing is not None:  # its sender reconnecting: tell it what is held
            if not self.owners[rid].owns(peer):
                self._refuse(sock, peer, rid, "not owner",
                             "the request is in progress here for another peer")
                return
            if wire.canonical_json(hello.get("preamble") or {}) != \
                    wire.canonical_json(existing.hello.get("preamble") or {}):
                self._refuse(sock, peer, rid, "incompatible",
                             "the request is in progress here with a different preamble")
                return
            existing.last_rx_t = time.monotonic()
            self.owners[rid] = peer  # the same peer, maybe over a new connection
            self._send(sock, peer.routing_id, P.json_message(P.MsgType.ACCEPT, rid, {
                "window_bytes": self.s.window_bytes, "held": existing.held_ranges()}))
            self.log(f"request {P.id_hex(rid)}: sender reconnected; "
                     f"{sum(s.count for s in existing.streams)} chunk(s) held")
            return
        if len(self.requests) >= self.s.max_active_requests:
            self._refuse(sock, peer, rid, "busy: requests", f"{len(self.requests)} in progress "
                         f"(max_active_requests {self.s.max_active_requests})")
            return
        mine = sum(1 for r in self.requests if self.owners[r].principal == peer.principal)
        if mine >= self.s.max_requests_per_peer:
            self._refuse(sock, peer, rid, "busy: peer", f"{mine} of this peer's in progress "
                         f"(max_requests_per_peer {self.s.max_requests_per_peer})")
            return
        try:
            asm, need, device_need = self._admit(rid, hello)
        except Refused as exc:
            self._refuse(sock, peer, rid, exc.code, str(exc))
            return
        except Exception as exc:  # admission never ends the server: the request is refused
            self._refuse(sock, peer, rid, "admission error", f"{type(exc).__name__}: {exc}")
            self.log(traceback.format_exc(limit=4)[-2000:])
            return
        self.requests[rid] = asm
        self.owners[rid] = peer
        self.reserved[rid] = need
        if device_need:
            self.device_reserved[rid] = device_need
        try:  # the decode loop first: its cache builder receives layers as they arrive
            made: tuple[Any, dict] | Exception = self.make_decoder(hello, asm)
        except Exception as exc:  # reported in the request's row, as a decode failure
            made = exc
        accept: dict = {"window_bytes": self.s.window_bytes, "held": {}}
        use = asm.prefix
        if use is not None:  # the leading blocks held here: counted in, not sent
            self._keep_given()  # (what finished dequantizing by now is held)
            use.hit, kv = self.prefix_store.lookup(  # type: ignore[union-attr]
                use.key, use.block_bytes, use.blocks,
                (asm.shape.tokens - 1) // use.block_tokens)
            if use.hit:
                asm.preload(HeldPrefix(kv, use.block_tokens, asm.table.page_tokens))
            accept["held"], accept["prefix_tokens"] = asm.held_ranges(), use.hit_tokens
            rid_ = asm.request_id
            asm.on_full_layer = lambda layer, kv_layer: self._give(rid_, use, layer, kv_layer)
        asm.start(getattr(made[0], "cache_builder", None) if isinstance(made, tuple) else None)
        self._send(sock, peer.routing_id, P.json_message(P.MsgType.ACCEPT, rid, accept))
        threading.Thread(target=self._decode, args=(asm, made), daemon=True,
                         name=f"kvsim-decode-{P.id_hex(rid)[:8]}").start()

    def _admit(self, rid: int, hello: dict) -> tuple[Assembly, int, int]:
        """Validate a HELLO (untrusted: every field bounded before anything is built) and
        build its assembler; returns it, the host bytes it reserves and the device bytes
        (0: its caches are not on a device). Raises Refused naming what differs."""
        version = hello.get("wire_version")
        if version != wire.WIRE_VERSION:
            raise Refused("incompatible", f"wire version {str(version)[:20]} differs: this "
                          f"receiver speaks {wire.WIRE_VERSION}")
        pre = hello.get("preamble")
        if not isinstance(pre, dict):
            raise Refused("incompatible", "HELLO has no preamble object")
        shape_doc = pre.get("shape")
        if not isinstance(shape_doc, dict) or not set(shape_doc) <= {
                "layers", "tokens", "kv_heads", "head_dim", "dtype"}:
            raise Refused("incompatible", "preamble shape must be an object of layers, "
                          "tokens, kv_heads, head_dim, dtype")
        try:
            layers = P.field_int(shape_doc, "layers", 1, MAX_LAYERS)
            tokens = P.field_int(shape_doc, "tokens", 1, MAX_TOKENS)
            heads = P.field_int(shape_doc, "kv_heads", 1, 1024)
            dim = P.field_int(shape_doc, "head_dim", 1, 1024)
            codec_name = P.field_str(pre, "codec", 64)
        except P.ProtocolError as exc:
            raise Refused("incompatible", str(exc)) from None
        bf16_bytes = 2 * layers * 2 * heads * tokens * dim
        if bf16_bytes > self.s.max_request_bytes:
            raise Refused("incompatible", f"a {layers}x2x{heads}x{tokens}x{dim} cache exceeds "
                          f"this receiver's max_request_bytes {self.s.max_request_bytes}")
        try:
            shape = KVShape(layers=layers, tokens=tokens, kv_heads=heads, head_dim=dim,
                            dtype=P.field_str(shape_doc, "dtype", 16))
        except (P.ProtocolError, ValueError) as exc:
            raise Refused("incompatible", str(exc)) from None
        try:  # the same bounds as a preamble read from a file (kvsim.kernels.codec)
            codec = checked_codec(codec_name, pre.get("params"))
            page_tokens = codec.page_tokens(shape)
        except (wire.WireError, ValueError, TypeError, OverflowError) as exc:
            raise Refused("incompatible", str(exc)) from None
        if pre.get("streams") != codec.stream_names():
            raise Refused("incompatible", f"streams differ: codec {codec.stream_names()}")
        if pre.get("page_tokens") != page_tokens:
            raise Refused("incompatible", f"page_tokens differ: codec {page_tokens}")
        chunks = codec.num_streams * layers * -(-tokens // max(1, page_tokens))
        if not 1 <= page_tokens or chunks > MAX_CHUNKS:
            raise Refused("incompatible", f"{chunks} chunks exceed this receiver's "
                          f"{MAX_CHUNKS}")
        try:
            codec.check_shape(shape)
        except (wire.WireError, ValueError) as exc:
            raise Refused("incompatible", str(exc)) from None
        model = hello.get("model")
        if self.s.model and model != self.s.model:
            raise Refused("incompatible", f"model differs: sender {str(model)[:64]!r}, this "
                          f"decode node {self.s.model!r}")
        policy = hello.get("policy")
        if policy not in POLICIES:
            raise Refused("incompatible", f"unknown transfer policy {str(policy)[:32]!r}")
        if self.check_hello is not None:
            problem = self.check_hello(hello, shape)
            if problem:
                raise Refused("incompatible", problem)
        table = codec.size_table(shape)
        if int(table.chunk_bytes.max(initial=0)) > self.s.window_bytes:
            raise Refused("incompatible", f"a chunk of {int(table.chunk_bytes.max())} bytes "
                          f"exceeds the credit window {self.s.window_bytes}")
        try:
            use = prefix_of(hello, codec, shape, page_tokens) \
                if self.prefix_store is not None else None
        except ValueError as exc:
            raise Refused("incompatible", str(exc)) from None
        anchor = str(policy).startswith("split_stream") and int(hello.get("cap_tokens") or 0) > 0
        fp32_bytes = 2 * bf16_bytes
        caches = fp32_bytes * self.s.cache_copies * (2 if anchor else 1)
        device_need = caches if self.device_memory_limit_bytes else 0
        if device_need:
            free = self.device_memory_limit_bytes - sum(self.device_reserved.values())
            if device_need > free:
                raise Refused("busy: device memory", f"the request's caches need "
                              f"{device_need / 2**20:.0f} MiB of {self.s.device}, "
                              f"{free / 2**20:.0f} MiB of max_device_memory_bytes "
                              f"{self.device_memory_limit_bytes / 2**20:.0f} MiB are free")
        need = int(table.total_bytes) + (0 if device_need else caches)
        limit = self.memory_limit_bytes
        over = self.reserved_bytes + need - limit
        if over > 0 and self.prefix_store is not None and self.prefix_store.idle_bytes >= over:
            self.prefix_store.evict(over)  # idle prefix blocks give way to a request
        if self.reserved_bytes + need > limit:
            raise Refused("busy: memory", f"the request needs {need / 2**20:.0f} MiB, "
                          f"{(limit - self.reserved_bytes) / 2**20:.0f} MiB of "
                          f"max_memory_bytes {limit / 2**20:.0f} MiB are free")
        return Assembly(rid, codec, shape, table, hello, dequantize=self.s.dequantize,
                        anchor_needed=anchor, prefix=use, device=self.s.device), need, \
            device_need

    def _send_acks(self, sock: zmq.Socket) -> None:
        for rid in self._touched:
            asm = self.requests.get(rid)
            if asm is not None:
                asm.acked_bytes = asm.processed_bytes  # credit granted from here
                self._send(sock, self.owners[rid].routing_id,
                           P.ack_message(rid, asm.processed_bytes, asm.contiguous()))
        self._touched.clear()

    # ---- decode thread -----------------------------------------------------------------
    def _decode(self, asm: Assembly, made: tuple[Any, dict] | Exception) -> None:
        hello, result, error = asm.hello, None, ""
        try:
            if isinstance(made, Exception):
                raise made
            loop, _ = made
            speculative = hello["policy"].startswith("split_stream") and asm.num_streams > 1
            result = loop.run(asm, speculative, int(hello["output_tokens"]),
                              int(hello.get("cap_tokens", 0)), timeout_s=1e9)
            asm.wait_fin(self.s.timeout_s)  # the sender's times follow its last chunk
        except Exception as exc:  # a request's failure never takes the receiver down
            error = asm.failed or f"{type(exc).__name__}: {exc}"
            if not asm.failed:
                self.log(f"request {asm.request_id:032x}: decode failed: {error}\n"
                         f"{traceback.format_exc(limit=3)}")
        try:
            row = self.build_row(asm, hello, result, error)
        except Exception as exc:
            row = {"request_id": asm.request_id, "status": "error",
                   "error": f"report row failed: {type(exc).__name__}: {exc}"}
        self._done.put((asm.request_id, row))

    def _finish(self, sock: zmq.Socket, rid: int, row: dict) -> None:
        asm = self.requests.get(rid)
        use = asm.prefix if asm is not None else None
        if use is not None:  # what it reused, and the blocks it used go idle
            self._keep_given()  # (its own blocks, if they are waiting)
            use.ended = True
            row["prefix_hit_tokens"] = use.hit_tokens
            self.prefix_store.release(use.key,  # type: ignore[union-attr]
                                      [*use.blocks[:use.hit], *use.kept])
        owner = self.owners.pop(rid, None)
        if owner is not None:  # answer first, then free the request's buffers
            self._send(sock, owner.routing_id, P.json_message(P.MsgType.DONE, rid, row))
        self.rows.append(row)
        self.finished_ids[rid] = None
        while len(self.finished_ids) > MAX_FINISHED_IDS:
            self.finished_ids.popitem(last=False)
        self.reserved.pop(rid, None)
        self.device_reserved.pop(rid, None)
        asm = self.requests.pop(rid, None)
        if asm is not None:
            asm.close()
        if self.metrics is not None:
            self.metrics.request_ended(outcome_of(row))
            self.metrics.observe_row(row)

    def _drop_silent(self, now: float) -> None:
        """End requests whose sender fell silent, and those past their deadline."""
        for rid, asm in list(self.requests.items()):
            if asm.failed:
                continue
            if now - asm.last_rx_t > self.s.timeout_s:
                summary = asm.received_summary()
                self.log(f"request {P.id_hex(rid)}: sender silent for {self.s.timeout_s} s; "
                         f"partial: {summary}")
                asm.fail(f"sender silent for {self.s.timeout_s} s (partial request: "
                         f"{summary['chunks_received']} of {summary['chunks_expected']} "
                         "chunks per stream)")
            elif now - asm.admitted_mono > self.s.request_deadline_s:
                self._count("deadline", f"request {P.id_hex(rid)} ran "
                            f"{now - asm.admitted_mono:.0f} s")
                asm.fail(P.reason("deadline", f"ended after request_deadline_s "
                                  f"{self.s.request_deadline_s:g} s"))
