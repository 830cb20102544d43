"""Dequantization on arrival: one worker thread per request turns each layer into fp32 as soon
as its chunks are in, so that when the last chunk lands only its own layer is left to do.

    I/O thread (Assembly.add, under the assembly's lock): the last page of (stream s, layer l)
        arrived -> anchor job (s = 0, when the decoder will draft on the anchor) and, once every
        stream of layer l is in, a full job (every stream)
    worker: jobs in priority order (anchor jobs first, then by layer; a job in progress is
        not interrupted) -> codec.decode_layer -> finite check -> added to the decoder's
        cache of its kind (a `CacheBuilder` the decode loop supplies: the model's cache
        grows layer by layer) or, without one, written into a [layers, 2, kv_heads, tokens,
        head_dim] fp32 buffer of its kind

This is what the simulator's `deserializer=on_arrival` models: one server per request whose
work for a layer is that layer's dequantization (the anchor alone or every stream: the codec
timing's layer job, a fixed part + the layer's bytes where calibrated), served anchors
first. The decoder then takes the finished cache (or builds it from the buffer: the
hardware profile's `cache_build`). Codecs whose layers
do not decode alone (`layer_independent` False) are dequantized whole, on demand
(`Assembly.dequantize` says which one ran).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from kvsim.core.device import synchronize
from kvsim.core.layout import KVShape, all_finite
from kvsim.kernels import wire
from kvsim.kernels.codec import Codec
from kvsim.kernels.encoded import Chunk
from kvsim.transport.prefix_store import HeldPrefix

ANCHOR, FULL = 0, 1  # job kinds, also their priority (lower first)
Span = tuple[str, float, float]


class CacheBuilder(Protocol):
    """A decoder's cache filled layer by layer (kvsim.kv.capture.CacheFromLayers)."""

    def add(self, layer: int, kv_layer: torch.Tensor) -> None: ...

    def cache(self) -> Any: ...


class LayerDequantizer:
    """Per request; every method but `run` is called with `lock` held (the assembly's)."""

    def __init__(self, request_id: int, codec: Codec, shape: KVShape,
                 pages_per_layer: list[np.ndarray], anchor: bool,
                 lock: threading.Condition, failed: Callable[[], str],
                 device: torch.device | str = "cpu") -> None:
        self.request_id, self.codec, self.shape = request_id, codec, shape
        self.device = torch.device(device)  # where the layers are dequantized to
        self.num_streams = codec.num_streams
        self.anchor = anchor and self.num_streams > 1  # the decoder drafts on stream 0 alone
        self._pages = pages_per_layer  # [streams] of [layers]: chunks of each (stream, layer)
        self._chunks: list[list[list[Chunk]]] = [[[] for _ in range(shape.layers)]
                                                 for _ in pages_per_layer]
        self._jobs: list[tuple[int, int]] = []  # heap of (kind, layer)
        self._done = {ANCHOR: 0, FULL: 0}  # layers finished per kind
        self._buffers: dict[int, torch.Tensor] = {}
        # set before the worker starts: the decoder's caches are built here, layer by layer
        self.new_builder: Callable[[], CacheBuilder] | None = None
        # ... and each layer of every stream is handed here once dequantized (the prefix
        # store's feed: kvsim.transport.prefix_store.PrefixUse.give_layer)
        self.on_full_layer: Callable[[int, torch.Tensor], None] | None = None
        self._held: HeldPrefix | None = None  # leading blocks held dequantized (hold)
        self._builders: dict[int, CacheBuilder] = {}
        self._taken: set[int] = set()
        self._cv, self._failed = lock, failed
        self.error: Exception | None = None
        self.spans: list[Span] = []  # (name, t0, t1) of every job, Unix s
        # a job is running now (read without the lock by a timing decode loop that slows its
        # draft steps while the worker works; a stale read is off by one poll)
        self.working = False

    # ---- I/O thread side (lock held) ------------------------------------------------------
    def hold(self, held: HeldPrefix, held_pages: list[np.ndarray]) -> None:
        """The leading pages are held dequantized (held_pages[s][layer] of stream s's chunks
        of each layer): their chunks never come, and each layer is decoded from the rest.
        Before any chunk arrives."""
        self._held = held
        self._pages = [p - h for p, h in zip(self._pages, held_pages, strict=True)]
        for layer in range(self.shape.layers):  # a layer with nothing left to come
            for s in range(len(self._pages)):
                if self._pages[s][layer] == 0:
                    self._complete(s, layer)

    def chunk_arrived(self, chunk: Chunk) -> None:
        s, layer = chunk.stream, chunk.layer
        self._chunks[s][layer].append(chunk)
        if len(self._chunks[s][layer]) == self._pages[s][layer]:
            self._complete(s, layer)

    def _complete(self, s: int, layer: int) -> None:
        """Stream s's chunks of `layer` are all in: queue the jobs they complete."""
        if s == 0 and self.anchor:
            heapq.heappush(self._jobs, (ANCHOR, layer))
        if all(len(c[layer]) == p[layer] for c, p in zip(self._chunks, self._pages, strict=True)) \
                and (FULL, layer) not in self._jobs:
            heapq.heappush(self._jobs, (FULL, layer))
        self._cv.notify_all()

    # ---- decoder side (lock held) ---------------------------------------------------------
    def ready(self, streams: int) -> bool:
        """The cache of the first `streams` streams (1: the anchor; all) is dequantized."""
        kind = FULL if streams >= self.num_streams or not self.anchor else ANCHOR
        return self._done[kind] == self.shape.layers or \
            self._done[FULL] == self.shape.layers

    def streams_ready(self) -> int:
        if self._done[FULL] == self.shape.layers:
            return self.num_streams
        return 1 if self.anchor and self._done[ANCHOR] == self.shape.layers else 0

    def _finished_kind(self, streams: int) -> int:
        if self.error is not None:
            raise self.error
        if not self.ready(streams):
            raise RuntimeError(f"request {self.request_id:032x}: streams 0..{streams - 1} are not "
                               "dequantized yet")
        kind = ANCHOR if self.anchor and streams < self.num_streams else FULL
        if self._done[kind] < self.shape.layers:  # the full cache arrived before the anchor's
            kind = FULL
        return kind

    def buffer(self, streams: int) -> torch.Tensor:
        """The finished fp32 cache [layers, 2, kv_heads, tokens, head_dim] of `streams`
        (kept only without a cache builder)."""
        kind = self._finished_kind(streams)
        if kind not in self._buffers:
            raise RuntimeError(f"request {self.request_id:032x}: its layers went into the "
                               "decoder's cache; take it with built_cache()")
        return self._buffers[kind]

    def built_cache(self, streams: int) -> Any:
        """The decoder's cache of `streams`, built as layers were dequantized (once: decoding
        extends it); None without a cache builder."""
        if self.new_builder is None:
            return None
        kind = self._finished_kind(streams)
        if kind in self._taken:
            raise RuntimeError(f"request {self.request_id:032x}: the cache of streams "
                               f"0..{streams - 1} was taken already")
        self._taken.add(kind)
        return self._builders[kind].cache()

    def release(self) -> None:
        """The request ended: drop its chunks, caches and pending jobs (a job in progress
        finishes into a builder nobody takes, freed with this object)."""
        self._chunks = [[[] for _ in range(self.shape.layers)] for _ in self._pages]
        self._jobs.clear()
        self._builders.clear()
        self._buffers.clear()

    # ---- worker ---------------------------------------------------------------------------
    def run(self, poll_s: float = 0.5) -> None:
        """Serve jobs until every layer of every kind is done, the request failed, or a
        layer's bytes were refused (then `error` is set and waiters are woken)."""
        kinds = (ANCHOR, FULL) if self.anchor else (FULL,)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._failed(), timeout=poll_s)
                if self._failed():
                    return
                if not self._jobs:
                    continue
                kind, layer = heapq.heappop(self._jobs)
                n = 1 if kind == ANCHOR else self.num_streams
                chunks = [list(self._chunks[s][layer]) for s in range(n)]
            t0 = time.time()
            self.working = True
            try:
                held = self._held
                if held is None:
                    out = self.codec.decode_layer(self.shape, layer, chunks,
                                                  dtype=torch.float32, device=self.device)
                else:  # the pages after the held ones, a cache of their own
                    out = self.codec.decode_layer(held.rest_shape(self.shape), layer,
                                                  held.rest_chunks(chunks), dtype=torch.float32,
                                                  device=self.device)
                if not all_finite(out):  # (reads the device's answer: its kernels have run)
                    raise wire.WireError(f"request {self.request_id:032x}: layer {layer} "
                                         "decodes to non-finite values")
                if held is not None:
                    out = held.layer(layer, out)
                if kind == FULL and self.on_full_layer is not None:
                    self.on_full_layer(layer, out)
                if self.new_builder is not None:
                    builder = self._builders.get(kind)
                    if builder is None:
                        builder = self._builders[kind] = self.new_builder()
                    builder.add(layer, out)
                else:
                    buf = self._buffers.get(kind)
                    if buf is None:  # pages are committed as layers are written
                        buf = torch.empty(self.shape.layers, *out.shape, dtype=torch.float32,
                                          device=self.device)
                        self._buffers[kind] = buf
                    buf[layer].copy_(out)
                synchronize(self.device)  # the span ends when the device has done the layer
            except Exception as exc:  # CodecError / WireError: bytes the codec refuses
                self.working = False
                with self._cv:
                    self.error = exc
                    self._cv.notify_all()
                return
            t1 = time.time()
            self.working = False
            with self._cv:
                name = "stream 0" if n == 1 else f"streams 0-{n - 1}"
                self.spans.append((f"dequantize layer {layer} {name}", t0, t1))
                self._done[kind] += 1
                if self._done[kind] == self.shape.layers:
                    self._cv.notify_all()
                    if all(self._done[k] == self.shape.layers for k in kinds):
                        return


__all__ = ["ANCHOR", "FULL", "CacheBuilder", "LayerDequantizer"]
