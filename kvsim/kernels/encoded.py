"""Encoded KV cache: ordered streams of (layer x page) chunks with exact byte sizes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvsim.kernels import wire
from kvsim.layout import KVShape


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
    def from_meta(cls, meta: dict) -> Encoded:
        try:
            shape = KVShape(**meta["shape"])
            return cls(meta["codec"], dict(meta["params"]), shape, int(meta["page_tokens"]),
                       list(meta["streams"]), [[] for _ in meta["streams"]])
        except (KeyError, TypeError, ValueError) as exc:
            raise wire.WireError(f"preamble metadata is malformed: {exc}") from exc

    def add_chunk(self, chunk: Chunk) -> None:
        """Insert a received chunk, validating its coordinates against the preamble."""
        pages = -(-self.shape.tokens // self.page_tokens)
        if not (0 <= chunk.stream < len(self.stream_names)):
            raise wire.WireError(f"chunk stream {chunk.stream} out of range "
                                 f"(codec {self.codec} has {len(self.stream_names)} streams)")
        if not (0 <= chunk.layer < self.shape.layers and 0 <= chunk.page < pages):
            raise wire.WireError(f"chunk (layer {chunk.layer}, page {chunk.page}) out of range "
                                 f"for {self.shape.layers} layers x {pages} pages")
        while len(self.streams) <= chunk.stream:
            self.streams.append([])
        self.streams[chunk.stream].append(chunk)


def preamble_meta(codec: str, params: dict, shape: KVShape, page_tokens: int,
                  stream_names: list[str]) -> dict:
    return {
        "codec": codec,
        "params": params,
        "shape": shape.to_dict(),
        "page_tokens": page_tokens,
        "streams": list(stream_names),
    }
