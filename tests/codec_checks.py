"""Shared assertion for codec tests: the wire round trip with exact byte accounting."""

from __future__ import annotations

import numpy as np
import torch

from kvsim.core.layout import KVShape
from kvsim.kernels.codec import Codec
from kvsim.kernels.encoded import Encoded


def wire_round_trip(codec: Codec, kv: torch.Tensor) -> tuple[Encoded, torch.Tensor]:
    """Encode, serialize, parse and decode kv; assert the serialized bytes equal the codec's
    size table in total and per chunk. Returns (encoded, decoded from the parsed bytes)."""
    enc = codec.encode(kv)
    blob = enc.to_bytes()
    table = codec.size_table(KVShape.of(kv))
    assert len(blob) == table.total_bytes
    np.testing.assert_array_equal(enc.chunk_bytes(), table.chunk_bytes)
    return enc, codec.decode(Encoded.from_bytes(blob))
