"""The transport's messages: ZeroMQ multipart frames, parsed without trusting a byte.

Every message starts with a 24-byte control frame (little-endian):

    magic b"KVTP" | version u8 | type u8 | reserved u16 (0) | request_id u128

A request id is 128 random bits drawn by the sender (`new_request_id`): unguessable, so
knowing one is no way into another sender's request (which also belongs to the peer that
opened it, kvsim.transport.receiver).

followed by type-specific frames:

    HELLO     (sender -> receiver) JSON: wire version, codec preamble (codec, params, KV shape,
              page tokens, streams), model, transfer policy, first token, times
    ACCEPT    (receiver -> sender) JSON: window_bytes, held chunks per stream (for a resume)
    REFUSE    (receiver -> sender) JSON: code (REFUSAL_CODES), reason (code: what differs,
              at most MAX_REASON_CHARS characters)
    CHUNK     (sender -> receiver) chunk header (below) | payload (sent zero-copy)
    ACK       (receiver -> sender) processed_bytes u64 | streams u16 | contiguous u32 x streams
    NACK      (receiver -> sender) count u32 | (stream u8, seq u32) x count: send these again
    FIN       (sender -> receiver) JSON: every chunk sent; sender-side times (encode end, ...)
    DONE      (receiver -> sender) JSON: the request's report row
    ABORT     (either way)         JSON: reason; the request is dropped
    HEARTBEAT (either way)         nothing: "I am alive" while otherwise silent

The chunk header is 20 bytes: stream u8 | flags u8 (0) | layer u16 | page u32 | seq u32 |
payload_len u32 | crc32c u32. `seq` is the chunk's index among its stream's chunks in
(layer, page) order; the CRC32C covers the control frame, the chunk header (with the CRC field
zero), computed payload first (so a sender can checksum a payload when it encodes it,
off its link loop), so a flipped header field is caught like a flipped payload byte.
Times in messages are Unix seconds (time.time()): the same clock on both ends of a
one-machine run, NTP-aligned between two hosts.
"""

from __future__ import annotations

import enum
import json
import math
import secrets
import struct
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np

from kvsim.kernels import wire

MAGIC = b"KVTP"
PROTOCOL_VERSION = 2  # 2: 128-bit request ids
MAX_JSON_BYTES = 4 << 20  # a HELLO with 1M context token ids fits; anything larger is refused
MAX_NACK = 1 << 16
MAX_REASON_CHARS = 256  # a REFUSE / ABORT reason, a logged refusal: never an echo of a field

# Why a frame or a request is refused: the fixed vocabulary refusals are counted by (in the
# receiver's counters, its metrics and the REFUSE's `code`); the detail goes in the reason
REFUSAL_CODES = (
    "malformed",  # does not parse (ProtocolError)
    "checksum",  # a chunk's CRC32C does not match (asked for again)
    "unknown request",  # a message for a request not in progress here
    "not owner",  # a message or HELLO for a request another peer opened
    "bad chunk",  # a chunk that contradicts its request's preamble
    "duplicate chunk",
    "beyond credit",  # a chunk past the request's credit window (dropped)
    "not a sender message",
    "incompatible",  # a HELLO this decode node cannot serve (names what differs)
    "finished",  # a HELLO for a request that already ended here
    "busy: requests",  # max_active_requests in progress
    "busy: peer",  # max_requests_per_peer from this peer in progress
    "busy: memory",  # the request's bytes do not fit the memory budget
    "busy: device memory",  # its caches do not fit the device's (a decode node on a GPU)
    "admission error",  # admission failed unexpectedly (a bug: the request is refused)
    "slow reader",  # replies to a peer that does not read them were dropped
    "deadline",  # a request outlived request_deadline_s
)

_CONTROL = struct.Struct("<4sBBH16s")  # magic, version, type, reserved, request_id
_CHUNK = struct.Struct("<BBHIIII")  # stream, flags, layer, page, seq, payload_len, crc32c
_ACK_HEAD = struct.Struct("<QH")  # processed_bytes, streams
_NACK_ITEM = struct.Struct("<BI")  # stream, seq
CONTROL_BYTES = _CONTROL.size  # 16
CHUNK_HEADER_BYTES = _CHUNK.size  # 20
_CRC_OFFSET = CHUNK_HEADER_BYTES - 4
_ZERO_CRC = b"\0\0\0\0"


class MsgType(enum.IntEnum):
    HELLO = 1
    ACCEPT = 2
    REFUSE = 3
    CHUNK = 4
    ACK = 5
    NACK = 6
    FIN = 7
    DONE = 8
    ABORT = 9
    HEARTBEAT = 10


class ProtocolError(wire.WireError):
    """A message that does not parse or breaks the protocol (refused, never trusted).
    code: its REFUSAL_CODES entry."""

    def __init__(self, message: str, code: str = "malformed") -> None:
        super().__init__(message)
        self.code = code if code in REFUSAL_CODES else "malformed"


def new_request_id() -> int:
    """128 random bits (secrets): what a request is known by on the wire."""
    return secrets.randbits(128)


def id_hex(request_id: int) -> str:
    """A request id as rows and logs write it: 32 hex digits."""
    return f"{request_id:032x}"


def parse_id(text: str) -> int:
    """A request id from its 32 hex digits (id_hex); ValueError otherwise."""
    text = text.strip().lower()
    if len(text) != 32 or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"a request id is 32 hex digits, got {text[:40]!r}")
    return int(text, 16)


def reason(code: str, detail: str = "") -> str:
    """A refusal's reason as sent and logged: 'code: detail', at most MAX_REASON_CHARS."""
    text = f"{code}: {detail}" if detail else code
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS - 3] + "..."


@dataclass(frozen=True)
class ChunkFrame:
    request_id: int
    stream: int
    layer: int
    page: int
    seq: int
    payload: memoryview  # payload_len bytes, checksum verified


@dataclass(frozen=True)
class Message:
    type: MsgType
    request_id: int
    body: Any = None  # dict (JSON types), ChunkFrame, (processed, [contiguous]), [(s, seq)]


# ---- building ------------------------------------------------------------------------------
def control(msg_type: MsgType, request_id: int) -> bytes:
    return _CONTROL.pack(MAGIC, PROTOCOL_VERSION, int(msg_type), 0,
                         request_id.to_bytes(16, "little"))


def json_message(msg_type: MsgType, request_id: int, doc: dict) -> list[bytes]:
    return [control(msg_type, request_id), wire.canonical_json(_finite(doc))]


def payload_crc(payload: Any) -> int:
    """CRC32C of a payload alone: the seed of its frame's checksum."""
    return crc32c.crc32c(memoryview(payload).cast("B"))


def chunk_frames(request_id: int, stream: int, layer: int, page: int, seq: int,
                 payload: Any, crc_of_payload: int | None = None) -> list[Any]:
    """[control, chunk header, payload]; the payload object is passed through untouched so
    ZeroMQ can send it without a copy. crc_of_payload: payload_crc(payload) if known."""
    ctl = control(MsgType.CHUNK, request_id)
    nbytes = memoryview(payload).nbytes
    head = _CHUNK.pack(stream, 0, layer, page, seq, nbytes, 0)
    seed = payload_crc(payload) if crc_of_payload is None else crc_of_payload
    crc = crc32c.crc32c(head, crc32c.crc32c(ctl, seed))
    return [ctl, head[:_CRC_OFFSET] + struct.pack("<I", crc), payload]


def ack_message(request_id: int, processed_bytes: int, contiguous: list[int]) -> list[bytes]:
    body = _ACK_HEAD.pack(processed_bytes, len(contiguous)) + struct.pack(
        f"<{len(contiguous)}I", *contiguous)
    return [control(MsgType.ACK, request_id), body]


def nack_message(request_id: int, items: list[tuple[int, int]]) -> list[bytes]:
    body = struct.pack("<I", len(items)) + b"".join(_NACK_ITEM.pack(s, q) for s, q in items)
    return [control(MsgType.NACK, request_id), body]


def heartbeat() -> list[bytes]:
    return [control(MsgType.HEARTBEAT, 0)]


# ---- parsing (every byte checked) ----------------------------------------------------------
def parse(frames: list[Any]) -> Message:
    """Parse one multipart message (frames: bytes, memoryview or zmq.Frame objects).
    Raises ProtocolError with a reason for anything malformed; never anything else."""
    try:
        views = [memoryview(f.buffer if hasattr(f, "buffer") else f).cast("B") for f in frames]
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"unreadable frame: {exc}") from exc
    if not views:
        raise ProtocolError("empty message")
    ctl = views[0]
    if ctl.nbytes != CONTROL_BYTES:
        raise ProtocolError(f"control frame is {ctl.nbytes} bytes, expected {CONTROL_BYTES}")
    magic, version, type_code, reserved, id_bytes = _CONTROL.unpack(ctl)
    request_id = int.from_bytes(id_bytes, "little")
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version}, this kvsim speaks {PROTOCOL_VERSION}")
    try:
        mtype = MsgType(type_code)
    except ValueError:
        raise ProtocolError(f"unknown message type {type_code}") from None
    if reserved != 0:
        raise ProtocolError(f"reserved field is {reserved}, must be 0")
    rest = views[1:]
    if mtype == MsgType.CHUNK:
        return Message(mtype, request_id, _parse_chunk(ctl, rest, request_id))
    if mtype == MsgType.HEARTBEAT:
        _expect_frames(mtype, rest, 0)
        return Message(mtype, request_id)
    if mtype == MsgType.ACK:
        _expect_frames(mtype, rest, 1)
        return Message(mtype, request_id, _parse_ack(rest[0]))
    if mtype == MsgType.NACK:
        _expect_frames(mtype, rest, 1)
        return Message(mtype, request_id, _parse_nack(rest[0]))
    _expect_frames(mtype, rest, 1)
    return Message(mtype, request_id, _parse_json(mtype, rest[0]))


def _expect_frames(mtype: MsgType, rest: list[memoryview], n: int) -> None:
    if len(rest) != n:
        raise ProtocolError(f"{mtype.name} has {len(rest)} frame(s) after the control frame, "
                            f"expected {n}")


def _parse_chunk(ctl: memoryview, rest: list[memoryview], request_id: int) -> ChunkFrame:
    _expect_frames(MsgType.CHUNK, rest, 2)
    head, payload = rest
    if head.nbytes != CHUNK_HEADER_BYTES:
        raise ProtocolError(f"chunk header is {head.nbytes} bytes, expected "
                            f"{CHUNK_HEADER_BYTES}")
    stream, flags, layer, page, seq, payload_len, crc = _CHUNK.unpack(head)
    if flags == 0 and payload_len == payload.nbytes:  # the common case: only the checksum
        got = crc32c.crc32c(_ZERO_CRC, crc32c.crc32c(head[:_CRC_OFFSET], crc32c.crc32c(
            ctl, crc32c.crc32c(payload))))
        if got == crc:
            return ChunkFrame(request_id, stream, layer, page, seq, payload)
    where = f"chunk (stream {stream}, layer {layer}, page {page}, seq {seq})"
    if flags != 0:
        raise ProtocolError(f"{where}: flags {flags:#x}, none are defined")
    if payload_len != payload.nbytes:
        raise ProtocolError(f"{where}: header says {payload_len} payload bytes, frame has "
                            f"{payload.nbytes}")
    got = crc32c.crc32c(_ZERO_CRC, crc32c.crc32c(head[:_CRC_OFFSET], crc32c.crc32c(
        ctl, crc32c.crc32c(payload))))
    if got != crc:
        raise ChecksumError(where, request_id, stream, seq)
    return ChunkFrame(request_id, stream, layer, page, seq, payload)


class ChecksumError(ProtocolError):
    """A chunk whose CRC32C does not match: its (stream, seq) can be asked for again, though
    neither can be trusted (a resend request for a forged pair is refused by the sender)."""

    def __init__(self, where: str, request_id: int, stream: int, seq: int) -> None:
        super().__init__(f"{where}: CRC32C mismatch (corrupt frame)", "checksum")
        self.request_id, self.stream, self.seq = request_id, stream, seq


def _parse_ack(body: memoryview) -> tuple[int, list[int]]:
    if body.nbytes < _ACK_HEAD.size:
        raise ProtocolError(f"ACK body is {body.nbytes} bytes, shorter than its header")
    processed, n = _ACK_HEAD.unpack_from(body)
    if body.nbytes != _ACK_HEAD.size + 4 * n:
        raise ProtocolError(f"ACK claims {n} streams but has {body.nbytes} bytes")
    return processed, list(struct.unpack_from(f"<{n}I", body, _ACK_HEAD.size))


def _parse_nack(body: memoryview) -> list[tuple[int, int]]:
    if body.nbytes < 4:
        raise ProtocolError("NACK body shorter than its count")
    (n,) = struct.unpack_from("<I", body)
    if n > MAX_NACK or body.nbytes != 4 + n * _NACK_ITEM.size:
        raise ProtocolError(f"NACK claims {n} items but has {body.nbytes} bytes")
    return [_NACK_ITEM.unpack_from(body, 4 + i * _NACK_ITEM.size) for i in range(n)]


def _parse_json(mtype: MsgType, body: memoryview) -> dict:
    if body.nbytes > MAX_JSON_BYTES:
        raise ProtocolError(f"{mtype.name} body of {body.nbytes} bytes exceeds {MAX_JSON_BYTES}")
    try:
        doc = json.loads(bytes(body), parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ProtocolError(f"{mtype.name} body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ProtocolError(f"{mtype.name} body must be a JSON object, got {type(doc).__name__}")
    return doc


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def _finite(doc: Any) -> Any:
    """Refuse NaN / inf before they reach the wire (JSON has no such numbers)."""
    if isinstance(doc, dict):
        return {k: _finite(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [_finite(v) for v in doc]
    if isinstance(doc, float) and not math.isfinite(doc):
        return None
    return doc


# ---- typed accessors for JSON bodies (a missing or mistyped field is a ProtocolError) -----
def field_int(doc: dict, key: str, lo: int = 0, hi: int = 1 << 62) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ProtocolError(f"field {key!r} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def field_str(doc: dict, key: str, max_len: int = 256) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or len(value) > max_len:
        raise ProtocolError(f"field {key!r} must be a string of at most {max_len} characters")
    return value


def stream_order(chunk_bytes: np.ndarray) -> list[list[tuple[int, int]]]:
    """Per stream, its present (layer, page) chunks in send order (layer-major): a chunk's
    `seq` is its index here. chunk_bytes: [streams, layers, pages] (0 = no such chunk)."""
    out = []
    for s in range(chunk_bytes.shape[0]):
        layers, pages = np.nonzero(chunk_bytes[s] > 0)
        out.append([(int(a), int(b)) for a, b in zip(layers, pages, strict=True)])
    return out
