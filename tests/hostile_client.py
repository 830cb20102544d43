"""A hostile ZeroMQ client of `kvsim serve` (kvsim.transport.receiver), for tests.

It speaks the transport's protocol (frames from kvsim.transport.protocol's builders) on
purpose wrongly: malformed frames, hostile HELLOs, another peer's request, chunks beyond
credit, floods of large or many small messages, a peer that never reads its replies. Every
flood is bounded (a count and a wall-clock limit), every receive is a poll with a timeout,
and the client measures what it did (sent, not sent) and what came back.

    kit = request_kit(cfg)                  # one request as the real sender opens it
    with HostileClient(endpoint) as c:
        c.send(kit.hello_frames(rid))
        msg = c.wait(rid, {P.MsgType.ACCEPT, P.MsgType.REFUSE}, timeout_s=5)

Also here: the process's memory (VmRSS, VmHWM; the receiver runs in-process in the tests)
and a thread-safe log capture for the receiver's `log` callable.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from kvsim.transport import protocol as P
from kvsim.transport import session
from kvsim.transport.config import EmulateConfig
from kvsim.transport.rate_limiter import Unlimited
from kvsim.transport.sender import Sender, _Req

REPLIES = frozenset({P.MsgType.ACCEPT, P.MsgType.REFUSE})


# ---- memory of this process ----------------------------------------------------------------
def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def rss_bytes(trim: bool = False) -> int:
    """Resident memory of this process now (VmRSS). trim: first hand freed heap back to
    the OS (glibc malloc_trim), so memory freed after a flood is not counted as held."""
    if trim:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
    return _status_kib("VmRSS") * 1024


def reset_peak_rss() -> None:
    """Restart the peak (VmHWM) from the current RSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """Highest resident memory since the last reset_peak_rss (VmHWM)."""
    return _status_kib("VmHWM") * 1024


class LogCapture:
    """A receiver's `log` callable that keeps its lines (thread-safe)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self._lock:
            self.lines.append(line)

    def since(self, mark: int) -> list[str]:
        with self._lock:
            return self.lines[mark:]

    def mark(self) -> int:
        with self._lock:
            return len(self.lines)


# ---- one request as the real sender opens it -----------------------------------------------
@dataclass
class RequestKit:
    """A request's HELLO document (exactly as kvsim's Sender writes it) and its encoded
    chunks in send order, re-framed for any request id."""

    hello: dict
    chunks: list[tuple[int, int, int, int, np.ndarray]]  # (stream, layer, page, seq, payload)
    wire_bytes: int  # size table total (preamble + chunk headers + payloads)
    fp32_bytes: int  # the dequantized cache [layers, 2, heads, tokens, dim] fp32

    @property
    def reserved_bytes(self) -> int:
        """What a memory-budgeted receiver reserves for it: wire bytes + fp32 cache."""
        return self.wire_bytes + self.fp32_bytes

    def hello_frames(self, rid: int, **changes: Any) -> list[bytes]:
        return P.json_message(P.MsgType.HELLO, rid, {**self.hello, **changes})

    def hello_with(self, rid: int, path: tuple[str, ...], value: Any) -> list[bytes]:
        """The HELLO with one nested field replaced (path: keys from the top)."""
        doc = _deep_copy(self.hello)
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return P.json_message(P.MsgType.HELLO, rid, doc)

    def chunk_frames(self, rid: int, which: Iterable[int] | None = None) -> Iterator[list[Any]]:
        picked = range(len(self.chunks)) if which is None else which
        for i in picked:
            stream, layer, page, seq, payload = self.chunks[i]
            yield P.chunk_frames(rid, stream, layer, page, seq, payload)

    def fin_frames(self, rid: int) -> list[bytes]:
        now = time.time()
        return P.json_message(P.MsgType.FIN, rid, {
            "encode_end_t": now, "encode_work_s": 0.0, "backlog_start_t": {},
            "skipped_chunks": 0, "first_send_t": now})


def _deep_copy(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: _deep_copy(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_deep_copy(v) for v in doc]
    return doc


def request_kit(cfg: EmulateConfig) -> RequestKit:
    """The first request of cfg's workload, its HELLO written by kvsim's own Sender (so the
    HELLO follows whatever the sender sends: wire version, preamble, acceptance curve)."""
    [batch, *_] = session.outgoing_requests(cfg, None)
    out = batch[0]
    source = out.make_source()
    sender = Sender("tcp://127.0.0.1:9", Unlimited(), log=lambda m: None)
    req = _Req(out)
    sender._hello(req, source)  # queues the HELLO frames in its outbox (no socket yet)
    hello = P.parse(sender._outbox.get()).body
    enc = out.codec.encode(source.full())
    table = req.table
    order = P.stream_order(table.chunk_bytes)
    seq_of = [{lp: i for i, lp in enumerate(o)} for o in order]
    chunks = sorted(((c.stream, c.layer, c.page, seq_of[c.stream][(c.layer, c.page)],
                      np.ascontiguousarray(c.payload)) for s in enc.streams for c in s),
                    key=lambda c: (c[0], c[3]))
    shape = source.shape
    fp32 = 4 * shape.layers * 2 * shape.kv_heads * shape.tokens * shape.head_dim
    return RequestKit(hello, chunks, int(table.total_bytes), fp32)


# ---- the client ------------------------------------------------------------------------------
@dataclass
class Flood:
    sent: int = 0
    not_sent: int = 0  # would have blocked past the send timeout (the receiver pushed back)
    took_s: float = 0.0
    replies: int = 0


@dataclass
class HostileClient:
    """One DEALER peer. rcvhwm / rcvbuf small and never calling recv: a slow reader."""

    endpoint: str
    identity: bytes = field(default_factory=lambda: uuid.uuid4().bytes)
    rcvhwm: int = 1000
    sndhwm: int = 1000
    rcvbuf: int = 0  # SO_RCVBUF bytes (0: the OS default)
    send_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        try:
            self.sock.setsockopt(zmq.ROUTING_ID, self.identity)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
            self.sock.setsockopt(zmq.SNDHWM, self.sndhwm)
            self.sock.setsockopt(zmq.SNDTIMEO, int(self.send_timeout_s * 1000))
            if self.rcvbuf:
                self.sock.setsockopt(zmq.RCVBUF, self.rcvbuf)
            self.sock.connect(self.endpoint)
        except BaseException:
            self.close()
            raise
        self.inbox: list[P.Message] = []
        self.unparsed = 0  # replies that did not parse

    def __enter__(self) -> HostileClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.close(0)
        self.ctx.term()

    # ---- sending ---------------------------------------------------------------------
    def send(self, frames: list[Any]) -> bool:
        """Send one message; False when it would block past the send timeout."""
        try:
            self.sock.send_multipart(frames)
            return True
        except zmq.Again:
            return False

    def flood(self, messages: Iterable[list[Any]], max_s: float = 30.0,
              drain: bool = True) -> Flood:
        """Send every message (or until max_s passes); drain replies meanwhile unless
        drain=False (a peer that never reads)."""
        out = Flood()
        started = time.monotonic()
        for i, frames in enumerate(messages):
            if time.monotonic() - started > max_s:
                break
            if self.send(frames):
                out.sent += 1
            else:
                out.not_sent += 1
            if drain and i % 64 == 0:
                out.replies += self.pump(0)
        out.took_s = time.monotonic() - started
        if drain:
            out.replies += self.pump(0)
        return out

    def heartbeat(self) -> bool:
        return self.send(P.heartbeat())

    # ---- receiving -------------------------------------------------------------------
    def pump(self, timeout_s: float) -> int:
        """Take in what arrived (waiting up to timeout_s for the first); returns how many."""
        n = 0
        wait_ms = int(timeout_s * 1000)
        while self.sock.poll(wait_ms, zmq.POLLIN):
            frames = self.sock.recv_multipart(zmq.NOBLOCK)
            try:
                msg = P.parse(frames)
            except P.ProtocolError:
                self.unparsed += 1
                continue
            if msg.type != P.MsgType.HEARTBEAT:
                self.inbox.append(msg)
            n += 1
            wait_ms = 0
        return n

    def take(self, rid: int | None = None, types: Iterable[P.MsgType] | None = None
             ) -> list[P.Message]:
        """Remove and return the received messages for rid (any if None) of these types."""
        kinds = set(types) if types is not None else None
        hit = [m for m in self.inbox if (rid is None or m.request_id == rid)
               and (kinds is None or m.type in kinds)]
        self.inbox = [m for m in self.inbox if not any(m is h for h in hit)]
        return hit

    def wait(self, rid: int, types: Iterable[P.MsgType], timeout_s: float,
             heartbeat_s: float | None = 0.2) -> P.Message | None:
        """The first message for rid of one of these types within timeout_s (None if none
        came); sends a heartbeat every heartbeat_s meanwhile (None: stays silent)."""
        kinds = set(types)
        deadline = time.monotonic() + timeout_s
        last_hb = time.monotonic()
        while True:
            hit = self.take(rid, kinds)
            if hit:
                self.inbox = hit[1:] + self.inbox
                return hit[0]
            now = time.monotonic()
            if now >= deadline:
                return None
            if heartbeat_s is not None and now - last_hb >= heartbeat_s:
                self.heartbeat()
                last_hb = now
            self.pump(min(0.05, deadline - now))


# ---- a flood from another process -----------------------------------------------------------
_FLOOD_PROCESS = r"""
import json, sys, time, uuid
import zmq
from kvsim.transport import protocol as P
endpoint, n, body_bytes, sndhwm, max_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), float(sys.argv[5])
body = b'{"pad": "' + b"a" * max(0, body_bytes - 16) + b'"}'
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sent = not_sent = 0
try:
    sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.SNDTIMEO, 10000)
    sock.connect(endpoint)
    t0 = time.monotonic()
    for _ in range(n):
        if time.monotonic() - t0 > max_s:
            break
        try:
            sock.send_multipart([P.control(P.MsgType.FIN, P.new_request_id()), body])
            sent += 1
        except zmq.Again:
            not_sent += 1
    took = time.monotonic() - t0
    time.sleep(0.5)  # what is queued here reaches the receiver before the socket closes
finally:
    sock.close(0)
    ctx.term()
print(json.dumps({"sent": sent, "not_sent": not_sent, "took_s": took}))
"""


def flood_from_process(endpoint: str, n: int, body_bytes: int, sndhwm: int = 2,
                       max_s: float = 60.0) -> Flood:
    """n FINs for unknown request ids of about body_bytes each, sent by another process
    (its own interpreter: the flood is not slowed by the receiver's GIL in this one)."""
    proc = subprocess.run([sys.executable, "-c", _FLOOD_PROCESS, endpoint, str(n),
                           str(body_bytes), str(sndhwm), str(max_s)],
                          capture_output=True, text=True, timeout=max_s + 60)
    if proc.returncode != 0:
        raise RuntimeError(f"flood process failed: {proc.stderr[-2000:]}")
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    return Flood(sent=doc["sent"], not_sent=doc["not_sent"], took_s=doc["took_s"])


# ---- message classes -------------------------------------------------------------------------
def malformed_messages(n: int, seed: int = 0) -> Iterator[list[bytes]]:
    """n malformed variants of valid messages: truncated, extended, bit-flipped, frames
    dropped or repeated, wrong magic / version / type / reserved field, random bytes."""
    rng = np.random.default_rng(seed)
    rid = P.new_request_id()
    payload = rng.integers(0, 256, 300, dtype=np.uint8)
    seeds = [P.chunk_frames(rid, 0, 2, 3, 4, payload), P.ack_message(rid, 10, [1, 2]),
             P.nack_message(rid, [(0, 1)]), P.json_message(P.MsgType.FIN, rid, {"x": 1}),
             P.json_message(P.MsgType.HELLO, rid, {"wire_version": 1}), P.heartbeat()]
    seeds = [[bytes(memoryview(f).cast("B")) for f in s] for s in seeds]
    for _ in range(n):
        frames = [bytearray(f) for f in seeds[int(rng.integers(len(seeds)))]]
        op = int(rng.integers(8))
        i = int(rng.integers(len(frames)))
        if op == 0 and frames[i]:
            del frames[i][int(rng.integers(len(frames[i]))):]
        elif op == 1:
            frames[i] += bytes(rng.integers(0, 256, int(rng.integers(1, 40)), dtype=np.uint8))
        elif op == 2 and frames[i]:
            for _ in range(int(rng.integers(1, 4))):
                frames[i][int(rng.integers(len(frames[i])))] ^= 1 << int(rng.integers(8))
        elif op == 3 and len(frames) > 1:
            del frames[i]
        elif op == 4:
            frames.insert(i, frames[i])
        elif op == 5:  # one control byte set wrong: magic, version, type or reserved
            at = int(rng.choice([0, 4, 5, 6]))
            frames[0][at] = (frames[0][at] + 1 + int(rng.integers(200))) % 256
        elif op == 6:
            frames = [bytearray(rng.integers(0, 256, int(rng.integers(0, 64)), dtype=np.uint8))
                      for _ in range(int(rng.integers(1, 5)))]
        else:  # a JSON body that is not JSON, or not an object
            bodies = (b"[1,2]", b"{\"a\": NaN}", b"\xff\xfe", b"{" * 5000, b"[" * 100000)
            frames = [bytearray(P.control(P.MsgType.FIN, rid)),
                      bytearray(bodies[int(rng.integers(len(bodies)))])]
        yield [bytes(f) for f in frames]


def unknown_fins(n: int, body_bytes: int = 16, numbers: bool = False) -> Iterator[list[bytes]]:
    """FINs for request ids never opened; each body a JSON object of about body_bytes (one
    body object shared by all, so the flood itself costs no memory). numbers: the body is a
    list of numbers (slow to parse: a receiver that parses it falls behind the flood)."""
    pad = max(0, body_bytes - 16)
    if numbers:
        body = b'{"pad": [' + b"1," * (pad // 2) + b'1]}'
    else:
        body = b'{"pad": "' + b"a" * pad + b'"}'
    for _ in range(n):
        yield [P.control(P.MsgType.FIN, P.new_request_id()), body]


def junk_hellos(n: int, pad: int = 0) -> Iterator[list[bytes]]:
    """HELLOs refused at once (a wire version nobody speaks): each one asks for a reply,
    about pad characters long where the receiver names the version it got."""
    version: int | str = "v" * pad if pad else -1
    for _ in range(n):
        yield P.json_message(P.MsgType.HELLO, P.new_request_id(), {"wire_version": version})
