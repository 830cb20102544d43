"""Per-request assembler on the decode side: holds the chunks that arrived, refuses what does
not fit the request's preamble, says what is complete, and dequantizes: layer by layer as the
chunks arrive (`dequantize="on_arrival"`, kvsim.transport.layer_dequantizer) or the whole
cache when the decoder starts on it (`"on_demand"`).

Everything in a chunk frame is checked against what the HELLO announced before it is kept:
stream, layer and page in range; `seq` names exactly that (layer, page); the payload length
equals the codec's size table (exact codecs) or stays under a bound (entropy-coded ones); a
second copy of a chunk is refused. Thread-safe: the receiver's I/O thread adds chunks while
the request's decode thread waits on streams and dequantizes (it is a `CacheView`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvsim.core.layout import KVShape, all_finite
from kvsim.kernels import wire
from kvsim.kernels.codec import Codec
from kvsim.kernels.encoded import Chunk, Encoded, SizeTable
from kvsim.transport import protocol as P
from kvsim.transport.config import DEQUANTIZE_MODES
from kvsim.transport.layer_dequantizer import LayerDequantizer
from kvsim.transport.prefix_store import HeldPrefix


class RequestCancelled(RuntimeError):
    """The request was dropped while its decode loop ran (silent sender, deadline, ...)."""


@dataclass
class StreamState:
    expected: list[tuple[int, int]]  # (layer, page) of seq 0, 1, ...
    received: np.ndarray  # [chunks] bool
    count: int = 0
    contiguous: int = 0  # seq 0..contiguous-1 all received (what the ACK says)
    bytes: int = 0  # wire bytes (chunk header + payload, as in the size table)
    first_arrival_t: float = float("nan")
    last_arrival_t: float = float("nan")
    complete_t: float = float("nan")

    @property
    def complete(self) -> bool:
        return self.count == len(self.expected)


@dataclass
class Assembly:
    request_id: int
    codec: Codec
    shape: KVShape
    table: SizeTable
    hello: dict
    streams: list[StreamState] = field(default_factory=list)
    chunks: list[list[Chunk]] = field(default_factory=list)
    created_t: float = field(default_factory=time.time)
    last_rx_t: float = field(default_factory=time.monotonic)
    processed_bytes: int = 0  # every chunk frame consumed, good or refused (sender credit)
    acked_bytes: int = 0  # processed_bytes as of the last ACK sent (credit granted)
    admitted_mono: float = field(default_factory=time.monotonic)  # its deadline's origin
    refused: dict[str, int] = field(default_factory=dict)
    failed: str = ""  # set when the request is dropped: waiters wake up and give up
    fin: dict | None = None
    events: list[tuple[str, float, float]] = field(default_factory=list)
    # on_arrival: each layer dequantized once its chunks are in (codecs whose layers decode
    # alone; others fall back to on_demand): the whole cache when the decoder starts on it
    dequantize: str = "on_demand"
    anchor_needed: bool = False  # the decoder drafts on stream 0 alone (split-stream, cap > 0)
    prefix: Any = None  # its part in the decode node's prefix store (PrefixUse), if any
    # each layer of the cache dequantized with every stream, as it is (layer, [2, kv_heads,
    # tokens, head_dim] fp32; from the dequantizing thread): the prefix store's feed
    on_full_layer: Any = None
    # where its caches are dequantized to: "cpu" or a CUDA device (the decode node's device;
    # a codec with a device path copies each layer's chunks there once, then runs kernels)
    device: str = "cpu"

    def __post_init__(self) -> None:
        self._cv = threading.Condition()
        for order in P.stream_order(self.table.chunk_bytes):
            self.streams.append(StreamState(order, np.zeros(len(order), dtype=bool)))
            self.chunks.append([])
        if self.dequantize not in DEQUANTIZE_MODES:
            raise ValueError(f"dequantize must be one of {DEQUANTIZE_MODES}, got "
                             f"{self.dequantize!r}")
        self._closed = False
        self.held: HeldPrefix | None = None  # leading blocks its decode node holds (preload)
        self.dequantizer: LayerDequantizer | None = None
        if self.dequantize == "on_arrival" and not self.codec.layer_independent:
            self.dequantize = "on_demand"  # its layers do not decode alone
        if self.dequantize == "on_arrival":
            pages = [np.bincount([layer for layer, _ in st.expected],
                                 minlength=self.shape.layers) for st in self.streams]
            self.dequantizer = LayerDequantizer(
                self.request_id, self.codec, self.shape, pages, self.anchor_needed, self._cv,
                lambda: self.failed or self._closed, device=self.device)
        # bound for entropy-coded chunks: the raw bf16 bytes of the chunk, doubled, + 64 KiB
        self._max_payload = 2 * 2 * 2 * self.shape.kv_heads * self.table.page_tokens * \
            self.shape.head_dim + (64 << 10)

    # ---- I/O thread side ---------------------------------------------------------------
    def add(self, frame: P.ChunkFrame, frame_bytes: int) -> str:
        """Keep a verified chunk frame. Returns 'ok' or 'duplicate'; raises ProtocolError
        for a frame that contradicts the preamble (the request itself is not harmed)."""
        self.last_rx_t = time.monotonic()
        self.processed_bytes += frame_bytes
        where = _Where(self.request_id, frame)
        if frame.stream >= len(self.streams):
            raise P.ProtocolError(f"{where}: the codec has {len(self.streams)} stream(s)")
        st = self.streams[frame.stream]
        if frame.seq >= len(st.expected):
            raise P.ProtocolError(f"{where}: stream {frame.stream} has {len(st.expected)} chunks")
        if st.expected[frame.seq] != (frame.layer, frame.page):
            raise P.ProtocolError(f"{where}: seq {frame.seq} is (layer, page) = "
                                  f"{st.expected[frame.seq]}")
        n = frame.payload.nbytes
        want = int(self.table.chunk_bytes[frame.stream, frame.layer, frame.page]) - \
            wire.CHUNK_HEADER_BYTES
        if self.codec.exact_sizes and n != want:
            raise P.ProtocolError(f"{where}: {n} payload bytes, the {self.codec.name} size table "
                                  f"says {want}")
        if n > self._max_payload:
            raise P.ProtocolError(f"{where}: {n} payload bytes exceed the bound "
                                  f"{self._max_payload}")
        now = time.time()
        with self._cv:
            if st.received[frame.seq]:
                return "duplicate"
            st.received[frame.seq] = True
            st.count += 1
            st.bytes += wire.CHUNK_HEADER_BYTES + n
            while st.contiguous < len(st.expected) and st.received[st.contiguous]:
                st.contiguous += 1
            if st.count == 1:
                st.first_arrival_t = now
            st.last_arrival_t = now
            chunk = Chunk(frame.stream, frame.layer, frame.page,
                          np.frombuffer(frame.payload, dtype=np.uint8))
            self.chunks[frame.stream].append(chunk)
            if self.dequantizer is not None:
                self.dequantizer.chunk_arrived(chunk)
            if st.complete:
                st.complete_t = now
                self._cv.notify_all()
        return "ok"

    def preload(self, held: HeldPrefix) -> None:
        """The leading blocks this decode node holds already, dequantized (a reused prefix:
        kvsim.transport.prefix_store): their pages count as received before any chunk
        arrives (never sent, not in the received bytes or arrival times) and are not
        dequantized; the cache's layers are the held tokens, then the rest's. Before any
        chunk and before start()."""
        if held.tokens <= 0 or held.tokens >= self.shape.tokens or \
                held.tokens % self.table.page_tokens:
            raise ValueError(f"a held prefix of {held.tokens} tokens is not whole pages of a "
                             f"{self.shape.tokens}-token cache")
        held_pages = []  # [streams] of [layers]: chunks of held pages
        with self._cv:
            self.held = held
            for st in self.streams:
                layers = [layer for layer, page in st.expected if page < held.pages]
                held_pages.append(np.bincount(layers, minlength=self.shape.layers))
                for seq, (_, page) in enumerate(st.expected):
                    if page < held.pages and not st.received[seq]:
                        st.received[seq] = True
                        st.count += 1
                while st.contiguous < len(st.expected) and st.received[st.contiguous]:
                    st.contiguous += 1
            if self.dequantizer is not None:
                self.dequantizer.hold(held, held_pages)

    @property
    def held_tokens(self) -> int:
        """Leading tokens of the cache its decode node held already (0: none)."""
        return 0 if self.held is None else self.held.tokens

    def start(self, new_builder: Any = None) -> None:
        """Start the on-arrival dequantization worker (no-op on demand). new_builder: makes
        the decoder's cache, filled layer by layer as they are dequantized (a decode loop's
        `cache_builder`); None: fp32 buffers, read with kv()."""
        if self.dequantizer is not None:
            self.dequantizer.new_builder = new_builder
            self.dequantizer.on_full_layer = self.on_full_layer
            threading.Thread(target=self.dequantizer.run, daemon=True,
                             name=f"kvsim-dequantize-{self.request_id:032x}").start()

    def close(self) -> None:
        """The request ended: the worker, if still waiting for chunks, stops, and the chunks
        and dequantized caches are let go now. (The worker's callback refers back to this
        assembly, so without this they would wait for a cyclic garbage collection, and the
        next request would page-fault fresh memory for its own.)"""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            self.chunks = [[] for _ in self.chunks]
            if self.dequantizer is not None:
                self.dequantizer.release()

    def refuse(self, code: str) -> None:
        """Count a refused frame of this request by its code (protocol.REFUSAL_CODES)."""
        self.refused[code] = self.refused.get(code, 0) + 1

    def fail(self, why: str) -> None:
        """Drop the request: waiters wake and give up, its decode loop stops at its next
        step (cancelled), its sleeps end now."""
        with self._cv:
            self.failed = why
            self._cv.notify_all()

    def cancelled(self) -> str:
        """Why the request was dropped ("" while it runs): what a decode loop checks
        between steps."""
        return self.failed

    def sleep(self, s: float) -> None:
        """Sleep s seconds, or until the request is dropped (then raise RequestCancelled):
        a timing decode loop's steps, however long a time_scale makes them."""
        with self._cv:
            if self._cv.wait_for(lambda: self.failed, timeout=max(0.0, s)):
                raise RequestCancelled(self.failed)

    def set_fin(self, doc: dict) -> None:
        """The sender's FIN (its encode / send times) arrived."""
        with self._cv:
            self.fin = doc
            self._cv.notify_all()

    def wait_fin(self, timeout_s: float) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self.fin is not None or self.failed, timeout=timeout_s)

    def contiguous(self) -> list[int]:
        return [s.contiguous for s in self.streams]

    def held_ranges(self) -> dict[str, list[list[int]]]:
        """Per stream, the seq ranges [a, b) held (what a resuming sender may skip)."""
        out = {}
        for i, st in enumerate(self.streams):
            ranges, start = [], None
            for seq, have in enumerate(np.append(st.received, False)):
                if have and start is None:
                    start = seq
                elif not have and start is not None:
                    ranges.append([start, seq])
                    start = None
            if ranges:
                out[str(i)] = ranges
        return out

    # ---- CacheView (decode thread side) ------------------------------------------------
    @property
    def num_streams(self) -> int:
        return len(self.streams)

    def arrived_streams(self) -> int:
        """Leading streams whose every chunk arrived."""
        with self._cv:
            n = 0
            while n < len(self.streams) and self.streams[n].complete:
                n += 1
            return n

    def streams_ready(self) -> int:
        """Leading streams the decoder can use: arrived (on demand) or dequantized (on
        arrival: 1 once the anchor is, every stream once the full cache is)."""
        if self.dequantizer is None:
            return self.arrived_streams()
        with self._cv:
            return self.dequantizer.streams_ready()

    def worker_busy(self) -> bool:
        """The on-arrival worker is dequantizing a layer now (False on demand: nothing runs
        beside the decoder until it asks for the cache)."""
        return self.dequantizer is not None and self.dequantizer.working

    def later_bytes(self) -> float:
        """Wire bytes of the later streams (1..) received so far (a timing decode loop's
        ingest cost follows them)."""
        with self._cv:
            return float(sum(st.bytes for st in self.streams[1:]))

    def wait_streams(self, n: int, timeout_s: float) -> bool:
        """Block until streams 0..n-1 are usable (see streams_ready); True also when the
        on-arrival worker refused their bytes (kv(n) then raises its error)."""
        dq = self.dequantizer
        with self._cv:
            if dq is None:
                ok = lambda: all(s.complete for s in self.streams[:n])  # noqa: E731
            else:
                ok = lambda: dq.error is not None or dq.ready(n)  # noqa: E731
            self._cv.wait_for(lambda: self.failed or ok(), timeout=timeout_s)
            return not self.failed and ok()

    def built_cache(self, n: int) -> Any:
        """The decoder's cache of the first n streams built on arrival (after
        wait_streams(n)), or None where there is none (on demand, or no cache builder)."""
        if self.dequantizer is None:
            return None
        with self._cv:
            return self.dequantizer.built_cache(n)

    def kv(self, n: int) -> torch.Tensor:
        """The first n streams dequantized -> [layers, 2, kv_heads, tokens, head_dim] fp32:
        the on-arrival worker's buffer (after wait_streams(n)), or dequantized now. Raises
        CodecError / WireError for bytes the codec refuses."""
        if self.dequantizer is not None:
            with self._cv:
                return self.dequantizer.buffer(n)
        t0 = time.time()
        with self._cv:
            snapshot = [list(c) for c in self.chunks[:n]]
        held, shape = self.held, self.shape
        if held is not None:  # only the pages after the held ones were sent
            shape, snapshot = held.rest_shape(shape), held.rest_chunks(snapshot)
        enc = Encoded(self.codec.name, self.codec.params_dict(), shape,
                      self.table.page_tokens, self.codec.stream_names(), snapshot)
        kv = self.codec.decode(enc, streams=n, dtype=torch.float32, device=self.device)
        if not all_finite(kv):
            raise wire.WireError(f"request {self.request_id:032x}: streams 0..{n - 1} decode to "
                                 "non-finite values")
        if held is not None:
            kv = held.whole(kv)
        self.events.append((f"dequantize streams 0..{n - 1}", t0, time.time()))
        if n == self.num_streams and self.on_full_layer is not None:
            for layer in range(self.shape.layers):
                self.on_full_layer(layer, kv[layer])
        return kv

    def received_summary(self) -> dict:
        return {"chunks_received": [s.count for s in self.streams],
                "chunks_expected": [len(s.expected) for s in self.streams],
                "complete_streams": self.arrived_streams()}


class _Where:
    """The chunk named in an error message, formatted only when one is raised."""

    def __init__(self, request_id: int, frame: P.ChunkFrame) -> None:
        self.request_id, self.frame = request_id, frame

    def __str__(self) -> str:
        f = self.frame
        return (f"request {self.request_id:032x} chunk (stream {f.stream}, layer {f.layer}, "
                f"page {f.page}, seq {f.seq})")

    __format__ = lambda self, spec: str(self)  # noqa: E731 (f-strings call __format__)
