"""Decode side: a ZeroMQ ROUTER that accepts requests, assembles their chunks, acknowledges
them, and runs each request's decode loop as soon as the streams it needs are in.

    I/O thread (owns the socket):  poll (timeout) -> parse (never trusts a byte) ->
        HELLO: validate the preamble against this decode node -> ACCEPT (+ chunks held) |
               REFUSE (names what differs)
        CHUNK: checksum, coordinates, length -> Assembly; a bad checksum -> NACK (resend)
        FIN:   the sender's own times (encode end, backlog starts, first send)
        -> one ACK per request touched per poll round (cumulative per stream + credit)
    decode thread per request: Assembly (a CacheView) -> decode loop -> report row -> DONE

A request whose sender falls silent for `timeout_s` is reported as partial (which streams
and chunks arrived) and freed; until then a sender that reconnects with the same request id
is told what is held and resumes. Every refused frame is counted by reason, never raised.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from kvsim.core.layout import KVShape
from kvsim.kernels import wire
from kvsim.kernels.codec import CodecError, make_codec
from kvsim.scenario.policy import POLICIES
from kvsim.transport import protocol as P
from kvsim.transport.assembly import Assembly

MAX_LAYERS = 4096
MAX_TOKENS = 1 << 22  # 4M tokens: a larger claim is refused before any table is built


@dataclass(kw_only=True)
class ReceiverSettings:
    bind: str = "tcp://127.0.0.1:5557"  # e.g. tcp://127.0.0.1:5555 or tcp://*:5555
    model: str = ""  # model the HELLO must name ("" accepts any)
    timeout_s: float = 30.0  # a silent sender's request is dropped after this
    heartbeat_s: float = 0.5
    window_bytes: int = 16 << 20  # credit: bytes a sender may have unprocessed in flight
    max_request_bytes: int = 8 << 30  # refuse a request whose bf16 cache is larger
    max_active_requests: int = 64  # refuse a HELLO beyond this many requests in progress
    max_requests: int = 0  # stop after this many requests ended (0: until stopped)
    idle_exit_s: float = 0.0  # stop when nothing happened for this long (0: never)
    # on_arrival: a worker per request dequantizes each layer once its chunks are in |
    # on_demand: the decoder dequantizes the whole cache when it starts on it
    dequantize: str = "on_arrival"


# (hello, assembly) -> (decode loop with .run(view, ...), description dict); raises to refuse
DecoderFactory = Callable[[dict, Assembly], tuple[Any, dict]]
# (assembly, hello, DecodeResult | None, error) -> report row
RowBuilder = Callable[[Assembly, dict, Any, str], dict]


class Receiver:
    def __init__(self, settings: ReceiverSettings, make_decoder: DecoderFactory,
                 build_row: RowBuilder, log: Callable[[str], None] | None = None,
                 check_hello: Callable[[dict, KVShape], str] | None = None) -> None:
        self.s = settings
        self.make_decoder, self.build_row = make_decoder, build_row
        self.check_hello = check_hello
        self.log = log or (lambda msg: print(f"kvsim serve: {msg}", file=sys.stderr))
        self.requests: dict[int, Assembly] = {}
        self.peers: dict[int, bytes] = {}
        self.finished_ids: set[int] = set()
        self.rows: list[dict] = []
        self.refused: Counter[str] = Counter()
        self._done: queue.SimpleQueue[tuple[int, dict]] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.bound = threading.Event()
        self.endpoint = ""
        self._touched: set[int] = set()

    # ---- main loop -------------------------------------------------------------------
    def serve(self) -> list[dict]:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished peer raises
        sock.setsockopt(zmq.SNDTIMEO, int(self.s.timeout_s * 1000))
        sock.setsockopt(zmq.RCVHWM, 0)  # the senders' credit window bounds what is buffered
        try:
            sock.bind(self.s.bind)
            self.endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            self.bound.set()
            self._loop(sock)
        finally:
            self.bound.set()
            for asm in list(self.requests.values()):
                asm.fail("receiver stopped")
            sock.close(0)
            ctx.term()
        return self.rows

    def _loop(self, sock: zmq.Socket) -> None:
        last_hb = last_event = time.monotonic()
        while not self.stop.is_set():
            if sock.poll(int(self.s.heartbeat_s * 1000 / 2), zmq.POLLIN):
                budget = 256  # messages per round before ACKs go out
                while budget and sock.poll(0, zmq.POLLIN):
                    self._handle(sock, sock.recv_multipart(copy=False))
                    budget -= 1
                last_event = time.monotonic()
            self._send_acks(sock)
            while not self._done.empty():
                self._finish(sock, *self._done.get())
                last_event = time.monotonic()
            now = time.monotonic()
            if now - last_hb >= self.s.heartbeat_s:
                for peer in set(self.peers.values()):
                    self._send(sock, peer, P.heartbeat())
                last_hb = now
            self._drop_silent(sock, now)
            if self.s.max_requests and len(self.rows) >= self.s.max_requests:
                return
            if self.s.idle_exit_s and not self.requests and \
                    now - last_event > self.s.idle_exit_s:
                return

    def _send(self, sock: zmq.Socket, peer: bytes, frames: list[Any]) -> None:
        try:
            sock.send_multipart([peer, *frames])
        except zmq.ZMQError as exc:  # the peer vanished (ROUTER_MANDATORY) or would block
            self.log(f"could not reply to a peer: {exc}")

    # ---- messages ----------------------------------------------------------------------
    def _handle(self, sock: zmq.Socket, frames: list[Any]) -> None:
        if len(frames) < 2:
            self.refused["no routing id"] += 1
            return
        peer, body = frames[0].bytes, frames[1:]
        try:
            msg = P.parse(body)
        except P.ChecksumError as exc:
            self._checksum_failed(sock, exc)
            return
        except P.ProtocolError as exc:
            self._refuse_frame(str(exc), None)
            return
        if msg.type == P.MsgType.HEARTBEAT:
            for rid, p in self.peers.items():
                if p == peer and rid in self.requests:
                    self.requests[rid].last_rx_t = time.monotonic()
            return
        if msg.type == P.MsgType.HELLO:
            self._hello(sock, peer, msg.request_id, msg.body)
            return
        asm = self.requests.get(msg.request_id)
        if asm is None:
            self._refuse_frame(f"{msg.type.name} for unknown request {msg.request_id}", None)
            return
        if self.peers.get(msg.request_id) != peer:
            self._refuse_frame(f"{msg.type.name} for request {msg.request_id} from a peer "
                               "that does not own it", asm)
            return
        asm.last_rx_t = time.monotonic()
        if msg.type == P.MsgType.CHUNK:
            frame = msg.body
            size = P.CONTROL_BYTES + P.CHUNK_HEADER_BYTES + frame.payload.nbytes
            try:
                if asm.add(frame, size) == "duplicate":
                    self._refuse_frame(f"duplicate chunk (stream {frame.stream}, seq "
                                       f"{frame.seq})", asm, log=False)
            except P.ProtocolError as exc:
                self._refuse_frame(str(exc), asm)
            self._touched.add(msg.request_id)
        elif msg.type == P.MsgType.FIN:
            asm.set_fin(msg.body)
        elif msg.type == P.MsgType.ABORT:
            asm.fail(f"sender aborted: {msg.body.get('reason', '')}")
        else:
            self._refuse_frame(f"{msg.type.name} is not a sender's message", asm)

    def _refuse_frame(self, reason: str, asm: Assembly | None, log: bool = True) -> None:
        key = P.refusal_key(reason)
        self.refused[key] += 1
        if asm is not None:
            asm.refuse(reason)
        if log and self.refused[key] <= 3:  # say it, without flooding under a fuzzer
            self.log(f"refused a frame: {reason}")

    def _checksum_failed(self, sock: zmq.Socket, exc: P.ChecksumError) -> None:
        self._refuse_frame(str(exc), self.requests.get(exc.request_id))
        asm = self.requests.get(exc.request_id)
        if asm is None or exc.stream >= asm.num_streams or \
                exc.seq >= len(asm.streams[exc.stream].expected):
            return
        if asm.streams[exc.stream].received[exc.seq]:
            return
        # ask for the chunk again (the sender takes its bytes off its in-flight count)
        self._send(sock, self.peers[exc.request_id],
                   P.nack_message(exc.request_id, [(exc.stream, exc.seq)]))

    def _hello(self, sock: zmq.Socket, peer: bytes, rid: int, hello: dict) -> None:
        if rid in self.finished_ids:
            self._send(sock, peer, P.json_message(P.MsgType.REFUSE, rid, {
                "reason": f"request {rid} already completed here"}))
            return
        existing = self.requests.get(rid)
        if existing is not None:  # a sender reconnecting: tell it what is held
            if wire.canonical_json(hello.get("preamble") or {}) != \
                    wire.canonical_json(existing.hello.get("preamble") or {}):
                self._send(sock, peer, P.json_message(P.MsgType.REFUSE, rid, {
                    "reason": f"request {rid} is in progress here with a different preamble"}))
                return
            self.peers[rid] = peer
            existing.last_rx_t = time.monotonic()
            self._send(sock, peer, P.json_message(P.MsgType.ACCEPT, rid, {
                "window_bytes": self.s.window_bytes, "held": existing.held_ranges()}))
            self.log(f"request {rid}: sender reconnected; {sum(existing.contiguous())} "
                     "chunk(s) held")
            return
        if len(self.requests) >= self.s.max_active_requests:
            self.refused["HELLO refused: busy"] += 1
            self._send(sock, peer, P.json_message(P.MsgType.REFUSE, rid, {
                "reason": f"busy: {len(self.requests)} requests in progress (max_active_requests "
                          f"{self.s.max_active_requests})"}))
            return
        try:
            asm = self._admit(rid, hello)
        except (P.ProtocolError, CodecError, ValueError, TypeError, KeyError) as exc:
            self.refused["HELLO refused"] += 1
            self._send(sock, peer, P.json_message(P.MsgType.REFUSE, rid, {"reason": str(exc)}))
            self.log(f"refused request {rid}: {exc}")
            return
        self.requests[rid] = asm
        self.peers[rid] = peer
        try:  # the decode loop first: its cache builder receives layers as they arrive
            made: tuple[Any, dict] | Exception = self.make_decoder(hello, asm)
        except Exception as exc:  # reported in the request's row, as a decode failure
            made = exc
        asm.start(getattr(made[0], "cache_builder", None) if isinstance(made, tuple) else None)
        self._send(sock, peer, P.json_message(P.MsgType.ACCEPT, rid, {
            "window_bytes": self.s.window_bytes, "held": {}}))
        threading.Thread(target=self._decode, args=(asm, made), daemon=True,
                         name=f"kvsim-decode-{rid}").start()

    def _admit(self, rid: int, hello: dict) -> Assembly:
        """Validate a HELLO (untrusted) and build its assembler; raise naming what differs."""
        version = hello.get("wire_version")
        if version != wire.WIRE_VERSION:
            raise P.ProtocolError(f"wire version {version!r} differs: this receiver speaks "
                                  f"{wire.WIRE_VERSION}")
        pre = hello.get("preamble")
        if not isinstance(pre, dict):
            raise P.ProtocolError("HELLO has no preamble object")
        shape_doc = pre.get("shape")
        if not isinstance(shape_doc, dict):
            raise P.ProtocolError("preamble has no shape object")
        layers = P.field_int(shape_doc, "layers", 1, MAX_LAYERS)
        tokens = P.field_int(shape_doc, "tokens", 1, MAX_TOKENS)
        heads = P.field_int(shape_doc, "kv_heads", 1, 1024)
        dim = P.field_int(shape_doc, "head_dim", 1, 1024)
        if 2 * layers * 2 * heads * tokens * dim > self.s.max_request_bytes:
            raise P.ProtocolError(f"a {layers}x2x{heads}x{tokens}x{dim} cache exceeds this "
                                  f"receiver's max_request_bytes {self.s.max_request_bytes}")
        shape = KVShape(**shape_doc)
        codec = make_codec(P.field_str(pre, "codec", 64), pre.get("params"))
        if codec.params_dict() != pre.get("params"):
            raise P.ProtocolError(f"codec parameters differ: sender {pre.get('params')}, "
                                  f"this kvsim {codec.params_dict()}")
        if pre.get("streams") != codec.stream_names():
            raise P.ProtocolError(f"streams differ: sender {pre.get('streams')}, codec "
                                  f"{codec.stream_names()}")
        if pre.get("page_tokens") != codec.page_tokens(shape):
            raise P.ProtocolError(f"page_tokens differ: sender {pre.get('page_tokens')}, codec "
                                  f"{codec.page_tokens(shape)}")
        codec.check_shape(shape)
        model = hello.get("model")
        if self.s.model and model != self.s.model:
            raise P.ProtocolError(f"model differs: sender {model!r}, this decode node "
                                  f"{self.s.model!r}")
        policy = hello.get("policy")
        if policy not in POLICIES:
            raise P.ProtocolError(f"unknown transfer policy {policy!r}")
        if self.check_hello is not None:
            problem = self.check_hello(hello, shape)
            if problem:
                raise P.ProtocolError(problem)
        anchor = str(policy).startswith("split_stream") and int(hello.get("cap_tokens") or 0) > 0
        return Assembly(rid, codec, shape, codec.size_table(shape), hello,
                        dequantize=self.s.dequantize, anchor_needed=anchor)

    def _send_acks(self, sock: zmq.Socket) -> None:
        for rid in self._touched:
            asm = self.requests.get(rid)
            if asm is not None:
                self._send(sock, self.peers[rid],
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
                self.log(f"request {asm.request_id}: decode failed: {error}\n"
                         f"{traceback.format_exc(limit=3)}")
        try:
            row = self.build_row(asm, hello, result, error)
        except Exception as exc:
            row = {"request_id": asm.request_id, "status": "error",
                   "error": f"report row failed: {type(exc).__name__}: {exc}"}
        self._done.put((asm.request_id, row))

    def _finish(self, sock: zmq.Socket, rid: int, row: dict) -> None:
        peer = self.peers.pop(rid, None)
        if peer is not None:  # answer first, then free the request's buffers
            self._send(sock, peer, P.json_message(P.MsgType.DONE, rid, row))
        self.rows.append(row)
        self.finished_ids.add(rid)
        asm = self.requests.pop(rid, None)
        if asm is not None:
            asm.close()

    def _drop_silent(self, sock: zmq.Socket, now: float) -> None:
        for rid, asm in list(self.requests.items()):
            if now - asm.last_rx_t > self.s.timeout_s and not asm.failed:
                summary = asm.received_summary()
                self.log(f"request {rid}: sender silent for {self.s.timeout_s} s; partial: "
                         f"{summary}")
                asm.fail(f"sender silent for {self.s.timeout_s} s (partial request: "
                         f"{summary['chunks_received']} of {summary['chunks_expected']} "
                         "chunks per stream)")
