"""Encoded KV cache: ordered streams of (layer x page) chunks with exact byte sizes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvsim.core.layout import KVShape
from kvsim.kernels import wire


@dataclass
class Chunk:
    """One unit that is encoded, sent and decoded: one layer x one page of one stream.

    payload: 1-D uint8 array (may be a view into a larger buffer) holding everything the
    decoder needs for this chunk of this stream: codes, scales, zero points, indices...
    """

    stream: int
    layer: int
    page: int
    payload: np.ndarray

    @property
    def payload_bytes(self) -> int:
        return int(self.payload.nbytes)

    @property
    def size_bytes(self) -> int:
        """Bytes this chunk occupies on the wire: frame header + payload."""
        return wire.CHUNK_HEADER_BYTES + self.payload_bytes


@dataclass
class SizeTable:
    """Wire bytes of every chunk of every stream, known from (codec config, shape) alone.

    chunk_bytes: [streams, layers, pages] int64, frame header included; 0 = no such chunk.
    exact: False for data-dependent codecs (entropy coding), whose sizes are estimates.
    """

    stream_names: list[str]
    page_tokens: int
    header_bytes: int
    chunk_bytes: np.ndarray
    exact: bool = True
    note: str = ""

    @property
    def stream_bytes(self) -> list[int]:
        return [int(x) for x in self.chunk_bytes.sum(axis=(1, 2))]

    @property
    def total_bytes(self) -> int:
        """Serialized size: preamble + every chunk frame of every stream."""
        return self.header_bytes + int(self.chunk_bytes.sum())

    def layer_stream_bytes(self) -> np.ndarray:
        """[streams, layers] bytes."""
        return self.chunk_bytes.sum(axis=2)


@dataclass
class Encoded:
    """What crosses the wire for one request's KV cache."""

    codec: str
    params: dict
    shape: KVShape
    page_tokens: int
    stream_names: list[str]
    streams: list[list[Chunk]] = field(default_factory=list)  # streams[i] = chunks of stream i
    # (layer, page) of every chunk add_chunk took, per stream (duplicate check)
    _seen: dict[int, set[tuple[int, int]]] = field(default_factory=dict, repr=False,
                                                   compare=False)

    # ---- metadata & accounting -------------------------------------------------------
    def meta(self) -> dict:
        return preamble_meta(self.codec, self.params, self.shape, self.page_tokens,
                             self.stream_names)

    @property
    def header_bytes(self) -> int:
        return wire.preamble_size_bytes(self.meta())

    @property
    def stream_bytes(self) -> list[int]:
        return [sum(c.size_bytes for c in chunks) for chunks in self.streams]

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + sum(self.stream_bytes)

    def bits_per_element(self, streams: int | None = None) -> float:
        """Bits per KV element from the serialized bytes (preamble + first `streams` streams)."""
        n = len(self.streams) if streams is None else streams
        size = self.header_bytes + sum(self.stream_bytes[:n])
        return 8.0 * size / self.shape.numel

    def chunk_bytes(self) -> np.ndarray:
        """[streams, layers, pages] wire bytes, laid out like SizeTable.chunk_bytes."""
        pages = -(-self.shape.tokens // self.page_tokens)
        out = np.zeros((len(self.stream_names), self.shape.layers, pages), dtype=np.int64)
        for chunks in self.streams:
            for c in chunks:
                out[c.stream, c.layer, c.page] = c.size_bytes
        return out

    def payloads(self, stream: int) -> dict[tuple[int, int], np.ndarray]:
        """{(layer, page): payload} of one stream."""
        if stream >= len(self.streams):
            raise ValueError(
                f"stream {stream} not present: this {self.codec} cache has "
                f"{len(self.streams)} of {len(self.stream_names)} streams"
            )
        return {(c.layer, c.page): c.payload for c in self.streams[stream]}

    # ---- serialization ---------------------------------------------------------------
    def to_bytes(self) -> bytes:
        parts: list[bytes | np.ndarray] = [wire.pack_preamble(self.meta())]
        for chunks in self.streams:
            for c in chunks:
                payload = np.ascontiguousarray(c.payload, dtype=np.uint8)
                parts.append(wire.pack_chunk_header(c.stream, c.layer, c.page, payload))
                parts.append(payload)
        return b"".join(bytes(p) if isinstance(p, np.ndarray) else p for p in parts)

    @classmethod
    def from_bytes(cls, buf: bytes | memoryview) -> Encoded:
        meta, off = wire.unpack_preamble(buf)
        enc = cls.from_meta(meta)
        view = memoryview(buf)
        while off < len(buf):
            hdr = wire.unpack_chunk_header(buf, off)
            off += wire.CHUNK_HEADER_BYTES
            payload = view[off : off + hdr.payload_len]
            wire.check_payload(hdr, payload)
            off += hdr.payload_len
            enc.add_chunk(Chunk(hdr.stream, hdr.layer, hdr.page,
                                np.frombuffer(payload, dtype=np.uint8)))
        return enc

    @classmethod
    def from_meta(cls, meta: Any) -> Encoded:
        """An empty Encoded from a received preamble (JSON), every field type-checked: the
        codec checks the values (shape limits, params, page size) when it decodes."""
        bad = wire.WireError
        if not isinstance(meta, dict) or set(meta) != _META_KEYS:
            keys = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
            raise bad(f"preamble metadata is malformed: keys {keys}, expected "
                      f"{sorted(_META_KEYS)}")
        codec, params, streams = meta["codec"], meta["params"], meta["streams"]
        if not isinstance(codec, str) or not isinstance(params, dict):
            raise bad("preamble metadata is malformed: codec must be a string and params an "
                      "object")
        if not (isinstance(streams, list) and 1 <= len(streams) <= wire.MAX_STREAMS
                and all(isinstance(n, str) for n in streams)):
            raise bad(f"preamble metadata is malformed: streams must be a list of 1.."
                      f"{wire.MAX_STREAMS} names, got {streams!r:.200}")
        page_tokens = meta["page_tokens"]
        if not _is_int(page_tokens) or page_tokens < 1:
            raise bad(f"preamble metadata is malformed: page_tokens {page_tokens!r:.50} is not "
                      "a positive integer")
        if not isinstance(meta["shape"], dict):
            raise bad("preamble metadata is malformed: shape must be an object")
        try:
            shape = KVShape(**meta["shape"])
        except (TypeError, ValueError) as exc:
            raise bad(f"preamble metadata is malformed: {exc}") from exc
        return cls(codec, dict(params), shape, page_tokens, list(streams),
                   [[] for _ in streams])

    def add_chunk(self, chunk: Chunk) -> None:
        """Insert a received chunk, validating its coordinates against the preamble; a
        second chunk with the same (stream, layer, page) is refused."""
        pages = -(-self.shape.tokens // self.page_tokens)
        where = f"chunk (stream {chunk.stream}, layer {chunk.layer}, page {chunk.page})"
        if not (0 <= chunk.stream < len(self.stream_names)):
            raise wire.WireError(f"{where}: stream out of range (codec {self.codec} has "
                                 f"{len(self.stream_names)} streams)")
        if not (0 <= chunk.layer < self.shape.layers and 0 <= chunk.page < pages):
            raise wire.WireError(f"{where}: (layer, page) out of range for "
                                 f"{self.shape.layers} layers x {pages} pages")
        while len(self.streams) <= chunk.stream:
            self.streams.append([])
        chunks = self.streams[chunk.stream]
        seen = self._seen.get(chunk.stream)
        if seen is None or len(seen) != len(chunks):  # first use, or the list was edited
            seen = self._seen[chunk.stream] = {(c.layer, c.page) for c in chunks}
        if (chunk.layer, chunk.page) in seen:
            raise wire.WireError(f"{where}: duplicate chunk (already received)")
        seen.add((chunk.layer, chunk.page))
        chunks.append(chunk)


_META_KEYS = {"codec", "params", "shape", "page_tokens", "streams"}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def preamble_meta(codec: str, params: dict, shape: KVShape, page_tokens: int,
                  stream_names: list[str]) -> dict:
    return {
        "codec": codec,
        "params": params,
        "shape": shape.to_dict(),
        "page_tokens": page_tokens,
        "streams": list(stream_names),
    }
