"""Wire format shared by serialization (Encoded.to_bytes) and the real transport.

Everything little-endian. A serialized cache is one preamble frame followed by chunk
frames, stream 0's chunks first, then stream 1's, and so on.

preamble:  magic b"KVSM" | version u16 | reserved u16 | json_len u32 | crc32(json) u32 | json
chunk:     magic b"KVCH" | stream u8 | flags u8 | layer u16 | page u32 | payload_len u32
           | crc32(payload) u32 | payload

The JSON of the preamble is canonical (sorted keys, no spaces) so its size is known
from the codec config and the KV shape alone, without encoding anything.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

import numpy as np

PREAMBLE_MAGIC = b"KVSM"
CHUNK_MAGIC = b"KVCH"
WIRE_VERSION = 1

_PREAMBLE = struct.Struct("<4sHHII")  # magic, version, reserved, json_len, crc32
_CHUNK = struct.Struct("<4sBBHIII")  # magic, stream, flags, layer, page, payload_len, crc32

PREAMBLE_HEADER_BYTES = _PREAMBLE.size  # 16
CHUNK_HEADER_BYTES = _CHUNK.size  # 20
MAX_JSON_BYTES = 1 << 20
MAX_PAYLOAD_BYTES = 1 << 31


class WireError(ValueError):
    """Malformed or corrupt bytes on the wire (bad magic, length, checksum, truncation)."""


def canonical_json(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def preamble_size_bytes(meta: dict) -> int:
    return PREAMBLE_HEADER_BYTES + len(canonical_json(meta))


def pack_preamble(meta: dict) -> bytes:
    body = canonical_json(meta)
    return _PREAMBLE.pack(PREAMBLE_MAGIC, WIRE_VERSION, 0, len(body), zlib.crc32(body)) + body


def unpack_preamble(buf: bytes | memoryview, offset: int = 0) -> tuple[dict, int]:
    """Parse a preamble at `offset`; return (meta, offset just past it)."""
    if len(buf) - offset < PREAMBLE_HEADER_BYTES:
        raise WireError(f"truncated preamble: {len(buf) - offset} bytes < {PREAMBLE_HEADER_BYTES}")
    magic, version, _, json_len, crc = _PREAMBLE.unpack_from(buf, offset)
    if magic != PREAMBLE_MAGIC:
        raise WireError(f"bad preamble magic {bytes(magic)!r}, expected {PREAMBLE_MAGIC!r}")
    if version != WIRE_VERSION:
        raise WireError(f"unsupported wire version {version}, this kvsim speaks {WIRE_VERSION}")
    if json_len > MAX_JSON_BYTES:
        raise WireError(f"preamble JSON length {json_len} exceeds {MAX_JSON_BYTES}")
    start = offset + PREAMBLE_HEADER_BYTES
    body = bytes(buf[start : start + json_len])
    if len(body) != json_len:
        raise WireError(f"truncated preamble JSON: {len(body)} of {json_len} bytes")
    if zlib.crc32(body) != crc:
        raise WireError("preamble checksum mismatch (corrupt frame)")
    try:
        meta = json.loads(body)
    except json.JSONDecodeError as exc:
        raise WireError(f"preamble JSON does not parse: {exc}") from exc
    return meta, start + json_len


@dataclass(frozen=True)
class ChunkHeader:
    stream: int
    layer: int
    page: int
    payload_len: int
    crc32: int
    flags: int = 0


def pack_chunk_header(stream: int, layer: int, page: int, payload: np.ndarray | bytes) -> bytes:
    view = memoryview(payload).cast("B") if not isinstance(payload, bytes) else payload
    return _CHUNK.pack(CHUNK_MAGIC, stream, 0, layer, page, len(view), zlib.crc32(view))


def unpack_chunk_header(buf: bytes | memoryview, offset: int = 0) -> ChunkHeader:
    if len(buf) - offset < CHUNK_HEADER_BYTES:
        raise WireError(f"truncated chunk header: {len(buf) - offset} bytes < {CHUNK_HEADER_BYTES}")
    magic, stream, flags, layer, page, payload_len, crc = _CHUNK.unpack_from(buf, offset)
    if magic != CHUNK_MAGIC:
        raise WireError(f"bad chunk magic {bytes(magic)!r} at offset {offset}")
    if payload_len > MAX_PAYLOAD_BYTES:
        raise WireError(f"chunk payload length {payload_len} exceeds {MAX_PAYLOAD_BYTES}")
    return ChunkHeader(stream, layer, page, payload_len, crc, flags)


def check_payload(header: ChunkHeader, payload: bytes | memoryview) -> None:
    if len(payload) != header.payload_len:
        raise WireError(
            f"truncated chunk (stream {header.stream}, layer {header.layer}, page {header.page}):"
            f" {len(payload)} of {header.payload_len} payload bytes"
        )
    if zlib.crc32(payload) != header.crc32:
        raise WireError(
            f"chunk checksum mismatch (stream {header.stream}, layer {header.layer}, "
            f"page {header.page}): corrupt frame"
        )
