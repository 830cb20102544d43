"""Wire format and Encoded serialization: round trip, exact sizes, corrupt input rejected."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kernels.codec import CodecError, codec_for, make_codec
from kvsim.kernels.encoded import Encoded
from kvsim.kernels.wire import CHUNK_HEADER_BYTES, WireError, pack_chunk_header, pack_preamble


def _encoded(tokens: int = 37, page_tokens: int = 16) -> Encoded:
    kv = torch.randn(2, 2, 3, tokens, 8, generator=torch.Generator().manual_seed(0))
    return make_codec("bf16", {"page_tokens": page_tokens}).encode(kv)


def test_serialized_size_is_accounted_size():
    enc = _encoded()
    buf = enc.to_bytes()
    table = make_codec("bf16", {"page_tokens": 16}).size_table(enc.shape)
    assert len(buf) == enc.total_bytes == table.total_bytes
    assert np.array_equal(enc.chunk_bytes(), table.chunk_bytes)
    assert table.stream_bytes == enc.stream_bytes


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 70), page=st.integers(1, 40), layers=st.integers(1, 3))
def test_bf16_round_trip_any_shape(tokens, page, layers):
    kv = torch.randn(layers, 2, 2, tokens, 4).to(torch.bfloat16)
    enc = make_codec("bf16", {"page_tokens": page}).encode(kv)
    back = Encoded.from_bytes(enc.to_bytes())
    assert torch.equal(codec_for(back).decode(back), kv)
    assert enc.bits_per_element() > 16.0  # headers are counted, never free


def test_corrupt_payload_rejected():
    buf = bytearray(_encoded().to_bytes())
    buf[-3] ^= 0xFF
    with pytest.raises(WireError, match="checksum"):
        Encoded.from_bytes(bytes(buf))


def test_truncated_and_bad_magic_rejected():
    buf = _encoded().to_bytes()
    with pytest.raises(WireError, match="truncated"):
        Encoded.from_bytes(buf[:-5])
    with pytest.raises(WireError, match="magic"):
        Encoded.from_bytes(b"XXXX" + buf[4:])
    with pytest.raises(WireError, match="truncated"):
        Encoded.from_bytes(buf[:10])


def _with_first_chunk(enc: Encoded, header: bytes) -> bytes:
    """enc's bytes with the first chunk's 20-byte header replaced."""
    buf = enc.to_bytes()
    at = enc.header_bytes
    return buf[:at] + header + buf[at + CHUNK_HEADER_BYTES:]


def test_header_fields_are_checksummed():
    enc = _encoded()
    for offset, value in ((4, 1), (5, 1), (6, 99), (8, 3)):  # stream, flags, layer, page
        buf = bytearray(enc.to_bytes())
        buf[enc.header_bytes + offset] ^= value
        with pytest.raises(WireError, match="checksum"):
            Encoded.from_bytes(bytes(buf))


def test_chunk_out_of_range_rejected():
    enc = _encoded()
    payload = enc.streams[0][0].payload
    forged = pack_chunk_header(0, 99, 0, payload)  # valid checksum, impossible layer
    with pytest.raises(WireError, match="out of range"):
        Encoded.from_bytes(_with_first_chunk(enc, forged))


def test_nonzero_flags_rejected():
    enc = _encoded()
    payload = enc.streams[0][0].payload
    header = bytearray(pack_chunk_header(0, 0, 0, payload))
    header[5] = 0x80
    crc = zlib.crc32(payload, zlib.crc32(bytes(header[4:16])))
    header[16:20] = crc.to_bytes(4, "little")
    with pytest.raises(WireError, match="flags"):
        Encoded.from_bytes(_with_first_chunk(enc, bytes(header)))


def test_duplicate_chunk_rejected():
    enc = _encoded()
    buf = enc.to_bytes()
    first = buf[enc.header_bytes: enc.header_bytes + enc.streams[0][0].size_bytes]
    with pytest.raises(WireError, match="duplicate chunk"):
        Encoded.from_bytes(buf + first)


def test_preamble_header_fields_are_checksummed():
    buf = bytearray(_encoded().to_bytes())
    buf[6] ^= 1  # reserved field
    with pytest.raises(WireError, match="checksum"):
        Encoded.from_bytes(bytes(buf))


@pytest.mark.parametrize("meta", [
    [], {"codec": "bf16"}, {"codec": 7, "params": {}, "shape": {}, "page_tokens": 1,
                            "streams": ["full"]},
    {"codec": "bf16", "params": {}, "page_tokens": 0, "streams": ["full"],
     "shape": {"layers": 1, "kv_heads": 1, "tokens": 1, "head_dim": 1}},
    {"codec": "bf16", "params": {}, "page_tokens": True, "streams": ["full"],
     "shape": {"layers": 1, "kv_heads": 1, "tokens": 1, "head_dim": 1}},
    {"codec": "bf16", "params": {}, "page_tokens": 4, "streams": "full",
     "shape": {"layers": 1, "kv_heads": 1, "tokens": 1, "head_dim": 1}},
    {"codec": "bf16", "params": {}, "page_tokens": 4, "streams": ["full"],
     "shape": {"layers": 1, "kv_heads": 1, "tokens": 1.5, "head_dim": 1}},
    {"codec": "bf16", "params": {}, "page_tokens": 4, "streams": ["full"],
     "shape": {"layers": 1, "kv_heads": 1, "tokens": 1, "head_dim": 1, "dtype": ["x"]}},
])
def test_malformed_preamble_metadata_rejected(meta):
    with pytest.raises(WireError, match="preamble"):
        Encoded.from_bytes(pack_preamble(meta))


def test_missing_chunk_is_a_clear_error():
    enc = _encoded()
    enc.streams[0].pop(3)
    with pytest.raises(CodecError, match="missing 1 chunk"):
        codec_for(enc).decode(enc)


def test_frame_header_size_is_counted_per_chunk():
    enc = _encoded(tokens=32, page_tokens=16)
    assert all(c.size_bytes == c.payload_bytes + CHUNK_HEADER_BYTES for c in enc.streams[0])
